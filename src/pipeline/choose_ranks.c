/* kqsvd_proj_choose_ranks: the one place where `evaluate --ranks` and
 * `ranks --ranks` choose ranks from a projections file's stored spectra;
 * kqsvd_proj_choose_head_ranks: the stored per-head ranks both use
 * without --ranks. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

kqsvd_status_t kqsvd_proj_choose_head_ranks(kqsvd_proj_reader_t *proj, int32_t **head_k,
                                            int32_t **head_v, int *has) {
  kqsvd_status_t st = KQSVD_OK;
  const kqsvd_dims_t *dims = kqsvd_proj_dims(proj);
  const size_t per = (size_t)dims->layers * (size_t)dims->kv_heads;
  int any = 0;
  *head_k = *head_v = NULL;
  for (int m = 0; m < KQSVD_NMETHODS; m++) {
    has[m] = kqsvd_proj_has_head_ranks(proj, (kqsvd_method_t)m);
    any |= has[m];
  }
  /* Files without the extension allocate nothing: callers take NULL for
   * "per layer", which keeps their outputs exactly as before. */
  if (!any) goto done;
  KQSVD_MALLOC(*head_k, KQSVD_NMETHODS * per, "per-head ranks");
  KQSVD_MALLOC(*head_v, KQSVD_NMETHODS * per, "per-head ranks");
  memset(*head_k, 0, KQSVD_NMETHODS * per * sizeof **head_k);
  memset(*head_v, 0, KQSVD_NMETHODS * per * sizeof **head_v);
  for (int m = 0; m < KQSVD_NMETHODS; m++)
    if (has[m])
      KQSVD_CALL(kqsvd_proj_read_head_ranks(proj, (kqsvd_method_t)m, *head_k + m * per,
                                            *head_v + m * per));
done:
  if (st != KQSVD_OK) {
    free(*head_k);
    free(*head_v);
    *head_k = *head_v = NULL;
  }
  return st;
}
