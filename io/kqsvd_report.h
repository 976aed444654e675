/* The evaluation report (docs/formats.md section 4) as JSON.  Not collective:
 * one rank writes it. */
#ifndef KQSVD_REPORT_H
#define KQSVD_REPORT_H

#include <stdint.h>
#include <stdio.h>

#include "kqsvd_error.h"
#include "kqsvd_eval.h"
#include "kqsvd_solve.h"

typedef struct kqsvd_report {
  const char *model;
  int64_t tokens, sequences; /* of the validation set */
  int layers;
  const int32_t *rank_k, *rank_v; /* [KQSVD_NMETHODS][layers] */
  const double *err;              /* [KQSVD_NMETHODS][layers][KQSVD_NMETRICS] */
  /* Extensions (readers of version 1 ignore them). */
  const char *proj, *rank_policy;
  double beta; /* of the eigen method */
  int causal;  /* of the validation caches */
  int64_t calib_tokens;
  int64_t head_groups; /* > 1: a head-groups file (docs/formats.md 5.5); else not listed */
  /* Per-head ranks (docs/formats.md 5.5): rank_k_heads, rank_v_heads
   * [KQSVD_NMETHODS][layers][kv_heads], listed for the methods with
   * heads[m] set; NULL (and heads all 0) when the ranks are per layer.
   * rank_k / rank_v then hold each layer's maximum over its heads. */
  int kv_heads;
  const int32_t *rank_k_heads, *rank_v_heads;
  int heads[KQSVD_NMETHODS];
} kqsvd_report_t;

/* Mean over layers of one method's metric. */
double kqsvd_report_mean(const kqsvd_report_t *r, int method, int metric);

/* Writes the report to `path` through a temporary name renamed at the end,
 * so a failed run leaves nothing behind; the rename replaces a file that
 * appeared at `path` while the run worked only when `force`
 * (kqsvd_publish_new).  Numbers are printed with 17 significant digits
 * (they read back exactly).  Errors: KQSVD_ERR_IO naming the path. */
kqsvd_status_t kqsvd_report_write(const char *path, const kqsvd_report_t *r, int force);

/* Writes s to f as a JSON string: quotes, backslashes and control
 * characters escaped.  Not collective; no errors (f's error flag tells). */
void kqsvd_json_put_string(FILE *f, const char *s);

#endif
