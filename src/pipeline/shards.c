/* The header scan that calibrate and evaluate share: every shard is opened
 * once, by one rank, and what the plan needs is shared with all. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kqsvd_pipeline.h"

void kqsvd_shard_set_free(kqsvd_shard_set_t *set) {
  free(set->rows);
  free(set->seqs);
  free(set->seq_lens);
  memset(set, 0, sizeof *set);
}

/* A rope attribute as it reads: none means keys after RoPE. */
static const char *rope_or_post(const char *rope) { return *rope ? rope : "post"; }

/* This rank's shards: validate, count, keep their sequence lengths. */
static kqsvd_status_t scan_own(const kqsvd_ctx_t *ctx, const kqsvd_observer_t *obs, const char *cmd,
                               char **paths, int n, const kqsvd_dims_t *dims,
                               const char *model_path, const char *rope, kqsvd_shard_set_t *set,
                               int64_t **lens, int *esz) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_shard_t *sh = NULL;
  for (int s = ctx->rank; s < n; s += ctx->size) {
    KQSVD_CALL(kqsvd_shard_check(paths[s]));
    KQSVD_CALL(kqsvd_shard_open(paths[s], MPI_COMM_NULL, &sh));
    KQSVD_CALL(kqsvd_dims_match(kqsvd_shard_dims(sh), paths[s], dims, model_path));
    /* Keys before RoPE and keys after it span different spaces: one set,
     * one kind. */
    KQSVD_CHECK(strcmp(rope_or_post(kqsvd_shard_rope(sh)), rope_or_post(rope)) == 0,
                KQSVD_ERR_INPUT,
                "%s: attribute 'rope' is \"%s\", but %s says \"%s\": caches of keys before and "
                "after RoPE do not mix",
                paths[s], rope_or_post(kqsvd_shard_rope(sh)), model_path, rope_or_post(rope));
    set->rows[s] = kqsvd_shard_tokens(sh);
    set->seqs[s] = kqsvd_shard_sequences(sh);
    for (int64_t q = 0; q < set->seqs[s]; q++)
      if (kqsvd_shard_seq_lens(sh)[q] > set->seq_max) set->seq_max = kqsvd_shard_seq_lens(sh)[q];
    for (int t = 0; t < 3; t++) {
      const int e = (int)kqsvd_dtype_size(kqsvd_shard_dtype(sh, (kqsvd_tensor_t)t));
      *esz = e > *esz ? e : *esz;
    }
    if (strcmp(kqsvd_shard_dims(sh)->model, dims->model) != 0)
      kqsvd_observe(obs, KQSVD_LOG_WARNING,
                    "kqsvd %s: warning: %s is from model \"%s\", %s says \"%s\"\n", cmd, paths[s],
                    kqsvd_shard_dims(sh)->model, model_path, dims->model);
    if (lens) {
      KQSVD_MALLOC(lens[s], set->seqs[s] + 1, "sequence lengths");
      memcpy(lens[s], kqsvd_shard_seq_lens(sh), (size_t)set->seqs[s] * sizeof(int64_t));
    }
    kqsvd_shard_close(&sh);
  }
done:
  kqsvd_shard_close(&sh);
  return st;
}

kqsvd_status_t kqsvd_scan_shards(const kqsvd_ctx_t *ctx, const kqsvd_observer_t *obs,
                                 const char *cmd, char **paths, int n, const kqsvd_dims_t *dims,
                                 const char *model_path, const char *rope, size_t elem_min,
                                 int want_lens, kqsvd_shard_set_t *set) {
  kqsvd_status_t st = KQSVD_OK, local = KQSVD_OK;
  MPI_Comm comm = ctx->comm;
  int64_t **lens = NULL;
  int esz = (int)elem_min, esz_max = 0, n_int = 0;
  memset(set, 0, sizeof *set);
  /* Every failure before a collective is agreed on, or the others wait. */
  set->rows = calloc((size_t)n, sizeof *set->rows);
  set->seqs = calloc((size_t)n, sizeof *set->seqs);
  if (want_lens) lens = calloc((size_t)n, sizeof *lens);
  if (!set->rows || !set->seqs || (want_lens && !lens))
    local = kqsvd_error_set(KQSVD_ERR_NOMEM, __FILE__, __LINE__, __func__,
                            "cannot allocate the tables of %d shards", n);
  if (local == KQSVD_OK)
    local = scan_own(ctx, obs, cmd, paths, n, dims, model_path, rope, set, lens, &esz);
  KQSVD_CALL(kqsvd_mpi_agree(comm, local));
  KQSVD_MPI(MPI_Allreduce(MPI_IN_PLACE, set->rows, n, MPI_INT64_T, MPI_SUM, comm));
  KQSVD_MPI(MPI_Allreduce(MPI_IN_PLACE, set->seqs, n, MPI_INT64_T, MPI_SUM, comm));
  KQSVD_MPI(MPI_Allreduce(&esz, &esz_max, 1, MPI_INT, MPI_MAX, comm));
  KQSVD_MPI(MPI_Allreduce(MPI_IN_PLACE, &set->seq_max, 1, MPI_INT64_T, MPI_MAX, comm));
  set->elem_max = (size_t)esz_max;
  for (int s = 0; s < n; s++) set->tokens += set->rows[s], set->sequences += set->seqs[s];
  local = set->tokens > 0 ? KQSVD_OK
                          : kqsvd_error_set(KQSVD_ERR_INPUT, __FILE__, __LINE__, __func__,
                                            "the shards hold no tokens at all");
  KQSVD_CALL(kqsvd_mpi_agree(comm, local));
  if (want_lens) {
    /* Each shard's lengths land at its offset; the sum fills the table. */
    set->seq_lens = malloc((size_t)set->sequences * sizeof *set->seq_lens);
    local = set->seq_lens ? KQSVD_OK
                          : kqsvd_error_set(KQSVD_ERR_NOMEM, __FILE__, __LINE__, __func__,
                                            "cannot allocate %lld sequence lengths",
                                            (long long)set->sequences);
    KQSVD_CALL(kqsvd_mpi_agree(comm, local));
    int64_t off = 0;
    for (int s = 0; s < n; s++) {
      for (int64_t q = 0; q < set->seqs[s]; q++) set->seq_lens[off + q] = lens[s] ? lens[s][q] : 0;
      off += set->seqs[s];
    }
    KQSVD_TO_INT(set->sequences, &n_int, "number of sequences");
    KQSVD_MPI(MPI_Allreduce(MPI_IN_PLACE, set->seq_lens, n_int, MPI_INT64_T, MPI_SUM, comm));
  }
done:
  for (int s = 0; lens && s < n; s++) free(lens[s]);
  free(lens);
  return st;
}
