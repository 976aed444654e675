#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kqsvd_cli.h"
#include "kqsvd_util.h"

kqsvd_status_t kqsvd_opt_int(const char *opt, const char *s, int64_t lo, int64_t hi, int64_t *v) {
  kqsvd_status_t st = KQSVD_OK;
  char *end = NULL;
  errno = 0;
  long long x = strtoll(s, &end, 10);
  KQSVD_CHECK(*s && end && !*end && errno == 0, KQSVD_ERR_USAGE, "%s expects an integer, got '%s'",
              opt, s);
  KQSVD_CHECK(x >= lo && x <= hi, KQSVD_ERR_USAGE, "%s must be in [%lld, %lld], got %lld", opt,
              (long long)lo, (long long)hi, x);
  *v = x;
done:
  return st;
}

kqsvd_status_t kqsvd_opt_double(const char *opt, const char *s, double lo, double hi, int open_lo,
                                int open_hi, double *v) {
  kqsvd_status_t st = KQSVD_OK;
  char *end = NULL;
  errno = 0;
  double x = strtod(s, &end);
  KQSVD_CHECK(*s && end && !*end && errno == 0 && isfinite(x), KQSVD_ERR_USAGE,
              "%s expects a finite number, got '%s'", opt, s);
  const int ok = (open_lo ? x > lo : x >= lo) && (open_hi ? x < hi : x <= hi);
  KQSVD_CHECK(ok, KQSVD_ERR_USAGE, "%s must be in %c%g, %g%c, got %s", opt, open_lo ? '(' : '[', lo,
              hi, open_hi ? ')' : ']', s);
  *v = x;
done:
  return st;
}

/* Appends the pointer to --help to the message of a usage error. */
static void add_hint(const char *cmd) {
  char msg[1200];
  snprintf(msg, sizeof msg, "%s (see kqsvd %s --help)", kqsvd_error_message(), cmd);
  kqsvd_error_clear();
  kqsvd_error_set(KQSVD_ERR_USAGE, __FILE__, __LINE__, __func__, "%s", msg);
}

kqsvd_status_t kqsvd_usage_error(kqsvd_cli_t *cli, const char *cmd, kqsvd_status_t st) {
  if (st == KQSVD_ERR_USAGE) add_hint(cmd);
  /* Options are parsed identically everywhere: all ranks agree already. */
  kqsvd_error_mark_collective(cli->rank == 0);
  return st;
}

void kqsvd_usage_hint(const char *cmd) {
  if (kqsvd_error_origin() != KQSVD_ERR_USAGE || !kqsvd_error_report_here()) return;
  const bool collective = kqsvd_error_is_collective();
  add_hint(cmd);
  if (collective) kqsvd_error_mark_collective(true);
}

kqsvd_status_t kqsvd_getopt(int argc, char **argv, const char *shortopts,
                            const struct option *longopts, int *c) {
  kqsvd_status_t st = KQSVD_OK;
  opterr = 0;
  *c = getopt_long(argc, argv, shortopts, longopts, NULL);
  if (*c == '?') {
    const char *arg = argv[optind - 1];
    if (optopt) KQSVD_FAIL(KQSVD_ERR_USAGE, "unknown option '-%c'", optopt);
    KQSVD_FAIL(KQSVD_ERR_USAGE, "unknown option '%s'", arg);
  }
  if (*c == ':') KQSVD_FAIL(KQSVD_ERR_USAGE, "option '%s' needs a value", argv[optind - 1]);
done:
  return st;
}

void kqsvd_run_opts_default(kqsvd_run_opts_t *r) {
  r->mem_mib = 1024;
  r->threads = 1;
  r->progress = KQSVD_PROGRESS_AUTO;
}

kqsvd_status_t kqsvd_run_option(kqsvd_cli_t *cli, int o, const char *arg, kqsvd_run_opts_t *r,
                                int *handled) {
  kqsvd_status_t st = KQSVD_OK;
  *handled = 1;
  switch (o) {
  case KQSVD_OPT_MEM:
    KQSVD_CALL(kqsvd_opt_int("--mem-limit", arg, 16, INT64_C(1) << 30, &r->mem_mib));
    break;
  case KQSVD_OPT_THREADS: KQSVD_CALL(kqsvd_opt_int("--threads", arg, 1, 1024, &r->threads)); break;
  case KQSVD_OPT_PROGRESS: KQSVD_CALL(kqsvd_progress_parse(arg, &r->progress)); break;
  case 'v': cli->verbose = 1; break;
  default: *handled = 0;
  }
done:
  return st;
}
