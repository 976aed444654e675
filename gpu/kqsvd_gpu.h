/* CUDA backend (built with -DKQSVD_CUDA=ON): finding devices, and the
 * device QR stage of `calibrate`.  Nothing here is collective. */
#ifndef KQSVD_GPU_H
#define KQSVD_GPU_H

#include <stdint.h>

#include "kqsvd_error.h"
#ifdef __cplusplus
extern "C" {
#endif
#include "kqsvd_convert.h"
#ifdef __cplusplus
}
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Number of CUDA devices visible to this process (0 when the driver or a
 * device is missing: not an error).  Errors: none. */
int kqsvd_gpu_device_count(void);

/* One line describing device `dev` (name, memory, compute capability) and
 * the cuSOLVER version linked.  Errors: KQSVD_ERR_CUDA naming the call. */
kqsvd_status_t kqsvd_gpu_describe(int dev, char *buf, int n);

/* R factors on a device, updated by streaming rows. */
typedef struct kqsvd_gpu_fold kqsvd_gpu_fold_t;

/* Holds `nfactors` d x d R factors (zero) on `device`, with `nlanes`
 * streams, each with a pinned staging buffer and a work matrix for calls of
 * up to `max_rows` rows.  Errors: KQSVD_ERR_CUDA naming the call, _NOMEM,
 * _USAGE for sizes out of range. */
kqsvd_status_t kqsvd_gpu_fold_init(int device, int d, int64_t nfactors, int64_t max_rows,
                                   int nlanes, kqsvd_gpu_fold_t **f);
void kqsvd_gpu_fold_free(kqsvd_gpu_fold_t **f);

/* Waits for queued work, then sets every factor from `packed` (nfactors
 * packed upper triangles, kqsvd_tri_size(d) doubles each, as in a
 * checkpoint).  Errors: KQSVD_ERR_CUDA. */
kqsvd_status_t kqsvd_gpu_fold_load(kqsvd_gpu_fold_t *f, const double *packed);

/* Queues R_k <- the R factor of [R_k; X] for X = n rows of d elements of
 * type t (row-major, as stored in the caches), converted to float64 on the
 * device.  Returns once X is copied to pinned memory: the caller may reuse
 * it.  Calls on one factor run in order; calls on factors of different
 * lanes (k modulo nlanes) overlap.  `tag` (0 <= tag < 2^31) names the call
 * in NaN/Inf reports.  Errors: KQSVD_ERR_CUDA, _BUG. */
kqsvd_status_t kqsvd_gpu_fold_rows(kqsvd_gpu_fold_t *f, int64_t k, const void *X,
                                   kqsvd_dtype_t t, int64_t n, int64_t tag);

/* Waits for all queued work.  *bad_tag and *bad_row get the smallest tag
 * whose rows held a NaN or Inf and that row (else -1), and are reset.  When
 * `packed` is not NULL, the factors are copied into it (packed upper
 * triangles).  Errors: KQSVD_ERR_CUDA, _BUG. */
kqsvd_status_t kqsvd_gpu_fold_sync(kqsvd_gpu_fold_t *f, double *packed, int64_t *bad_tag,
                                   int64_t *bad_row);

#ifdef __cplusplus
}
#endif

#endif
