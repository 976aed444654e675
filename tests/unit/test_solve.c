/* The three methods against the paper's theorems, on random data with full
 * matrices formed explicitly (independently of the R-factor route):
 *  - Theorem 2: kqsvd's ||K A B^T Q^T - K Q^T||^2 is the tail energy of
 *    sigma(K Q^T) at every rank; values likewise with V W.
 *  - Theorem 3: err_ksvd - opt = sum_{i<=r} sigma_i(KQ^T)^2 - ||K V_r V_r^T Q^T||^2 >= 0.
 *  - Theorem 4: eigen's error tends to ksvd's as beta grows.
 *  - Theorem 5 (GQA): per-head optimal B_h given kqsvd's A add up to the
 *    stacked objective; the exact side-by-side W beats the averaged W^O.
 *  - K*c, Q/c leaves ksvd and kqsvd unchanged; zero and rank-deficient
 *    heads give finite results. */
#include <lapacke.h>
#include <string.h>

#include "check.h"
#include "kqsvd_linalg.h"
#include "kqsvd_solve.h"

enum { T = 300, D = 10, M = 3, HID = 16 };

typedef struct {
  double K[T * D], Q[M * T * D], V[T * D], WT[M * HID * D]; /* row-major */
} data_t;

/* R factor (column-major, D x D) of a row-major n x D matrix. */
static void r_of(const double *X, int n, double *R) {
  kqsvd_qr_ws_t *ws = NULL;
  int64_t bad;
  memset(R, 0, sizeof(double) * D * D);
  CHECK_OK(kqsvd_qr_ws_init(D, 64, &ws));
  CHECK_OK(kqsvd_qr_absorb(ws, R, X, KQSVD_F64, n, &bad));
  kqsvd_qr_ws_free(&ws);
}

/* G = X^T X (D x D) of a row-major n x D matrix. */
static void gram(const double *X, int n, double *G) {
  kqsvd_gemm('N', 'T', D, D, n, 1.0, X, D, X, D, 0.0, G, D);
}

/* trace((P - I)^T GL (P - I) GR) / trace(GL GR) with P = A_r B_r^T, for
 * row-major d x d A and B: the relative error of X A B^T Y^T vs X Y^T. */
static double rel_err(const double *GL, const double *GR, const double *A, const double *B, int r) {
  double E[D * D], T1[D * D], T2[D * D], num = 0, den = 0;
  for (int i = 0; i < D; i++)
    for (int j = 0; j < D; j++) {
      double p = 0;
      for (int k = 0; k < r; k++) p += A[i * D + k] * B[j * D + k];
      E[i * D + j] = p - (i == j);
    }
  kqsvd_gemm('N', 'N', D, D, D, 1.0, E, D, GL, D, 0.0, T1, D); /* row-major GL E */
  kqsvd_gemm('N', 'T', D, D, D, 1.0, T1, D, E, D, 0.0, T2, D); /* E^T GL E */
  for (int i = 0; i < D; i++)
    for (int j = 0; j < D; j++)
      num += T2[i * D + j] * GR[j * D + i], den += GL[i * D + j] * GR[j * D + i];
  return den > 0 ? num / den : 0.0;
}

/* Singular values of the explicit n1 x n2 product X Y^T. */
static void product_svals(const double *X, int n1, const double *Y, int n2, double *s) {
  double *P = malloc(sizeof(double) * (size_t)n1 * n2), *all = malloc(sizeof(double) * n1);
  kqsvd_gemm('T', 'N', n2, n1, D, 1.0, Y, D, X, D, 0.0, P, n2); /* row-major X Y^T */
  int info = LAPACKE_dgesdd(LAPACK_COL_MAJOR, 'N', n2, n1, P, n2, all, NULL, 1, NULL, 1);
  CHECK(info == 0, "reference dgesdd info %d", info);
  for (int i = 0; i < D; i++) s[i] = all[i];
  free(P);
  free(all);
}

static double tail(const double *s, int r) {
  double t = 0, all = 0;
  for (int i = 0; i < D; i++) all += s[i] * s[i], t += i >= r ? s[i] * s[i] : 0;
  return all > 0 ? t / all : 0;
}

