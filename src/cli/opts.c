/* Option values and the usage errors of every subcommand. */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

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
