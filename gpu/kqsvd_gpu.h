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

/* The factors of calibrate's items on a device, updated by streaming rows. */
typedef struct kqsvd_gpu_fold kqsvd_gpu_fold_t;

/* How rows become factors on the device.  QR: Householder QR of [R; rows]
 * per factor (cuSOLVER's geqrf, one factor at a time); the factors are R
 * factors.  GRAM: C += X^T X in float64 for every factor of a block in a
 * few batched GEMM calls (FP64 tensor cores), the rows cut into chunks of
 * `chunk` rows whose partial Gram matrices are then summed; the factors are
 * Gram matrices (kqsvd_gram_to_r makes R factors of them), the state of
 * `calibrate --qr gram`. */
typedef enum { KQSVD_GPU_QR = 0, KQSVD_GPU_GRAM = 1 } kqsvd_gpu_method_t;

/* What the device holds and takes.  Item i has three factors, 3 i + 0
 * (keys), 3 i + 1 (the stacked queries), 3 i + 2 (values), each G hd wide:
 * an item is one (layer, group of G KV heads), keys and values side by
 * side, and the queries' factor block-diagonal, the m query heads of the
 * group's j-th KV head folding into diagonal block j. */
typedef struct {
  int hd;           /* a head's width */
  int G;            /* KV heads per item (calibrate --head-groups) */
  int m;            /* query heads per KV head */
  int64_t nitems;   /* items on the device */
  int64_t max_rows; /* rows per call and head */
  int elem_bytes;   /* the widest element type of the calls (2, 4 or 8) */
  int nlanes;       /* streams: item i runs on lane i modulo nlanes */
  int chunk;        /* GRAM: rows per partial Gram matrix, 0: the default (2048) */
  kqsvd_gpu_method_t method;
} kqsvd_gpu_shape_t;

/* Holds every factor (zero) of `s` on `device`, with s->nlanes streams,
 * each with two pinned staging buffers (used in turn) for one item's block
 * of up to max_rows rows, and its work space.  Errors: KQSVD_ERR_CUDA
 * naming the call, _NOMEM, _USAGE for sizes out of range. */
kqsvd_status_t kqsvd_gpu_fold_init(int device, const kqsvd_gpu_shape_t *s, kqsvd_gpu_fold_t **f);
void kqsvd_gpu_fold_free(kqsvd_gpu_fold_t **f);

/* Waits for queued work, then sets every factor from `packed` (3 nitems
 * packed upper triangles, kqsvd_tri_size(G hd) doubles each, as in a
 * checkpoint).  Errors: KQSVD_ERR_CUDA. */
kqsvd_status_t kqsvd_gpu_fold_load(kqsvd_gpu_fold_t *f, const double *packed);

/* The pinned staging buffer that the next fold_item of `item` uses, once
 * the device has copied it out of its last use: reading an item's block
 * straight into it saves fold_item a copy.  NULL when item is out of
 * range or a wait failed (fold_item then reports the failure). */
void *kqsvd_gpu_fold_stage(kqsvd_gpu_fold_t *f, int64_t item);

/* Queues one item's block of n rows per head: X holds the keys of the G
 * KV heads ([G][n][hd], type t[0]), then their G m query heads ([G m][n][hd],
 * t[1]), then the values ([G][n][hd], t[2]), back to back and row-major as
 * the caches store them; they are converted to float64 on the device.  Keys
 * and values fold as rows G hd wide (the heads side by side), each query
 * head into its KV head's diagonal block.  X is host memory (copied to
 * pinned memory unless it is the buffer fold_stage returned; reusable when
 * this returns), or, with on_device, device memory that must stay as it is
 * until fold_sync.  Calls on one item run in order; calls on items of
 * different lanes overlap.  `tag` (0 <= tag < 2^31) names the call in
 * NaN/Inf reports.  Errors: KQSVD_ERR_CUDA, _BUG. */
kqsvd_status_t kqsvd_gpu_fold_item(kqsvd_gpu_fold_t *f, int64_t item, const void *X,
                                   const kqsvd_dtype_t t[3], int64_t n, int on_device, int64_t tag);

/* Waits for all queued work.  *bad_tag gets the smallest tag whose rows
 * held a NaN or Inf (else -1) and *bad_row the first such row of its
 * block, counted over the block's heads in order (head h, row i: h n + i;
 * else -1); both are reset.  When `packed` is not NULL, the factors are
 * copied into it (packed upper triangles).  Errors: KQSVD_ERR_CUDA, _BUG. */
kqsvd_status_t kqsvd_gpu_fold_sync(kqsvd_gpu_fold_t *f, double *packed, int64_t *bad_tag,
                                   int64_t *bad_row);

/* For benchmarks: seconds per fold_item of an item's block of n rows per
 * head of random bf16 data (a fresh device and factors of shape s), over
 * `reps` calls spread over the lanes after a warm-up: *on_device with the
 * block already on the device (the fold alone), *from_host from a pinned
 * host buffer (the copy in too).  Errors: KQSVD_ERR_CUDA, _NOMEM. */
kqsvd_status_t kqsvd_gpu_fold_rate(int device, const kqsvd_gpu_shape_t *s, int64_t n, int reps,
                                   double *on_device, double *from_host);

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
 * a table; version 2 folded one factor's rows per call (fold_rows). */
#define KQSVD_GPU_ABI_VERSION 3u

/* The module's functions.  abi_version comes first and stays first in
 * every version: it is the one field the loader reads before it knows the
 * table's layout.  The module fills every pointer. */
typedef struct kqsvd_gpu_api {
  uint32_t abi_version; /* KQSVD_GPU_ABI_VERSION of the module's build */
  int (*device_count)(void);
  kqsvd_status_t (*describe)(int dev, char *buf, int n);
  kqsvd_status_t (*fold_init)(int device, const kqsvd_gpu_shape_t *s, kqsvd_gpu_fold_t **f);
  void (*fold_free)(kqsvd_gpu_fold_t **f);
  kqsvd_status_t (*fold_load)(kqsvd_gpu_fold_t *f, const double *packed);
  void *(*fold_stage)(kqsvd_gpu_fold_t *f, int64_t item);
  kqsvd_status_t (*fold_item)(kqsvd_gpu_fold_t *f, int64_t item, const void *X,
                              const kqsvd_dtype_t t[3], int64_t n, int on_device, int64_t tag);
  kqsvd_status_t (*fold_sync)(kqsvd_gpu_fold_t *f, double *packed, int64_t *bad_tag,
                              int64_t *bad_row);
  const char *(*last_error)(void);
  kqsvd_status_t (*h2d_bandwidth)(int device, size_t bytes, int reps, double *gbps);
  kqsvd_status_t (*fold_rate)(int device, const kqsvd_gpu_shape_t *s, int64_t n, int reps,
                              double *on_device, double *from_host);
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
