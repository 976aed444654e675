/* Test tool: calibration through the public accumulator alone, in one
 * process.  Reads a model file and cache shards with kqsvd's readers and
 * feeds every row to kqsvd_acc_absorb (block_rows rows per call, keys,
 * query heads, values) and o_proj to kqsvd_acc_absorb_oproj, then finishes and writes.
 * `kqsvd calibrate` on one rank with the same --qr-block splits its folds
 * at the same rows, so the e2e scenario `accumulator` expects the two
 * proj.h5 files to agree bit for bit.
 *
 *     acc_replay BLOCK_ROWS POLICY BETA OUT.h5 MODEL.h5 SHARD...     */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kqsvd/kqsvd.h"
#include "kqsvd_cache.h"
#include "kqsvd_error.h"

static kqsvd_status_t replay(int argc, char **argv) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_model_t *model = NULL;
  kqsvd_shard_t *sh = NULL;
  kqsvd_acc_t *acc = NULL;
  kqsvd_result_t *res = NULL;
  char *buf = NULL;
  KQSVD_CALL(kqsvd_model_open(argv[5], &model));
  const kqsvd_dims_t *dm = kqsvd_model_dims(model);
  const kqsvd_shape_t shape = {dm->layers, dm->kv_heads, dm->heads / dm->kv_heads, dm->head_dim,
                               dm->hidden};
  kqsvd_acc_options_t opt;
  kqsvd_acc_options_default(&opt);
  opt.block_rows = atoll(argv[1]);
  KQSVD_CALL(kqsvd_acc_init(&shape, &opt, &acc));
  const int64_t d = shape.head_dim, m = shape.group;
  for (int s = 6; s < argc; s++) {
    KQSVD_CALL(kqsvd_shard_open(argv[s], MPI_COMM_NULL, &sh));
    const int64_t T = kqsvd_shard_tokens(sh);
    free(buf);
    buf = NULL;
    /* One element size for the three tensors: calibrate's inputs share it. */
    const size_t esz = kqsvd_dtype_size(kqsvd_shard_dtype(sh, KQSVD_KEYS));
    KQSVD_CHECK(esz == kqsvd_dtype_size(kqsvd_shard_dtype(sh, KQSVD_QUERIES)) &&
                    esz == kqsvd_dtype_size(kqsvd_shard_dtype(sh, KQSVD_VALUES)),
                KQSVD_ERR_USAGE, "acc_replay: mixed element sizes");
    KQSVD_MALLOC(buf, (size_t)((m + 2) * T * d) * esz, "rows");
    for (int64_t l = 0; l < shape.layers; l++)
      for (int64_t g = 0; g < shape.kv_heads; g++) {
        /* Block after block, keys, each query head, then values, as
         * calibrate folds them: the group's query heads share one factor,
         * whose rows (and so round-off) follow the order of the calls. */
        const kqsvd_tensor_t ts[3] = {KQSVD_KEYS, KQSVD_QUERIES, KQSVD_VALUES};
        for (int t = 0; t < 3; t++) {
          const int64_t nh = ts[t] == KQSVD_QUERIES ? m : 1;
          KQSVD_CALL(kqsvd_shard_read(sh, ts[t], l, ts[t] == KQSVD_QUERIES ? g * m : g, nh, 0, T,
                                      buf + (size_t)(t == 0   ? 0
                                                     : t == 1 ? T * d
                                                              : (m + 1) * T * d) *
                                                esz));
        }
        for (int64_t j0 = 0; j0 < T; j0 += opt.block_rows) {
          const int64_t nj = T - j0 < opt.block_rows ? T - j0 : opt.block_rows;
          for (int64_t k = 0; k < m + 2; k++) {
            const kqsvd_tensor_t ten = k == 0 ? KQSVD_KEYS : k <= m ? KQSVD_QUERIES : KQSVD_VALUES;
            KQSVD_CALL(kqsvd_acc_absorb(acc, ten, l, g, ten == KQSVD_QUERIES ? k - 1 : 0,
                                        buf + (size_t)((k * T + j0) * d) * esz,
                                        kqsvd_shard_dtype(sh, ten), nj, d));
          }
        }
      }
    kqsvd_shard_close(&sh);
  }
  free(buf);
  buf = NULL;
  const int64_t width = dm->heads * d;
  KQSVD_MALLOC(buf, (size_t)(dm->hidden * width * 8), "o_proj");
  for (int64_t l = 0; l < shape.layers; l++) {
    KQSVD_CALL(kqsvd_model_read_oproj(model, l, 0, dm->hidden, 0, width, buf));
    KQSVD_CALL(kqsvd_acc_absorb_oproj(acc, l, buf, kqsvd_model_dtype(model), dm->hidden, width));
  }
  kqsvd_finish_options_t fo;
  kqsvd_finish_options_default(&fo);
  fo.ranks = argv[2];
  fo.beta = atof(argv[3]);
  KQSVD_CALL(kqsvd_acc_finish(acc, &fo, &res));
  kqsvd_write_options_t wo;
  kqsvd_write_options_default(&wo);
  wo.model = dm->model;
  wo.causal = (int)dm->causal;
  wo.force = 1;
  /* As calibrate carries it: the caches' rope attribute, absent stays absent. */
  wo.rope = *kqsvd_model_rope(model) ? kqsvd_model_rope(model) : NULL;
  KQSVD_CALL(kqsvd_result_write(res, argv[4], &wo));
done:
  free(buf);
  kqsvd_shard_close(&sh);
  kqsvd_model_close(&model);
  kqsvd_acc_free(&acc);
  kqsvd_result_free(&res);
  return st;
}

int main(int argc, char **argv) {
  if (argc < 7) {
    fprintf(stderr, "usage: acc_replay BLOCK_ROWS POLICY BETA OUT.h5 MODEL.h5 SHARD...\n");
    return 2;
  }
  /* No MPI_Init: the accumulator and the serial readers need none. */
  if (replay(argc, argv) != KQSVD_OK) {
    fprintf(stderr, "acc_replay: %s\n", kqsvd_last_error());
    return 1;
  }
  return 0;
}
