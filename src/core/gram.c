#include "kqsvd_gram.h"

#include <cblas.h>
#include <lapacke.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kqsvd_linalg.h"

void kqsvd_gram_absorb(int d, double *G, const void *X, kqsvd_dtype_t type, int64_t n, double *buf,
                       int block_rows, int64_t *bad_row) {
  const size_t esz = kqsvd_dtype_size(type);
  *bad_row = -1;
  for (int64_t r0 = 0; r0 < n; r0 += block_rows) {
    const int m = (int)(n - r0 < block_rows ? n - r0 : block_rows);
    const char *src = (const char *)X + (size_t)r0 * (size_t)d * esz;
    const int64_t bad = kqsvd_convert_transpose(type, src, m, d, buf, m);
    if (bad >= 0) {
      *bad_row = r0 + bad;
      return;
    }
    cblas_dsyrk(CblasColMajor, CblasUpper, CblasTrans, d, m, 1.0, buf, m, 1.0, G, d);
  }
}

/* R from the eigen-decomposition: G = V diag(l) V^T = (S V^T)^T (S V^T)
 * with S = diag(sqrt(max(l, 0))), and QR keeps R^T R unchanged. */
static kqsvd_status_t gram_to_r_eig(int d, double *G) {
  kqsvd_status_t st = KQSVD_OK;
  double *w = NULL, *M = NULL, *tau = NULL;
  KQSVD_MALLOC(w, (size_t)d, "Gram eigenvalues");
  KQSVD_MALLOC(M, (size_t)d * (size_t)d, "Gram square root");
  KQSVD_MALLOC(tau, (size_t)d, "QR scalars");
  KQSVD_LAPACK("dsyevd", LAPACKE_dsyevd(LAPACK_COL_MAJOR, 'V', 'U', d, G, d, w));
  for (int i = 0; i < d; i++) {
    const double s = w[i] > 0 ? sqrt(w[i]) : 0.0;
    for (int j = 0; j < d; j++) M[(size_t)j * d + i] = s * G[(size_t)i * d + j];
  }
  KQSVD_LAPACK("dgeqrf", LAPACKE_dgeqrf(LAPACK_COL_MAJOR, d, d, M, d, tau));
  for (int j = 0; j < d; j++)
    for (int i = 0; i < d; i++) G[(size_t)j * d + i] = i <= j ? M[(size_t)j * d + i] : 0.0;
done:
  free(w);
  free(M);
  free(tau);
  return st;
}

kqsvd_status_t kqsvd_gram_to_r(int d, double *G) {
  kqsvd_status_t st = KQSVD_OK;
  double *copy = NULL;
  KQSVD_MALLOC(copy, (size_t)d * (size_t)d, "Gram copy");
  memcpy(copy, G, (size_t)d * (size_t)d * sizeof(double));
  const lapack_int info = LAPACKE_dpotrf(LAPACK_COL_MAJOR, 'U', d, G, d);
  if (info > 0) {
    /* Not positive definite in floating point: exactly what rank-deficient
     * heads give, so not an error. */
    memcpy(G, copy, (size_t)d * (size_t)d * sizeof(double));
    KQSVD_CALL(gram_to_r_eig(d, G));
  } else {
    KQSVD_LAPACK("dpotrf", info);
    for (int j = 0; j < d; j++)
      for (int i = j + 1; i < d; i++) G[(size_t)j * d + i] = 0.0;
  }
  kqsvd_r_fix_signs(d, G);
done:
  free(copy);
  return st;
}
