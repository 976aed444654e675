/* kqsvd_acc_finish and the result it makes: every (layer, KV head)'s d x d
 * solve (kqsvd_solve), the rank policy over all spectra, and a serial
 * writer of proj.h5 (include/kqsvd/accumulator.h). */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kqsvd/accumulator.h"
#include "kqsvd_acc.h"
#include "kqsvd_gram.h"
#include "kqsvd_h5guard.h"
#include "kqsvd_linalg.h"
#include "kqsvd_pipeline.h"
#include "kqsvd_proj.h"
#include "kqsvd_rank.h"
#include "kqsvd_solve.h"
#include "kqsvd_util.h"

enum { NMAT = 4, NSPEC = 5 }; /* matrices per method; K, Q, V, KQt, VWo */

struct kqsvd_result {
  kqsvd_shape_t shape;
  int d;
  int64_t nitems, tokens, block_rows, head_groups;
  double beta;
  char policy[64];
  double eps;                        /* NaN unless the policy is eps:E */
  double *mat[KQSVD_NMETHODS][NMAT]; /* [nitems][d][d] */
  double *sig[KQSVD_NMETHODS][2];    /* [nitems][d]: sigma_k, sigma_v */
  double *spec[NSPEC];               /* [nitems][d] */
  int32_t *rank_k, *rank_v;          /* [KQSVD_NMETHODS][layers] */
  double *storage;
};

void kqsvd_finish_options_default(kqsvd_finish_options_t *opt) {
  opt->beta = 1.0;
  opt->ranks = "eps:0.1";
}

void kqsvd_result_free(kqsvd_result_t **res) {
  if (!res || !*res) return;
  free((*res)->storage);
  free((*res)->rank_k);
  free((*res)->rank_v);
  free(*res);
  *res = NULL;
}

static kqsvd_status_t result_alloc(const kqsvd_shape_t *shape, kqsvd_result_t **out) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_result_t *r = NULL;
  KQSVD_MALLOC(r, 1, "result");
  memset(r, 0, sizeof *r);
  r->shape = *shape;
  r->d = (int)shape->head_dim;
  r->nitems = shape->layers * shape->kv_heads;
  const size_t dd = (size_t)r->d * (size_t)r->d, n = (size_t)r->nitems;
  const size_t per_method = NMAT * dd + 2 * (size_t)r->d;
  KQSVD_MALLOC(r->storage, n * (KQSVD_NMETHODS * per_method + NSPEC * (size_t)r->d), "projections");
  double *p = r->storage;
  for (int m = 0; m < KQSVD_NMETHODS; m++) {
    for (int k = 0; k < NMAT; k++) r->mat[m][k] = p, p += n * dd;
    for (int k = 0; k < 2; k++) r->sig[m][k] = p, p += n * (size_t)r->d;
  }
  for (int k = 0; k < NSPEC; k++) r->spec[k] = p, p += n * (size_t)r->d;
  KQSVD_MALLOC(r->rank_k, (size_t)(KQSVD_NMETHODS * shape->layers), "ranks");
  KQSVD_MALLOC(r->rank_v, (size_t)(KQSVD_NMETHODS * shape->layers), "ranks");
  *out = r;
  r = NULL;
done:
  kqsvd_result_free(&r);
  return st;
}

/* Copies one item's solution into the result's arrays. */
static void store(kqsvd_result_t *r, int64_t i, const kqsvd_solution_t *sol) {
  const size_t dd = (size_t)r->d * (size_t)r->d, vec = (size_t)r->d * sizeof(double);
  for (int m = 0; m < KQSVD_NMETHODS; m++) {
    const kqsvd_projection_t *p = &sol->method[m];
    const double *src[NMAT] = {p->key_down, p->query_down, p->value_down, p->value_up};
    for (int k = 0; k < NMAT; k++)
      memcpy(r->mat[m][k] + (size_t)i * dd, src[k], dd * sizeof(double));
    memcpy(r->sig[m][0] + (size_t)i * (size_t)r->d, p->sigma_k, vec);
    memcpy(r->sig[m][1] + (size_t)i * (size_t)r->d, p->sigma_v, vec);
  }
  const double *spec[NSPEC] = {sol->spec_K, sol->spec_Q, sol->spec_V, sol->spec_KQt, sol->spec_VWo};
  for (int k = 0; k < NSPEC; k++) memcpy(r->spec[k] + (size_t)i * (size_t)r->d, spec[k], vec);
}

