/* State shared by the stages of an evaluation (private to src/pipeline). */
#ifndef KQSVD_EVALUATE_H
#define KQSVD_EVALUATE_H

#include <stdint.h>

#include "kqsvd_cache.h"
#include "kqsvd_eval.h"
#include "kqsvd_mpi.h"
#include "kqsvd_pipeline.h"
#include "kqsvd_proj.h"
#include "kqsvd_rank.h"

typedef struct evaluation {
  kqsvd_ctx_t ctx;
  const kqsvd_observer_t *obs;
  kqsvd_eval_config_t cfg;
  int64_t block_rows; /* cfg's, or fewer to fit cfg.mem_mib */
  /* inputs */
  kqsvd_model_t *model;
  kqsvd_proj_reader_t *proj;
  /* The items' shape: the model's, or under a head-groups file (G > 1)
   * its group view, whose K and V rows are a group's G heads side by side
   * and whose query rows and o_proj blocks are padded to G hd (hd: the
   * model's head_dim). */
  kqsvd_dims_t dims;
  int64_t d, group, nseq, tokens, max_T;
  int64_t G, hd;
  int64_t *seq_shard, *seq_off, *seq_len; /* [nseq]: shard, first row, length */
  size_t elem_max;                        /* widest element type of the inputs */
  int32_t *rank_k, *rank_v;               /* [KQSVD_NMETHODS][L] */
  /* The stored per-head ranks, [KQSVD_NMETHODS][L][Hkv], of the methods
   * with has_heads[m]; NULL when none has them or under --ranks. */
  int32_t *head_k, *head_v;
  int has_heads[KQSVD_NMETHODS];
  char policy[96];
  /* plan: work units are (layer, sequence, block of query rows) in that
   * order; this rank takes the contiguous range [u0, u1) */
  int64_t nunits, u0, u1;
  double mem_need, layer_cost; /* the cost of one layer's units */
  /* results on rank 0: [KQSVD_NMETHODS][L][KQSVD_NMETRICS] */
  double *err;
} evaluation_t;

/* Number of blocks of a sequence and the cost of one, in arbitrary units
 * proportional to floating-point work (the same on every rank). */
int64_t eval_blocks(const evaluation_t *e, int64_t len);
double eval_unit_cost(const evaluation_t *e, int64_t len, int64_t blk);

/* The evaluation proper: every rank runs its units, and the per-sequence
 * errors are combined on rank 0 into e->err.  Collective. */
kqsvd_status_t eval_run(evaluation_t *e);

#endif
