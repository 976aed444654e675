/* Readers of cache shards and model files (docs/formats.md sections 1 and 2). */
#ifndef KQSVD_CACHE_H
#define KQSVD_CACHE_H

#include <mpi.h>
#include <stdint.h>

#include "kqsvd_convert.h"
#include "kqsvd_error.h"
#include "kqsvd_h5.h"

typedef struct kqsvd_shard kqsvd_shard_t;

/* Opens a cache shard and validates all of it but the numbers themselves:
 * format attributes, sizes, dataset shapes and element types, and seq_lens
 * (positive, summing to T).  comm == MPI_COMM_NULL opens with the default
 * driver (not collective); otherwise with MPI-IO, collective over comm.
 * Errors: KQSVD_ERR_INPUT naming the file and field. */
kqsvd_status_t kqsvd_shard_open(const char *path, MPI_Comm comm, kqsvd_shard_t **sh);

/* Not collective.  kqsvd_shard_open and close in a child process
 * (kqsvd_h5_isolate): a file that would crash libhdf5 is refused here,
 * naming it.  Errors: as kqsvd_shard_open. */
kqsvd_status_t kqsvd_shard_check(const char *path);

/* Closes (collective when opened with a communicator). */
void kqsvd_shard_close(kqsvd_shard_t **sh);

const kqsvd_dims_t *kqsvd_shard_dims(const kqsvd_shard_t *sh);
const char *kqsvd_shard_path(const kqsvd_shard_t *sh);
int64_t kqsvd_shard_tokens(const kqsvd_shard_t *sh);          /* T */
int64_t kqsvd_shard_sequences(const kqsvd_shard_t *sh);       /* S */
const int64_t *kqsvd_shard_seq_lens(const kqsvd_shard_t *sh); /* [S] */
kqsvd_dtype_t kqsvd_shard_dtype(const kqsvd_shard_t *sh, kqsvd_tensor_t t);
/* The extension attribute `rope` (docs/formats.md 5.6), checked by the
 * open: "pre" (keys and queries taken before RoPE), "post", or "" when
 * the file has none, which means "post". */
const char *kqsvd_shard_rope(const kqsvd_shard_t *sh);

/* Not collective (independent I/O).  Reads the raw elements
 * tensor[layer][head0 .. head0+nheads)[row0 .. row0+nrows)[:] into buf
 * (nheads x nrows x d elements of kqsvd_shard_dtype).  Errors: _HDF5. */
kqsvd_status_t kqsvd_shard_read(kqsvd_shard_t *sh, kqsvd_tensor_t t, int64_t layer, int64_t head0,
                                int64_t nheads, int64_t row0, int64_t nrows, void *buf);

typedef struct kqsvd_model kqsvd_model_t;

/* Opens and validates a model file (format, sizes, o_proj [L, D, Hq*d]),
 * its headers read first in a child process (kqsvd_h5_isolate).
 * Not collective.  Errors: KQSVD_ERR_INPUT naming the file and field. */
kqsvd_status_t kqsvd_model_open(const char *path, kqsvd_model_t **m);
void kqsvd_model_close(kqsvd_model_t **m);
const kqsvd_dims_t *kqsvd_model_dims(const kqsvd_model_t *m);
kqsvd_dtype_t kqsvd_model_dtype(const kqsvd_model_t *m);
const char *kqsvd_model_rope(const kqsvd_model_t *m); /* as kqsvd_shard_rope */

/* Not collective.  Reads the raw block o_proj[layer][row0 .. row0+nrows,
 * col0 .. col0+ncols) into buf (nrows x ncols, row-major).  Errors: _HDF5. */
kqsvd_status_t kqsvd_model_read_oproj(kqsvd_model_t *m, int64_t layer, int64_t row0, int64_t nrows,
                                      int64_t col0, int64_t ncols, void *buf);

#endif
