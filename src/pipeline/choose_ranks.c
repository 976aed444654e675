/* kqsvd_proj_choose_ranks: the one place where `evaluate --ranks` and
 * `ranks --ranks` choose ranks from a projections file's stored spectra. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "kqsvd_pipeline.h"

kqsvd_status_t kqsvd_proj_choose_ranks(kqsvd_proj_reader_t *proj, const kqsvd_rank_policy_t *policy,
                                       int32_t *rank_k, int32_t *rank_v, char *policy_buf,
                                       size_t n) {
  kqsvd_status_t st = KQSVD_OK;
  const kqsvd_dims_t *dims = kqsvd_proj_dims(proj);
  const int L = (int)dims->layers, H = (int)dims->kv_heads, d = (int)dims->head_dim;
  const size_t plane = (size_t)L * (size_t)H * (size_t)d;
  double *sig = NULL;
  if (!policy) {
    for (int m = 0; m < KQSVD_NMETHODS; m++)
      KQSVD_CALL(kqsvd_proj_read_ranks(proj, (kqsvd_method_t)m, rank_k + m * L, rank_v + m * L));
    const char *stored = kqsvd_proj_policy(proj);
    if (*stored)
      snprintf(policy_buf, n, "%s", stored);
    else if (isfinite(kqsvd_proj_eps(proj)))
      snprintf(policy_buf, n, "eps:%g", kqsvd_proj_eps(proj));
    else
      snprintf(policy_buf, n, "stored");
    goto done;
  }
  st = kqsvd_rank_policy_check(policy, L, d);
  if (st != KQSVD_OK) kqsvd_error_context("--ranks");
  KQSVD_CALL(st);
  KQSVD_MALLOC(sig, (2 * KQSVD_NMETHODS + 2) * plane, "spectra");
  const double *sk[KQSVD_NMETHODS], *sv[KQSVD_NMETHODS];
  for (int m = 0; m < KQSVD_NMETHODS; m++) {
    const char *g = kqsvd_method_name((kqsvd_method_t)m);
    sk[m] = sig + 2 * m * plane, sv[m] = sig + (2 * m + 1) * plane;
    KQSVD_CALL(kqsvd_proj_read(proj, g, "sigma_k", -1, sig + 2 * m * plane));
    KQSVD_CALL(kqsvd_proj_read(proj, g, "sigma_v", -1, sig + (2 * m + 1) * plane));
  }
  double *spec_K = sig + 2 * KQSVD_NMETHODS * plane, *spec_V = spec_K + plane;
  KQSVD_CALL(kqsvd_proj_read(proj, "spectra", "K", -1, spec_K));
  KQSVD_CALL(kqsvd_proj_read(proj, "spectra", "V", -1, spec_V));
  KQSVD_CALL(kqsvd_rank_choose(policy, L, H, d, sk, sv, spec_K, spec_V, rank_k, rank_v));
  kqsvd_rank_policy_format(policy, policy_buf, n);
done:
  free(sig);
  return st;
}