kqsvd_status_t kqsvd_acc_finish(const kqsvd_acc_t *acc, const kqsvd_finish_options_t *opt,
                                kqsvd_result_t **res) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_error_clear(); /* a call reports its own failure, not an earlier one */
  kqsvd_result_t *r = NULL;
  kqsvd_solution_t sol;
  kqsvd_finish_options_t o;
  kqsvd_rank_policy_t policy;
  double *R = NULL;
  memset(&sol, 0, sizeof sol);
  KQSVD_CHECK(acc && res, KQSVD_ERR_USAGE, "kqsvd_acc_finish: acc and res must not be NULL");
  *res = NULL;
  if (opt)
    o = *opt;
  else
    kqsvd_finish_options_default(&o);
  const kqsvd_shape_t *s = kqsvd_acc_shape(acc);
  const int d = (int)s->head_dim;
  KQSVD_CHECK(o.beta > 0.0 && isfinite(o.beta), KQSVD_ERR_USAGE,
              "kqsvd_acc_finish: beta = %g must be finite and > 0", o.beta);
  KQSVD_CALL(kqsvd_rank_policy_parse("ranks", o.ranks ? o.ranks : "eps:0.1", &policy));
  KQSVD_CALL(kqsvd_rank_policy_check(&policy, (int)s->layers, d));
  for (int64_t l = 0; l < s->layers; l++)
    KQSVD_CHECK(kqsvd_acc_oproj_rows(acc, l) == s->hidden, KQSVD_ERR_USAGE,
                "kqsvd_acc_finish: o_proj of layer %lld has %lld of its %lld rows; give every "
                "row with kqsvd_acc_absorb_oproj",
                (long long)l, (long long)kqsvd_acc_oproj_rows(acc, l), (long long)s->hidden);
  KQSVD_CALL(result_alloc(s, &r));
  r->tokens = kqsvd_acc_tokens(acc);
  r->beta = o.beta;
  r->block_rows = kqsvd_acc_options(acc)->block_rows;
  r->head_groups = kqsvd_acc_head_groups(acc);
  kqsvd_rank_policy_format(&policy, r->policy, sizeof r->policy);
  r->eps = policy.kind == KQSVD_RANKS_EPS ? policy.value : NAN;

  const size_t tri = kqsvd_tri_size(d), dd = (size_t)d * (size_t)d;
  const double *state = kqsvd_acc_state((kqsvd_acc_t *)acc);
  const int gram = kqsvd_acc_options(acc)->qr == KQSVD_QR_GRAM;
  KQSVD_MALLOC(R, 4 * dd, "R factors of one item");
  KQSVD_CALL(kqsvd_solution_init(d, &sol));
  for (int64_t i = 0; i < r->nitems; i++) {
    for (int k = 0; k < 3; k++) {
      kqsvd_tri_unpack(d, state + ((size_t)i * 3 + (size_t)k) * tri, R + k * dd);
      if (gram) KQSVD_CALL(kqsvd_gram_to_r(d, R + k * dd));
    }
    kqsvd_tri_unpack(d, kqsvd_acc_wstate(acc) + (size_t)i * tri, R + 3 * dd);
    KQSVD_CALL(kqsvd_solve(d, R, R + dd, R + 2 * dd, R + 3 * dd, o.beta, &sol));
    store(r, i, &sol);
  }
  const double *sk[KQSVD_NMETHODS], *sv[KQSVD_NMETHODS];
  for (int m = 0; m < KQSVD_NMETHODS; m++) sk[m] = r->sig[m][0], sv[m] = r->sig[m][1];
  KQSVD_CALL(kqsvd_rank_choose(&policy, (int)s->layers, (int)s->kv_heads, d, sk, sv, r->spec[0],
                               r->spec[2], r->rank_k, r->rank_v));
  *res = r;
  r = NULL;
