#include "kqsvd_report.h"
#include "kqsvd_signal.h"
#include "kqsvd_util.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

double kqsvd_report_mean(const kqsvd_report_t *r, int method, int metric) {
  double s = 0.0;
  for (int l = 0; l < r->layers; l++)
    s += r->err[((size_t)method * r->layers + l) * KQSVD_NMETRICS + metric];
  return r->layers > 0 ? s / r->layers : 0.0;
}

/* A JSON string: quotes, backslashes and control characters escaped. */
void kqsvd_json_put_string(FILE *f, const char *s) {
  fputc('"', f);
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    if (*p == '"' || *p == '\\')
      fprintf(f, "\\%c", *p);
    else if (*p < 0x20)
      fprintf(f, "\\u%04x", *p);
    else
      fputc(*p, f);
  }
  fputc('"', f);
}

static void put_metrics(FILE *f, const double *v) {
  for (int k = 0; k < KQSVD_NMETRICS; k++)
    fprintf(f, "%s\"%s\": %.17g", k ? ", " : "", kqsvd_metric_name(k), v[k]);
}

/* "key": [a, b, ...] of n ints and ", " after it. */
static void put_ints(FILE *f, const char *key, const int32_t *v, int n) {
  fprintf(f, "\"%s\": [", key);
  for (int k = 0; k < n; k++) fprintf(f, "%s%d", k ? ", " : "", v[k]);
  fprintf(f, "], ");
}

static void put_report(FILE *f, const kqsvd_report_t *r) {
  fprintf(f, "{\n  \"model\": ");
  kqsvd_json_put_string(f, r->model);
  fprintf(f, ", \"tokens\": %lld, \"sequences\": %lld,\n", (long long)r->tokens,
          (long long)r->sequences);
  fprintf(f, "  \"proj\": ");
  kqsvd_json_put_string(f, r->proj ? r->proj : "");
  fprintf(f, ", \"rank_policy\": ");
  kqsvd_json_put_string(f, r->rank_policy ? r->rank_policy : "");
  fprintf(f, ", \"beta\": %.17g, \"causal\": %d, \"calibration_tokens\": %lld,\n", r->beta,
          r->causal, (long long)r->calib_tokens);
  if (r->head_groups > 1) fprintf(f, "  \"head_groups\": %lld,\n", (long long)r->head_groups);
  fprintf(f, "  \"methods\": {\n");
  for (int m = 0; m < KQSVD_NMETHODS; m++) {
    fprintf(f, "    \"%s\": {\n      \"layers\": [\n", kqsvd_method_name((kqsvd_method_t)m));
    for (int l = 0; l < r->layers; l++) {
      fprintf(f, "        {\"layer\": %d, \"rank_k\": %d, \"rank_v\": %d, ", l,
              r->rank_k[m * r->layers + l], r->rank_v[m * r->layers + l]);
      if (r->rank_k_heads && r->heads[m]) {
        const size_t at = ((size_t)m * r->layers + l) * r->kv_heads;
        put_ints(f, "rank_k_heads", r->rank_k_heads + at, r->kv_heads);
        put_ints(f, "rank_v_heads", r->rank_v_heads + at, r->kv_heads);
      }
      put_metrics(f, r->err + ((size_t)m * r->layers + l) * KQSVD_NMETRICS);
      fprintf(f, "}%s\n", l + 1 < r->layers ? "," : "");
    }
    double mean[KQSVD_NMETRICS];
    for (int k = 0; k < KQSVD_NMETRICS; k++) mean[k] = kqsvd_report_mean(r, m, k);
    fprintf(f, "      ],\n      \"mean\": {");
    put_metrics(f, mean);
    fprintf(f, "}\n    }%s\n", m + 1 < KQSVD_NMETHODS ? "," : "");
  }
  fprintf(f, "  }\n}\n");
}

kqsvd_status_t kqsvd_report_write(const char *path, const kqsvd_report_t *r, int force) {
  kqsvd_status_t st = KQSVD_OK;
  char tmp[PATH_MAX + 32] = "";
  FILE *f = NULL;
  f = kqsvd_tmp_open(path, tmp, sizeof tmp);
  KQSVD_CHECK(f, KQSVD_ERR_IO, "%s: cannot create the report: %s", path, strerror(errno));
  kqsvd_signal_track(tmp);
  put_report(f, r);
  const int werr = ferror(f);
  const int cerr = fclose(f);
  f = NULL;
  KQSVD_CHECK(!werr && cerr == 0, KQSVD_ERR_IO, "%s: cannot write the report: %s", path,
              strerror(errno ? errno : EIO));
  KQSVD_CALL(force ? kqsvd_publish(tmp, path) : kqsvd_publish_new(tmp, path));
done:
  if (f) fclose(f);
  if (st != KQSVD_OK && tmp[0]) remove(tmp);
  if (tmp[0]) kqsvd_signal_untrack(tmp);
  return st;
}
