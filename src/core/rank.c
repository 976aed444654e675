#include "kqsvd_rank.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

double kqsvd_rank_retained(int nheads, int d, const double *sigma, int r) {
  double sum = 0.0;
  for (int h = 0; h < nheads; h++) {
    const double *s = sigma + (size_t)h * d;
    double total = 0.0, kept = 0.0;
    /* The same sequential sum for both, so the fraction at r = d is 1. */
    for (int j = 0; j < d; j++) {
      total += s[j] * s[j];
      if (j < r) kept += s[j] * s[j];
    }
    sum += total > 0.0 ? kept / total : 1.0;
  }
  return nheads > 0 ? sum / nheads : 1.0;
}

int kqsvd_rank_eps(int nheads, int d, const double *sigma, double eps) {
  for (int r = 1; r < d; r++)
    if (kqsvd_rank_retained(nheads, d, sigma, r) >= 1.0 - eps) return r;
  return d;
}

kqsvd_status_t kqsvd_rank_policy_parse(const char *opt, const char *text, kqsvd_rank_policy_t *p) {
  kqsvd_status_t st = KQSVD_OK;
  static const char *const kinds[3] = {"eps:", "fixed:", "budget:"};
  const char *arg = NULL;
  for (int k = 0; k < 3 && !arg; k++)
    if (strncmp(text, kinds[k], strlen(kinds[k])) == 0) {
      p->kind = (kqsvd_rank_kind_t)k;
      arg = text + strlen(kinds[k]);
    }
  KQSVD_CHECK(arg, KQSVD_ERR_USAGE,
              "%s '%s': expected eps:E (0 < E < 1), fixed:R (R >= 1) or budget:F (0 < F <= 1)", opt,
              text);
  char *end = NULL;
  errno = 0;
  p->value = strtod(arg, &end);
  KQSVD_CHECK(*arg && end && *end == '\0' && errno == 0 && isfinite(p->value), KQSVD_ERR_USAGE,
              "%s '%s': '%s' is not a number", opt, text, arg);
  switch (p->kind) {
  case KQSVD_RANKS_EPS:
    KQSVD_CHECK(p->value > 0 && p->value < 1, KQSVD_ERR_USAGE, "%s '%s': E must lie in (0, 1)", opt,
                text);
    break;
  case KQSVD_RANKS_FIXED:
    KQSVD_CHECK(p->value >= 1 && p->value <= 1e6 && p->value == floor(p->value), KQSVD_ERR_USAGE,
                "%s '%s': R must be a whole number >= 1", opt, text);
    break;
  case KQSVD_RANKS_BUDGET:
    KQSVD_CHECK(p->value > 0 && p->value <= 1, KQSVD_ERR_USAGE, "%s '%s': F must lie in (0, 1]",
                opt, text);
    break;
  }
done:
  return st;
}

void kqsvd_rank_policy_format(const kqsvd_rank_policy_t *p, char *buf, size_t n) {
  static const char *const kinds[3] = {"eps", "fixed", "budget"};
  snprintf(buf, n, "%s:%.17g", kinds[p->kind], p->value);
  /* Shortest form that reads back the same. */
  for (int prec = 1; prec <= 17; prec++) {
    char t[64];
    snprintf(t, sizeof t, "%s:%.*g", kinds[p->kind], prec, p->value);
    if (strtod(strchr(t, ':') + 1, NULL) == p->value) {
      snprintf(buf, n, "%s", t);
      break;
    }
  }
}

typedef struct {
  double gain;
  int side, col;
} gain_t;

static int gain_order(const void *a, const void *b) {
  const gain_t *x = a, *y = b;
  if (x->gain != y->gain) return x->gain > y->gain ? -1 : 1;
  if (x->side != y->side) return x->side < y->side ? -1 : 1;
  return (x->col > y->col) - (x->col < y->col);
}

/* Why greedy is exact: each side's objective, its tail energy at rank r, is
 * 1 - sum_{j<r} g_j where g_j is the head-averaged share of column j.
 * Singular values descend, so each side's gains do not increase with j:
 * the objective is separable and convex in each rank.  Minimising a sum of
 * such terms under one budget on the sum of ranks is maximising the total
 * gain of the columns kept; the `units` largest gains overall always form a
 * prefix of each side's columns (ties are broken by column), so they are a
 * feasible choice, and no other choice of as many columns gains more (an
 * exchange argument).  Sorting all gains once therefore gives the optimum. */
