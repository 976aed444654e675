/* Rank selection: the paper's energy rule and the rank policies shared by
 * `calibrate` (which stores its ranks) and `evaluate --ranks` (which may
 * choose others, since proj.h5 keeps all d columns).  Not collective. */
#ifndef KQSVD_RANK_H
#define KQSVD_RANK_H

#include <stddef.h>
#include <stdint.h>

#include "kqsvd_error.h"
#include "kqsvd_solve.h"

/* The paper's rule for one layer: average over the `nheads` heads the
 * retained energy fraction sum_{j<r} s_j^2 / sum_j s_j^2 of each head's
 * spectrum (sigma is [nheads][d], descending), and return the smallest r in
 * [1, d] whose average is >= 1 - eps.  A head with no energy at all retains
 * everything at any rank.  eps must lie in (0, 1). */
int kqsvd_rank_eps(int nheads, int d, const double *sigma, double eps);

/* Average retained fraction at rank r (the quantity the rule thresholds);
 * 1 minus it is the head-averaged relative tail energy. */
double kqsvd_rank_retained(int nheads, int d, const double *sigma, int r);

typedef enum kqsvd_rank_kind {
  KQSVD_RANKS_EPS = 0, /* eps:E     the paper's rule on sigma(K), sigma(V) */
  KQSVD_RANKS_FIXED,   /* fixed:R   R everywhere */
  KQSVD_RANKS_BUDGET   /* budget:F  a fraction F of the full cache, split by
                          each method's own spectra */
} kqsvd_rank_kind_t;

typedef struct kqsvd_rank_policy {
  kqsvd_rank_kind_t kind;
  double value; /* E, R or F */
} kqsvd_rank_policy_t;

/* Parses "eps:E" (0 < E < 1), "fixed:R" (integer R >= 1) or "budget:F"
 * (0 < F <= 1).  Errors: KQSVD_ERR_USAGE naming `opt` and the text. */
kqsvd_status_t kqsvd_rank_policy_parse(const char *opt, const char *text, kqsvd_rank_policy_t *p);

/* Renders the policy as parse() reads it ("eps:0.1"). */
void kqsvd_rank_policy_format(const kqsvd_rank_policy_t *p, char *buf, size_t n);

/* Checks that the policy can be met for L layers of head dimension d, so
 * that a long run does not find out at its end.  Errors: KQSVD_ERR_USAGE
 * (R > d, or a budget below one column per layer for keys and values). */
kqsvd_status_t kqsvd_rank_policy_check(const kqsvd_rank_policy_t *p, int L, int d);

/* Per-layer ranks of all three methods for a model of L layers, H KV heads
 * and head dimension d.  sigma_k[m], sigma_v[m] are method m's own spectra
 * and spec_K, spec_V those of K and V, all [L][H][d] and descending.
 * rank_k and rank_v receive [KQSVD_NMETHODS][L] ranks in [1, d]:
 *   eps     the same ranks for every method, from spec_K and spec_V;
 *   fixed   R for every layer and method;
 *   budget  per method, sum_l (rank_k + rank_v) <= F 2 d L, minimising
 *           sum_l of the head-averaged relative tail energies of sigma_k[m]
 *           and sigma_v[m] (kqsvd_rank_budget).
 * Errors: those of kqsvd_rank_policy_check, KQSVD_ERR_NOMEM. */
kqsvd_status_t kqsvd_rank_choose(const kqsvd_rank_policy_t *p, int L, int H, int d,
                                 const double *const sigma_k[KQSVD_NMETHODS],
                                 const double *const sigma_v[KQSVD_NMETHODS], const double *spec_K,
                                 const double *spec_V, int32_t *rank_k, int32_t *rank_v);

/* Splits `units` columns over `nsides` spectra (side s: sigma[s], [H][d])
 * as ranks rank[s] in [1, d] with sum <= units, minimising the sum over
 * sides of the head-averaged relative tail energy.  Columns whose gain is
 * zero are not spent.  Errors: KQSVD_ERR_USAGE if units < nsides,
 * KQSVD_ERR_NOMEM. */
kqsvd_status_t kqsvd_rank_budget(int nsides, int H, int d, const double *const *sigma,
                                 int64_t units, int32_t *rank);

#endif
