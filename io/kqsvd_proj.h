/* The projections file (docs/formats.md section 3), written in parallel: every
 * rank writes the (layer, KV head) items it solved. */
#ifndef KQSVD_PROJ_H
#define KQSVD_PROJ_H

#include <mpi.h>
#include <stdint.h>

#include "kqsvd_h5.h"
#include "kqsvd_solve.h"

typedef struct kqsvd_proj_meta {
  kqsvd_dims_t dims;
  double eps, beta; /* eps is NaN when the ranks came from another policy */
  int64_t tokens, shards;
  int64_t qr_block;        /* extension: rows per Householder update */
  const char *rank_policy; /* extension: the policy that chose the ranks */
  const char *inputs_hash; /* extension: what calibrate --manifest compares */
  const char *rope;        /* extension: "pre" or "post", where the caches' keys were
                              taken (docs/formats.md 5.3); NULL: no attribute */
  int64_t head_groups;     /* extension: G > 1 for head-group projections, whose
                              dims are the model's group view; 0 or 1: none */
  int64_t seq_len;         /* extension: the longest calibration sequence in
                              tokens; 0: unknown, no attribute */
} kqsvd_proj_meta_t;

typedef struct kqsvd_proj_writer kqsvd_proj_writer_t;

/* Collective over comm.  Creates `path` (the caller's temporary name) with
 * the MPI-IO driver (or, for comm == MPI_COMM_NULL, HDF5's default one, by
 * one process without MPI): root attributes, the groups /kqsvd, /ksvd, /eigen and
 * /spectra and all their datasets.  Errors: KQSVD_ERR_IO naming the path,
 * _HDF5 (not collective: main() aborts). */
kqsvd_status_t kqsvd_proj_create(const char *path, MPI_Comm comm, const kqsvd_proj_meta_t *meta,
                                 kqsvd_proj_writer_t **w);

/* Not collective.  Bytes a projections file of these sizes takes: every
 * dataset plus an allowance for HDF5's metadata. */
int64_t kqsvd_proj_size_estimate(const kqsvd_dims_t *dims);

/* Not collective; call on one rank, right after kqsvd_proj_create.  Makes
 * the file system allocate kqsvd_proj_size_estimate bytes for it now, so
 * that no write, and above all not the collective metadata flush inside
 * the final close, can fail on a full disk (one rank failing inside
 * H5Fclose leaves the others waiting there forever).  Errors:
 * KQSVD_ERR_IO naming `final_path` (the name the user gave) and the space
 * needed and free. */
kqsvd_status_t kqsvd_proj_reserve(const kqsvd_proj_writer_t *w, const char *final_path);

/* Not collective; call on one rank after a successful kqsvd_proj_close:
 * gives back what the reservation held beyond the file's end.  Errors:
 * KQSVD_ERR_IO, _HDF5. */
kqsvd_status_t kqsvd_proj_trim(const char *path);

/* Not collective (independent I/O): stores one item's solution. */
kqsvd_status_t kqsvd_proj_write_item(kqsvd_proj_writer_t *w, int64_t layer, int64_t kv_head,
                                     const kqsvd_solution_t *sol);

/* Not collective; call on one rank: rank_k and rank_v, [KQSVD_NMETHODS][L]
 * each, into the method groups. */
kqsvd_status_t kqsvd_proj_write_ranks(kqsvd_proj_writer_t *w, const int32_t *rank_k,
                                      const int32_t *rank_v);

/* Collective: closes the file (every rank must call it, also after a
 * failure, or the others hang).  Frees *w. */
kqsvd_status_t kqsvd_proj_close(kqsvd_proj_writer_t **w);

/* Reading a projections file (not collective: each rank opens its own
 * handle with the default driver; the file is small). */
typedef struct kqsvd_proj_reader kqsvd_proj_reader_t;

/* Opens `path` and checks the header and that every dataset of the
 * contract is there with its shape and kind (float or integer), and the
 * per-head ranks extension where present (both of the pair, shape); the
 * headers are read in a child process first (kqsvd_h5_isolate).  Errors:
 * KQSVD_ERR_INPUT naming the file and what is wrong. */
kqsvd_status_t kqsvd_proj_open(const char *path, kqsvd_proj_reader_t **r);
void kqsvd_proj_reader_free(kqsvd_proj_reader_t **r);

/* The header (causal is not part of it: set to -1), and attributes: beta
 * of /eigen, eps, tokens, and the rank_policy extension ("" if absent). */
const kqsvd_dims_t *kqsvd_proj_dims(const kqsvd_proj_reader_t *r);
double kqsvd_proj_beta(const kqsvd_proj_reader_t *r);
double kqsvd_proj_eps(const kqsvd_proj_reader_t *r);
int64_t kqsvd_proj_tokens(const kqsvd_proj_reader_t *r);
const char *kqsvd_proj_policy(const kqsvd_proj_reader_t *r);
/* The head_groups extension attribute (1 when absent): G > 1 means the
 * file's dims are the group view of a model with num_kv_heads x G KV heads
 * of head_dim / G (docs/formats.md 5.3); kqsvd_proj_open has checked that
 * G divides head_dim. */
int64_t kqsvd_proj_head_groups(const kqsvd_proj_reader_t *r);

/* Reads float64 dataset group/name ("kqsvd"/"key_down", "spectra"/"K"):
 * the whole of it for layer < 0, else layer `layer` ([Hkv][d][d] or
 * [Hkv][d]).  Errors: KQSVD_ERR_DATA naming the file, dataset and layer
 * when a value is NaN or Inf; _HDF5. */
kqsvd_status_t kqsvd_proj_read(kqsvd_proj_reader_t *r, const char *group, const char *name,
                               int64_t layer, double *buf);

/* Reads a method's rank_k and rank_v ([L] each) and checks 1 <= r <= d.
 * Errors: KQSVD_ERR_INPUT, _HDF5. */
kqsvd_status_t kqsvd_proj_read_ranks(kqsvd_proj_reader_t *r, kqsvd_method_t m, int32_t *rank_k,
                                     int32_t *rank_v);

/* Whether method m's group holds per-(layer, KV head) ranks, the extension
 * datasets rank_k_heads and rank_v_heads (docs/formats.md 5.3).
 * kqsvd_proj_open has checked that they come in pairs with shape [L, Hkv]
 * and integer elements. */
int kqsvd_proj_has_head_ranks(const kqsvd_proj_reader_t *r, kqsvd_method_t m);

/* Reads a method's per-head ranks ([L][Hkv] each; the method must have
 * them) and checks 1 <= r <= d and that rank_k / rank_v of each layer
 * equal the largest of its heads' ranks.  Errors: KQSVD_ERR_INPUT naming
 * the file and dataset, those of kqsvd_proj_read_ranks, _NOMEM, _HDF5. */
kqsvd_status_t kqsvd_proj_read_head_ranks(kqsvd_proj_reader_t *r, kqsvd_method_t m,
                                          int32_t *rank_k_heads, int32_t *rank_v_heads);

#endif
