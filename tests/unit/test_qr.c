/* Streaming Householder QR: R equals LAPACK dgeqrf's R of the whole matrix
 * up to row signs, whatever d and the block size; merges of triangles
 * likewise; zero and rank-deficient inputs stay finite; every element type
 * folds to the same bits as its float64 values; R is reproducible bit for
 * bit given the calls and block size. */
#include <lapacke.h>
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "kqsvd_linalg.h"

enum { N = 3001, D = 24 };

/* Relative difference of two d x d R factors after fixing row signs. */
static double r_diff_d(int d, const double *A, const double *B) {
  const size_t dd = (size_t)d * d;
  double *a = malloc(dd * sizeof *a), *b = malloc(dd * sizeof *b), num = 0, den = 0;
  memcpy(a, A, dd * sizeof *a);
  memcpy(b, B, dd * sizeof *b);
  kqsvd_r_fix_signs(d, a);
  kqsvd_r_fix_signs(d, b);
  for (size_t k = 0; k < dd; k++) {
    num = fmax(num, fabs(a[k] - b[k]));
    den = fmax(den, fabs(b[k]));
  }
  free(a);
  free(b);
  return den > 0 ? num / den : num;
}
static double r_diff(const double *A, const double *B) { return r_diff_d(D, A, B); }

/* dgeqrf's R of the row-major n x d matrix X (n >= d). */
static void lapack_r_d(int d, const double *X, int n, double *R) {
  double *A = malloc(sizeof(double) * (size_t)n * d), *tau = malloc(sizeof(double) * d);
  for (int i = 0; i < n; i++)
    for (int j = 0; j < d; j++) A[(size_t)j * n + i] = X[(size_t)i * d + j];
  LAPACKE_dgeqrf(LAPACK_COL_MAJOR, n, d, A, n, tau);
  for (int j = 0; j < d; j++)
    for (int i = 0; i < d; i++) R[(size_t)j * d + i] = i <= j ? A[(size_t)j * n + i] : 0.0;
  free(A);
  free(tau);
}
static void lapack_r(const double *X, int n, double *R) { lapack_r_d(D, X, n, R); }

static int lower_nonzeros(int d, const double *R) {
  int lower = 0;
  for (int j = 0; j < d; j++)
    for (int i = j + 1; i < d; i++) lower += R[(size_t)j * d + i] != 0.0;
  return lower;
}

/* R of X folded by kqsvd_qr_absorb in calls of `split` rows (0: one call). */
static void fold(int d, int block, const void *X, kqsvd_dtype_t type, int n, int split,
                 double *R) {
  kqsvd_qr_ws_t *ws = NULL;
  int64_t bad = 0;
  CHECK_OK(kqsvd_qr_ws_init(d, block, &ws));
  memset(R, 0, sizeof(double) * (size_t)d * d);
  const size_t row = (size_t)d * kqsvd_dtype_size(type);
  for (int r0 = 0; r0 < n; r0 += split > 0 ? split : n) {
    const int m = split > 0 && n - r0 > split ? split : n - r0;
    CHECK_OK(kqsvd_qr_absorb(ws, R, (const char *)X + (size_t)r0 * row, type, m, &bad));
    CHECK(bad == -1, "d %d: no bad rows expected", d);
  }
  kqsvd_qr_ws_free(&ws);
}

/* The new kernel over widths around its vector (8) and split (16) sizes. */
static void check_kernel_shapes(unsigned long long *seed) {
  const int ds[] = {1, 2, 3, 24, 100, 128, 129}, blocks[] = {1, 7, 256, 1000}, n = 1500;
  for (size_t a = 0; a < sizeof ds / sizeof ds[0]; a++) {
    const int d = ds[a];
    double *X = malloc(sizeof(double) * (size_t)n * d), *Rref = malloc(sizeof(double) * d * d);
    double *R = malloc(sizeof(double) * d * d);
    for (int i = 0; i < n; i++)
      for (int j = 0; j < d; j++)
        X[(size_t)i * d + j] = test_normal(seed) * pow(10.0, -3.0 * j / (d > 1 ? d - 1 : 1));
    lapack_r_d(d, X, n, Rref);
    for (size_t b = 0; b < sizeof blocks / sizeof blocks[0]; b++) {
      fold(d, blocks[b], X, KQSVD_F64, n, 611, R);
      const double diff = r_diff_d(d, R, Rref);
      CHECK(diff <= 1e-12, "d %d block %d: R differs from dgeqrf by %.3g", d, blocks[b], diff);
      CHECK(lower_nonzeros(d, R) == 0, "d %d block %d: strict lower part must stay zero", d,
            blocks[b]);
    }
    free(X);
    free(Rref);
    free(R);
  }
}

