#include "kqsvd_error.h"

#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One record per thread: library users may run independent handles on
 * several threads, and each must see its own failure. */
static _Thread_local struct {
  kqsvd_status_t code;
  char message[1024];
  char trace[2048];
  bool collective;
  bool report;
  bool fatal;
  kqsvd_status_t origin;
} g_err = {KQSVD_OK, "", "", false, true, false, KQSVD_OK};

static void append_frame(const char *file, int line, const char *func) {
  size_t used = strlen(g_err.trace);
  if (used + 1 < sizeof g_err.trace)
    snprintf(g_err.trace + used, sizeof g_err.trace - used, "  at %s (%s:%d)\n", func, file, line);
}

kqsvd_status_t kqsvd_error_set(kqsvd_status_t code, const char *file, int line, const char *func,
                               const char *fmt, ...) {
  if (g_err.code == KQSVD_OK) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err.message, sizeof g_err.message, fmt, ap);
    va_end(ap);
    g_err.code = code;
    g_err.trace[0] = '\0';
    g_err.collective = false;
    g_err.report = true;
  }
  append_frame(file, line, func);
  return code;
}

kqsvd_status_t kqsvd_error_trace(kqsvd_status_t code, const char *file, int line,
                                 const char *func) {
  if (g_err.code == KQSVD_OK) {
    /* A status without a message means a callee forgot to set one. */
    g_err.code = code;
    snprintf(g_err.message, sizeof g_err.message, "%s", kqsvd_status_name(code));
    g_err.collective = false;
    g_err.report = true;
  }
  append_frame(file, line, func);
  return code;
}

void kqsvd_error_context(const char *context) {
  if (g_err.code == KQSVD_OK || strstr(g_err.message, context)) return;
  const size_t cap = sizeof g_err.message, lc = strlen(context);
  if (lc + 3 >= cap) return;
  size_t lm = strlen(g_err.message);
  if (lc + 2 + lm + 1 > cap) lm = cap - lc - 3; /* keep the head of the message */
  memmove(g_err.message + lc + 2, g_err.message, lm);
  g_err.message[lc + 2 + lm] = '\0';
  memcpy(g_err.message, context, lc);
  g_err.message[lc] = ':';
  g_err.message[lc + 1] = ' ';
}

/* Set once before any work (kqsvd/error.h), read by failing API calls. */
static kqsvd_error_handler_t g_handler;
static void *g_handler_ctx;

const char *kqsvd_error_message(void) { return g_err.message; }
const char *kqsvd_last_error(void) { return g_err.message; }
kqsvd_status_t kqsvd_last_status(void) { return g_err.code; }
const char *kqsvd_last_error_trace(void) { return g_err.trace; }
void kqsvd_clear_error(void) { kqsvd_error_clear(); }

void kqsvd_set_error_handler(kqsvd_error_handler_t handler, void *ctx) {
  g_handler = handler;
  g_handler_ctx = ctx;
}

kqsvd_status_t kqsvd_api_return(kqsvd_status_t st) {
  if (st != KQSVD_OK && g_handler) g_handler(st, g_err.message, g_handler_ctx);
  return st;
}
const char *kqsvd_error_trace_text(void) { return g_err.trace; }

void kqsvd_error_clear(void) {
  g_err.code = KQSVD_OK;
  g_err.message[0] = '\0';
  g_err.trace[0] = '\0';
  g_err.collective = false;
  g_err.report = true;
  g_err.fatal = false;
  g_err.origin = KQSVD_OK;
}

void kqsvd_error_set_origin(kqsvd_status_t code) { g_err.origin = code; }
kqsvd_status_t kqsvd_error_origin(void) {
  return g_err.origin != KQSVD_OK ? g_err.origin : g_err.code;
}

void kqsvd_error_mark_collective(bool report_here) {
  g_err.collective = true;
  g_err.report = report_here;
}
void kqsvd_error_mark_fatal(void) { g_err.fatal = true; }
bool kqsvd_error_is_fatal(void) { return g_err.fatal; }

void kqsvd_error_mark_local(void) {
  g_err.collective = false;
  g_err.report = true;
}
bool kqsvd_error_is_collective(void) { return g_err.collective; }
bool kqsvd_error_report_here(void) { return g_err.report; }

const char *kqsvd_status_name(kqsvd_status_t st) {
  switch (st) {
  case KQSVD_OK: return "success";
  case KQSVD_ERR_USAGE: return "invalid usage";
  case KQSVD_ERR_INPUT: return "invalid input file";
  case KQSVD_ERR_DATA: return "invalid data";
  case KQSVD_ERR_IO: return "file system error";
  case KQSVD_ERR_HDF5: return "HDF5 error";
  case KQSVD_ERR_MPI: return "MPI error";
  case KQSVD_ERR_LAPACK: return "LAPACK numerical failure";
  case KQSVD_ERR_CUDA: return "CUDA error";
  case KQSVD_ERR_NOMEM: return "out of memory";
  case KQSVD_ERR_BUG: return "internal error";
  case KQSVD_ERR_REMOTE: return "failure on another rank";
  case KQSVD_ERR_INTERRUPTED: return "interrupted by a signal";
  }
  return "unknown status";
}

kqsvd_status_t kqsvd_to_int_(int64_t v, int *out, const char *what, const char *file, int line,
                             const char *func) {
  if (v < INT_MIN || v > INT_MAX)
    return kqsvd_error_set(KQSVD_ERR_USAGE, file, line, func,
                           "%s = %lld does not fit the 32-bit int of LAPACK/MPI/HDF5; "
                           "use smaller blocks",
                           what, (long long)v);
  *out = (int)v;
  return KQSVD_OK;
}

kqsvd_status_t kqsvd_malloc_(void **p, size_t count, size_t size, const char *what,
                             const char *file, int line, const char *func) {
  *p = NULL;
  if (count == 0) return KQSVD_OK;
  if (size != 0 && count > SIZE_MAX / size)
    return kqsvd_error_set(KQSVD_ERR_NOMEM, file, line, func,
                           "size of %s overflows (%zu x %zu bytes)", what, count, size);
  *p = malloc(count * size);
  if (!*p)
    return kqsvd_error_set(KQSVD_ERR_NOMEM, file, line, func, "cannot allocate %.1f MiB for %s",
                           (double)count * (double)size / 1048576.0, what);
  return KQSVD_OK;
}
