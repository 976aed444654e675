/* State shared by the stages of a calibration (private to src/pipeline). */
#ifndef KQSVD_CALIBRATE_H
#define KQSVD_CALIBRATE_H

#include <limits.h>
#include <stdint.h>

#include "kqsvd_acc.h"
#include "kqsvd_cache.h"
#include "kqsvd_checkpoint.h"
#include "kqsvd_mpi.h"
#include "kqsvd_pipeline.h"
#include "kqsvd_rank.h"

/* R factors kept per (layer, KV group), in this order in the state. */
enum { CAL_RK = 0, CAL_RQ = 1, CAL_RV = 2, CAL_NR = 3 };

typedef struct calib {
  kqsvd_ctx_t ctx;
  const kqsvd_observer_t *obs; /* where the run reports: notes, results, progress */
  kqsvd_calib_config_t cfg;    /* a copy: a manifest sets each model's paths */
  /* inputs */
  kqsvd_model_t *model;
  /* The items' shape.  With --head-groups G > 1, the model's group view:
   * dims.kv_heads / G KV heads of head_dim G d and G m query heads each (d,
   * group and nitems likewise), while the caches are read per head of hd
   * elements, m query heads per KV head. */
  kqsvd_dims_t dims;
  int64_t d, group, nitems, tokens, sequences;
  int64_t seq_max; /* the longest sequence, written as the output's seq_len */
  int64_t G, hd, m;
  int64_t *shard_rows; /* T of each shard */
  size_t elem_max;     /* widest element type among the inputs */
  /* plan */
  kqsvd_segment_t *segs;
  int64_t *seg_first; /* rank p: segs[seg_first[p] .. seg_first[p+1]) */
  int64_t io_rows;    /* rows per read, a multiple of qr_block */
  int64_t own0, own1; /* items this rank solves */
  uint64_t fingerprint;
  char inputs_hash[32]; /* written to the output: what a manifest run may skip */
  char rope[32];        /* the model file's `rope` attribute, "" when absent */
  char about[256];
  /* working state: the accumulator (include/kqsvd/accumulator.h) holds the
   * factors; state is its packed K, Q, V state (kqsvd_acc_state), read and
   * written as a whole by checkpoints, the GPU lane, pdgeqrf and the
   * reduction, and folded into row by row by the accumulator itself */
  kqsvd_acc_t *acc;
  double *state; /* nitems x CAL_NR packed triangles */
  char *raw;     /* (group + 2 G) x io_rows x hd elements */
  char *joint;   /* qr_block x d elements: a grouped block's rows side by side */
  kqsvd_checkpoint_pos_t pos;
  int32_t *rank_k, *rank_v; /* [KQSVD_NMETHODS][L], rank 0 */
  int device;               /* -1: CPU; else the GPU that folds this rank's rows */
  struct calib_gpu *gpu;
  double t_start, t_stream, streamed; /* streamed: tokens read by this run */
  /* --timings: this rank's seconds reading shards and folding rows (QR,
   * SYRK or pdgeqrf), bytes read and rows folded; reduce and solve stages */
  double t_read, t_fold, bytes_read, rows_folded, t_reduce, t_solve;
  double flops_folded; /* 2 w^2 per row of width w, where rows differ in width (head groups) */
} calib_t;

/* Not collective: the rows of rank p's segments (the plan is the same on
 * every rank). */
int64_t calib_rank_rows(const calib_t *c, int p);

/* One model from validated options to its written output, and every model
 * of a manifest in turn; collective, ending in agreement.  calib_model
 * frees what it allocated, so `c` may serve the next model. */
kqsvd_status_t calib_model(calib_t *c);
kqsvd_status_t calib_manifest(calib_t *c);

/* Not collective: a hash of the model and shard files (path, size, time),
 * the rank policy and beta, as hex in c->inputs_hash. */
void calib_inputs_hash(calib_t *c);

/* Not collective (call on one rank): whether c->out_path exists and holds
 * the inputs_hash of these inputs, so that it need not be made again. */
int calib_up_to_date(const calib_t *c);

/* The GPU lane of the streaming stage (calib_gpu.c); not collective.
 * calib_gpu_devices() is 0 without CUDA.  start() moves c->state to the
 * device; buffer() is where the next block of `item` is best read (a
 * pinned staging buffer, else c->raw); fold_read() queues the block just
 * read there (keys, queries, values as stream_item reads them); sync()
 * waits, reports a NaN or Inf like the CPU path (KQSVD_ERR_DATA) and, with
 * to_state, brings the factors back into c->state; stop() frees. */
int calib_gpu_devices(void);
kqsvd_status_t calib_gpu_start(calib_t *c, int device);
char *calib_gpu_buffer(calib_t *c, int64_t item);
kqsvd_status_t calib_gpu_fold_read(calib_t *c, const kqsvd_shard_t *sh, int64_t item, int64_t r0,
                                   int64_t n, const char *block);
kqsvd_status_t calib_gpu_sync(calib_t *c, int to_state);
void calib_gpu_stop(calib_t *c);

/* Stages, each collective over ctx.comm and ending in agreement.
 * calib_stream_pqr is the streaming stage of --qr scalapack: for each item
 * and tensor, every rank reads all its rows into memory, then pdgeqrf. */
kqsvd_status_t calib_stream(calib_t *c);
kqsvd_status_t calib_stream_pqr(calib_t *c);
kqsvd_status_t calib_finish(calib_t *c);

#endif