static void make(data_t *x, unsigned long long seed, int rank_k) {
  for (int i = 0; i < T * D; i++) x->K[i] = test_normal(&seed) * (1.0 + (i % D));
  for (int i = 0; i < M * T * D; i++) x->Q[i] = test_normal(&seed) / (1.0 + (i % D) * 0.3);
  for (int i = 0; i < T * D; i++) x->V[i] = test_normal(&seed) * exp(-0.2 * (i % D));
  for (int i = 0; i < M * HID * D; i++) x->WT[i] = test_normal(&seed) * (1 + (i % 7));
  if (rank_k < D) /* columns beyond rank_k repeat earlier ones */
    for (int i = 0; i < T; i++)
      for (int j = rank_k; j < D; j++)
        x->K[i * D + j] = x->K[i * D + j % (rank_k ? rank_k : 1)] * (rank_k > 0);
}

static int finite(const kqsvd_solution_t *s) {
  int ok = 1;
  for (int m = 0; m < KQSVD_NMETHODS; m++)
    for (int k = 0; k < D * D; k++)
      ok &= isfinite(s->method[m].key_down[k]) && isfinite(s->method[m].query_down[k]) &&
            isfinite(s->method[m].value_down[k]) && isfinite(s->method[m].value_up[k]);
  return ok;
}

static void solve(const data_t *x, double beta, kqsvd_solution_t *sol) {
  double RK[D * D], RQ[D * D], RV[D * D], RW[D * D];
  r_of(x->K, T, RK);
  r_of(x->Q, M * T, RQ);
  r_of(x->V, T, RV);
  r_of(x->WT, M * HID, RW);
  CHECK_OK(kqsvd_solve(D, RK, RQ, RV, RW, beta, sol));
}

