/* The paper's rank rule on spectra whose answer is known by hand, the
 * policy syntax, and the budget allocation against brute force. */
#include <string.h>

#include "check.h"
#include "kqsvd_rank.h"

enum { BL = 2, BH = 2, BD = 4, NS = 2 * BL };

/* Sum over sides of the head-averaged relative tail energy. */
static double objective(const double *const *sig, const int32_t *rank) {
  double s = 0.0;
  for (int k = 0; k < NS; k++) s += 1.0 - kqsvd_rank_retained(BH, BD, sig[k], rank[k]);
  return s;
}

/* Every rank vector in [1, BD]^NS with sum <= units: the best objective. */
static double brute_force(const double *const *sig, int64_t units) {
  double best = 1e300;
  int32_t r[NS];
  for (int code = 0; code < BD * BD * BD * BD; code++) {
    int c = code, sum = 0;
    for (int k = 0; k < NS; k++) r[k] = 1 + c % BD, c /= BD, sum += r[k];
    if (sum <= units) {
      const double v = objective(sig, r);
      best = v < best ? v : best;
    }
  }
  return best;
}

static void test_budget(void) {
  unsigned long long seed = 7;
  for (int trial = 0; trial < 40; trial++) {
    /* [side][head][BD] descending spectra; some heads zero or rank-deficient. */
    double spec[NS][BH * BD];
    const double *sig[NS];
    for (int k = 0; k < NS; k++) {
      for (int h = 0; h < BH; h++) {
        double *v = spec[k] + h * BD;
        for (int j = 0; j < BD; j++) v[j] = fabs(test_normal(&seed)) * pow(0.5, j * (trial % 3));
        for (int a = 0; a < BD; a++) /* sort descending */
          for (int b = a + 1; b < BD; b++)
            if (v[b] > v[a]) {
              const double t = v[a];
              v[a] = v[b];
              v[b] = t;
            }
        if ((trial + k + h) % 7 == 0) memset(v, 0, sizeof(double) * BD);
        if ((trial + k + h) % 5 == 0) v[BD - 1] = v[BD - 2] = 0.0;
      }
      sig[k] = spec[k];
    }
    for (int64_t units = NS; units <= NS * BD; units++) {
      int32_t r[NS];
      CHECK_OK(kqsvd_rank_budget(NS, BH, BD, sig, units, r));
      int sum = 0;
      for (int k = 0; k < NS; k++) {
        CHECK(r[k] >= 1 && r[k] <= BD, "rank %d out of range", r[k]);
        sum += r[k];
      }
      CHECK(sum <= units, "trial %d: %d columns used of %lld", trial, sum, (long long)units);
      CHECK_CLOSE(objective(sig, r), brute_force(sig, units), 1e-12, 1.0);
    }
  }
  int32_t r[NS];
  const double *sig[NS] = {NULL, NULL, NULL, NULL};
  CHECK(kqsvd_rank_budget(NS, BH, BD, sig, NS - 1, r) == KQSVD_ERR_USAGE,
        "budget below 1 per side");
  kqsvd_error_clear();
}