done:
  kqsvd_solution_free(&sol);
  free(R);
  kqsvd_result_free(&r);
  return kqsvd_api_return(st);
}

const double *kqsvd_result_matrix(const kqsvd_result_t *r, kqsvd_method_t m, kqsvd_matrix_t k,
                                  int64_t layer, int64_t g) {
  if (!r || m < 0 || m >= KQSVD_NMETHODS || (int)k < 0 || (int)k >= NMAT || layer < 0 ||
      layer >= r->shape.layers || g < 0 || g >= r->shape.kv_heads)
    return NULL;
  return r->mat[m][k] + (size_t)(layer * r->shape.kv_heads + g) * (size_t)r->d * (size_t)r->d;
}

const double *kqsvd_result_sigma(const kqsvd_result_t *r, kqsvd_method_t m, int values,
                                 int64_t layer, int64_t g) {
  if (!r || m < 0 || m >= KQSVD_NMETHODS || (values != 0 && values != 1) || layer < 0 ||
      layer >= r->shape.layers || g < 0 || g >= r->shape.kv_heads)
    return NULL;
  return r->sig[m][values] + (size_t)(layer * r->shape.kv_heads + g) * (size_t)r->d;
}

const int32_t *kqsvd_result_rank_k(const kqsvd_result_t *r, kqsvd_method_t m) {
  return r && m >= 0 && m < KQSVD_NMETHODS ? r->rank_k + m * r->shape.layers : NULL;
}
const int32_t *kqsvd_result_rank_v(const kqsvd_result_t *r, kqsvd_method_t m) {
  return r && m >= 0 && m < KQSVD_NMETHODS ? r->rank_v + m * r->shape.layers : NULL;
}
int64_t kqsvd_result_head_groups(const kqsvd_result_t *r) { return r ? r->head_groups : 0; }
kqsvd_shape_t kqsvd_result_shape(const kqsvd_result_t *r) {
  const kqsvd_shape_t none = {0, 0, 0, 0, 0};
  return r ? r->shape : none;
}

/* One item's solution as views into the result, for the file writer. */
static void view(const kqsvd_result_t *r, int64_t i, kqsvd_solution_t *sol) {
  const size_t dd = (size_t)r->d * (size_t)r->d, v = (size_t)r->d;
  memset(sol, 0, sizeof *sol);
  sol->d = r->d;
  for (int m = 0; m < KQSVD_NMETHODS; m++) {
    kqsvd_projection_t *p = &sol->method[m];
    p->key_down = r->mat[m][0] + (size_t)i * dd;
    p->query_down = r->mat[m][1] + (size_t)i * dd;
    p->value_down = r->mat[m][2] + (size_t)i * dd;
    p->value_up = r->mat[m][3] + (size_t)i * dd;
    p->sigma_k = r->sig[m][0] + (size_t)i * v;
    p->sigma_v = r->sig[m][1] + (size_t)i * v;
  }
  double **spec[NSPEC] = {&sol->spec_K, &sol->spec_Q, &sol->spec_V, &sol->spec_KQt, &sol->spec_VWo};
  for (int k = 0; k < NSPEC; k++) *spec[k] = r->spec[k] + (size_t)i * v;
}

void kqsvd_write_options_default(kqsvd_write_options_t *opt) {
  opt->model = "";
  opt->tokens = 0;
  opt->causal = 1;
  opt->force = 0;
  opt->inputs_hash = NULL;
  opt->rope = NULL;
  opt->seq_len = 0;
}

