#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "kqsvd_cli.h"
#include "kqsvd_util.h"

kqsvd_status_t kqsvd_progress_parse(const char *s, kqsvd_progress_mode_t *mode) {
  kqsvd_status_t st = KQSVD_OK;
  static const char *names[] = {"auto", "bar", "lines", "off"};
  for (int i = 0; i < 4; i++)
    if (strcmp(s, names[i]) == 0) {
      *mode = (kqsvd_progress_mode_t)i;
      return KQSVD_OK;
    }
  KQSVD_FAIL(KQSVD_ERR_USAGE, "--progress must be auto, bar, lines or off, got '%s'", s);
done:
  return st;
}

void kqsvd_progress_init(kqsvd_progress_t *p, kqsvd_progress_mode_t mode, const char *label,
                         int64_t tokens, int64_t work_base) {
  if (mode == KQSVD_PROGRESS_AUTO)
    mode = isatty(STDERR_FILENO) ? KQSVD_PROGRESS_BAR : KQSVD_PROGRESS_LINES;
  p->mode = mode;
  p->label = label;
  p->tokens = tokens;
  p->work_base = work_base;
  p->t0 = kqsvd_now();
}

double kqsvd_progress_interval(const kqsvd_progress_t *p) {
  return p->mode == KQSVD_PROGRESS_BAR ? 0.2 : 10.0;
}

void kqsvd_progress_show(void *ctx, int64_t done, int64_t total, int final) {
  kqsvd_progress_t *p = ctx;
  if (p->mode == KQSVD_PROGRESS_OFF || total <= 0) return;
  const double elapsed = kqsvd_now() - p->t0;
  const double frac = (double)done / (double)total;
  /* Rates count only this run's work, so a resumed run's ETA is honest. */
  const double run_frac = (double)(done - p->work_base) / (double)total;
  const double tok = frac * (double)p->tokens;
  const double rate = elapsed > 0 ? run_frac * (double)p->tokens / elapsed : 0.0;
  const double eta = run_frac > 0 ? elapsed * (1.0 - frac) / run_frac : -1.0;
  char a[32], b[32], c[32], e[32];
  kqsvd_fmt_count(tok, a, sizeof a);
  kqsvd_fmt_count((double)p->tokens, b, sizeof b);
  kqsvd_fmt_count(rate, c, sizeof c);
  kqsvd_fmt_duration(final ? elapsed : eta, e, sizeof e);
  if (p->mode == KQSVD_PROGRESS_BAR) {
    char bar[31];
    const int fill = (int)(frac * 30.0 + 0.5);
    for (int i = 0; i < 30; i++) bar[i] = i < fill ? '#' : '.';
    bar[30] = '\0';
    fprintf(stderr, "\r%s [%s] %5.1f%%  %s/%s tokens  %s tok/s  %s %s\033[K%s", p->label, bar,
            100.0 * frac, a, b, c, final ? "took" : "ETA", e, final ? "\n" : "");
  } else {
    fprintf(stderr, "%s: %5.1f%%  %s of %s tokens  %s tok/s  %s %s\n", p->label, 100.0 * frac, a, b,
            c, final ? "took" : "ETA", e);
  }
  fflush(stderr);
}

/* The command line's observer of a pipeline run: notes and warnings on
 * stderr (commentary only unless --progress off, details only with -v),
 * results on stdout, progress as kqsvd_progress_show draws it. */
static void cli_log(void *ctx, kqsvd_log_kind_t kind, const char *text) {
  const kqsvd_cli_observer_t *o = ctx;
  if (kind == KQSVD_LOG_INFO && o->mode == KQSVD_PROGRESS_OFF) return;
  if (kind == KQSVD_LOG_DETAIL && !o->verbose) return;
  fputs(text, kind == KQSVD_LOG_RESULT ? stdout : stderr);
}

static void cli_begin(void *ctx, const char *stage, int64_t tokens, int64_t base,
                      kqsvd_progress_fn *fn, void **fn_ctx, double *interval) {
  kqsvd_cli_observer_t *o = ctx;
  kqsvd_progress_init(&o->prog, o->mode, stage, tokens, base);
  *fn = kqsvd_progress_show;
  *fn_ctx = &o->prog;
  *interval = kqsvd_progress_interval(&o->prog);
}

/* The ranks table (one column pair per method when they differ), the
 * summary line, and --timings' parseable line (bench/ reads it). */
static void cli_calibrated(void *ctx, const kqsvd_calib_report_t *r) {
  (void)ctx;
  const int64_t L = r->layers;
  if (!r->per_method) {
    printf("layer  rank_k  rank_v   of d = %lld, ranks %s\n", (long long)r->head_dim, r->policy);
    for (int64_t l = 0; l < L; l++)
      printf("%5lld  %6d  %6d\n", (long long)l, r->rank_k[l], r->rank_v[l]);
  } else {
    printf("layer  rank_k/rank_v:    kqsvd     ksvd    eigen   of d = %lld, ranks %s\n",
           (long long)r->head_dim, r->policy);
    for (int64_t l = 0; l < L; l++) {
      printf("%5lld                ", (long long)l);
      for (int m = 0; m < KQSVD_NMETHODS; m++)
        printf(" %4d/%-4d", r->rank_k[m * L + l], r->rank_v[m * L + l]);
      printf("\n");
    }
  }
  char rate[32];
  kqsvd_fmt_count(r->tokens_per_s, rate, sizeof rate);
  printf("wrote %s: kqsvd, ksvd and eigen (beta = %g) projections in %.2f s (%s tokens/s "
         "streamed)\n",
         r->out_path, r->beta, r->seconds, rate);
  fflush(stdout);
  const kqsvd_calib_timings_t *t = r->timings;
  if (t)
    fprintf(stderr,
            "kqsvd calibrate: timings (--qr %s, %d rank%s; slowest rank): wall=%.3f s "
            "read=%.3f s bytes=%.4g read_rate=%.4g B/s/rank fold=%.3f s rows=%.6g "
            "fold_gflops=%.2f /rank reduce=%.3f s solve=%.3f s peak_rss=%.1f MiB/rank\n",
            t->qr, t->ranks, t->ranks == 1 ? "" : "s", t->wall, t->read, t->bytes, t->read_rate,
            t->fold, t->rows, t->fold_gflops, t->reduce, t->solve, t->peak_rss_mib);
}

void kqsvd_cli_observer_init(kqsvd_cli_observer_t *o, kqsvd_progress_mode_t mode, int verbose) {
  o->mode = mode;
  o->verbose = verbose;
  o->obs.log = cli_log;
  o->obs.begin = cli_begin;
  o->obs.calibrated = cli_calibrated;
  o->obs.ctx = o;
}
