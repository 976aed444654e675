/* Rank selection.  Not collective. */
#ifndef KQSVD_RANK_H
#define KQSVD_RANK_H

/* The paper's rule for one layer: average over the `nheads` heads the
 * retained energy fraction sum_{j<r} s_j^2 / sum_j s_j^2 of each head's
 * spectrum (sigma is [nheads][d], descending), and return the smallest r in
 * [1, d] whose average is >= 1 - eps.  A head with no energy at all retains
 * everything at any rank.  eps must lie in (0, 1). */
int kqsvd_rank_eps(int nheads, int d, const double *sigma, double eps);

/* Average retained fraction at rank r (the quantity the rule thresholds). */
double kqsvd_rank_retained(int nheads, int d, const double *sigma, int r);

#endif