int main(void) {
  static data_t x, y;
  kqsvd_solution_t s, s2;
  double GK[D * D], GQ[D * D], GV[D * D], GW[D * D], skq[D], svw[D];
  CHECK_OK(kqsvd_solution_init(D, &s));
  CHECK_OK(kqsvd_solution_init(D, &s2));
  make(&x, 7, D);
  solve(&x, 1.0, &s);
  gram(x.K, T, GK);
  gram(x.Q, M * T, GQ);
  gram(x.V, T, GV);
  gram(x.WT, M * HID, GW);
  product_svals(x.K, T, x.Q, M * T, skq);
  product_svals(x.V, T, x.WT, M * HID, svw);
  const kqsvd_projection_t *kq = &s.method[KQSVD_METHOD_KQSVD], *ks = &s.method[KQSVD_METHOD_KSVD];
  for (int i = 0; i < D; i++) {
    CHECK_CLOSE(kq->sigma_k[i], skq[i], 1e-10, skq[0]);
    CHECK_CLOSE(kq->sigma_v[i], svw[i], 1e-10, svw[0]);
  }
  for (int r = 1; r <= D; r++) {
    const double opt = rel_err(GK, GQ, kq->key_down, kq->query_down, r);
    CHECK_CLOSE(opt, tail(skq, r), 1e-10, 1.0);
    CHECK_CLOSE(rel_err(GV, GW, kq->value_down, kq->value_up, r), tail(svw, r), 1e-10, 1.0);
    /* Theorem 3, with ||K V_r V_r^T Q^T||^2 formed from the Grams. */
    const double eks = rel_err(GK, GQ, ks->key_down, ks->query_down, r);
    double head = 0, all = 0;
    for (int i = 0; i < D; i++) all += skq[i] * skq[i], head += i < r ? skq[i] * skq[i] : 0;
    /* ||K P Q^T||^2 with P = V_r V_r^T, from the Grams. */
    double Pn = 0;
    {
      double P[D * D], T1[D * D], T2[D * D];
      for (int i = 0; i < D; i++)
        for (int j = 0; j < D; j++) {
          double p = 0;
          for (int k = 0; k < r; k++) p += ks->key_down[i * D + k] * ks->key_down[j * D + k];
          P[i * D + j] = p;
        }
      kqsvd_gemm('N', 'N', D, D, D, 1.0, P, D, GK, D, 0.0, T1, D);
      kqsvd_gemm('N', 'T', D, D, D, 1.0, T1, D, P, D, 0.0, T2, D);
      for (int i = 0; i < D; i++)
        for (int j = 0; j < D; j++) Pn += T2[i * D + j] * GQ[j * D + i];
    }
    CHECK_CLOSE(eks - opt, (head - Pn) / all, 1e-10, 1.0);
    CHECK(eks - opt >= -1e-12, "r = %d: ksvd beats the optimum by %g", r, opt - eks);
  }

  /* Theorem 4: eigen approaches ksvd as beta grows (r where sigma_r(K) > sigma_r+1(K)). */
  double prev = INFINITY;
  const int r = 4;
  const double eks = rel_err(GK, GQ, ks->key_down, ks->query_down, r);
  const double betas[] = {1, 10, 100, 1000, 10000};
  for (int b = 0; b < 5; b++) {
    solve(&x, betas[b], &s2);
    const kqsvd_projection_t *ei = &s2.method[KQSVD_METHOD_EIGEN];
    const double gap = fabs(rel_err(GK, GQ, ei->key_down, ei->query_down, r) - eks);
    CHECK(gap <= prev + 1e-15, "beta %g: |eigen - ksvd| = %g grew from %g", betas[b], gap, prev);
    prev = gap;
  }
  CHECK(prev <= 1e-6 * eks, "beta 1e4: eigen still differs from ksvd by %g", prev);

  /* Theorem 5: given kqsvd's A, each head's best B_h leaves the energy of
   * K Q_h^T outside range(K A); their sum is the stacked optimum. */
  for (int rr = 1; rr < D; rr += 3) {
    double *X = malloc(sizeof(double) * T * rr), tau[D], Mx[D * D], sum = 0, den = 0;
    for (int i = 0; i < T; i++)
      for (int j = 0; j < rr; j++) {
        double v = 0;
        for (int k = 0; k < D; k++) v += x.K[i * D + k] * kq->key_down[k * D + j];
        X[j * T + i] = v; /* column-major T x rr */
      }
    LAPACKE_dgeqrf(LAPACK_COL_MAJOR, T, rr, X, T, tau);
    LAPACKE_dorgqr(LAPACK_COL_MAJOR, T, rr, rr, X, T, tau);
    kqsvd_gemm('N', 'N', D, rr, T, 1.0, x.K, D, X, T, 0.0, Mx, D); /* K^T Q_X, D x rr */
    for (int h = 0; h < M; h++) {
      double Gh[D * D];
      gram(x.Q + h * T * D, T, Gh);
      double tot = 0, in = 0;
      for (int i = 0; i < D; i++)
        for (int j = 0; j < D; j++) {
          tot += GK[i * D + j] * Gh[j * D + i];
          for (int c = 0; c < rr; c++) in += Mx[c * D + i] * Gh[i * D + j] * Mx[c * D + j];
        }
      sum += tot - in;
      den += tot;
    }
    CHECK_CLOSE(sum / den, rel_err(GK, GQ, kq->key_down, kq->query_down, rr), 1e-9, 1.0);
    free(X);
  }
  /* The authors' averaged W^O is feasible but not optimal. */
  {
    data_t *avg = &y;
    memcpy(avg, &x, sizeof x);
    for (int i = 0; i < HID * D; i++) {
      double a = 0;
      for (int h = 0; h < M; h++) a += x.WT[h * HID * D + i];
      for (int h = 0; h < M; h++) avg->WT[h * HID * D + i] = a / M;
    }
    solve(avg, 1.0, &s2);
    for (int rr = 1; rr < D; rr++) {
      const double ours = rel_err(GV, GW, kq->value_down, kq->value_up, rr);
      const double theirs = rel_err(GV, GW, s2.method[0].value_down, s2.method[0].value_up, rr);
      CHECK(ours <= theirs + 1e-12, "rank %d: exact W %g worse than averaged %g", rr, ours, theirs);
    }
  }

  /* K*c, Q/c: ksvd's and kqsvd's errors and A B^T do not move. */
  memcpy(&y, &x, sizeof x);
  for (int i = 0; i < T * D; i++) y.K[i] *= 8.0;
  for (int i = 0; i < M * T * D; i++) y.Q[i] /= 8.0;
  solve(&y, 1.0, &s2);
  for (int m = 0; m < 2; m++)
    for (int rr = 1; rr <= D; rr++) {
      const kqsvd_projection_t *a = &s.method[m], *b = &s2.method[m];
      CHECK_CLOSE(rel_err(GK, GQ, a->key_down, a->query_down, rr),
                  rel_err(GK, GQ, b->key_down, b->query_down, rr), 1e-10, 1.0);
      double dmax = 0, scale = 0;
      for (int i = 0; i < D; i++)
        for (int j = 0; j < D; j++) {
          double pa = 0, pb = 0;
          for (int k = 0; k < rr; k++)
            pa += a->key_down[i * D + k] * a->query_down[j * D + k],
                pb += b->key_down[i * D + k] * b->query_down[j * D + k];
          dmax = fmax(dmax, fabs(pa - pb));
          scale = fmax(scale, fabs(pa));
        }
      CHECK(dmax <= 1e-9 * scale, "%s rank %d: A B^T moved by %g", kqsvd_method_name(m), rr, dmax);
    }

  /* Degenerate heads: all-zero keys, and keys of rank 4. */
  make(&y, 11, 0);
  solve(&y, 1.0, &s2);
  CHECK(finite(&s2), "zero head gave non-finite projections");
  double mx = 0;
  for (int k = 0; k < D * D; k++) mx = fmax(mx, fabs(s2.method[0].key_down[k]));
  CHECK(mx == 0.0, "zero head: kqsvd A should be 0, max %g", mx);
  make(&y, 13, 4);
  solve(&y, 1.0, &s2);
  CHECK(finite(&s2), "rank-deficient head gave non-finite projections");
  gram(y.K, T, GK);
  gram(y.Q, M * T, GQ);
  product_svals(y.K, T, y.Q, M * T, skq);
  for (int rr = 1; rr <= D; rr++)
    CHECK_CLOSE(rel_err(GK, GQ, s2.method[0].key_down, s2.method[0].query_down, rr), tail(skq, rr),
                1e-9, 1.0);
  /* Fewer rows than d (5 keys, 15 queries, 5 values): the same rows in
   * another order give R factors that differ by round-off and row signs,
   * as other rank counts do, and every projection must stay put, the
   * columns of zero singular values included. */
  {
    enum { N = 5 };
    double RK[D * D], RQ[D * D], RV[D * D], RW[D * D], rev[M * N * D];
    kqsvd_solution_t a, b;
    CHECK_OK(kqsvd_solution_init(D, &a));
    CHECK_OK(kqsvd_solution_init(D, &b));
    r_of(y.WT, M * HID, RW);
    for (int pass = 0; pass < 2; pass++) {
      const double *src[3] = {x.K, x.Q, x.V};
      double *R[3] = {RK, RQ, RV};
      for (int t = 0; t < 3; t++) {
        const int n = t == 1 ? M * N : N;
        for (int i = 0; i < n; i++)
          memcpy(rev + (size_t)i * D, src[t] + (size_t)(pass ? n - 1 - i : i) * D,
                 D * sizeof(double));
        r_of(rev, n, R[t]);
      }
      CHECK_OK(kqsvd_solve(D, RK, RQ, RV, RW, 1.0, pass ? &b : &a));
    }
    for (int m = 0; m < KQSVD_NMETHODS; m++) {
      const double *pa[4] = {a.method[m].key_down, a.method[m].query_down, a.method[m].value_down,
                             a.method[m].value_up};
      const double *pb[4] = {b.method[m].key_down, b.method[m].query_down, b.method[m].value_down,
                             b.method[m].value_up};
      for (int k = 0; k < 4; k++) {
        double dmax = 0, scale = 0;
        for (int i = 0; i < D * D; i++)
          dmax = fmax(dmax, fabs(pa[k][i] - pb[k][i])), scale = fmax(scale, fabs(pa[k][i]));
        CHECK(dmax <= 1e-9 * (scale > 0 ? scale : 1),
              "%s matrix %d: %d rows in another order "
              "moved it by %g",
              kqsvd_method_name((kqsvd_method_t)m), k, (int)N, dmax);
      }
    }
    kqsvd_solution_free(&a);
    kqsvd_solution_free(&b);
  }
  kqsvd_solution_free(&s);
  kqsvd_solution_free(&s2);
  return check_exit("test_solve");
}
