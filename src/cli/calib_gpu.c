/* The GPU lane of calibrate's streaming stage (built with KQSVD_CUDA): the
 * R factors of this rank's items live on its GPU, every block read is
 * queued there whole, and the factors come back to c->state at every
 * checkpoint and at the end.  Calls since the last sync are remembered so
 * that a NaN found on the device is reported like the CPU path does. */
#include <stdio.h>
#include <stdlib.h>

#include "calibrate.h"
#ifdef KQSVD_HAVE_CUDA
#include "kqsvd_gpu.h"
#endif

/* What one queued call was, for messages. */
typedef struct {
  const char *path;
  int64_t item, row0, head;
  kqsvd_tensor_t tensor;
} gpu_call_t;

struct calib_gpu {
#ifdef KQSVD_HAVE_CUDA
  kqsvd_gpu_fold_t *fold;
#endif
  gpu_call_t *calls;
  int64_t ncalls, cap;
};

int calib_gpu_devices(void) {
#ifdef KQSVD_HAVE_CUDA
  return kqsvd_gpu_device_count();
#else
  return 0;
#endif
}

kqsvd_status_t calib_gpu_start(calib_t *c, int device) {
  kqsvd_status_t st = KQSVD_OK;
#ifdef KQSVD_HAVE_CUDA
  c->gpu = calloc(1, sizeof *c->gpu);
  KQSVD_CHECK(c->gpu, KQSVD_ERR_NOMEM, "cannot allocate the GPU state");
  KQSVD_CALL(kqsvd_gpu_fold_init(device, (int)c->d, c->nitems * CAL_NR, c->io_rows, 4,
                                 &c->gpu->fold));
  KQSVD_CALL(kqsvd_gpu_fold_load(c->gpu->fold, c->state));
#else
  (void)device;
  KQSVD_FAIL(KQSVD_ERR_USAGE, "this kqsvd was built without CUDA (configure with -DKQSVD_CUDA=ON)");
#endif
done:
  return st;
}

kqsvd_status_t calib_gpu_fold_read(calib_t *c, const kqsvd_shard_t *sh, int64_t item,
                                   int64_t r0, int64_t n) {
  kqsvd_status_t st = KQSVD_OK;
#ifdef KQSVD_HAVE_CUDA
  struct calib_gpu *g = c->gpu;
  const int64_t d = c->d, m = c->group;
  const kqsvd_tensor_t tens[3] = {KQSVD_KEYS, KQSVD_QUERIES, KQSVD_VALUES};
  const int target[3] = {CAL_RK, CAL_RQ, CAL_RV};
  const int64_t heads[3] = {1, m, 1};
  const char *base = c->raw;
  for (int t = 0; t < 3; t++) {
    const kqsvd_dtype_t type = kqsvd_shard_dtype(sh, tens[t]);
    const size_t esz = kqsvd_dtype_size(type);
    for (int64_t h = 0; h < heads[t]; h++) {
      if (g->ncalls == g->cap) {
        const int64_t cap = g->cap ? 2 * g->cap : 1024;
        gpu_call_t *grown = realloc(g->calls, (size_t)cap * sizeof *grown);
        KQSVD_CHECK(grown, KQSVD_ERR_NOMEM, "cannot grow the GPU call list");
        g->calls = grown, g->cap = cap;
      }
      g->calls[g->ncalls] = (gpu_call_t){kqsvd_shard_path(sh), item, r0, h, tens[t]};
      KQSVD_CALL(kqsvd_gpu_fold_rows(g->fold, item * CAL_NR + target[t],
                                     base + (size_t)(h * n * d) * esz, type, n, g->ncalls));
      g->ncalls++;
    }
    base += (size_t)(heads[t] * n * d) * esz;
  }
#else
  (void)c, (void)sh, (void)item, (void)r0, (void)n;
  KQSVD_FAIL(KQSVD_ERR_BUG, "GPU path without CUDA");
#endif
done:
  return st;
}

kqsvd_status_t calib_gpu_sync(calib_t *c, int to_state) {
  kqsvd_status_t st = KQSVD_OK;
#ifdef KQSVD_HAVE_CUDA
  struct calib_gpu *g = c->gpu;
  int64_t tag = -1, row = -1;
  KQSVD_CALL(kqsvd_gpu_fold_sync(g->fold, to_state ? c->state : NULL, &tag, &row));
  if (tag >= 0 && tag < g->ncalls) {
    const gpu_call_t *k = &g->calls[tag];
    const int64_t grp = k->item % c->dims.kv_heads;
    KQSVD_FAIL(KQSVD_ERR_DATA, "%s: dataset '%s': NaN or Inf at layer %lld, head %lld, row %lld",
               k->path, kqsvd_tensor_name(k->tensor), (long long)(k->item / c->dims.kv_heads),
               (long long)(k->tensor == KQSVD_QUERIES ? grp * c->group + k->head : grp),
               (long long)(k->row0 + row));
  }
  g->ncalls = 0;
#else
  (void)c, (void)to_state;
  goto done;
#endif
done:
  return st;
}

void calib_gpu_stop(calib_t *c) {
  if (!c->gpu) return;
#ifdef KQSVD_HAVE_CUDA
  kqsvd_gpu_fold_free(&c->gpu->fold);
#endif
  free(c->gpu->calls);
  free(c->gpu);
  c->gpu = NULL;
}