/* Exact zeros give R = 0; a rank-1 matrix a finite R of rank 1; values
 * near underflow and overflow the R of the scaled matrix. */
static void check_kernel_degenerate(unsigned long long *seed) {
  enum { d = 128, n = 1300 };
  double *X = calloc((size_t)n * d, sizeof(double)), *R = malloc(sizeof(double) * d * d);
  double *Rref = malloc(sizeof(double) * d * d), *S = malloc(sizeof(double) * (size_t)n * d);
  double s[d];
  fold(d, 256, X, KQSVD_F64, n, 0, R);
  double mx = 0;
  for (int k = 0; k < d * d; k++) mx = fmax(mx, fabs(R[k]));
  CHECK(mx == 0.0, "d 128: zero input must give R = 0, got max %g", mx);

  double u[n], v[d];
  for (int i = 0; i < n; i++) u[i] = test_normal(seed);
  for (int j = 0; j < d; j++) v[j] = test_normal(seed);
  for (int i = 0; i < n; i++)
    for (int j = 0; j < d; j++) X[(size_t)i * d + j] = u[i] * v[j];
  fold(d, 256, X, KQSVD_F64, n, 0, R);
  int finite = 1;
  for (int k = 0; k < d * d; k++) finite &= isfinite(R[k]);
  CHECK(finite, "rank-1 input must give a finite R");
  CHECK_OK(kqsvd_svd(d, d, R, d, s, NULL, d, NULL, d));
  CHECK(s[1] <= 1e-12 * s[0], "rank 1 input: sigma_2 / sigma_1 = %g", s[1] / s[0]);

  for (int i = 0; i < n * d; i++) X[i] = test_normal(seed);
  lapack_r_d(d, X, n, Rref);
  const double scales[] = {0x1p-1000, 0x1p-530, 0x1p600};
  for (size_t c = 0; c < sizeof scales / sizeof scales[0]; c++) {
    for (int i = 0; i < n * d; i++) S[i] = X[i] * scales[c];
    fold(d, 512, S, KQSVD_F64, n, 0, R);
    for (int k = 0; k < d * d; k++) R[k] /= scales[c];
    const double diff = r_diff_d(d, R, Rref);
    CHECK(diff <= 1e-12, "scale 2^%d: R differs from dgeqrf by %.3g",
          (int)lround(log2(scales[c])), diff);
  }
  free(X);
  free(R);
  free(Rref);
  free(S);
}

/* Bits depend on the calls and block size only: splitting calls on block
 * boundaries and the BLAS thread count change nothing, and every element
 * type folds like float64 holding its values. */
static void check_kernel_reproducible(unsigned long long *seed) {
  enum { d = 128, n = 2100 };
  double *X = malloc(sizeof(double) * (size_t)n * d), *R1 = malloc(sizeof(double) * d * d);
  double *R2 = malloc(sizeof(double) * d * d);
  uint16_t *h = malloc(sizeof(uint16_t) * (size_t)n * d);
  float *f = malloc(sizeof(float) * (size_t)n * d);
  for (int i = 0; i < n * d; i++) X[i] = test_normal(seed);
  fold(d, 256, X, KQSVD_F64, n, 0, R1);
  fold(d, 256, X, KQSVD_F64, n, 512, R2);
  CHECK(memcmp(R1, R2, sizeof(double) * d * d) == 0, "calls split on block boundaries differ");
  kqsvd_blas_set_threads(2);
  fold(d, 256, X, KQSVD_F64, n, 0, R2);
  kqsvd_blas_set_threads(1);
  CHECK(memcmp(R1, R2, sizeof(double) * d * d) == 0, "2 BLAS threads change R");

  const kqsvd_dtype_t types[] = {KQSVD_BF16, KQSVD_F16, KQSVD_F32};
  for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
    void *raw = types[t] == KQSVD_F32 ? (void *)f : (void *)h;
    kqsvd_convert_from_f64(types[t], X, (int64_t)n * d, raw);
    double *back = malloc(sizeof(double) * (size_t)n * d);
    CHECK(kqsvd_convert_to_f64(types[t], raw, (int64_t)n * d, back) == -1, "finite values");
    fold(d, 300, back, KQSVD_F64, n, 1000, R1);
    fold(d, 300, raw, types[t], n, 1000, R2);
    CHECK(memcmp(R1, R2, sizeof(double) * d * d) == 0, "%s folds unlike its float64 values",
          kqsvd_dtype_name(types[t]));
    /* The first non-finite row is reported and its sub-block not folded. */
    kqsvd_qr_ws_t *ws = NULL;
    int64_t bad = 0;
    double *R3 = calloc((size_t)d * d, sizeof(double));
    const size_t at = (size_t)1234 * d + 77, esz = kqsvd_dtype_size(types[t]);
    unsigned char save[4];
    memcpy(save, (char *)raw + at * esz, esz);
    kqsvd_convert_from_f64(types[t], &(double){t == 1 ? -INFINITY : NAN}, 1,
                           (char *)raw + at * esz);
    CHECK_OK(kqsvd_qr_ws_init(d, 300, &ws));
    CHECK_OK(kqsvd_qr_absorb(ws, R3, raw, types[t], n, &bad));
    CHECK(bad == 1234, "%s: bad row %lld, expected 1234", kqsvd_dtype_name(types[t]),
          (long long)bad);
    fold(d, 300, back, KQSVD_F64, 1200, 0, R1);
    CHECK(memcmp(R1, R3, sizeof(double) * d * d) == 0, "%s: rows before the bad block",
          kqsvd_dtype_name(types[t]));
    memcpy((char *)raw + at * esz, save, esz);
    kqsvd_qr_ws_free(&ws);
    free(R3);
    free(back);
  }
  free(X);
  free(R1);
  free(R2);
  free(h);
  free(f);
}

