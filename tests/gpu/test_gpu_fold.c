/* The device fold against the CPU's kernels: the same item blocks folded on
 * the GPU (whole blocks, two lanes, some read into the staging buffers) and
 * on the CPU (Householder QR, and the float64 SYRK of --qr gram) give the
 * same factors, for both methods, per head and in head groups (keys and
 * values side by side, queries block-diagonal), for every element type and
 * a block of mixed types; the Gram method's R factors equal Householder's
 * on these well-conditioned rows; a NaN is reported with its call and its
 * row in the block.  Skips (77) without a device. */
#include <stdlib.h>
#include <string.h>

#include "../unit/check.h"
#include "kqsvd_gpu.h"
#include "kqsvd_gram.h"
#include "kqsvd_linalg.h"

enum { HD = 16, M = 3, NI = 3, ROWS = 700, MAXW = 2 * HD };

typedef struct {
  int G, w, heads;
  kqsvd_dtype_t t[3];
  double *ref; /* NI x 3 unpacked w x w factors (R, or Gram) */
  kqsvd_qr_ws_t *ws_w, *ws_hd;
  double *gbuf;
  unsigned char *block, *joint;
} ref_t;

static size_t part_bytes(const ref_t *r, int p, int64_t n) {
  const int64_t heads = p == 1 ? r->G * M : r->G;
  return (size_t)(heads * n * HD) * kqsvd_dtype_size(r->t[p]);
}

/* The CPU's fold of rows (n x width, type t) into F (width x width). */
static void cpu_fold(ref_t *r, int gram, int width, double *F, const void *rows, kqsvd_dtype_t t,
                     int64_t n) {
  int64_t bad = -1;
  if (gram)
    kqsvd_gram_absorb(width, F, rows, t, n, r->gbuf, 256, &bad);
  else
    CHECK_OK(kqsvd_qr_absorb(width == r->w ? r->ws_w : r->ws_hd, F, rows, t, n, &bad));
  CHECK(bad < 0, "CPU fold saw a NaN at row %lld", (long long)bad);
}

/* The block of item i (random rows, heads scaled apart) into r->block, and
 * its fold on the CPU: joined keys and values, each query head into its
 * KV head's block (kept in its own hd x hd matrix, placed at the end). */
static void make_block(ref_t *r, int gram, int i, int64_t n, unsigned long long *seed,
                       double *qblocks) {
  double *x = malloc((size_t)(r->G * M) * (size_t)n * HD * sizeof(double));
  size_t off = 0;
  for (int p = 0; p < 3; p++) {
    const int heads = p == 1 ? r->G * M : r->G;
    const size_t esz = kqsvd_dtype_size(r->t[p]);
    for (int64_t k = 0; k < heads * n * HD; k++) x[k] = test_normal(seed) * (1.0 + (k % HD));
    kqsvd_convert_from_f64(r->t[p], x, heads * n * HD, r->block + off);
    if (p == 1) {
      for (int q = 0; q < heads; q++)
        cpu_fold(r, gram, HD, qblocks + (size_t)(i * r->G + q / M) * HD * HD,
                 r->block + off + (size_t)q * n * HD * esz, r->t[p], n);
    } else {
      double *F = r->ref + (size_t)(3 * i + p) * r->w * r->w;
      for (int64_t row = 0; row < n; row++)
        for (int h = 0; h < r->G; h++)
          memcpy(r->joint + ((size_t)row * r->G + h) * HD * esz,
                 r->block + off + ((size_t)h * n + row) * HD * esz, HD * esz);
      cpu_fold(r, gram, r->w, F, r->joint, r->t[p], n);
    }
    off += part_bytes(r, p, n);
  }
  free(x);
}

static double rel_diff(int w, double *a, double *b, int signs) {
  double scale = 0.0, worst = 0.0;
  if (signs) kqsvd_r_fix_signs(w, a), kqsvd_r_fix_signs(w, b);
  for (int j = 0; j < w; j++)
    for (int i = 0; i <= j; i++) scale = fmax(scale, fabs(b[i + j * w]));
  for (int j = 0; j < w; j++)
    for (int i = 0; i <= j; i++) worst = fmax(worst, fabs(a[i + j * w] - b[i + j * w]));
  return worst / (scale > 0 ? scale : 1.0);
}

