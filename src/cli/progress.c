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
    fprintf(stderr, "%s: %5.1f%%  %s of %s tokens  %s tok/s  %s %s\n", p->label, 100.0 * frac, a,
            b, c, final ? "took" : "ETA", e);
  }
  fflush(stderr);
}

/* The command line's observer of a pipeline run: notes and warnings on
 * stderr, results on stdout, progress as kqsvd_progress_show draws it. */
static void cli_log(void *ctx, kqsvd_log_kind_t kind, const char *text) {
  (void)ctx;
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

void kqsvd_cli_observer_init(kqsvd_cli_observer_t *o, kqsvd_progress_mode_t mode) {
  o->mode = mode;
  o->obs.log = cli_log;
  o->obs.begin = cli_begin;
  o->obs.ctx = o;
}
