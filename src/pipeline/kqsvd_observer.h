/* How a pipeline run (calibrate, evaluate) reports what it does, instead of
 * printing: the command line's observer prints (src/cli/progress.c), a
 * library caller may collect or ignore.  Not collective: the stages call it
 * on the ranks that have something to say (rank 0, mostly). */
#ifndef KQSVD_OBSERVER_H
#define KQSVD_OBSERVER_H

#include <stdint.h>

#include "kqsvd_mpi.h"

typedef enum kqsvd_log_kind {
  KQSVD_LOG_NOTE = 0, /* worth seeing always (the command line: stderr) */
  KQSVD_LOG_WARNING,  /* something the user should know but not fatal (stderr) */
  KQSVD_LOG_RESULT,   /* the outcome: files written, runs skipped (stdout) */
  KQSVD_LOG_INFO,     /* what the run is about to do: a running commentary
                         that --progress off silences */
  KQSVD_LOG_DETAIL    /* for diagnosis only (the command line: with -v) */
} kqsvd_log_kind_t;

/* --timings of one calibration: the slowest rank's stage seconds, bytes
 * and rows summed over ranks, the largest peak RSS. */
typedef struct kqsvd_calib_timings {
  const char *qr; /* the method's --qr spelling */
  int ranks;
  double wall, read, bytes, read_rate, fold, rows, fold_gflops, reduce, solve, peak_rss_mib;
} kqsvd_calib_timings_t;

/* One model's calibration, written (rank 0).  Pointers live for the call. */
typedef struct kqsvd_calib_report {
  const char *out_path, *policy; /* policy as kqsvd_rank_policy_format writes it */
  int64_t layers, head_dim;
  const int32_t *rank_k, *rank_v; /* [KQSVD_NMETHODS][layers] */
  int per_method;                 /* the ranks depend on the method (budget:F) */
  double beta, seconds, tokens_per_s;
  const kqsvd_calib_timings_t *timings; /* NULL unless asked for */
} kqsvd_calib_report_t;

typedef struct kqsvd_observer {
  /* One or more whole lines of text, each ending in a newline. */
  void (*log)(void *ctx, kqsvd_log_kind_t kind, const char *text);
  /* A stage with a progress measure starts: `tokens` is what its work
   * stands for, `base` the work already done (a resumed run).  Returns in
   * *fn, *fn_ctx and *interval the callback the stage's monitor calls
   * (kqsvd_monitor_init); *fn NULL shows nothing.  Called on every rank
   * (the monitor is collective); only rank 0's callback is ever called. */
  void (*begin)(void *ctx, const char *stage, int64_t tokens, int64_t base, kqsvd_progress_fn *fn,
                void **fn_ctx, double *interval);
  /* A model's projections are written (rank 0): the ranks table and the
   * summary the command line prints. */
  void (*calibrated)(void *ctx, const kqsvd_calib_report_t *report);
  void *ctx;
} kqsvd_observer_t;

/* printf into obs->log (nothing when obs or its log is NULL).  Text longer
 * than 4 KiB is cut. */
void kqsvd_observe(const kqsvd_observer_t *obs, kqsvd_log_kind_t kind, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* obs->begin, or no progress when obs or begin is NULL. */
void kqsvd_observe_begin(const kqsvd_observer_t *obs, const char *stage, int64_t tokens,
                         int64_t base, kqsvd_progress_fn *fn, void **fn_ctx, double *interval);

/* obs->calibrated, if any. */
void kqsvd_observe_calibrated(const kqsvd_observer_t *obs, const kqsvd_calib_report_t *report);

#endif
