#include "kqsvd_rank.h"

#include <stddef.h>

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
