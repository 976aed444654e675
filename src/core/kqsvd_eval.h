/* Attention fidelity (docs/formats.md section 4): the squared Frobenius sums
 * behind err_k, err_q, err_v, err_kq and err_out for one layer, one
 * sequence and one block of its query rows, for all three methods at once.
 * All matrices are float64 and row-major.  Not collective.
 *
 * A block covers every head of the layer, because err_out sums the heads
 * before taking the norm; rows are the unit of work instead, since softmax
 * acts on each query row alone, so blocks of one sequence are independent
 * and their sums simply add up. */
#ifndef KQSVD_EVAL_H
#define KQSVD_EVAL_H

#include <stddef.h>
#include <stdint.h>

#include "kqsvd_error.h"
#include "kqsvd_solve.h"

enum { KQSVD_ERR_K = 0, KQSVD_ERR_Q, KQSVD_ERR_V, KQSVD_ERR_KQ, KQSVD_ERR_OUT, KQSVD_NMETRICS };

/* "err_k", "err_q", "err_v", "err_kq", "err_out": the report's keys. */
const char *kqsvd_metric_name(int metric);

/* ||M||^2 (den, the same for every method) and ||M - M~||^2 per method. */
typedef struct kqsvd_eval_sums {
  double den[KQSVD_NMETRICS];
  double num[KQSVD_NMETHODS][KQSVD_NMETRICS];
} kqsvd_eval_sums_t;

/* Adds b into a. */
void kqsvd_eval_sums_add(kqsvd_eval_sums_t *a, const kqsvd_eval_sums_t *b);

/* Relative error num / den of one metric; 0 when den and num are both 0
 * (nothing to approximate), 1 when only den is (M = 0 but M~ is not). */
double kqsvd_eval_ratio(const kqsvd_eval_sums_t *s, int method, int metric);

/* One layer as the evaluation sees it: projections proj[m][k] for method m
 * and k = key_down, query_down, value_down, value_up, each [Hkv][d][d] as
 * in proj.h5, cut to the ranks rank_k[m] / rank_v[m]; o_proj [D][Hq*d].
 * Where rank_k_heads[m] and rank_v_heads[m] are not NULL ([Hkv] each), KV
 * head g of method m is cut to its own ranks rank_k_heads[m][g] and
 * rank_v_heads[m][g] instead (per-head ranks, docs/formats.md 5.3). */
typedef struct kqsvd_eval_layer {
  int heads, kv_heads, d, hidden, causal;
  /* The head_dim whose root scales the scores: d, or the model's under
   * head groups, where d is the group view's G x head_dim (0: d). */
  int scale_dim;
  const double *proj[KQSVD_NMETHODS][4];
  int rank_k[KQSVD_NMETHODS], rank_v[KQSVD_NMETHODS];
  const int32_t *rank_k_heads[KQSVD_NMETHODS], *rank_v_heads[KQSVD_NMETHODS];
  const double *o_proj;
} kqsvd_eval_layer_t;

typedef struct kqsvd_eval_ws kqsvd_eval_ws_t;

/* Bytes a workspace for these sizes allocates (for memory plans). */
double kqsvd_eval_ws_bytes(int heads, int d, int hidden, int64_t max_T, int64_t block_rows);

/* Workspace for sequences of at most max_T tokens and blocks of at most
 * block_rows query rows.  Errors: KQSVD_ERR_USAGE for sizes < 1, _NOMEM. */
kqsvd_status_t kqsvd_eval_ws_init(int heads, int d, int hidden, int64_t max_T, int64_t block_rows,
                                  kqsvd_eval_ws_t **ws);
void kqsvd_eval_ws_free(kqsvd_eval_ws_t **ws);

/* Starts the block of query rows [row0, row0 + nrows) of a sequence of T
 * tokens.  `layer` must stay valid until kqsvd_eval_end.  Errors:
 * KQSVD_ERR_USAGE when the sizes exceed the workspace's. */
kqsvd_status_t kqsvd_eval_begin(kqsvd_eval_ws_t *ws, const kqsvd_eval_layer_t *layer, int64_t T,
                                int64_t row0, int64_t nrows);

/* KV group g of the block: K and V (T x d, the whole sequence) and the
 * group's m = Hq / Hkv query heads' rows of the block (m x nrows x d).
 * Adds the err_k, err_q, err_v and err_kq sums of these rows to *sums and
 * keeps the heads' attention outputs for kqsvd_eval_end.  err_kq is taken
 * over every key of the sequence, without the mask, as the contract says.
 * Errors: KQSVD_ERR_LAPACK, _BUG. */
kqsvd_status_t kqsvd_eval_group(kqsvd_eval_ws_t *ws, int g, const double *K, const double *V,
                                const double *Q, kqsvd_eval_sums_t *sums);

/* Ends the block once every group has been added: the outputs through W^O
 * give the err_out sums. */
void kqsvd_eval_end(kqsvd_eval_ws_t *ws, kqsvd_eval_sums_t *sums);

#endif
