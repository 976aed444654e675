/* How a pipeline run (calibrate, for now) reports what it does, instead of
 * printing: the command line's observer prints (src/cli/progress.c), a
 * library caller may collect or ignore.  Not collective: the stages call it
 * on the ranks that have something to say (rank 0, mostly). */
#ifndef KQSVD_OBSERVER_H
#define KQSVD_OBSERVER_H

#include <stdint.h>

#include "kqsvd_mpi.h"

typedef enum kqsvd_log_kind {
  KQSVD_LOG_NOTE = 0, /* what the run is doing (the command line: stderr) */
  KQSVD_LOG_WARNING,  /* something the user should know but not fatal (stderr) */
  KQSVD_LOG_RESULT    /* the outcome: tables, files written (stdout) */
} kqsvd_log_kind_t;

typedef struct kqsvd_observer {
  /* One or more whole lines of text, each ending in a newline. */
  void (*log)(void *ctx, kqsvd_log_kind_t kind, const char *text);
  /* A stage with a progress measure starts: `tokens` is what its work
   * stands for, `base` the work already done (a resumed run).  Returns in
   * *fn, *fn_ctx and *interval the callback the stage's monitor calls
   * (kqsvd_monitor_init); *fn NULL shows nothing. */
  void (*begin)(void *ctx, const char *stage, int64_t tokens, int64_t base, kqsvd_progress_fn *fn,
                void **fn_ctx, double *interval);
  void *ctx;
} kqsvd_observer_t;

/* printf into obs->log (nothing when obs or its log is NULL).  Text longer
 * than 4 KiB is cut. */
void kqsvd_observe(const kqsvd_observer_t *obs, kqsvd_log_kind_t kind, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* obs->begin, or no progress when obs or begin is NULL. */
void kqsvd_observe_begin(const kqsvd_observer_t *obs, const char *stage, int64_t tokens,
                         int64_t base, kqsvd_progress_fn *fn, void **fn_ctx, double *interval);

#endif