static void run(const kqsvd_gpu_api_t *gpu, kqsvd_gpu_method_t method, int G,
                const kqsvd_dtype_t t[3], unsigned long long *seed, double *rs) {
  const int gram = method == KQSVD_GPU_GRAM, w = G * HD;
  ref_t r = {G, w, 2 * G + G * M, {t[0], t[1], t[2]}, NULL, NULL, NULL, NULL, NULL, NULL};
  const kqsvd_gpu_shape_t shape = {HD, G, M, NI, ROWS, 8, 2, 64, method};
  const size_t tri = kqsvd_tri_size(w);
  kqsvd_gpu_fold_t *f = NULL;
  double *packed = calloc((size_t)NI * 3 * tri, sizeof(double));
  double *qblocks = calloc((size_t)NI * G * HD * HD, sizeof(double));
  double *g = calloc((size_t)w * w, sizeof(double));
  r.ref = calloc((size_t)NI * 3 * w * w, sizeof(double));
  r.gbuf = malloc((size_t)256 * w * sizeof(double));
  r.block = malloc((size_t)r.heads * ROWS * HD * 8);
  r.joint = malloc((size_t)ROWS * w * 8);
  CHECK_OK(kqsvd_qr_ws_init(w, 256, &r.ws_w));
  CHECK_OK(kqsvd_qr_ws_init(HD, 256, &r.ws_hd));
  if (gpu->fold_init(0, &shape, &f) != KQSVD_OK) {
    CHECK(0, "fold_init: %s", gpu->last_error());
    return;
  }
  /* Several calls per item, of uneven sizes (one row, short blocks, whole
   * and partial chunks), interleaved across items; odd calls are read
   * straight into the staging buffer. */
  const int64_t sizes[] = {ROWS, 1, 300, 77, ROWS - 3};
  for (int call = 0; call < 5; call++)
    for (int i = 0; i < NI; i++) {
      const int64_t n = sizes[(call + i) % 5];
      make_block(&r, gram, i, n, seed, qblocks);
      size_t bytes = part_bytes(&r, 0, n) + part_bytes(&r, 1, n) + part_bytes(&r, 2, n);
      const void *X = r.block;
      if (call % 2) {
        void *stage = gpu->fold_stage(f, i);
        CHECK(stage != NULL, "no staging buffer");
        if (stage) memcpy(stage, r.block, bytes), X = stage;
      }
      CHECK_OK(gpu->fold_item(f, i, X, t, n, 0, call * NI + i));
    }
  int64_t bad_tag = 0, bad_row = 0;
  CHECK_OK(gpu->fold_sync(f, packed, &bad_tag, &bad_row));
  CHECK(bad_tag == -1 && bad_row == -1, "no NaN, yet tag %lld row %lld", (long long)bad_tag,
        (long long)bad_row);
  /* The CPU's query blocks on the diagonal of the block-diagonal factor. */
  for (int i = 0; i < NI; i++)
    for (int j = 0; j < G; j++)
      for (int c = 0; c < HD; c++)
        memcpy(r.ref + (size_t)(3 * i + 1) * w * w + (size_t)(j * HD + c) * w + j * HD,
               qblocks + (size_t)(i * G + j) * HD * HD + (size_t)c * HD, HD * sizeof(double));
  double worst = 0.0;
  for (int k = 0; k < 3 * NI; k++) {
    double *R = rs + (size_t)k * w * w;
    kqsvd_tri_unpack(w, packed + (size_t)k * tri, g);
    worst = fmax(worst, rel_diff(w, g, r.ref + (size_t)k * w * w, !gram));
    /* The R factor, for the caller's comparison of the methods. */
    kqsvd_tri_unpack(w, packed + (size_t)k * tri, R);
    if (gram) CHECK_OK(kqsvd_gram_to_r(w, R));
  }
  CHECK(worst <= 1e-12, "%s, G = %d, types %s/%s/%s: GPU and CPU factors differ by %.3g",
        gram ? "gram" : "qr", G, kqsvd_dtype_name(t[0]), kqsvd_dtype_name(t[1]),
        kqsvd_dtype_name(t[2]), worst);
  printf("%s, G = %d, %s/%s/%s: largest relative difference %.3g\n", gram ? "gram" : "qr", G,
         kqsvd_dtype_name(t[0]), kqsvd_dtype_name(t[1]), kqsvd_dtype_name(t[2]), worst);

  /* Load, then a NaN in query head 2 of item 1's second call, row 5. */
  CHECK_OK(gpu->fold_load(f, packed));
  const int64_t n = 10;
  make_block(&r, gram, 1, n, seed, qblocks);
  CHECK_OK(gpu->fold_item(f, 1, r.block, t, n, 0, 7));
  {
    const size_t esz = kqsvd_dtype_size(t[1]), at = part_bytes(&r, 0, n) + (2 * n + 5) * HD * esz;
    double nan = NAN;
    kqsvd_convert_from_f64(t[1], &nan, 1, r.block + at + 3 * esz);
  }
  CHECK_OK(gpu->fold_item(f, 1, r.block, t, n, 0, 8));
  CHECK_OK(gpu->fold_item(f, 2, r.block, t, n, 0, 9));
  CHECK_OK(gpu->fold_sync(f, NULL, &bad_tag, &bad_row));
  CHECK(bad_tag == 8 && bad_row == (G + 2) * n + 5,
        "NaN reported as tag %lld row %lld, expected 8 and %lld", (long long)bad_tag,
        (long long)bad_row, (long long)((G + 2) * n + 5));
  gpu->fold_free(&f);
  kqsvd_qr_ws_free(&r.ws_w);
  kqsvd_qr_ws_free(&r.ws_hd);
  free(r.ref), free(r.gbuf), free(r.block), free(r.joint);
  free(packed), free(qblocks), free(g);
}

