#include "kqsvd_observer.h"

#include <stdarg.h>
#include <stdio.h>

void kqsvd_observe(const kqsvd_observer_t *obs, kqsvd_log_kind_t kind, const char *fmt, ...) {
  if (!obs || !obs->log) return;
  char text[4096];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  obs->log(obs->ctx, kind, text);
}

void kqsvd_observe_begin(const kqsvd_observer_t *obs, const char *stage, int64_t tokens,
                         int64_t base, kqsvd_progress_fn *fn, void **fn_ctx, double *interval) {
  *fn = NULL;
  *fn_ctx = NULL;
  *interval = 1.0;
  if (obs && obs->begin) obs->begin(obs->ctx, stage, tokens, base, fn, fn_ctx, interval);
}

void kqsvd_observe_calibrated(const kqsvd_observer_t *obs, const kqsvd_calib_report_t *report) {
  if (obs && obs->calibrated) obs->calibrated(obs->ctx, report);
}
