/* The projections file (FORMATS.md section 3), written in parallel: every
 * rank writes the (layer, KV head) items it solved. */
#ifndef KQSVD_PROJ_H
#define KQSVD_PROJ_H

#include <mpi.h>
#include <stdint.h>

#include "kqsvd_h5.h"
#include "kqsvd_solve.h"

typedef struct kqsvd_proj_meta {
  kqsvd_dims_t dims;
  double eps, beta;
  int64_t tokens, shards;
  int64_t qr_block; /* extension: rows per Householder update */
} kqsvd_proj_meta_t;

typedef struct kqsvd_proj_writer kqsvd_proj_writer_t;

/* Collective over comm.  Creates `path` (the caller's temporary name) with
 * the MPI-IO driver: root attributes, the groups /kqsvd, /ksvd, /eigen and
 * /spectra and all their datasets.  Errors: KQSVD_ERR_IO naming the path,
 * _HDF5 (not collective: main() aborts). */
kqsvd_status_t kqsvd_proj_create(const char *path, MPI_Comm comm, const kqsvd_proj_meta_t *meta,
                                 kqsvd_proj_writer_t **w);

/* Not collective (independent I/O): stores one item's solution. */
kqsvd_status_t kqsvd_proj_write_item(kqsvd_proj_writer_t *w, int64_t layer, int64_t kv_head,
                                     const kqsvd_solution_t *sol);

/* Not collective; call on one rank: rank_k and rank_v ([L] each) of every
 * method group. */
kqsvd_status_t kqsvd_proj_write_ranks(kqsvd_proj_writer_t *w, const int32_t *rank_k,
                                      const int32_t *rank_v);

/* Collective: closes the file (every rank must call it, also after a
 * failure, or the others hang).  Frees *w. */
kqsvd_status_t kqsvd_proj_close(kqsvd_proj_writer_t **w);

#endif