int main(void) {
  const kqsvd_gpu_api_t *gpu = NULL;
  if (kqsvd_gpu_driver_devices() == 0) {
    printf("test_gpu_fold: SKIPPED, no CUDA device visible\n");
    return 77;
  }
  CHECK_OK(kqsvd_gpu_open(&gpu));
  if (!gpu) return check_exit("test_gpu_fold");
  const kqsvd_dtype_t types[][3] = {{KQSVD_F64, KQSVD_F64, KQSVD_F64},
                                    {KQSVD_F32, KQSVD_F32, KQSVD_F32},
                                    {KQSVD_BF16, KQSVD_BF16, KQSVD_BF16},
                                    {KQSVD_F16, KQSVD_F16, KQSVD_F16},
                                    {KQSVD_BF16, KQSVD_F32, KQSVD_F16}};
  for (int G = 1; G <= 2; G++)
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
      const int w = G * HD;
      double *rs[2], worst = 0.0;
      for (int k = 0; k < 2; k++) {
        unsigned long long seed = 11 + ti; /* the same rows for both methods */
        rs[k] = calloc((size_t)3 * NI * w * w, sizeof(double));
        run(gpu, k ? KQSVD_GPU_GRAM : KQSVD_GPU_QR, G, types[ti], &seed, rs[k]);
      }
      /* Well-conditioned rows: the Gram method's R is Householder's. */
      for (int k = 0; k < 3 * NI; k++)
        worst = fmax(worst, rel_diff(w, rs[1] + (size_t)k * w * w, rs[0] + (size_t)k * w * w, 1));
      CHECK(worst <= 1e-10, "G = %d: the Gram method's R differs from QR's by %.3g", G, worst);
      printf("G = %d, %s: gram R against qr R %.3g\n", G, kqsvd_dtype_name(types[ti][0]), worst);
      free(rs[0]);
      free(rs[1]);
    }
  return check_exit("test_gpu_fold");
}
