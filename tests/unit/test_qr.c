/* Streaming Householder QR: R equals LAPACK dgeqrf's R of the whole matrix
 * up to row signs, whatever the block size; merges of triangles likewise;
 * zero and rank-deficient inputs stay finite. */
#include <lapacke.h>
#include <string.h>

#include "check.h"
#include "kqsvd_linalg.h"

enum { N = 3001, D = 24 };

/* Relative difference of two R factors after fixing row signs. */
static double r_diff(const double *A, const double *B) {
  double a[D * D], b[D * D], num = 0, den = 0;
  memcpy(a, A, sizeof a);
  memcpy(b, B, sizeof b);
  kqsvd_r_fix_signs(D, a);
  kqsvd_r_fix_signs(D, b);
  for (int k = 0; k < D * D; k++) {
    num = fmax(num, fabs(a[k] - b[k]));
    den = fmax(den, fabs(b[k]));
  }
  return den > 0 ? num / den : num;
}

/* dgeqrf's R of the row-major n x D matrix X. */
static void lapack_r(const double *X, int n, double *R) {
  double *A = malloc(sizeof(double) * (size_t)n * D), tau[D];
  for (int i = 0; i < n; i++)
    for (int j = 0; j < D; j++) A[(size_t)j * n + i] = X[(size_t)i * D + j];
  LAPACKE_dgeqrf(LAPACK_COL_MAJOR, n, D, A, n, tau);
  for (int j = 0; j < D; j++)
    for (int i = 0; i < D; i++) R[j * D + i] = i <= j ? A[(size_t)j * n + i] : 0.0;
  free(A);
}

int main(void) {
  unsigned long long seed = 42;
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
    const double diff = r_diff(R, Rref);
    CHECK(diff <= 1e-12, "block %d: R differs from dgeqrf by %.3g", blocks[b], diff);
    int lower = 0;
    for (int j = 0; j < D; j++)
      for (int i = j + 1; i < D; i++) lower += R[j * D + i] != 0.0;
    CHECK(lower == 0, "strict lower part must stay zero");
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
  return check_exit("test_qr");
}
