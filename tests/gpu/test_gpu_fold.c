/* The device QR stage against the CPU reference: the same rows folded on
 * the GPU (whole blocks, several lanes in flight) and on the CPU (256-row
 * blocks) give the same R up to row signs, for every element type; a NaN
 * is reported with its call and row.  Skips (77) without a device. */
#include <stdlib.h>
#include <string.h>

#include "../unit/check.h"
#include "kqsvd_gpu.h"
#include "kqsvd_linalg.h"

enum { D = 48, NF = 5, ROWS = 700 };

int main(void) {
  const kqsvd_gpu_api_t *gpu = NULL;
  if (kqsvd_gpu_driver_devices() == 0) {
    printf("test_gpu_fold: SKIPPED, no CUDA device visible\n");
    return 77;
  }
  CHECK_OK(kqsvd_gpu_open(&gpu));
  if (!gpu) return check_exit("test_gpu_fold");
  unsigned long long seed = 11;
  const kqsvd_dtype_t types[] = {KQSVD_F64, KQSVD_F32, KQSVD_BF16, KQSVD_F16};
  const size_t tri = kqsvd_tri_size(D);
  for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
    const kqsvd_dtype_t t = types[ti];
    kqsvd_gpu_fold_t *f = NULL;
    kqsvd_qr_ws_t *ws = NULL;
    double *cpu = calloc((size_t)NF * D * D, sizeof(double));
    double *packed = calloc((size_t)NF * tri, sizeof(double));
    double *x = malloc((size_t)ROWS * D * sizeof(double));
    void *raw = malloc((size_t)ROWS * D * 8);
    if (gpu->fold_init(0, D, NF, ROWS, (int)kqsvd_dtype_size(t), 3, &f) != KQSVD_OK) {
      CHECK(0, "fold_init: %s", gpu->last_error());
      break;
    }
    CHECK_OK(kqsvd_qr_ws_init(D, 256, &ws));
    /* Several calls per factor, of uneven sizes, interleaved across factors. */
    const int64_t sizes[] = {ROWS, 1, 300, 77, ROWS};
    for (int call = 0; call < 5; call++)
      for (int k = 0; k < NF; k++) {
        const int64_t n = sizes[(call + k) % 5];
        for (int64_t i = 0; i < n * D; i++) x[i] = test_normal(&seed) * (1.0 + (i % D));
        kqsvd_convert_from_f64(t, x, n * D, raw);
        int64_t bad = -1;
        CHECK_OK(gpu->fold_rows(f, k, raw, t, n, call * NF + k));
        CHECK_OK(kqsvd_qr_absorb(ws, cpu + (size_t)k * D * D, raw, t, n, &bad));
      }
    int64_t bad_tag = 0, bad_row = 0;
    CHECK_OK(gpu->fold_sync(f, packed, &bad_tag, &bad_row));
    CHECK(bad_tag == -1 && bad_row == -1, "no NaN, yet tag %lld row %lld", (long long)bad_tag,
          (long long)bad_row);
    double worst = 0.0;
    for (int k = 0; k < NF; k++) {
      double g[D * D], *c = cpu + (size_t)k * D * D, scale = 0.0;
      kqsvd_tri_unpack(D, packed + (size_t)k * tri, g);
      kqsvd_r_fix_signs(D, g);
      kqsvd_r_fix_signs(D, c);
      for (int i = 0; i < D * D; i++) scale = fabs(c[i]) > scale ? fabs(c[i]) : scale;
      for (int i = 0; i < D * D; i++) {
        const double e = fabs(g[i] - c[i]) / scale;
        worst = e > worst ? e : worst;
      }
    }
    CHECK(worst <= 1e-10, "%s: GPU and CPU R differ by %.3g relative", kqsvd_dtype_name(t), worst);
    printf("%s: largest relative difference %.3g\n", kqsvd_dtype_name(t), worst);

    /* Load, then a NaN in the second call of factor 2 at row 5. */
    CHECK_OK(gpu->fold_load(f, packed));
    for (int64_t i = 0; i < 10 * D; i++) x[i] = 1.0 + (double)i;
    kqsvd_convert_from_f64(t, x, 10 * D, raw);
    CHECK_OK(gpu->fold_rows(f, 2, raw, t, 10, 7));
    x[5 * D + 3] = NAN;
    kqsvd_convert_from_f64(t, x, 10 * D, raw);
    CHECK_OK(gpu->fold_rows(f, 2, raw, t, 10, 8));
    CHECK_OK(gpu->fold_rows(f, 3, raw, t, 10, 9));
    CHECK_OK(gpu->fold_sync(f, NULL, &bad_tag, &bad_row));
    CHECK(bad_tag == 8 && bad_row == 5, "NaN reported as tag %lld row %lld, expected 8 and 5",
          (long long)bad_tag, (long long)bad_row);
    gpu->fold_free(&f);
    kqsvd_qr_ws_free(&ws);
    free(cpu);
    free(packed);
    free(x);
    free(raw);
  }
  return check_exit("test_gpu_fold");
}