static void test_policies(void) {
  kqsvd_rank_policy_t p;
  char buf[64];
  const char *good[] = {"eps:0.1", "fixed:16", "budget:0.25", "budget:1", "eps:1e-3"};
  for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
    CHECK_OK(kqsvd_rank_policy_parse("--ranks", good[i], &p));
    kqsvd_rank_policy_format(&p, buf, sizeof buf);
    kqsvd_rank_policy_t q;
    CHECK_OK(kqsvd_rank_policy_parse("--ranks", buf, &q));
    CHECK(q.kind == p.kind && q.value == p.value, "%s -> %s does not read back", good[i], buf);
  }
  kqsvd_rank_policy_format(&(kqsvd_rank_policy_t){KQSVD_RANKS_EPS, 0.1}, buf, sizeof buf);
  CHECK(strcmp(buf, "eps:0.1") == 0, "format gives %s", buf);
  const char *bad[] = {"eps:0",      "eps:1",   "eps:",     "fixed:0",  "fixed:2.5", "budget:0",
                       "budget:1.5", "ranks:3", "eps:0.1x", "fixed:-3", "eps:nan"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    CHECK(kqsvd_rank_policy_parse("--ranks", bad[i], &p) == KQSVD_ERR_USAGE, "%s accepted", bad[i]);
    CHECK(strstr(kqsvd_error_message(), "--ranks") != NULL, "message names the option: %s",
          kqsvd_error_message());
    kqsvd_error_clear();
  }
  p = (kqsvd_rank_policy_t){KQSVD_RANKS_FIXED, 9};
  CHECK(kqsvd_rank_policy_check(&p, 2, 8) == KQSVD_ERR_USAGE, "fixed:9 with d = 8");
  kqsvd_error_clear();
  p = (kqsvd_rank_policy_t){KQSVD_RANKS_BUDGET, 0.1};
  CHECK(kqsvd_rank_policy_check(&p, 3, 4) == KQSVD_ERR_USAGE, "budget:0.1 of 24 < 6");
  kqsvd_error_clear();

  /* choose(): eps gives the rule's ranks to every method, budget meets its
   * definition per method, fixed is fixed. */
  enum { L = 3, H = 2, d = 6 };
  double sk[KQSVD_NMETHODS][L * H * d], sv[KQSVD_NMETHODS][L * H * d], K[L * H * d], V[L * H * d];
  unsigned long long seed = 3;
  for (int i = 0; i < L * H; i++)
    for (int j = 0; j < d; j++) {
      K[i * d + j] = pow(0.6, j) * (1 + 0.1 * i);
      V[i * d + j] = pow(0.8, j);
      for (int m = 0; m < KQSVD_NMETHODS; m++) {
        sk[m][i * d + j] = pow(0.3 + 0.2 * m, j) * (1 + fabs(test_normal(&seed)));
        sv[m][i * d + j] = pow(0.5, j + m);
      }
    }
  const double *skp[KQSVD_NMETHODS] = {sk[0], sk[1], sk[2]};
  const double *svp[KQSVD_NMETHODS] = {sv[0], sv[1], sv[2]};
  int32_t rk[KQSVD_NMETHODS * L], rv[KQSVD_NMETHODS * L];
  p = (kqsvd_rank_policy_t){KQSVD_RANKS_EPS, 0.1};
  CHECK_OK(kqsvd_rank_choose(&p, L, H, d, skp, svp, K, V, rk, rv));
  for (int m = 0; m < KQSVD_NMETHODS; m++)
    for (int l = 0; l < L; l++) {
      CHECK(rk[m * L + l] == kqsvd_rank_eps(H, d, K + l * H * d, 0.1), "eps rank_k");
      CHECK(rv[m * L + l] == kqsvd_rank_eps(H, d, V + l * H * d, 0.1), "eps rank_v");
    }
  p = (kqsvd_rank_policy_t){KQSVD_RANKS_FIXED, 4};
  CHECK_OK(kqsvd_rank_choose(&p, L, H, d, skp, svp, K, V, rk, rv));
  for (int k = 0; k < KQSVD_NMETHODS * L; k++) CHECK(rk[k] == 4 && rv[k] == 4, "fixed:4");
  const double fractions[] = {1.0 / 6, 0.3, 0.5, 0.77, 1.0};
  for (size_t f = 0; f < sizeof fractions / sizeof fractions[0]; f++) {
    p = (kqsvd_rank_policy_t){KQSVD_RANKS_BUDGET, fractions[f]};
    CHECK_OK(kqsvd_rank_choose(&p, L, H, d, skp, svp, K, V, rk, rv));
    for (int m = 0; m < KQSVD_NMETHODS; m++) {
      int sum = 0;
      for (int l = 0; l < L; l++) sum += rk[m * L + l] + rv[m * L + l];
      CHECK(sum <= fractions[f] * 2 * d * L + 1e-9, "budget %g: %d columns", fractions[f], sum);
    }
  }
}

int main(void) {
  test_policies();
  test_budget();
  /* One head, energies 4, 3, 2, 1 (sigma = sqrt): retained 0.4, 0.7, 0.9, 1. */
  const double a[4] = {2.0, 1.7320508075688772, 1.4142135623730951, 1.0};
  CHECK(kqsvd_rank_eps(1, 4, a, 0.65) == 1, "eps 0.65 -> 1");
  CHECK(kqsvd_rank_eps(1, 4, a, 0.35) == 2, "eps 0.35 -> 2");
  CHECK(kqsvd_rank_eps(1, 4, a, 0.1) == 3, "0.9 >= 0.9 -> 3 (boundary is inclusive)");
  CHECK(kqsvd_rank_eps(1, 4, a, 0.05) == 4, "eps 0.05 -> 4");
  /* Two heads: the average, not each head, must reach 1 - eps. */
  const double b[8] = {1, 0, 0, 0, /* all energy in one direction */
                       1, 1, 1, 1};
  /* retained averages: (1 + 0.25)/2, (1 + .5)/2, (1 + .75)/2, 1. */
  CHECK(kqsvd_rank_eps(2, 4, b, 0.4) == 1, "avg 0.625 >= 0.6");
  CHECK(kqsvd_rank_eps(2, 4, b, 0.2) == 3, "avg 0.875 >= 0.8 at r = 3");
  CHECK_CLOSE(kqsvd_rank_retained(2, 4, b, 2), 0.75, 1e-15, 1.0);
  /* A head without energy retains everything; rank is at least 1. */
  const double z[8] = {0, 0, 0, 0, 3, 0, 0, 0};
  CHECK(kqsvd_rank_eps(2, 4, z, 0.01) == 1, "zero head and a rank-1 head -> 1");
  CHECK(kqsvd_rank_eps(1, 4, z, 0.5) == 1, "all-zero layer -> 1");
  CHECK_CLOSE(kqsvd_rank_retained(1, 4, a, 4), 1.0, 0.0, 1.0);
  return check_exit("test_rank");
}
