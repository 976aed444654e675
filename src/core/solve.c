#include "kqsvd_solve.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kqsvd_linalg.h"

const char *kqsvd_method_name(kqsvd_method_t m) {
  switch (m) {
  case KQSVD_METHOD_KQSVD: return "kqsvd";
  case KQSVD_METHOD_KSVD: return "ksvd";
  case KQSVD_METHOD_EIGEN: return "eigen";
  default: return "?";
  }
}

kqsvd_status_t kqsvd_solution_init(int d, kqsvd_solution_t *s) {
  kqsvd_status_t st = KQSVD_OK;
  const size_t dd = (size_t)d * (size_t)d;
  memset(s, 0, sizeof *s);
  s->d = d;
  KQSVD_MALLOC(s->storage_, KQSVD_NMETHODS * (4 * dd + 2 * (size_t)d) + 5 * (size_t)d, "solution");
  double *p = s->storage_;
  for (int m = 0; m < KQSVD_NMETHODS; m++) {
    kqsvd_projection_t *o = &s->method[m];
    o->key_down = p, p += dd;
    o->query_down = p, p += dd;
    o->value_down = p, p += dd;
    o->value_up = p, p += dd;
    o->sigma_k = p, p += d;
    o->sigma_v = p, p += d;
  }
  s->spec_K = p, p += d;
  s->spec_Q = p, p += d;
  s->spec_V = p, p += d;
  s->spec_KQt = p, p += d;
  s->spec_VWo = p;
done:
  return st;
}

void kqsvd_solution_free(kqsvd_solution_t *s) {
  if (!s) return;
  free(s->storage_);
  memset(s, 0, sizeof *s);
}

/* Column-major M -> row-major out (the C order of proj.h5). */
static void store_rowmajor(int d, const double *M, double *out) {
  for (int i = 0; i < d; i++)
    for (int j = 0; j < d; j++) out[(size_t)i * d + j] = M[(size_t)j * d + i];
}

/* Singular vectors are defined up to sign; fix it by the largest entry of
 * `ref` (or of `alt` when that column of ref is zero), flipping both. */
static void fix_column_signs(int d, double *ref, double *alt) {
  for (int j = 0; j < d; j++) {
    double *cols[2] = {ref + (size_t)j * d, alt ? alt + (size_t)j * d : NULL};
    for (int c = 0; c < 2 && cols[c]; c++) {
      int imax = 0;
      for (int i = 1; i < d; i++)
        if (fabs(cols[c][i]) > fabs(cols[c][imax])) imax = i;
      if (cols[c][imax] == 0.0) continue;
      if (cols[c][imax] < 0)
        for (int i = 0; i < d; i++) {
          ref[(size_t)j * d + i] = -ref[(size_t)j * d + i];
          if (alt) alt[(size_t)j * d + i] = -alt[(size_t)j * d + i];
        }
      break;
    }
  }
}

/* Singular vectors of (numerically) zero singular values span a subspace,
 * and any orthonormal basis of it is a right answer; LAPACK's choice
 * depends on round-off, so results from other rank counts or shard splits
 * (fewer rows than d, an all-zero head) would differ completely there.
 * Columns r..d-1 of the orthonormal column-major Q are replaced by a basis
 * of the complement of columns 0..r-1 that depends only on that subspace:
 * Gram-Schmidt (two passes) of e_1, e_2, ... in order, each kept when what
 * is left of it has squared norm above tau (1/2, then lower if a pass ends
 * short).  v holds d doubles. */
static void canonical_null_basis(int d, int r, double *Q, double *v) {
  int have = r;
  for (double tau = 0.5; have < d; tau /= 4)
    for (int j = 0; j < d && have < d; j++) {
      for (int i = 0; i < d; i++) v[i] = i == j;
      for (int pass = 0; pass < 2; pass++)
        for (int k = 0; k < have; k++) {
          const double *q = Q + (size_t)k * d;
          double dot = 0.0;
          for (int i = 0; i < d; i++) dot += q[i] * v[i];
          for (int i = 0; i < d; i++) v[i] -= dot * q[i];
        }
      double nrm2 = 0.0;
      for (int i = 0; i < d; i++) nrm2 += v[i] * v[i];
      if (nrm2 <= tau) continue;
      const double inv = 1.0 / sqrt(nrm2);
      for (int i = 0; i < d; i++) Q[(size_t)have * d + i] = v[i] * inv;
      have++;
    }
}

/* How many of the (descending) singular values s count as non-zero: the
 * same cut as the pseudo-inverse's. */
static int numerical_rank(int d, const double *s) {
  const double tol = (double)d * DBL_EPSILON * s[0];
  int r = 0;
  while (r < d && s[r] > tol) r++;
  return r;
}

/* SVD of a copy of the d x d factor R: s, U and Vt (column-major). */
static kqsvd_status_t svd_of(int d, const double *R, double *tmp, double *s, double *U,
                             double *Vt) {
  memcpy(tmp, R, (size_t)d * (size_t)d * sizeof(double));
  return kqsvd_svd(d, d, tmp, d, s, U, d, Vt, d);
}

/* The optimal pair for min ||X A B^T Y^T - X Y^T||: with X = Q_X R_X and the
 * core R_X R_Y^T = U S V^T, A = R_X^+ U and B = R_X^T U.  R_X's own SVD
 * (sX, UX, VtX) gives the pseudo-inverse without another factorisation. */