/* The transposing conversion (column-major input of the Gram path) has a
 * tiled bf16 path: same values as one-by-one decoding, same first bad row. */
static void check_bf16_transpose(unsigned long long *seed) {
  enum { d = 129, rows = 100, ld = 104 };
  uint16_t *h = malloc(sizeof(uint16_t) * rows * d);
  double *dst = malloc(sizeof(double) * ld * d);
  for (int k = 0; k < rows * d; k++) h[k] = kqsvd_f64_to_bf16(test_normal(seed));
  CHECK(kqsvd_convert_transpose(KQSVD_BF16, h, rows, d, dst, ld) == -1, "bf16: all finite");
  int wrong = 0;
  for (int i = 0; i < rows; i++)
    for (int j = 0; j < d; j++) wrong += dst[(size_t)j * ld + i] != kqsvd_bf16_to_f64(h[i * d + j]);
  CHECK(wrong == 0, "bf16 transpose: %d values differ", wrong);
  /* One bad value at a time, in the last (odd) column, in a tile and in the
   * row tail; then two, where the first row counts. */
  const int bad_at[][2] = {{70, 128}, {33, 5}, {99, 64}, {2, 127}};
  for (size_t b = 0; b < sizeof bad_at / sizeof bad_at[0]; b++) {
    uint16_t *at = &h[bad_at[b][0] * d + bad_at[b][1]];
    const uint16_t keep = *at;
    *at = b % 2 ? 0xff80 : 0x7fc0; /* -Inf, NaN */
    const int64_t got = kqsvd_convert_transpose(KQSVD_BF16, h, rows, d, dst, ld);
    CHECK(got == bad_at[b][0], "bf16 transpose: bad row %lld, expected %d", (long long)got,
          bad_at[b][0]);
    if (b + 1 < sizeof bad_at / sizeof bad_at[0]) *at = keep;
  }
  h[50 * d + 3] = 0x7f80; /* +Inf, with row 2's NaN still there */
  CHECK(kqsvd_convert_transpose(KQSVD_BF16, h, rows, d, dst, ld) == 2, "bf16 transpose: first bad row");
  free(h);
  free(dst);
}

