/* The GPU lane of calibrate's streaming stage: the factors of this rank's
 * items (R factors, or Gram matrices under --qr gram) live on its GPU (the
 * CUDA module, loaded on demand), every block read is queued there whole,
 * read straight into a pinned staging buffer, and the factors come back to
 * c->state at every checkpoint and at the end.  Calls since the last sync are
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
  int64_t item, row0, n;
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
  /* Two lanes: while one item's block is copied in, the last one folds.
   * KQSVD_GPU_GRAM_CHUNK (benchmarks) sets the Gram method's chunk. */
  const char *chunk = getenv("KQSVD_GPU_GRAM_CHUNK");
  const kqsvd_gpu_shape_t shape = {(int)c->hd,
                                   (int)c->G,
                                   (int)c->m,
                                   c->nitems,
                                   c->io_rows,
                                   (int)c->elem_max,
                                   2,
                                   chunk ? atoi(chunk) : 0,
                                   c->cfg.qr == KQSVD_CALIB_QR_GRAM ? KQSVD_GPU_GRAM
                                                                    : KQSVD_GPU_QR};
  c->gpu = calloc(1, sizeof *c->gpu);
  KQSVD_CHECK(c->gpu, KQSVD_ERR_NOMEM, "cannot allocate the GPU state");
  KQSVD_CALL(kqsvd_gpu_open(&c->gpu->api));
  GPU_CALL(c->gpu, c->gpu->api->fold_init(device, &shape, &c->gpu->fold));
  GPU_CALL(c->gpu, c->gpu->api->fold_load(c->gpu->fold, c->state));
done:
  return st;
}

char *calib_gpu_buffer(calib_t *c, int64_t item) {
  /* The wait for the buffer is the device's copy and fold of an earlier
   * block: fold time, as --timings reports it. */
  const double t0 = kqsvd_now();
  char *p = (char *)c->gpu->api->fold_stage(c->gpu->fold, item);
  c->t_fold += kqsvd_now() - t0;
  return p ? p : c->raw; /* fold_item reports what failed */
}

kqsvd_status_t calib_gpu_fold_read(calib_t *c, const kqsvd_shard_t *sh, int64_t item, int64_t r0,
                                   int64_t n, const char *block) {
  kqsvd_status_t st = KQSVD_OK;
  struct calib_gpu *g = c->gpu;
  const kqsvd_dtype_t t[3] = {kqsvd_shard_dtype(sh, KQSVD_KEYS),
                              kqsvd_shard_dtype(sh, KQSVD_QUERIES),
                              kqsvd_shard_dtype(sh, KQSVD_VALUES)};
  const double w = (double)c->d, hd = (double)c->hd;
  /* --timings: the device works while the next block is read, so the
   * host's share (staging, queueing) is counted here and the waits in
   * calib_gpu_sync; together they are the fold time the CPU path reports. */
  const double t0 = kqsvd_now();
  if (g->ncalls == g->cap) {
    const int64_t cap = g->cap ? 2 * g->cap : 1024;
    gpu_call_t *grown = realloc(g->calls, (size_t)cap * sizeof *grown);
    KQSVD_CHECK(grown, KQSVD_ERR_NOMEM, "cannot grow the GPU call list");
    g->calls = grown, g->cap = cap;
  }
  g->calls[g->ncalls] = (gpu_call_t){kqsvd_shard_path(sh), item, r0, n};
  GPU_CALL(g, g->api->fold_item(g->fold, item, block, t, n, 0, g->ncalls));
  g->ncalls++;
  /* As the CPU path counts: keys and values once each (whole rows of the
   * group), every query head once. */
  c->rows_folded += (double)((2 + c->group) * n);
  c->flops_folded += 2.0 * (double)n * (2.0 * w * w + (double)c->group * hd * hd);
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
    /* The block's heads in order: G keys, G m queries, G values. */
    const gpu_call_t *k = &g->calls[tag];
    const int64_t G = c->G, h = row / k->n, i = row % k->n;
    const int64_t g0 = (k->item % c->dims.kv_heads) * G, layer = k->item / c->dims.kv_heads;
    const kqsvd_tensor_t t = h < G ? KQSVD_KEYS : h < G + c->group ? KQSVD_QUERIES : KQSVD_VALUES;
    const int64_t head = h < G              ? g0 + h
                         : h < G + c->group ? g0 * c->m + h - G
                                            : g0 + h - G - c->group;
    KQSVD_FAIL(KQSVD_ERR_DATA, "%s: dataset '%s': NaN or Inf at layer %lld, head %lld, row %lld",
               k->path, kqsvd_tensor_name(t), (long long)layer, (long long)head,
               (long long)(k->row0 + i));
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
