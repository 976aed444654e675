/* The instruction sets the hand-vectorized kernels are built for (today
 * the Householder QR of tpqr.c), and the one place that picks among them.
 *
 * The choice is the best set this CPU and build can run, unless the
 * environment variable KQSVD_ISA names one (avx512, avx2 or base, any
 * case), which the tests use to run every path on one machine.  It is made
 * once, at first use, and never changes within a process. */
#ifndef KQSVD_ISA_H
#define KQSVD_ISA_H

#include <stdbool.h>

#include "kqsvd_error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* GCC on x86 builds the AVX-512 and AVX2 clones (the vector code relies on
 * GCC's __builtin_shuffle and target attributes); other builds have the
 * base kernels only. */
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#define KQSVD_ISA_X86_CLONES 1
#endif

/* In increasing order: a set needs everything the ones below it need.
 *   base    baseline x86-64 (or the target's default), plain loops, no FMA
 *   avx2    AVX2 + FMA, plain loops the compiler vectorizes
 *   avx512  AVX-512 F, VL, BW, DQ, CD + FMA (x86-64-v4), GCC vector code */
typedef enum kqsvd_isa { KQSVD_ISA_BASE = 0, KQSVD_ISA_AVX2, KQSVD_ISA_AVX512 } kqsvd_isa_t;
#define KQSVD_ISA_COUNT 3

/* "base", "avx2", "avx512" (the values KQSVD_ISA takes); "?" otherwise. */
const char *kqsvd_isa_name(kqsvd_isa_t isa);

/* Whether this CPU and build can run `isa`, and the best such set. */
bool kqsvd_isa_supported(kqsvd_isa_t isa);
kqsvd_isa_t kqsvd_isa_best(void);

/* The set a KQSVD_ISA value asks for: NULL or "" means kqsvd_isa_best().
 * KQSVD_ERR_USAGE, naming the variable, the value and what this CPU
 * supports, for an unknown name or a set this CPU or build cannot run. */
kqsvd_status_t kqsvd_isa_parse(const char *value, kqsvd_isa_t *isa);

/* The process's choice: KQSVD_ISA as read at the first call, parsed by
 * kqsvd_isa_parse.  Every call while that value is invalid fails with its
 * message.  `isa` may be NULL (a check only).  kqsvd_qr_ws_init calls it,
 * so no kernel runs with an override it cannot honour. */
kqsvd_status_t kqsvd_isa_select(kqsvd_isa_t *isa);

/* The set the kernels use: kqsvd_isa_select's, or kqsvd_isa_best() while
 * KQSVD_ISA is invalid (callers that must not ignore the variable check
 * kqsvd_isa_select first). */
kqsvd_isa_t kqsvd_isa_active(void);

/* The kernel of kqsvd_tpqr on an explicit set, which must be supported:
 * lets a test compare the paths within one process. */
void kqsvd_tpqr_isa(kqsvd_isa_t isa, int m, int n, double *R, int ldr, double *B, int ldb,
                    double *work);

#ifdef __cplusplus
}
#endif

#endif
