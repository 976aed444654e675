/* CUDA backend: finding devices, and the device QR stage of `calibrate`.
 * The CUDA code is a module, libkqsvd_gpu.so (built with -DKQSVD_CUDA=ON,
 * the default where CMake finds nvcc), loaded with dlopen only when a GPU
 * is there: linking cuSOLVER would cost every process some 240 MB of
 * memory at start, GPU or not.  The first part of this header is the
 * module's code; it exports one symbol, kqsvd_gpu_module_table, whose
 * versioned table (kqsvd_gpu_api_t) the loader at the end, in every kqsvd,
 * checks before it calls anything else.  Nothing here is collective. */
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
 * streams, each with two pinned staging buffers (used in turn) for calls of
 * up to `max_rows` rows of elements of at most `elem_bytes` bytes, and a
 * work matrix.  Errors: KQSVD_ERR_CUDA naming the call, _NOMEM, _USAGE for
 * sizes out of range. */
kqsvd_status_t kqsvd_gpu_fold_init(int device, int d, int64_t nfactors, int64_t max_rows,
                                   int elem_bytes, int nlanes, kqsvd_gpu_fold_t **f);
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
kqsvd_status_t kqsvd_gpu_fold_rows(kqsvd_gpu_fold_t *f, int64_t k, const void *X, kqsvd_dtype_t t,
                                   int64_t n, int64_t tag);

/* Waits for all queued work.  *bad_tag and *bad_row get the smallest tag
 * whose rows held a NaN or Inf and that row (else -1), and are reset.  When
 * `packed` is not NULL, the factors are copied into it (packed upper
 * triangles).  Errors: KQSVD_ERR_CUDA, _BUG. */
kqsvd_status_t kqsvd_gpu_fold_sync(kqsvd_gpu_fold_t *f, double *packed, int64_t *bad_tag,
                                   int64_t *bad_row);

/* The module's own error record: the message of its last failure. */
const char *kqsvd_gpu_last_error(void);

/* Host-to-device bandwidth of `device` in GB/s: `reps` copies of `bytes`
 * from pinned memory.  Errors: KQSVD_ERR_CUDA. */
kqsvd_status_t kqsvd_gpu_h2d_bandwidth(int device, size_t bytes, int reps, double *gbps);

/* ---- the module's table ------------------------------------------------ */

/* The version of kqsvd_gpu_api_t and of the meaning of its functions.
 * Raise it with any change to the table or to a signature or contract
 * above: a kqsvd refuses a module of another version (installed from
 * another build) rather than call through a table it would misread.
 * Version 1 was the module that exported its functions by name, without
 * a table. */
#define KQSVD_GPU_ABI_VERSION 2u

/* The module's functions.  abi_version comes first and stays first in
 * every version: it is the one field the loader reads before it knows the
 * table's layout.  The module fills every pointer. */
typedef struct kqsvd_gpu_api {
  uint32_t abi_version; /* KQSVD_GPU_ABI_VERSION of the module's build */
  int (*device_count)(void);
  kqsvd_status_t (*describe)(int dev, char *buf, int n);
  kqsvd_status_t (*fold_init)(int device, int d, int64_t nfactors, int64_t max_rows, int elem_bytes,
                              int nlanes, kqsvd_gpu_fold_t **f);
  void (*fold_free)(kqsvd_gpu_fold_t **f);
  kqsvd_status_t (*fold_load)(kqsvd_gpu_fold_t *f, const double *packed);
  kqsvd_status_t (*fold_rows)(kqsvd_gpu_fold_t *f, int64_t k, const void *X, kqsvd_dtype_t t,
                              int64_t n, int64_t tag);
  kqsvd_status_t (*fold_sync)(kqsvd_gpu_fold_t *f, double *packed, int64_t *bad_tag,
                              int64_t *bad_row);
  const char *(*last_error)(void);
  kqsvd_status_t (*h2d_bandwidth)(int device, size_t bytes, int reps, double *gbps);
} kqsvd_gpu_api_t;

/* The module's one exported symbol (gpu/device.cu): its table, static and
 * filled at build time, so calling it runs no CUDA code.  Errors: none. */
const kqsvd_gpu_api_t *kqsvd_gpu_module_table(void);
#define KQSVD_GPU_MODULE_ENTRY "kqsvd_gpu_module_table"

/* ---- the loader (gpu/loader.c, in every build) ------------------------ */

/* GPUs the CUDA driver sees (through libcuda.so.1, without the module):
 * 0 when there is no driver or no device.  Under the test hook
 * KQSVD_TEST_GPU_LOADER=1, at least 1, so that the callers (calibrate
 * --device auto|cuda, kqsvd --version) go on to kqsvd_gpu_open on a machine
 * without a GPU.  Errors: none. */
int kqsvd_gpu_driver_devices(void);

/* Where the module is looked for: $KQSVD_GPU_MODULE when set and not
 * empty (tests point it at stand-in modules), else libkqsvd_gpu.so next to
 * the executable.  Errors: none. */
const char *kqsvd_gpu_module_path(void);

/* Loads the module once and returns its table, after checking, before
 * using anything else of it, that it exports kqsvd_gpu_module_table, that
 * the table's abi_version is KQSVD_GPU_ABI_VERSION and that it fills every
 * function.  A failure is remembered: later calls fail alike without
 * loading again.  Under KQSVD_TEST_GPU_LOADER=1 a module that passes every
 * check is still refused ("checked, not used"), so that no CUDA code runs:
 * the hook lets CI run the checks, and calibrate's fallback to the CPU,
 * without a GPU.  Errors: KQSVD_ERR_CUDA naming the module's path and the
 * reason: dlopen's (e.g. a kqsvd built without -DKQSVD_CUDA=ON has no
 * module), a missing entry point, "has ABI version M, this kqsvd needs
 * version N", a missing function, or the test hook. */
kqsvd_status_t kqsvd_gpu_open(const kqsvd_gpu_api_t **api);

#ifdef __cplusplus
}
#endif

#endif
