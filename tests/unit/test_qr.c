/* Streaming Householder QR: R equals LAPACK dgeqrf's R of the whole matrix
 * up to row signs, whatever d and the block size; merges of triangles
 * likewise; zero and rank-deficient inputs stay finite; every element type
 * folds to the same bits as its float64 values; R is reproducible bit for
 * bit given the calls and block size.
 *
 * The kernels exist once per instruction set (kqsvd_isa.h); ctest runs this
 * test once per set with KQSVD_ISA=base|avx2|avx512 and it checks that the
 * set asked for is the one running (77, skipped, where this CPU lacks it),
 * then compares the other sets' R with this one's. */
#include <float.h>
#include <lapacke.h>
#include <stdint.h>
#include <string.h>
#include <strings.h>

#include "check.h"
#include "kqsvd_isa.h"
#include "kqsvd_linalg.h"

enum { N = 3001, D = 24 };

/* Round-off tolerances: TOL_R eps (d + sqrt n) for d columns folded from n
 * rows (eps = DBL_EPSILON).
 *
 * r_diff_d measures an R against another column by column, relative to the
 * column's norm (the norm of the input column).  Householder QR is
 * columnwise backward stable, and the test matrices are Gaussian with
 * n >> d rows, so once their columns are scaled to unit norm they are well
 * conditioned (kappa < 2): R's forward error is of the order of the
 * backward error.  Within one fold of a block, each column of R meets at
 * most d reflectors, each adding about eps: the d term.  A stream folds up
 * to n blocks (n at one row per block), each rounding R afresh, and those
 * roundings add up like a random walk: the sqrt n term (measured: the error
 * grows with the number of folds and hardly with d; 19 eps at d = 129 and
 * 1500 one-row folds, 3 eps at 256-row blocks).
 *
 * Measured worst, over every check and all three kernel sets: 0.41 of the
 * unit against dgeqrf (whose own error is in the difference; d = 3, one-row
 * blocks), 0.02 between sets, 0.02 for merges.  TOL_R = 2 leaves a margin
 * of about 5; a kernel that drops or misapplies one reflector update, or
 * one row or vector tail, fails by ten orders of magnitude or more.
 * The rank-deficient checks bound the spurious singular values of R,
 * relative to sigma_1: the same round-off, with the same tolerance. */
#define TOL_R 2.0
#define UNITS " eps (d + sqrt n)"
static double unit(int d, int n) { return DBL_EPSILON * (d + sqrt((double)n)); }
static double tol_r(int d, int n) { return TOL_R * unit(d, n); }

/* The worst error seen in each class of check, in units of eps (d + sqrt n). */
enum { W_DGEQRF, W_MERGE, W_PATHS, W_RANK, W_COUNT };
static const char *const g_worst_name[W_COUNT] = {"fold vs dgeqrf", "merges vs dgeqrf",
                                                  "other sets vs this one", "rank-deficient sigma"};
static double g_worst[W_COUNT];
static double seen(int what, double err, int d, int n) {
  g_worst[what] = fmax(g_worst[what], err / unit(d, n));
  return err;
}

/* Difference of two d x d R factors after fixing row signs: the largest
 * over columns j of max_i |A_ij - B_ij| / ||B_{:,j}||. */
