#include "kqsvd_synth.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kqsvd_linalg.h"
#include "kqsvd_util.h"

struct kqsvd_synth {
  kqsvd_synth_config_t c;
  double *cos_t, *sin_t; /* [max_seq_len][head_dim/2] */
};

struct kqsvd_synth_layer {
  const kqsvd_synth_t *gen;
  int64_t layer;
  int r;     /* latent dimension */
  double *G; /* [heads + 2 kv_heads][r][d]: diag(s) P W_h */
  double *b; /* [heads + 2 kv_heads][d]: mu W_h */
};

/* Independent random streams, keyed by what they generate. */
enum {
  STREAM_Z = 1,
  STREAM_P,
  STREAM_MU,
  STREAM_W,
  STREAM_WSCALE,
  STREAM_O,
  STREAM_OSCALE,
  STREAM_LEN,
  STREAM_OUTLIER
};
static uint64_t stream(const kqsvd_synth_t *g, int64_t layer, int what, int64_t head) {
  return kqsvd_mix64(kqsvd_mix64(kqsvd_mix64(g->c.seed, (uint64_t)layer + 1), (uint64_t)what),
                     (uint64_t)head + 1);
}

kqsvd_status_t kqsvd_synth_init(const kqsvd_synth_config_t *cfg, kqsvd_synth_t **out) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_synth_t *g = NULL;
  *out = NULL;
  KQSVD_CHECK(cfg->layers >= 1, KQSVD_ERR_USAGE, "--layers must be >= 1");
  KQSVD_CHECK(cfg->kv_heads >= 1, KQSVD_ERR_USAGE, "--kv-heads must be >= 1");
  KQSVD_CHECK(cfg->heads >= 1 && cfg->heads % cfg->kv_heads == 0, KQSVD_ERR_USAGE,
              "--heads (%lld) must be a positive multiple of --kv-heads (%lld)",
              (long long)cfg->heads, (long long)cfg->kv_heads);
  KQSVD_CHECK(cfg->head_dim >= 2 && cfg->head_dim % 2 == 0 && cfg->head_dim <= 4096,
              KQSVD_ERR_USAGE, "--head-dim must be even, in [2, 4096] (RoPE rotates pairs)");
  KQSVD_CHECK(cfg->hidden >= 1, KQSVD_ERR_USAGE, "--hidden must be >= 1");
  KQSVD_CHECK(cfg->max_seq_len >= 1, KQSVD_ERR_USAGE, "--seq-len must be >= 1");
  KQSVD_CHECK(cfg->min_seq_len >= 1 && cfg->min_seq_len <= cfg->max_seq_len, KQSVD_ERR_USAGE,
              "--min-seq-len must be in [1, --seq-len]");
  KQSVD_CHECK(cfg->beta > 0 && isfinite(cfg->beta), KQSVD_ERR_USAGE,
              "--beta must be finite and > 0");
  g = calloc(1, sizeof *g);
  KQSVD_CHECK(g, KQSVD_ERR_NOMEM, "cannot allocate the synthetic generator");
  g->c = *cfg;
  if (!(g->c.rope_theta > 0)) g->c.rope_theta = 10000.0;
  const int64_t half = cfg->head_dim / 2;
  KQSVD_MALLOC(g->cos_t, (size_t)(cfg->max_seq_len * half), "RoPE table");
  KQSVD_MALLOC(g->sin_t, (size_t)(cfg->max_seq_len * half), "RoPE table");
  for (int64_t p = 0; p < cfg->max_seq_len; p++)
    for (int64_t i = 0; i < half; i++) {
      /* Hugging Face rotate_half convention: pairs (i, i + d/2). */
      const double ang = (double)p * pow(g->c.rope_theta, -2.0 * (double)i / (double)cfg->head_dim);
      g->cos_t[p * half + i] = cos(ang);
      g->sin_t[p * half + i] = sin(ang);
    }
  *out = g;
  g = NULL;
done:
  kqsvd_synth_free(&g);
  return st;
}

void kqsvd_synth_free(kqsvd_synth_t **g) {
  if (!g || !*g) return;
  free((*g)->cos_t);
  free((*g)->sin_t);
  free(*g);
  *g = NULL;
}

