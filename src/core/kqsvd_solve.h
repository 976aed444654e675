/* The three projection methods of the data contract, computed for one
 * (layer, KV group) from d x d R factors alone.  Not collective. */
#ifndef KQSVD_SOLVE_H
#define KQSVD_SOLVE_H

#include "kqsvd_error.h"

/* kqsvd_method_t and kqsvd_method_name: kqsvd/types.h. */

/* One method's output for one (layer, KV group).  Matrices are d x d in C
 * order (row-major), columns ordered most important first, exactly as in
 * proj.h5. */
typedef struct kqsvd_projection {
  double *key_down, *query_down, *value_down, *value_up;
  double *sigma_k, *sigma_v;
} kqsvd_projection_t;

/* Everything proj.h5 stores for one (layer, KV group). */
typedef struct kqsvd_solution {
  int d;
  kqsvd_projection_t method[KQSVD_NMETHODS];
  double *spec_K, *spec_Q, *spec_V, *spec_KQt, *spec_VWo;
  double *storage_;
} kqsvd_solution_t;

kqsvd_status_t kqsvd_solution_init(int d, kqsvd_solution_t *s);
void kqsvd_solution_free(kqsvd_solution_t *s);

/* Computes all three methods.  Inputs are column-major d x d upper
 * triangles: R_K of K (T x d), R_Q of the group's stacked queries (mT x d),
 * R_V of V, and R_W of W^T, where W = [W^O_h ...] (d x mD) places the
 * group's output blocks side by side.  beta > 0 scales K by beta and Q by
 * 1/beta for the eigen method only (ksvd and kqsvd are invariant to it).
 *   ksvd:  A = B = right singular vectors of R_K; A_v = B_v those of R_V.
 *   eigen: A = B = right singular vectors of [beta R_K; R_Q / beta].
 *   kqsvd: A = R_K^+ U, B = R_K^T U, U the left singular vectors of
 *          R_K R_Q^T; values likewise with R_V and R_W.
 * Pseudo-inverses drop singular values <= d * DBL_EPSILON * sigma_max, so
 * rank-deficient and all-zero heads give finite results.  Each column's sign
 * is fixed (largest entry of B, or of A, positive) so that results do not
 * depend on how the R factors were reduced.  Errors: KQSVD_ERR_NOMEM,
 * KQSVD_ERR_LAPACK. */
kqsvd_status_t kqsvd_solve(int d, const double *R_K, const double *R_Q, const double *R_V,
                           const double *R_W, double beta, kqsvd_solution_t *out);

#endif
