/* Uses the installed kqsvd library the way an inference engine would: feeds
 * rows of keys, queries and values to an accumulator as they come, checks
 * the key factor against LAPACK's dgeqrf of all the rows (up to row signs,
 * 1e-12 relative), solves, and writes proj.h5.  No MPI_Init: one process.
 *
 *     kqsvd_consumer [OUT.h5]          exit 0 when every check passes */
#include <float.h>
#include <lapacke.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kqsvd/kqsvd.h>

enum { L = 2, HKV = 2, GROUP = 2, D = 16, HIDDEN = 48, T = 1000 };

static double uniform(unsigned long long *s) {
  *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
  return ((double)(*s >> 11) + 0.5) * 0x1.0p-53 - 0.5;
}

#define TRY(call)                                                             \
  do {                                                                        \
    if ((call) != KQSVD_OK) {                                                 \
      fprintf(stderr, "kqsvd_consumer: %s: %s\n", #call, kqsvd_last_error()); \
      return 1;                                                               \
    }                                                                         \
  } while (0)

int main(int argc, char **argv) {
  const char *out = argc > 1 ? argv[1] : "consumer-proj.h5";
  printf("kqsvd library %s (headers %s)\n", kqsvd_version(), KQSVD_VERSION);
  kqsvd_shape_t shape = {L, HKV, GROUP, D, HIDDEN};
  kqsvd_acc_t *acc = NULL;
  TRY(kqsvd_acc_init(&shape, NULL, &acc));
  /* Keys of (layer 1, KV head 0), kept for the reference; every head gets
   * rows of decaying scale, in batches of 128 tokens, as float32. */
  double *K = malloc(sizeof(double) * T * D);
  float *batch = malloc(sizeof(float) * 128 * D);
  unsigned long long seed = 12345;
  for (int64_t t0 = 0; t0 < T; t0 += 128) {
    const int64_t n = T - t0 < 128 ? T - t0 : 128;
    for (int64_t l = 0; l < L; l++)
      for (int64_t g = 0; g < HKV; g++)
        for (int k = 0; k < 2 + GROUP; k++) {
          for (int64_t i = 0; i < n * D; i++)
            batch[i] = (float)(uniform(&seed) * pow(0.7, (double)(i % D)));
          if (l == 1 && g == 0 && k == 0)
            for (int64_t i = 0; i < n * D; i++) K[t0 * D + i] = batch[i];
          const kqsvd_tensor_t ten = k == 0 ? KQSVD_KEYS : k == 1 ? KQSVD_VALUES : KQSVD_QUERIES;
          TRY(kqsvd_acc_absorb(acc, ten, l, g, k >= 2 ? k - 2 : 0, batch, KQSVD_F32, n, D));
        }
  }
  float *w = malloc(sizeof(float) * HIDDEN * HKV * GROUP * D);
  for (int64_t l = 0; l < L; l++) {
    for (int64_t i = 0; i < HIDDEN * HKV * GROUP * D; i++) w[i] = (float)uniform(&seed);
    TRY(kqsvd_acc_absorb_oproj(acc, l, w, KQSVD_F32, HIDDEN, HKV * GROUP * D));
  }
  /* The reference: LAPACK's R of the same rows, compared row by row up to
   * sign. */
  double R[D * D], *A = malloc(sizeof(double) * T * D), tau[D], worst = 0.0, scale = 0.0;
  TRY(kqsvd_acc_factor(acc, KQSVD_KEYS, 1, 0, R));
  memcpy(A, K, sizeof(double) * T * D);
  if (LAPACKE_dgeqrf(LAPACK_ROW_MAJOR, T, D, A, D, tau) != 0) return 1;
  for (int i = 0; i < D * D; i++) scale = fmax(scale, fabs(A[i]));
  for (int i = 0; i < D; i++) {
    const double s = (R[i * D + i] < 0) == (A[i * D + i] < 0) ? 1.0 : -1.0;
    for (int j = 0; j < D; j++)
      worst = fmax(worst, fabs(s * R[i * D + j] - (j >= i ? A[i * D + j] : 0.0)) / scale);
  }
  printf("R factor vs LAPACK dgeqrf: %.2e relative\n", worst);
  kqsvd_result_t *res = NULL;
  TRY(kqsvd_acc_finish(acc, NULL, &res));
  printf("kqsvd key ranks (eps:0.1): %d %d\n", kqsvd_result_rank_k(res, KQSVD_METHOD_KQSVD)[0],
         kqsvd_result_rank_k(res, KQSVD_METHOD_KQSVD)[1]);
  kqsvd_write_options_t wo;
  kqsvd_write_options_default(&wo);
  wo.model = "kqsvd_consumer";
  wo.force = 1;
  TRY(kqsvd_result_write(res, out, &wo));
  printf("wrote %s\n", out);
  kqsvd_result_free(&res);
  kqsvd_acc_free(&acc);
  free(K);
  free(batch);
  free(w);
  free(A);
  return worst <= 1e-12 ? 0 : 1;
}
