/* The accumulator's internals for the rest of the library (calibrate's
 * pipeline and kqsvd_acc_finish): its packed state, not part of the public
 * API.  None of these is collective. */
#ifndef KQSVD_ACC_INTERNAL_H
#define KQSVD_ACC_INTERNAL_H

#include <stdint.h>

#include "kqsvd/accumulator.h"
#include "kqsvd_error.h"

/* Doubles in the K, Q, V state: layers x kv_heads items of 3 packed d x d
 * triangles (K, Q, V), item = layer * kv_heads + kv_head; the state itself
 * (Gram matrices' upper triangles under KQSVD_QR_GRAM), up to date (the
 * item being fed is packed back first).  Writing into it is allowed (a
 * checkpoint's factors, the GPU's) while no item is being fed. */
int64_t kqsvd_acc_state_doubles(const kqsvd_acc_t *acc);
double *kqsvd_acc_state(kqsvd_acc_t *acc);
/* The W^T factors: one packed triangle per item. */
const double *kqsvd_acc_wstate(const kqsvd_acc_t *acc);
/* The items' shape: the model's, or its group view under head_groups G
 * (kv_heads / G heads of head_dim G d, group G query heads each). */
const kqsvd_shape_t *kqsvd_acc_shape(const kqsvd_acc_t *acc);
int64_t kqsvd_acc_head_groups(const kqsvd_acc_t *acc);
const kqsvd_acc_options_t *kqsvd_acc_options(const kqsvd_acc_t *acc);
/* Forgets the rows given to the current item since it became current (the
 * item whose rows arrived last): calibrate stops mid-item this way, so
 * that a checkpoint resumes at the item's start. */
void kqsvd_acc_discard(kqsvd_acc_t *acc);
/* The row of the NaN or Inf that made the last absorb fail, else -1
 * (calibrate names the shard and the row within it). */
int64_t kqsvd_acc_bad_row(const kqsvd_acc_t *acc);
/* Folds W^T's rows of KV group g of `layer`: nrows rows of o_proj, each
 * starting with the group's m d columns (row_stride elements apart).
 * The W factors are not reduced; calibrate computes only the groups its
 * rank solves.  A NaN or Inf leaves the factor unchanged and sets
 * kqsvd_acc_bad_row (row * m + head within the group) without failing.
 * Errors: KQSVD_ERR_NOMEM, _BUG. */
kqsvd_status_t kqsvd_acc_absorb_wt(kqsvd_acc_t *acc, int64_t layer, int64_t g, const void *cols,
                                   kqsvd_dtype_t type, int64_t nrows, int64_t row_stride);
/* o_proj rows absorbed into `layer` (hidden when complete). */
int64_t kqsvd_acc_oproj_rows(const kqsvd_acc_t *acc, int64_t layer);

#endif
