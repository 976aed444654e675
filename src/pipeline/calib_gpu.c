/* The GPU lane of calibrate's streaming stage: the R factors of this rank's
 * items live on its GPU (the CUDA module, loaded on demand), every block
 * read is queued there whole, and the factors come back to c->state at
 * every checkpoint and at the end.  Calls since the last sync are
 * remembered so that a NaN found on the device is reported like the CPU
 * path does. */
#include <stdio.h>
#include <stdlib.h>

#include "calib.h"
#include "kqsvd_gpu.h"
#include "kqsvd_util.h"

/* What one queued call was, for messages. */
typedef struct {
  const char *path;
  int64_t item, row0, head;
  kqsvd_tensor_t tensor;
} gpu_call_t;

struct calib_gpu {
  const kqsvd_gpu_api_t *api;
  kqsvd_gpu_fold_t *fold;
  gpu_call_t *calls;
  int64_t ncalls, cap;
};

/* A failure inside the module: its message, here. */
#define GPU_CALL(g, call)                                                  \
  do {                                                                     \
    kqsvd_status_t s_ = (call);                                            \
    if (s_ != KQSVD_OK) KQSVD_FAIL(s_, "GPU: %s", (g)->api->last_error()); \
  } while (0)

int calib_gpu_devices(void) { return kqsvd_gpu_driver_devices(); }

kqsvd_status_t calib_gpu_start(calib_t *c, int device) {
  kqsvd_status_t st = KQSVD_OK;
  c->gpu = calloc(1, sizeof *c->gpu);
  KQSVD_CHECK(c->gpu, KQSVD_ERR_NOMEM, "cannot allocate the GPU state");
  KQSVD_CALL(kqsvd_gpu_open(&c->gpu->api));
  GPU_CALL(c->gpu, c->gpu->api->fold_init(device, (int)c->d, c->nitems * CAL_NR, c->io_rows,
                                          (int)c->elem_max, 4, &c->gpu->fold));
  GPU_CALL(c->gpu, c->gpu->api->fold_load(c->gpu->fold, c->state));
done:
  return st;
}

kqsvd_status_t calib_gpu_fold_read(calib_t *c, const kqsvd_shard_t *sh, int64_t item, int64_t r0,
                                   int64_t n) {
  kqsvd_status_t st = KQSVD_OK;
  struct calib_gpu *g = c->gpu;
  const int64_t d = c->d, m = c->group;
  const kqsvd_tensor_t tens[3] = {KQSVD_KEYS, KQSVD_QUERIES, KQSVD_VALUES};
  const int target[3] = {CAL_RK, CAL_RQ, CAL_RV};
  const int64_t heads[3] = {1, m, 1};
  const char *base = c->raw;
  /* --timings: the device works while the next block is read, so the
   * host's share (staging, queueing) is counted here and the waits in
   * calib_gpu_sync; together they are the fold time the CPU path reports. */
  const double t0 = kqsvd_now();
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
      GPU_CALL(g, g->api->fold_rows(g->fold, item * CAL_NR + target[t],
                                    base + (size_t)(h * n * d) * esz, type, n, g->ncalls));
      g->ncalls++;
      c->rows_folded += (double)n;
    }
    base += (size_t)(heads[t] * n * d) * esz;
  }
done:
  c->t_fold += kqsvd_now() - t0;
  return st;
}

kqsvd_status_t calib_gpu_sync(calib_t *c, int to_state) {
  kqsvd_status_t st = KQSVD_OK;
  struct calib_gpu *g = c->gpu;
  int64_t tag = -1, row = -1;
  const double t0 = kqsvd_now();
  GPU_CALL(g, g->api->fold_sync(g->fold, to_state ? c->state : NULL, &tag, &row));
  c->t_fold += kqsvd_now() - t0;
  KQSVD_CHECK(tag < g->ncalls, KQSVD_ERR_BUG, "GPU NaN report names call %lld of %lld",
              (long long)tag, (long long)g->ncalls);
  if (tag >= 0) {
    const gpu_call_t *k = &g->calls[tag];
    const int64_t grp = k->item % c->dims.kv_heads;
    KQSVD_FAIL(KQSVD_ERR_DATA, "%s: dataset '%s': NaN or Inf at layer %lld, head %lld, row %lld",
               k->path, kqsvd_tensor_name(k->tensor), (long long)(k->item / c->dims.kv_heads),
               (long long)(k->tensor == KQSVD_QUERIES ? grp * c->group + k->head : grp),
               (long long)(k->row0 + row));
  }
  g->ncalls = 0;
done:
  return st;
}

void calib_gpu_stop(calib_t *c) {
  if (!c->gpu) return;
  if (c->gpu->api && c->gpu->fold) c->gpu->api->fold_free(&c->gpu->fold);
  free(c->gpu->calls);
  free(c->gpu);
  c->gpu = NULL;
}