void kqsvd_synth_seq_lens(const kqsvd_synth_t *g, int64_t S, int64_t *lens) {
  const int64_t hi = g->c.max_seq_len, lo = g->c.min_seq_len;
  const uint64_t key = stream(g, -1, STREAM_LEN, 0);
  for (int64_t s = 0; s < S; s++)
    lens[s] = lo + (int64_t)(kqsvd_uniform(key, (uint64_t)s) * (double)(hi - lo + 1));
}

kqsvd_status_t kqsvd_synth_layer_init(const kqsvd_synth_t *g, int64_t layer,
                                      kqsvd_synth_layer_t **out) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_synth_layer_t *lay = NULL;
  double *P = NULL, *mu = NULL, *W = NULL;
  const int64_t D = g->c.hidden, d = g->c.head_dim;
  const int64_t nproj = g->c.heads + 2 * g->c.kv_heads;
  *out = NULL;
  lay = calloc(1, sizeof *lay);
  KQSVD_CHECK(lay, KQSVD_ERR_NOMEM, "cannot allocate a synthetic layer");
  lay->gen = g;
  lay->layer = layer;
  lay->r = (int)(D < 2 * d ? D : 2 * d);
  const int r = lay->r;
  KQSVD_MALLOC(P, (size_t)(r * D), "synthetic mixing matrix");
  KQSVD_MALLOC(mu, (size_t)D, "synthetic offset");
  KQSVD_MALLOC(W, (size_t)(D * d), "synthetic head projection");
  KQSVD_MALLOC(lay->G, (size_t)(nproj * r * d), "synthetic projections");
  KQSVD_MALLOC(lay->b, (size_t)(nproj * d), "synthetic offsets");

  /* Hidden state x = z diag(s) P + mu: decaying latent spectrum, a few
   * outlier channels (columns of P scaled up) carrying a large offset. */
  const uint64_t kp = stream(g, layer, STREAM_P, 0), km = stream(g, layer, STREAM_MU, 0);
  const uint64_t ko = stream(g, layer, STREAM_OUTLIER, 0);
  for (int64_t c = 0; c < D; c++) {
    const int outlier = kqsvd_uniform(ko, (uint64_t)c) < 4.0 / (double)(D > 64 ? D : 64);
    mu[c] = (outlier ? 1.5 : 0.05) * kqsvd_normal(km, (uint64_t)c);
    for (int j = 0; j < r; j++) {
      const double s = pow(1.0 + j, -0.55) * (outlier ? 6.0 : 1.0);
      P[(int64_t)j * D + c] = s * kqsvd_normal(kp, (uint64_t)(j * D + c)) / sqrt((double)r);
    }
  }
  const int64_t m = g->c.heads / g->c.kv_heads;
  for (int64_t h = 0; h < nproj; h++) {
    const int qk = h < g->c.heads + g->c.kv_heads;
    /* Unequal output dimensions, as trained projections have; query and key
     * projections more so, which makes keys lower-rank than values.  A KV
     * group's queries and keys share the weights of their dimensions, as
     * trained heads do where q.k matters. */
    const int64_t scale_id = !qk ? h : h < g->c.heads ? h / m : h - g->c.heads;
    const uint64_t kw = stream(g, layer, STREAM_W, h);
    const uint64_t ks = stream(g, layer, STREAM_WSCALE, scale_id);
    const double spread = qk ? log(0.08) : log(0.5);
    /* Queries and keys large enough that scores q.k / sqrt(d) spread over a
     * few units, as in trained models, so softmax is far from uniform and
     * errors in the scores show in the output.  Keys get m^(1/4) more and
     * queries m^(1/4) less, so that a group's m stacked queries carry about
     * the energy of its keys: balanced at beta = 1, Eigen's premise. */
    const double m4 = pow((double)m, 0.25);
    const double gain = !qk ? 1.0 : h < g->c.heads ? 12.0 / m4 : 12.0 * m4;
    for (int64_t j = 0; j < d; j++) {
      const double scale = gain * exp(spread * kqsvd_uniform(ks, (uint64_t)j)) / sqrt((double)D);
      for (int64_t c = 0; c < D; c++)
        W[c * d + j] = scale * kqsvd_normal(kw, (uint64_t)(c * d + j));
    }
    /* Row-major products via column-major BLAS on the transposes. */
    kqsvd_gemm('N', 'N', (int)d, r, (int)D, 1.0, W, (int)d, P, (int)D, 0.0, lay->G + h * r * d,
               (int)d);
    kqsvd_gemm('N', 'N', (int)d, 1, (int)D, 1.0, W, (int)d, mu, (int)D, 0.0, lay->b + h * d,
               (int)d);
  }
  *out = lay;
  lay = NULL;
