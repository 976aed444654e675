/* State shared by the stages of `kqsvd evaluate` (private to src/cli). */
#ifndef KQSVD_EVALUATE_H
#define KQSVD_EVALUATE_H

#include <stdint.h>

#include "kqsvd_cache.h"
#include "kqsvd_cli.h"
#include "kqsvd_eval.h"
#include "kqsvd_mpi.h"
#include "kqsvd_proj.h"
#include "kqsvd_rank.h"

typedef struct evaluation {
  kqsvd_cli_t *cli;
  /* options */
  const char *model_path, *proj_path, *json_path;
  kqsvd_rank_policy_t ranks;
  int ranks_set, block_set, nshards, help, allow_mismatch;
  int64_t block_rows;
  kqsvd_run_opts_t run;
  char **shards;
  /* inputs */
  kqsvd_model_t *model;
  kqsvd_proj_reader_t *proj;
  kqsvd_dims_t dims;
  int64_t d, group, nseq, tokens, max_T;
  int64_t *seq_shard, *seq_off, *seq_len; /* [nseq]: shard, first row, length */
  size_t elem_max;                        /* widest element type of the inputs */
  int32_t *rank_k, *rank_v;               /* [KQSVD_NMETHODS][L] */
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