static kqsvd_status_t optimal_pair(int d, const double *RX, const double *RY, const double *sX,
                                   const double *UX, const double *VtX, double *scratch,
                                   double *sigma, double *A, double *B) {
  kqsvd_status_t st = KQSVD_OK;
  const size_t dd = (size_t)d * (size_t)d;
  double *core = scratch, *U = scratch + dd, *tmp = scratch + 2 * dd;
  kqsvd_gemm('N', 'T', d, d, d, 1.0, RX, d, RY, d, 0.0, core, d);
  KQSVD_CALL(kqsvd_svd(d, d, core, d, sigma, U, d, NULL, d));
  canonical_null_basis(d, numerical_rank(d, sigma), U, tmp);
  kqsvd_gemm('T', 'N', d, d, d, 1.0, RX, d, U, d, 0.0, B, d);
  kqsvd_gemm('T', 'N', d, d, d, 1.0, UX, d, U, d, 0.0, tmp, d);
  const double tol = (double)d * DBL_EPSILON * sX[0];
  for (int i = 0; i < d; i++) {
    const double inv = sX[i] > tol ? 1.0 / sX[i] : 0.0;
    for (int j = 0; j < d; j++) tmp[(size_t)j * d + i] *= inv;
  }
  kqsvd_gemm('T', 'N', d, d, d, 1.0, VtX, d, tmp, d, 0.0, A, d);
  fix_column_signs(d, B, A);
done:
  return st;
}

/* Right singular vectors (rows of Vt) of singular values s as the columns
 * of A, with the canonical null basis, sign-fixed.  v: d doubles. */
static void right_vectors(int d, const double *Vt, int ldvt, const double *s, double *A,
                          double *v) {
  for (int j = 0; j < d; j++)
    for (int i = 0; i < d; i++) A[(size_t)j * d + i] = Vt[(size_t)i * ldvt + j];
  canonical_null_basis(d, numerical_rank(d, s), A, v);
  fix_column_signs(d, A, NULL);
}

kqsvd_status_t kqsvd_solve(int d, const double *R_K, const double *R_Q, const double *R_V,
                           const double *R_W, double beta, kqsvd_solution_t *out) {
  kqsvd_status_t st = KQSVD_OK;
  const size_t dd = (size_t)d * (size_t)d;
  double *buf = NULL;
  KQSVD_CHECK(beta > 0 && isfinite(beta), KQSVD_ERR_USAGE, "beta must be finite and > 0");
  KQSVD_MALLOC(buf, 16 * dd, "solver workspace");
  double *UK = buf, *VtK = buf + dd, *UV = buf + 2 * dd, *VtV = buf + 3 * dd;
  double *A = buf + 4 * dd, *B = buf + 5 * dd, *tmp = buf + 6 * dd, *M = buf + 7 * dd;
  double *scratch = buf + 9 * dd, *sE = buf + 12 * dd;

  KQSVD_CALL(svd_of(d, R_K, tmp, out->spec_K, UK, VtK));
  KQSVD_CALL(svd_of(d, R_Q, tmp, out->spec_Q, NULL, NULL));
  KQSVD_CALL(svd_of(d, R_V, tmp, out->spec_V, UV, VtV));

  /* ksvd: the dominant right singular subspaces of K and V themselves. */
  kqsvd_projection_t *ks = &out->method[KQSVD_METHOD_KSVD];
  right_vectors(d, VtK, d, out->spec_K, A, M);
  store_rowmajor(d, A, ks->key_down);
  store_rowmajor(d, A, ks->query_down);
  right_vectors(d, VtV, d, out->spec_V, A, M);
  store_rowmajor(d, A, ks->value_down);
  store_rowmajor(d, A, ks->value_up);
  memcpy(ks->sigma_k, out->spec_K, (size_t)d * sizeof(double));
  memcpy(ks->sigma_v, out->spec_V, (size_t)d * sizeof(double));

  /* eigen: [beta K; Q/beta] has the R factor of [beta R_K; R_Q/beta]. */
  kqsvd_projection_t *ei = &out->method[KQSVD_METHOD_EIGEN];
  for (int j = 0; j < d; j++)
    for (int i = 0; i < d; i++) {
      M[(size_t)j * 2 * d + i] = beta * R_K[(size_t)j * d + i];
      M[(size_t)j * 2 * d + d + i] = R_Q[(size_t)j * d + i] / beta;
    }
  KQSVD_CALL(kqsvd_svd(2 * d, d, M, 2 * d, sE, NULL, 2 * d, tmp, d));
  right_vectors(d, tmp, d, sE, A, M);
  store_rowmajor(d, A, ei->key_down);
  store_rowmajor(d, A, ei->query_down);
  memcpy(ei->value_down, ks->value_down, dd * sizeof(double));
  memcpy(ei->value_up, ks->value_up, dd * sizeof(double));
  memcpy(ei->sigma_k, sE, (size_t)d * sizeof(double));
  memcpy(ei->sigma_v, out->spec_V, (size_t)d * sizeof(double));

  /* kqsvd: optimal factorisations of K Q^T and of V W. */
  kqsvd_projection_t *kq = &out->method[KQSVD_METHOD_KQSVD];
  KQSVD_CALL(optimal_pair(d, R_K, R_Q, out->spec_K, UK, VtK, scratch, out->spec_KQt, A, B));
  store_rowmajor(d, A, kq->key_down);
  store_rowmajor(d, B, kq->query_down);
  KQSVD_CALL(optimal_pair(d, R_V, R_W, out->spec_V, UV, VtV, scratch, out->spec_VWo, A, B));
  store_rowmajor(d, A, kq->value_down);
  store_rowmajor(d, B, kq->value_up);
  memcpy(kq->sigma_k, out->spec_KQt, (size_t)d * sizeof(double));
  memcpy(kq->sigma_v, out->spec_VWo, (size_t)d * sizeof(double));
done:
  free(buf);
  return st;
}