kqsvd_status_t kqsvd_result_write(const kqsvd_result_t *r, const char *path,
                                  const kqsvd_write_options_t *opt) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_error_clear(); /* a call reports its own failure, not an earlier one */
  kqsvd_proj_writer_t *w = NULL;
  char tmp[PATH_MAX + 32] = "";
  kqsvd_h5guard_t guard;
  int locked = 0;
  KQSVD_CHECK(r && path, KQSVD_ERR_USAGE, "kqsvd_result_write: res and path needed");
  KQSVD_CALL(kqsvd_check_output(NULL, path, opt && opt->force));
  const char *hash = opt && opt->inputs_hash && *opt->inputs_hash ? opt->inputs_hash : NULL;
  KQSVD_CHECK(!hash || strlen(hash) < 64, KQSVD_ERR_USAGE,
              "kqsvd_result_write: inputs_hash longer than 63 characters");
  const char *rope = opt ? opt->rope : NULL;
  KQSVD_CHECK(!rope || strcmp(rope, "pre") == 0 || strcmp(rope, "post") == 0, KQSVD_ERR_USAGE,
              "kqsvd_result_write: rope is \"%s\", expected \"pre\", \"post\" or NULL", rope);
  KQSVD_CHECK(!opt || opt->seq_len >= 0, KQSVD_ERR_USAGE,
              "kqsvd_result_write: seq_len is %lld, expected 0 (unknown) or more",
              (long long)(opt ? opt->seq_len : 0));
  /* A window is no longer than all the tokens seen (readers refuse it). */
  const int64_t seen = opt && opt->tokens > 0 ? opt->tokens : r->tokens;
  KQSVD_CHECK(!opt || seen <= 0 || opt->seq_len <= seen, KQSVD_ERR_USAGE,
              "kqsvd_result_write: seq_len %lld exceeds the %lld tokens calibrated on",
              (long long)opt->seq_len, (long long)seen);
  kqsvd_tmp_path(path, tmp, sizeof tmp); /* fits: path is under PATH_MAX */
  kqsvd_proj_meta_t meta;
  memset(&meta, 0, sizeof meta);
  snprintf(meta.dims.model, sizeof meta.dims.model, "%s", opt && opt->model ? opt->model : "");
  meta.dims.layers = r->shape.layers;
  meta.dims.kv_heads = r->shape.kv_heads;
  meta.dims.heads = r->shape.kv_heads * r->shape.group;
  meta.dims.head_dim = r->shape.head_dim;
  meta.dims.hidden = r->shape.hidden;
  meta.dims.causal = opt ? (opt->causal != 0) : 1;
  meta.eps = r->eps;
  meta.beta = r->beta;
  meta.tokens = opt && opt->tokens > 0 ? opt->tokens : r->tokens;
  meta.shards = 0;
  meta.qr_block = r->block_rows;
  meta.rank_policy = r->policy;
  meta.inputs_hash = hash;
  meta.rope = rope;
  meta.head_groups = r->head_groups;
  meta.seq_len = opt ? opt->seq_len : 0;
  kqsvd_h5guard_enter(&guard);
  locked = 1;
  KQSVD_CALL(kqsvd_check_space(path, kqsvd_proj_size_estimate(&meta.dims)));
  KQSVD_CALL(kqsvd_proj_create(tmp, MPI_COMM_NULL, &meta, &w));
  KQSVD_CALL(kqsvd_proj_reserve(w, path));
  for (int64_t i = 0; i < r->nitems; i++) {
    kqsvd_solution_t sol;
    view(r, i, &sol);
    KQSVD_CALL(kqsvd_proj_write_item(w, i / r->shape.kv_heads, i % r->shape.kv_heads, &sol));
  }
  KQSVD_CALL(kqsvd_proj_write_ranks(w, r->rank_k, r->rank_v));
  KQSVD_CALL(kqsvd_proj_close(&w));
  KQSVD_CALL(kqsvd_proj_trim(tmp));
  KQSVD_CALL(opt && opt->force ? kqsvd_publish(tmp, path) : kqsvd_publish_new(tmp, path));
  tmp[0] = '\0';
done:
  if (w) kqsvd_proj_close(&w);
  if (tmp[0]) remove(tmp);
  if (locked) kqsvd_h5guard_leave(&guard);
  return kqsvd_api_return(st);
}