done:
  free(P);
  free(mu);
  free(W);
  kqsvd_synth_layer_free(&lay);
  return st;
}

void kqsvd_synth_layer_free(kqsvd_synth_layer_t **lay) {
  if (!lay || !*lay) return;
  free((*lay)->G);
  free((*lay)->b);
  free(*lay);
  *lay = NULL;
}

int kqsvd_synth_latent_dim(const kqsvd_synth_layer_t *lay) { return lay->r; }

void kqsvd_synth_latent(const kqsvd_synth_layer_t *lay, int64_t t0, int64_t n, double *Z) {
  const uint64_t key = stream(lay->gen, lay->layer, STREAM_Z, 0);
  const int64_t r = lay->r, pairs = (r + 1) / 2;
  for (int64_t t = 0; t < n; t++)
    for (int64_t k = 0; k < pairs; k++) {
      double a, b;
      kqsvd_normal2(key, (uint64_t)((t0 + t) * pairs + k), &a, &b);
      Z[t * r + 2 * k] = a;
      if (2 * k + 1 < r) Z[t * r + 2 * k + 1] = b;
    }
}

void kqsvd_synth_project(const kqsvd_synth_layer_t *lay, kqsvd_synth_kind_t kind, int64_t head,
                         const double *Z, int64_t n, const int64_t *pos, double *out) {
  const kqsvd_synth_t *g = lay->gen;
  const int64_t d = g->c.head_dim, half = d / 2;
  const int64_t h = kind == KQSVD_SYNTH_Q   ? head
                    : kind == KQSVD_SYNTH_K ? g->c.heads + head
                                            : g->c.heads + g->c.kv_heads + head;
  const double *G = lay->G + h * lay->r * d, *b = lay->b + h * d;
  for (int64_t t = 0; t < n; t++) memcpy(out + t * d, b, (size_t)d * sizeof(double));
  kqsvd_gemm('N', 'N', (int)d, (int)n, lay->r, 1.0, G, (int)d, Z, lay->r, 1.0, out, (int)d);
  if (kind == KQSVD_SYNTH_V) return;
  const double scale = kind == KQSVD_SYNTH_K ? g->c.beta : 1.0 / g->c.beta;
  for (int64_t t = 0; t < n; t++) {
    double *x = out + t * d;
    const double *cs = g->cos_t + pos[t] * half, *sn = g->sin_t + pos[t] * half;
    for (int64_t i = 0; i < half; i++) {
      const double x1 = x[i], x2 = x[i + half];
      x[i] = scale * (x1 * cs[i] - x2 * sn[i]);
      x[i + half] = scale * (x2 * cs[i] + x1 * sn[i]);
    }
  }
}

void kqsvd_synth_oproj(const kqsvd_synth_t *g, int64_t layer, int64_t row0, int64_t n,
                       double *out) {
  const int64_t cols = g->c.heads * g->c.head_dim;
  const uint64_t ko = stream(g, layer, STREAM_O, 0), ks = stream(g, layer, STREAM_OSCALE, 0);
  /* Columns of unequal weight make V W^O differ from V, as in real models. */
  for (int64_t c = 0; c < cols; c++) {
    const double scale = exp(log(0.1) * kqsvd_uniform(ks, (uint64_t)c)) / sqrt((double)cols);
    for (int64_t i = 0; i < n; i++)
      out[i * cols + c] = scale * kqsvd_normal(ko, (uint64_t)((row0 + i) * cols + c));
  }
}
