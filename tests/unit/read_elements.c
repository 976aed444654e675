/* kqsvd_test_read SHARD OUT: decodes keys, values and queries of a cache
 * shard through kqsvd's reader and converters and writes them to OUT as
 * float64 (native order), in that order.  Exit 3 names the first NaN/Inf.
 * The element-type test writes shards with h5py and compares bit for bit. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

#include "kqsvd_cache.h"

int main(int argc, char **argv) {
  kqsvd_shard_t *sh = NULL;
  int rc = 0;
  MPI_Init(&argc, &argv);
  kqsvd_h5_init();
  if (argc != 3) {
    fprintf(stderr, "usage: kqsvd_test_read SHARD OUT\n");
    MPI_Finalize();
    return 2;
  }
  FILE *out = fopen(argv[2], "wb");
  if (!out || kqsvd_shard_open(argv[1], MPI_COMM_NULL, &sh) != KQSVD_OK) {
    fprintf(stderr, "kqsvd_test_read: %s\n", out ? kqsvd_error_message() : "cannot open output");
    MPI_Finalize();
    return 1;
  }
  const kqsvd_dims_t *d = kqsvd_shard_dims(sh);
  const int64_t T = kqsvd_shard_tokens(sh);
  const kqsvd_tensor_t order[3] = {KQSVD_KEYS, KQSVD_VALUES, KQSVD_QUERIES};
  for (int t = 0; t < 3 && rc == 0; t++) {
    const int64_t H = order[t] == KQSVD_QUERIES ? d->heads : d->kv_heads;
    const int64_t n = H * T * d->head_dim;
    const kqsvd_dtype_t type = kqsvd_shard_dtype(sh, order[t]);
    void *raw = malloc((size_t)n * kqsvd_dtype_size(type) + 1);
    double *x = malloc((size_t)n * sizeof(double) + 1);
    for (int64_t l = 0; l < d->layers && rc == 0; l++) {
      if (kqsvd_shard_read(sh, order[t], l, 0, H, 0, T, raw) != KQSVD_OK) {
        fprintf(stderr, "kqsvd_test_read: %s\n", kqsvd_error_message());
        rc = 1;
        break;
      }
      const int64_t bad = kqsvd_convert_to_f64(type, raw, n, x);
      if (bad >= 0) {
        printf("non-finite %s layer %lld element %lld\n", kqsvd_tensor_name(order[t]), (long long)l,
               (long long)bad);
        rc = 3;
      }
      fwrite(x, sizeof(double), (size_t)n, out);
    }
    free(raw);
    free(x);
  }
  fclose(out);
  kqsvd_shard_close(&sh);
  MPI_Finalize();
  return rc;
}