kqsvd_status_t kqsvd_rank_budget(int nsides, int H, int d, const double *const *sigma,
                                 int64_t units, int32_t *rank) {
  kqsvd_status_t st = KQSVD_OK;
  gain_t *g = NULL;
  double *share = NULL;
  size_t n = 0;
  KQSVD_CHECK(units >= nsides, KQSVD_ERR_USAGE,
              "a budget of %lld columns cannot give each of %d spectra rank 1", (long long)units,
              nsides);
  KQSVD_MALLOC(g, (size_t)nsides * (size_t)d + 1, "rank gains");
  KQSVD_MALLOC(share, (size_t)d, "rank gains");
  for (int s = 0; s < nsides; s++) {
    rank[s] = 1;
    for (int j = 0; j < d; j++) share[j] = 0.0;
    for (int h = 0; h < H; h++) {
      const double *v = sigma[s] + (size_t)h * d;
      double total = 0.0;
      for (int j = 0; j < d; j++) total += v[j] * v[j];
      if (total > 0.0)
        for (int j = 0; j < d; j++) share[j] += v[j] * v[j] / total;
    }
    /* Column 0 is always kept.  Clamping makes the gains non-increasing
     * even for spectra that are not quite sorted, which keeps the greedy
     * choice a prefix of each side. */
    double prev = share[0];
    for (int j = 1; j < d; j++) {
      const double gj = share[j] < prev ? share[j] : prev;
      prev = gj;
      if (gj > 0.0) g[n++] = (gain_t){gj / H, s, j};
    }
  }
  qsort(g, n, sizeof *g, gain_order);
  const size_t take = (size_t)(units - nsides) < n ? (size_t)(units - nsides) : n;
  for (size_t k = 0; k < take; k++) rank[g[k].side]++;
done:
  free(g);
  free(share);
  return st;
}

/* Columns per KV head a budget keeps.  The tolerance keeps budgets like 0.3
 * of 2dL = 30.000000000000004 from losing a column to round-off. */
static int64_t budget_units(double F, int L, int d) {
  return (int64_t)floor(F * 2.0 * d * L * (1.0 + 1e-12));
}

kqsvd_status_t kqsvd_rank_policy_check(const kqsvd_rank_policy_t *p, int L, int d) {
  kqsvd_status_t st = KQSVD_OK;
  if (p->kind == KQSVD_RANKS_FIXED)
    KQSVD_CHECK(p->value <= d, KQSVD_ERR_USAGE, "rank policy fixed:%.0f exceeds head_dim = %d",
                p->value, d);
  if (p->kind == KQSVD_RANKS_BUDGET)
    KQSVD_CHECK(budget_units(p->value, L, d) >= 2 * (int64_t)L, KQSVD_ERR_USAGE,
                "rank policy budget:%g keeps %lld of %d columns per KV head, fewer than one per "
                "layer for keys and for values; the smallest budget here is 1/d = %g",
                p->value, (long long)budget_units(p->value, L, d), 2 * d * L, 1.0 / d);
done:
  return st;
}

kqsvd_status_t kqsvd_rank_choose(const kqsvd_rank_policy_t *p, int L, int H, int d,
                                 const double *const sigma_k[KQSVD_NMETHODS],
                                 const double *const sigma_v[KQSVD_NMETHODS], const double *spec_K,
                                 const double *spec_V, int32_t *rank_k, int32_t *rank_v) {
  kqsvd_status_t st = KQSVD_OK;
  const double **sides = NULL;
  int32_t *r = NULL;
  const size_t layer = (size_t)H * (size_t)d;
  KQSVD_CALL(kqsvd_rank_policy_check(p, L, d));
  switch (p->kind) {
  case KQSVD_RANKS_EPS:
    for (int l = 0; l < L; l++) {
      const int rk = kqsvd_rank_eps(H, d, spec_K + l * layer, p->value);
      const int rv = kqsvd_rank_eps(H, d, spec_V + l * layer, p->value);
      for (int m = 0; m < KQSVD_NMETHODS; m++) rank_k[m * L + l] = rk, rank_v[m * L + l] = rv;
    }
    break;
  case KQSVD_RANKS_FIXED:
    for (int k = 0; k < KQSVD_NMETHODS * L; k++) rank_k[k] = rank_v[k] = (int32_t)p->value;
    break;
  case KQSVD_RANKS_BUDGET: {
    const int64_t units = budget_units(p->value, L, d);
    KQSVD_MALLOC(sides, (size_t)(2 * L), "rank sides");
    KQSVD_MALLOC(r, (size_t)(2 * L), "ranks");
    for (int m = 0; m < KQSVD_NMETHODS; m++) {
      for (int l = 0; l < L; l++) {
        sides[2 * l] = sigma_k[m] + l * layer;
        sides[2 * l + 1] = sigma_v[m] + l * layer;
      }
      KQSVD_CALL(kqsvd_rank_budget(2 * L, H, d, sides, units, r));
      for (int l = 0; l < L; l++) rank_k[m * L + l] = r[2 * l], rank_v[m * L + l] = r[2 * l + 1];
    }
    break;
  }
  }
done:
  free(sides);
  free(r);
  return st;
}
