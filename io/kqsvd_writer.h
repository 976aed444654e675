/* Writers of cache shards and model files (docs/formats.md sections 1 and 2),
 * used by `kqsvd synth` and the tests.  Not collective.  Files are written
 * under "<path>.tmp" and renamed by kqsvd_writer_commit, so a failed or
 * killed run never leaves a partial file under the final name. */
#ifndef KQSVD_WRITER_H
#define KQSVD_WRITER_H

#include <stdint.h>

#include "kqsvd_cache.h"

typedef struct kqsvd_writer kqsvd_writer_t;

/* A cache shard of T = sum(seq_lens) tokens; datasets of element type t. */
kqsvd_status_t kqsvd_cache_create(const char *path, const kqsvd_dims_t *dims, kqsvd_dtype_t t,
                                  int64_t nseq, const int64_t *seq_lens, kqsvd_writer_t **w);
/* A model file holding o_proj [L, D, Hq*d]. */
kqsvd_status_t kqsvd_model_create(const char *path, const kqsvd_dims_t *dims, kqsvd_dtype_t t,
                                  kqsvd_writer_t **w);

/* Writes rows row0 .. row0+nrows of tensor[layer][head] from float64
 * (rounded to the element type).  Errors: _HDF5, _NOMEM. */
kqsvd_status_t kqsvd_cache_put(kqsvd_writer_t *w, kqsvd_tensor_t t, int64_t layer, int64_t head,
                               int64_t row0, int64_t nrows, const double *rows);
/* Writes rows row0 .. row0+nrows of o_proj[layer] (each Hq*d wide). */
kqsvd_status_t kqsvd_model_put_oproj(kqsvd_writer_t *w, int64_t layer, int64_t row0, int64_t nrows,
                                     const double *rows);

/* Closes and renames to the final path; frees *w either way. */
kqsvd_status_t kqsvd_writer_commit(kqsvd_writer_t **w);
/* Closes and deletes the temporary file. */
void kqsvd_writer_abort(kqsvd_writer_t **w);

#endif