int main(void) {
  unsigned long long seed = 42;
  double *X = malloc(sizeof(double) * N * D), Rref[D * D], R[D * D], R2[D * D];
  kqsvd_blas_set_threads(1);
  /* Columns of very different scale: conditioning ~1e4. */
  for (int i = 0; i < N; i++)
    for (int j = 0; j < D; j++) X[i * D + j] = test_normal(&seed) * pow(10.0, -4.0 * j / (D - 1));
  lapack_r(X, N, Rref);

  const int blocks[] = {1, 7, 64, 256, N};
  for (size_t b = 0; b < sizeof blocks / sizeof blocks[0]; b++) {
    kqsvd_qr_ws_t *ws = NULL;
    int64_t bad = 0;
    CHECK_OK(kqsvd_qr_ws_init(D, blocks[b], &ws));
    memset(R, 0, sizeof R);
    /* Uneven calls, as reads of different sizes would give. */
    CHECK_OK(kqsvd_qr_absorb(ws, R, X, KQSVD_F64, 1000, &bad));
    CHECK_OK(kqsvd_qr_absorb(ws, R, X + 1000 * D, KQSVD_F64, N - 1000, &bad));
    CHECK(bad == -1, "no bad rows expected");
    const double diff = r_diff(R, Rref);
    CHECK(diff <= 1e-12, "block %d: R differs from dgeqrf by %.3g", blocks[b], diff);
    CHECK(lower_nonzeros(D, R) == 0, "strict lower part must stay zero");
    kqsvd_qr_ws_free(&ws);
  }

  /* TSQR: R([X1; X2]) from the factors of the halves, either order. */
  kqsvd_qr_ws_t *ws = NULL;
  int64_t bad = 0;
  CHECK_OK(kqsvd_qr_ws_init(D, 128, &ws));
  memset(R, 0, sizeof R);
  memset(R2, 0, sizeof R2);
  CHECK_OK(kqsvd_qr_absorb(ws, R, X, KQSVD_F64, 1234, &bad));
  CHECK_OK(kqsvd_qr_absorb(ws, R2, X + 1234 * D, KQSVD_F64, N - 1234, &bad));
  double top[D * D], bottom[D * D];
  memcpy(top, R, sizeof R);
  CHECK_OK(kqsvd_qr_merge(ws, top, R2));
  CHECK(r_diff(top, Rref) <= 1e-12, "merged R differs by %.3g", r_diff(top, Rref));
  memcpy(bottom, R2, sizeof R2);
  CHECK_OK(kqsvd_qr_merge(ws, bottom, R));
  CHECK(r_diff(bottom, Rref) <= 1e-12, "reversed merge differs by %.3g", r_diff(bottom, Rref));
  /* Fewer block rows than d: the LAPACK dtpqrt merge. */
  kqsvd_qr_ws_t *narrow = NULL;
  CHECK_OK(kqsvd_qr_ws_init(D, 8, &narrow));
  memcpy(top, R, sizeof R);
  CHECK_OK(kqsvd_qr_merge(narrow, top, R2));
  CHECK(r_diff(top, Rref) <= 1e-12, "dtpqrt merge differs by %.3g", r_diff(top, Rref));
  kqsvd_qr_ws_free(&narrow);

  /* Packing round trip. */
  double P[D * (D + 1) / 2], U[D * D];
  kqsvd_tri_pack(D, Rref, P);
  kqsvd_tri_unpack(D, P, U);
  CHECK(memcmp(U, Rref, sizeof U) == 0, "pack/unpack must be exact");

  /* All-zero rows give R = 0; rank-deficient rows a finite R of that rank. */
  double *Z = calloc((size_t)N * D, sizeof(double));
  memset(R, 0, sizeof R);
  CHECK_OK(kqsvd_qr_absorb(ws, R, Z, KQSVD_F64, N, &bad));
  double mx = 0;
  for (int k = 0; k < D * D; k++) mx = fmax(mx, fabs(R[k]));
  CHECK(mx == 0.0, "zero input must give R = 0, got max %g", mx);
  for (int i = 0; i < N; i++)
    for (int j = 0; j < D; j++) Z[i * D + j] = j < 5 ? X[i * D + j] : X[i * D + j % 5];
  memset(R, 0, sizeof R);
  CHECK_OK(kqsvd_qr_absorb(ws, R, Z, KQSVD_F64, N, &bad));
  int finite = 1;
  for (int k = 0; k < D * D; k++) finite &= isfinite(R[k]);
  CHECK(finite, "rank-deficient input must give a finite R");
  double s[D], tmp[D * D];
  memcpy(tmp, R, sizeof tmp);
  CHECK_OK(kqsvd_svd(D, D, tmp, D, s, NULL, D, NULL, D));
  CHECK(s[5] <= 1e-12 * s[0], "rank 5 input: sigma_6 / sigma_1 = %g", s[5] / s[0]);

  /* A NaN stops the fold at its sub-block and names the row. */
  Z[777 * D + 3] = NAN;
  CHECK_OK(kqsvd_qr_absorb(ws, R, Z, KQSVD_F64, N, &bad));
  CHECK(bad == 777, "bad row %lld, expected 777", (long long)bad);
  kqsvd_qr_ws_free(&ws);
  free(Z);
  free(X);

  check_kernel_shapes(&seed);
  check_kernel_degenerate(&seed);
  check_kernel_reproducible(&seed);
  check_bf16_transpose(&seed);
  return check_exit("test_qr");
}
