/* Status codes, the error record and the macros that carry errors upwards.
 *
 * Every fallible function returns kqsvd_status_t and ends in a single
 * `done:` label that releases what it holds.  The first failure records one
 * human-readable message (naming the file and field involved); each frame it
 * passes through appends its source position to a trace, which `kqsvd -v`
 * prints.  None of these functions is collective. */
#ifndef KQSVD_ERROR_H
#define KQSVD_ERROR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kqsvd/error.h"
#include "kqsvd/types.h"
#include "kqsvd/version.h" /* KQSVD_VERSION, for every part */

#ifdef __cplusplus
extern "C" {
#endif

/* Records a new error (the first one wins while one is pending) and returns
 * `code`.  printf-style message; file/line/func locate the failure. */
kqsvd_status_t kqsvd_error_set(kqsvd_status_t code, const char *file, int line, const char *func,
                               const char *fmt, ...) __attribute__((format(printf, 5, 6)));

/* Appends a frame to the trace of the pending error and returns `code`. */
kqsvd_status_t kqsvd_error_trace(kqsvd_status_t code, const char *file, int line, const char *func);

/* Makes the pending message start with "<context>: " unless it already
 * names `context` (readers use it so every failure names the file). */
void kqsvd_error_context(const char *context);

/* What every public function (include/kqsvd) returns through: calls the
 * error handler of kqsvd_set_error_handler when st is a failure. */
kqsvd_status_t kqsvd_api_return(kqsvd_status_t st);

/* The pending error's message ("" when none), its trace, and a reset. */
const char *kqsvd_error_message(void);
const char *kqsvd_error_trace_text(void);
void kqsvd_error_clear(void);

/* Whether every rank already knows the run failed (so main() may finalize
 * instead of aborting) and whether this rank is the one that prints it. */
void kqsvd_error_mark_collective(bool report_here);
/* Undoes that: some rank may be stuck, so main() must abort. */
void kqsvd_error_mark_local(void);
/* The libraries are left in a state their shutdown cannot survive (HDF5
 * after a failed close, e.g. on a full disk): main() aborts even when every
 * rank knows of the error.  The reporting rank still prints it once. */
void kqsvd_error_mark_fatal(void);
bool kqsvd_error_is_fatal(void);
bool kqsvd_error_is_collective(void);
/* The status of the rank whose message is reported (set when ranks agree
 * on a failure), so that every rank exits with the same code; the pending
 * error's own status when no agreement recorded one. */
void kqsvd_error_set_origin(kqsvd_status_t code);
kqsvd_status_t kqsvd_error_origin(void);
bool kqsvd_error_report_here(void);

/* Checked narrowing for LAPACK/MPI/HDF5 `int` arguments (row counts are
 * 64-bit everywhere else). */
kqsvd_status_t kqsvd_to_int_(int64_t v, int *out, const char *what, const char *file, int line,
                             const char *func);

/* malloc that fails with a message naming what was being allocated. */
kqsvd_status_t kqsvd_malloc_(void **p, size_t count, size_t size, const char *what,
                             const char *file, int line, const char *func);

/* Carries a failing call's status up: needs `kqsvd_status_t st` and `done:`. */
#define KQSVD_CALL(expr)                                              \
  do {                                                                \
    kqsvd_status_t kqsvd_s_ = (expr);                                 \
    if (kqsvd_s_ != KQSVD_OK) {                                       \
      st = kqsvd_error_trace(kqsvd_s_, __FILE__, __LINE__, __func__); \
      goto done;                                                      \
    }                                                                 \
  } while (0)

#define KQSVD_FAIL(code, ...)                                                \
  do {                                                                       \
    st = kqsvd_error_set((code), __FILE__, __LINE__, __func__, __VA_ARGS__); \
    goto done;                                                               \
  } while (0)

#define KQSVD_CHECK(cond, code, ...)            \
  do {                                          \
    if (!(cond)) KQSVD_FAIL(code, __VA_ARGS__); \
  } while (0)

#define KQSVD_TO_INT(v, out, what) \
  KQSVD_CALL(kqsvd_to_int_((int64_t)(v), (out), (what), __FILE__, __LINE__, __func__))

#define KQSVD_MALLOC(p, count, what)                                                       \
  KQSVD_CALL(kqsvd_malloc_((void **)&(p), (size_t)(count), sizeof(*(p)), (what), __FILE__, \
                           __LINE__, __func__))

#ifdef __cplusplus
}
#endif

#endif