static double r_diff_d(int d, const double *A, const double *B) {
  const size_t dd = (size_t)d * d;
  double *a = malloc(dd * sizeof *a), *b = malloc(dd * sizeof *b), worst = 0;
  memcpy(a, A, dd * sizeof *a);
  memcpy(b, B, dd * sizeof *b);
  kqsvd_r_fix_signs(d, a);
  kqsvd_r_fix_signs(d, b);
  for (int j = 0; j < d; j++) {
    double num = 0, norm = 0;
    for (int i = 0; i < d; i++) {
      num = fmax(num, fabs(a[(size_t)j * d + i] - b[(size_t)j * d + i]));
      norm = hypot(norm, b[(size_t)j * d + i]);
    }
    worst = fmax(worst, norm > 0 ? num / norm : num);
  }
  free(a);
  free(b);
  return worst;
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
static void fold(int d, int block, const void *X, kqsvd_dtype_t type, int n, int split, double *R) {
  kqsvd_qr_ws_t *ws = NULL;
  int64_t bad = 0;
  CHECK_OK(kqsvd_qr_ws_init(d, block, &ws));
  memset(R, 0, sizeof(double) * (size_t)d * d);
  const size_t row = (size_t)d * kqsvd_dtype_size(type);
  for (int r0 = 0; r0<n; r0 += split> 0 ? split : n) {
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
      const double diff = seen(W_DGEQRF, r_diff_d(d, R, Rref), d, n);
      CHECK(diff <= tol_r(d, n), "d %d block %d: R differs from dgeqrf by %.3g" UNITS, d, blocks[b],
            diff / unit(d, n));
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
  CHECK(seen(W_RANK, s[1] / s[0], d, n) <= tol_r(d, n), "rank 1 input: sigma_2 / sigma_1 = %g",
        s[1] / s[0]);

  for (int i = 0; i < n * d; i++) X[i] = test_normal(seed);
  lapack_r_d(d, X, n, Rref);
  const double scales[] = {0x1p-1000, 0x1p-530, 0x1p600};
  for (size_t c = 0; c < sizeof scales / sizeof scales[0]; c++) {
    for (int i = 0; i < n * d; i++) S[i] = X[i] * scales[c];
    fold(d, 512, S, KQSVD_F64, n, 0, R);
    for (int k = 0; k < d * d; k++) R[k] /= scales[c];
    const double diff = seen(W_DGEQRF, r_diff_d(d, R, Rref), d, n);
    CHECK(diff <= tol_r(d, n), "scale 2^%d: R differs from dgeqrf by %.3g" UNITS,
          (int)lround(log2(scales[c])), diff / unit(d, n));
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
  CHECK(kqsvd_convert_transpose(KQSVD_BF16, h, rows, d, dst, ld) == 2,
        "bf16 transpose: first bad row");
  free(h);
  free(dst);
}

/* KQSVD_ISA is honoured, never ignored: the set it names runs, or the test
 * is skipped (77) where this CPU lacks it, after checking that the library
 * refuses it too.  Returns the set running, or -1 to skip. */
static int check_isa(void) {
  const char *want_s = getenv("KQSVD_ISA");
  kqsvd_isa_t got = KQSVD_ISA_BASE, want = kqsvd_isa_best(), parsed;
  /* Names, any case; an unknown one and an unsupported one are errors that
   * name the variable, the value and what this CPU supports. */
  for (int i = 0; i < KQSVD_ISA_COUNT; i++) {
    const kqsvd_isa_t isa = (kqsvd_isa_t)i;
    char upper[16];
    snprintf(upper, sizeof upper, "%s", kqsvd_isa_name(isa));
    for (char *c = upper; *c; c++) *c = (char)(*c >= 'a' && *c <= 'z' ? *c - 32 : *c);
    const kqsvd_status_t st = kqsvd_isa_parse(upper, &parsed);
    if (kqsvd_isa_supported(isa)) {
      CHECK(st == KQSVD_OK && parsed == isa, "KQSVD_ISA=%s not accepted: %s", upper,
            kqsvd_error_message());
    } else {
      CHECK(st == KQSVD_ERR_USAGE && strstr(kqsvd_error_message(), upper) &&
                strstr(kqsvd_error_message(), "supports"),
            "KQSVD_ISA=%s on a CPU without it: %s", upper, kqsvd_error_message());
    }
    kqsvd_error_clear();
  }
  CHECK(kqsvd_isa_parse("avx3", &parsed) == KQSVD_ERR_USAGE &&
            strstr(kqsvd_error_message(), "KQSVD_ISA=avx3: unknown") &&
            strstr(kqsvd_error_message(), kqsvd_isa_name(kqsvd_isa_best())),
        "unknown set: %s", kqsvd_error_message());
  kqsvd_error_clear();
  CHECK(kqsvd_isa_parse("", &parsed) == KQSVD_OK && parsed == kqsvd_isa_best(), "empty value");

  if (want_s && *want_s) {
    int i = 0;
    while (i < KQSVD_ISA_COUNT && strcasecmp(want_s, kqsvd_isa_name((kqsvd_isa_t)i))) i++;
    /* A misspelt registration must fail, not skip. */
    CHECK(i < KQSVD_ISA_COUNT, "KQSVD_ISA=%s is no kernel set", want_s);
    if (i == KQSVD_ISA_COUNT) return -1;
    want = (kqsvd_isa_t)i;
    if (!kqsvd_isa_supported(want)) {
      const kqsvd_status_t st = kqsvd_isa_select(&got);
      CHECK(st == KQSVD_ERR_USAGE && strstr(kqsvd_error_message(), want_s),
            "KQSVD_ISA=%s accepted on a CPU without it", want_s);
      kqsvd_qr_ws_t *ws = NULL;
      CHECK(kqsvd_qr_ws_init(D, 64, &ws) == KQSVD_ERR_USAGE, "the QR workspace ignores KQSVD_ISA");
      printf("test_qr: SKIPPED: %s\n", kqsvd_error_message());
      kqsvd_error_clear();
      kqsvd_qr_ws_free(&ws);
      return -1;
    }
  }
  CHECK_OK(kqsvd_isa_select(&got));
  CHECK(got == want && kqsvd_isa_active() == want, "KQSVD_ISA=%s: %s kernels run, not %s",
        want_s ? want_s : "(unset)", kqsvd_isa_name(kqsvd_isa_active()), kqsvd_isa_name(want));
  printf("test_qr: %s kernels (KQSVD_ISA=%s; this CPU's best: %s)\n", kqsvd_isa_name(got),
         want_s ? want_s : "", kqsvd_isa_name(kqsvd_isa_best()));
  return (int)got;
}

/* Every set this CPU runs folds the same blocks through kqsvd_tpqr_isa:
 * each agrees with dgeqrf and with the running set within round-off, and
 * the running set's R is bit for bit kqsvd_qr_absorb's, which is what makes
 * the override observable: the sets differ in their last bits. */
static void check_paths(kqsvd_isa_t active, unsigned long long *seed) {
  /* Blocks of 251 and 247 rows: every kernel meets its row and vector tails. */
  const int ds[] = {5, 24, 129}, n = 1000, block = 251;
  for (size_t a = 0; a < sizeof ds / sizeof ds[0]; a++) {
    const int d = ds[a], ldb = kqsvd_tpqr_ld(d);
    double *X = malloc(sizeof(double) * (size_t)n * d);
    double *B = calloc((size_t)block * ldb, sizeof(double));
    double *work = malloc(sizeof(double) * kqsvd_tpqr_work_size(block, d));
    double *Rref = malloc(sizeof(double) * d * d), *Rabs = malloc(sizeof(double) * d * d);
    double *R[KQSVD_ISA_COUNT] = {0};
    for (int i = 0; i < n; i++)
      for (int j = 0; j < d; j++)
        X[(size_t)i * d + j] = test_normal(seed) * pow(10.0, -3.0 * j / (d > 1 ? d - 1 : 1));
    lapack_r_d(d, X, n, Rref);
    fold(d, block, X, KQSVD_F64, n, 0, Rabs);
    int differ = 0;
    for (int isa = 0; isa < KQSVD_ISA_COUNT; isa++) {
      if (!kqsvd_isa_supported((kqsvd_isa_t)isa)) continue;
      R[isa] = calloc((size_t)d * d, sizeof(double));
      for (int r0 = 0; r0 < n; r0 += block) {
        const int m = n - r0 < block ? n - r0 : block;
        for (int r = 0; r < m; r++)
          memcpy(B + (size_t)r * ldb, X + (size_t)(r0 + r) * d, sizeof(double) * d);
        kqsvd_tpqr_isa((kqsvd_isa_t)isa, m, d, R[isa], d, B, ldb, work);
      }
      const double diff = seen(W_DGEQRF, r_diff_d(d, R[isa], Rref), d, n);
      CHECK(diff <= tol_r(d, n), "d %d, %s kernels: R differs from dgeqrf by %.3g" UNITS, d,
            kqsvd_isa_name((kqsvd_isa_t)isa), diff / unit(d, n));
      differ += memcmp(R[isa], Rabs, sizeof(double) * d * d) != 0;
    }
    CHECK(memcmp(R[active], Rabs, sizeof(double) * d * d) == 0,
          "d %d: kqsvd_qr_absorb does not run the %s kernels", d, kqsvd_isa_name(active));
    for (int isa = 0; isa < KQSVD_ISA_COUNT; isa++) {
      if (!R[isa] || isa == (int)active) continue;
      const double diff = seen(W_PATHS, r_diff_d(d, R[isa], R[active]), d, n);
      CHECK(diff <= tol_r(d, n), "d %d: %s and %s kernels differ by %.3g" UNITS, d,
            kqsvd_isa_name((kqsvd_isa_t)isa), kqsvd_isa_name(active), diff / unit(d, n));
    }
    if (a == sizeof ds / sizeof ds[0] - 1)
      printf("test_qr: d = %d: %d other kernel set%s, %d with other bits\n", d,
             kqsvd_isa_best() - KQSVD_ISA_BASE, kqsvd_isa_best() == KQSVD_ISA_AVX2 ? "" : "s",
             differ);
    for (int isa = 0; isa < KQSVD_ISA_COUNT; isa++) free(R[isa]);
    free(X);
    free(B);
    free(work);
    free(Rref);
    free(Rabs);
  }
}

int main(void) {
  unsigned long long seed = 42;
  kqsvd_blas_set_threads(1);
  const int active = check_isa();
  if (active < 0) return g_failures ? check_exit("test_qr") : 77;
  double *X = malloc(sizeof(double) * N * D), Rref[D * D], R[D * D], R2[D * D];
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
    const double diff = seen(W_DGEQRF, r_diff(R, Rref), D, N);
    CHECK(diff <= tol_r(D, N), "block %d: R differs from dgeqrf by %.3g" UNITS, blocks[b],
          diff / unit(D, N));
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
  CHECK(seen(W_MERGE, r_diff(top, Rref), D, N) <= tol_r(D, N), "merged R differs by %.3g" UNITS,
        r_diff(top, Rref) / unit(D, N));
  memcpy(bottom, R2, sizeof R2);
  CHECK_OK(kqsvd_qr_merge(ws, bottom, R));
  CHECK(seen(W_MERGE, r_diff(bottom, Rref), D, N) <= tol_r(D, N),
        "reversed merge differs by %.3g" UNITS, r_diff(bottom, Rref) / unit(D, N));
  /* Fewer block rows than d: the LAPACK dtpqrt merge. */
  kqsvd_qr_ws_t *narrow = NULL;
  CHECK_OK(kqsvd_qr_ws_init(D, 8, &narrow));
  memcpy(top, R, sizeof R);
  CHECK_OK(kqsvd_qr_merge(narrow, top, R2));
  CHECK(seen(W_MERGE, r_diff(top, Rref), D, N) <= tol_r(D, N), "dtpqrt merge differs by %.3g" UNITS,
        r_diff(top, Rref) / unit(D, N));
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
  CHECK(seen(W_RANK, s[5] / s[0], D, N) <= tol_r(D, N), "rank 5 input: sigma_6 / sigma_1 = %g",
        s[5] / s[0]);

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
  check_paths((kqsvd_isa_t)active, &seed);
  printf("test_qr: %s kernels: worst errors in" UNITS ":", kqsvd_isa_name((kqsvd_isa_t)active));
  for (int w = 0; w < W_COUNT; w++) printf("%s %s %.3g", w ? "," : "", g_worst_name[w], g_worst[w]);
  printf("\n");
  return check_exit("test_qr");
}
