/* Deterministic synthetic attention caches with the structure of real ones:
 * per-layer hidden states with a decaying spectrum, a few outlier channels
 * and a shared offset; per-head projections; RoPE on Q and K; GQA; the
 * key/query unbalance beta.  Every element is a function of (seed, layer,
 * head, global token), so the same set can be cut into any shards.  Not
 * collective; a generator may be shared read-only between threads. */
#ifndef KQSVD_SYNTH_H
#define KQSVD_SYNTH_H

#include <stdint.h>

#include "kqsvd_error.h"

typedef struct kqsvd_synth_config {
  int64_t layers, heads, kv_heads, head_dim, hidden;
  double beta; /* keys times beta, queries divided by beta */
  uint64_t seed;
  int64_t max_seq_len; /* positions run 0 .. max_seq_len-1 */
  int64_t min_seq_len; /* lengths are uniform in [min_seq_len, max_seq_len] */
  double rope_theta;   /* 10000 as in Llama-2 */
} kqsvd_synth_config_t;

typedef enum kqsvd_synth_kind {
  KQSVD_SYNTH_Q = 0,
  KQSVD_SYNTH_K,
  KQSVD_SYNTH_V
} kqsvd_synth_kind_t;

typedef struct kqsvd_synth kqsvd_synth_t;
typedef struct kqsvd_synth_layer kqsvd_synth_layer_t;

/* Validates the configuration (head_dim even, heads a multiple of
 * kv_heads, ...).  Errors: KQSVD_ERR_USAGE naming the option, _NOMEM. */
kqsvd_status_t kqsvd_synth_init(const kqsvd_synth_config_t *cfg, kqsvd_synth_t **gen);
void kqsvd_synth_free(kqsvd_synth_t **gen);

/* Lengths of S sequences, each in [min_seq_len, max_seq_len]. */
void kqsvd_synth_seq_lens(const kqsvd_synth_t *gen, int64_t S, int64_t *lens);

/* Per-layer projections (about (2 head_dim) x hidden x head_dim flops per
 * head to build).  Errors: _NOMEM. */
kqsvd_status_t kqsvd_synth_layer_init(const kqsvd_synth_t *gen, int64_t layer,
                                      kqsvd_synth_layer_t **lay);
void kqsvd_synth_layer_free(kqsvd_synth_layer_t **lay);
int kqsvd_synth_latent_dim(const kqsvd_synth_layer_t *lay);

/* Latent rows of global tokens t0 .. t0+n-1: n x latent_dim, row-major. */
void kqsvd_synth_latent(const kqsvd_synth_layer_t *lay, int64_t t0, int64_t n, double *Z);

/* Rows of Q_head, K_head or V_head for those tokens (n x head_dim,
 * row-major), with RoPE at positions pos[] and beta applied. */
void kqsvd_synth_project(const kqsvd_synth_layer_t *lay, kqsvd_synth_kind_t kind, int64_t head,
                         const double *Z, int64_t n, const int64_t *pos, double *out);

/* Rows row0 .. row0+n-1 of o_proj[layer] (hidden x heads*head_dim). */
void kqsvd_synth_oproj(const kqsvd_synth_t *gen, int64_t layer, int64_t row0, int64_t n,
                       double *out);

#endif
