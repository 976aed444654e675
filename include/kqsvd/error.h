/* Errors of the kqsvd library: a status code from every fallible function,
 * a message per thread, and an optional handler.
 *
 * A failing call records one human-readable message naming the file, field
 * or argument involved and returns its status.  Every fallible function of
 * kqsvd/accumulator.h clears the record when it starts, so the record
 * always describes the last failing call.  The record is per thread, so threads that use
 * separate handles do not see each other's errors. */
#ifndef KQSVD_PUBLIC_ERROR_H
#define KQSVD_PUBLIC_ERROR_H

#include "kqsvd/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The calling thread's pending error: its message ("" when none), its
 * status (KQSVD_OK when none), a trace of the source positions it passed
 * (for bug reports), and a reset, needed before the next failure can be
 * recorded.  Not collective. */
KQSVD_API const char *kqsvd_last_error(void);
KQSVD_API kqsvd_status_t kqsvd_last_status(void);
KQSVD_API const char *kqsvd_last_error_trace(void);
KQSVD_API void kqsvd_clear_error(void);

/* Called by every public function of kqsvd/accumulator.h that fails, after
 * it has released what it held, in the failing thread, with the status and
 * the message; then the function returns the status.  A binding sets one to
 * raise an exception carrying the message (the handler may record the error
 * and return; it must not unwind through kqsvd's frames).  NULL (the
 * default) calls nothing.  Not thread-safe against calls in flight: set it
 * before any work starts. */
typedef void (*kqsvd_error_handler_t)(kqsvd_status_t status, const char *message, void *ctx);
KQSVD_API void kqsvd_set_error_handler(kqsvd_error_handler_t handler, void *ctx);

#ifdef __cplusplus
}
#endif

#endif
