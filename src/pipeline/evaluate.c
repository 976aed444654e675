/* kqsvd_evaluate: input validation, ranks, the work plan; the work itself
 * lives in eval_run.c. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eval_plan.h"
#include "kqsvd_util.h"

/* Every rank opens the model and the projections (small); the shard
 * headers are read once, round robin, and their sequences shared. */
static kqsvd_status_t validate_inputs(evaluation_t *e) {
  kqsvd_status_t st = KQSVD_OK, local = KQSVD_OK;
  kqsvd_shard_set_t set;
  memset(&set, 0, sizeof set);
  local = kqsvd_model_open(e->cfg.model_path, &e->model);
  if (local == KQSVD_OK) local = kqsvd_proj_open(e->cfg.proj_path, &e->proj);
  if (local == KQSVD_OK) {
    e->dims = *kqsvd_model_dims(e->model);
    kqsvd_dims_t pd = *kqsvd_proj_dims(e->proj);
    pd.causal = e->dims.causal; /* not part of a projections file */
    /* A head-groups file describes the model's group view. */
    e->G = kqsvd_proj_head_groups(e->proj);
    if (e->dims.kv_heads % e->G != 0)
      local = kqsvd_error_set(KQSVD_ERR_INPUT, __FILE__, __LINE__, __func__,
                              "%s: attribute 'head_groups' = %lld does not divide the %lld KV "
                              "heads of %s",
                              e->cfg.proj_path, (long long)e->G, (long long)e->dims.kv_heads,
                              e->cfg.model_path);
    kqsvd_dims_t view = e->dims;
    view.kv_heads /= e->G;
    view.head_dim *= e->G;
    if (local == KQSVD_OK)
      local = kqsvd_dims_match(&pd, e->cfg.proj_path, &view, e->cfg.model_path);
    /* Projections of another model with the same shapes give numbers that
     * look fine and mean nothing. */
    if (local == KQSVD_OK && strcmp(pd.model, e->dims.model) != 0) {
      if (!e->cfg.allow_mismatch)
        local = kqsvd_error_set(KQSVD_ERR_INPUT, __FILE__, __LINE__, __func__,
                                "%s: attribute 'model' is \"%s\", but %s says \"%s\"; give "
                                "--allow-model-mismatch to evaluate them anyway",
                                e->cfg.proj_path, pd.model, e->cfg.model_path, e->dims.model);
      else if (e->ctx.rank == 0)
        kqsvd_observe(e->obs, KQSVD_LOG_WARNING,
                      "kqsvd evaluate: warning: %s is from model \"%s\", %s says \"%s\"\n",
                      e->cfg.proj_path, pd.model, e->cfg.model_path, e->dims.model);
    }
  }
  KQSVD_CALL(kqsvd_mpi_agree(e->ctx.comm, local));
  e->hd = e->dims.head_dim;
  KQSVD_CALL(kqsvd_scan_shards(&e->ctx, e->obs, "evaluate", e->cfg.shards, e->cfg.nshards, &e->dims,
                               e->cfg.model_path, kqsvd_model_rope(e->model),
                               kqsvd_dtype_size(kqsvd_model_dtype(e->model)), 1, &set));
  e->dims.kv_heads /= e->G; /* from here on, the group view */
  e->dims.head_dim *= e->G;
  e->d = e->dims.head_dim;
  e->group = e->dims.heads / e->dims.kv_heads;
  e->nseq = set.sequences;
  e->tokens = set.tokens;
  e->elem_max = set.elem_max;
  /* Failures before the next collective must be agreed, or others wait. */
  e->seq_shard = malloc((size_t)e->nseq * sizeof *e->seq_shard);
  e->seq_off = malloc((size_t)e->nseq * sizeof *e->seq_off);
  local = e->seq_shard && e->seq_off
              ? KQSVD_OK
              : kqsvd_error_set(KQSVD_ERR_NOMEM, __FILE__, __LINE__, __func__,
                                "cannot allocate the table of %lld sequences", (long long)e->nseq);
  KQSVD_CALL(kqsvd_mpi_agree(e->ctx.comm, local));
  e->seq_len = set.seq_lens;
  set.seq_lens = NULL;
  e->max_T = 0;
  for (int64_t s = 0, q = 0; s < e->cfg.nshards; s++)
    for (int64_t k = 0, off = 0; k < set.seqs[s]; k++, q++) {
      e->seq_shard[q] = s;
      e->seq_off[q] = off;
      off += e->seq_len[q];
      e->max_T = e->seq_len[q] > e->max_T ? e->seq_len[q] : e->max_T;
    }
done:
  kqsvd_shard_set_free(&set);
  return st;
}

/* The stored ranks (per KV head where the file has them), or those of
 * --ranks from the stored spectra (kqsvd_proj_choose_ranks, shared with
 * `kqsvd ranks`).  Every rank computes the same (deterministic, from the
 * same file). */
static kqsvd_status_t choose_ranks(evaluation_t *e) {
  kqsvd_status_t st = KQSVD_OK;
  const size_t n = (size_t)KQSVD_NMETHODS * (size_t)e->dims.layers;
  KQSVD_MALLOC(e->rank_k, n, "ranks");
  KQSVD_MALLOC(e->rank_v, n, "ranks");
  KQSVD_CALL(kqsvd_proj_choose_ranks(e->proj, e->cfg.ranks, e->rank_k, e->rank_v, e->policy,
                                     sizeof e->policy));
  if (!e->cfg.ranks)
    KQSVD_CALL(kqsvd_proj_choose_head_ranks(e->proj, &e->head_k, &e->head_v, e->has_heads));
done:
  return st;
}

/* Memory under --mem-limit (shrinking the row blocks when they were not
 * given), and this rank's contiguous share of the units by cost. */
static kqsvd_status_t plan(evaluation_t *e) {
  kqsvd_status_t st = KQSVD_OK;
  const double mib = 1048576.0, d = (double)e->d, hd = (double)(e->dims.heads * e->d);
  const double fixed =
      8.0 * ((double)e->dims.hidden * hd + 12.0 * (double)e->dims.kv_heads * d * d +
             2.0 * (double)e->max_T * d) +
      64.0 * mib; /* libraries */
  if (e->block_rows > e->max_T) e->block_rows = e->max_T;
  for (;;) {
    const double b = (double)e->block_rows;
    const double raw =
        (double)e->elem_max * fmax(fmax((double)e->max_T * d, (double)e->group * b * d), hd);
    /* Under head groups, the rows as read, as float64, before joining. */
    const double heads = e->G > 1 ? raw / (double)e->elem_max * 8.0 : 0.0;
    e->mem_need = fixed + raw + heads + 8.0 * (double)e->group * b * d +
                  kqsvd_eval_ws_bytes((int)e->dims.heads, (int)e->d, (int)e->dims.hidden, e->max_T,
                                      e->block_rows);
    if (e->mem_need <= (double)e->cfg.mem_mib * mib || e->cfg.block_set || e->block_rows <= 16)
      break;
    e->block_rows /= 2;
  }
  KQSVD_CHECK(e->mem_need <= (double)e->cfg.mem_mib * mib, KQSVD_ERR_USAGE,
              "--mem-limit %lld MiB is too small: sequences of %lld tokens with --block-rows %lld "
              "need %.0f MiB per rank (%s)",
              (long long)e->cfg.mem_mib, (long long)e->max_T, (long long)e->block_rows,
              e->mem_need / mib + 1,
              e->cfg.block_set ? "lower --block-rows or raise --mem-limit" : "raise --mem-limit");

  double total = 0.0;
  e->nunits = 0;
  for (int64_t q = 0; q < e->nseq; q++)
    for (int64_t k = 0; k < eval_blocks(e, e->seq_len[q]); k++) {
      total += eval_unit_cost(e, e->seq_len[q], k);
      e->nunits++;
    }
  e->layer_cost = total;
  total *= (double)e->dims.layers;
  e->nunits *= e->dims.layers;
  /* A unit goes to the rank whose share of the total cost holds its middle. */
  const int P = e->ctx.size, me = e->ctx.rank;
  double cum = 0.0;
  int64_t u = 0;
  e->u0 = e->u1 = 0;
  int found = 0;
  for (int64_t l = 0; l < e->dims.layers; l++)
    for (int64_t q = 0; q < e->nseq; q++)
      for (int64_t k = 0; k < eval_blocks(e, e->seq_len[q]); k++, u++) {
        const double c = eval_unit_cost(e, e->seq_len[q], k);
        int p = (int)((cum + 0.5 * c) / total * P);
        p = p >= P ? P - 1 : p;
        cum += c;
        if (p == me && !found) e->u0 = u, found = 1;
        if (p == me) e->u1 = u + 1;
      }
done:
  return st;
}

void kqsvd_eval_config_default(kqsvd_eval_config_t *cfg) {
  memset(cfg, 0, sizeof *cfg);
  cfg->block_rows = 256;
  cfg->mem_mib = 1024;
}

void kqsvd_eval_result_free(kqsvd_eval_result_t *res) {
  kqsvd_report_t *r = &res->report;
  free((void *)r->rank_k);
  free((void *)r->rank_v);
  free((void *)r->rank_k_heads);
  free((void *)r->rank_v_heads);
  free((void *)r->err);
  free((void *)r->model);
  free((void *)r->rank_policy);
  memset(res, 0, sizeof *res);
}

static void announce(const evaluation_t *e) {
  char tok[32];
  kqsvd_fmt_count((double)e->tokens, tok, sizeof tok);
  kqsvd_observe(e->obs, KQSVD_LOG_INFO,
                "kqsvd evaluate: %d shard%s, %s tokens in %lld sequence%s (longest %lld); %lld "
                "layers x %lld heads; %lld units of %lld query rows on %d rank%s, %.0f MiB each\n",
                e->cfg.nshards, e->cfg.nshards == 1 ? "" : "s", tok, (long long)e->nseq,
                e->nseq == 1 ? "" : "s", (long long)e->max_T, (long long)e->dims.layers,
                (long long)e->dims.heads, (long long)e->nunits, (long long)e->block_rows,
                e->ctx.size, e->ctx.size == 1 ? "" : "s", e->mem_need / 1048576.0);
}

/* Hands rank 0's results over to the result, which then owns them. */
static kqsvd_status_t fill_result(evaluation_t *e, kqsvd_eval_result_t *res) {
  kqsvd_status_t st = KQSVD_OK;
  char *model = NULL, *policy = NULL;
  KQSVD_MALLOC(model, strlen(e->dims.model) + 1, "the report");
  KQSVD_MALLOC(policy, strlen(e->policy) + 1, "the report");
  memcpy(model, e->dims.model, strlen(e->dims.model) + 1);
  memcpy(policy, e->policy, strlen(e->policy) + 1);
  res->head_dim = e->d;
  res->report = (kqsvd_report_t){.model = model,
                                 .tokens = e->tokens,
                                 .sequences = e->nseq,
                                 .layers = (int)e->dims.layers,
                                 .rank_k = e->rank_k,
                                 .rank_v = e->rank_v,
                                 .err = e->err,
                                 .proj = e->cfg.proj_path,
                                 .rank_policy = policy,
                                 .beta = kqsvd_proj_beta(e->proj),
                                 .causal = (int)e->dims.causal,
                                 .calib_tokens = kqsvd_proj_tokens(e->proj),
                                 .head_groups = e->G,
                                 .kv_heads = (int)e->dims.kv_heads,
                                 .rank_k_heads = e->head_k,
                                 .rank_v_heads = e->head_v};
  for (int m = 0; m < KQSVD_NMETHODS; m++) res->report.heads[m] = e->head_k && e->has_heads[m];
  model = policy = NULL;
  e->rank_k = e->rank_v = NULL;
  e->head_k = e->head_v = NULL;
  e->err = NULL;
done:
  free(model);
  free(policy);
  return st;
}

kqsvd_status_t kqsvd_evaluate(const kqsvd_ctx_t *ctx, const kqsvd_eval_config_t *cfg,
                              const kqsvd_observer_t *obs, kqsvd_eval_result_t *res) {
  kqsvd_status_t st = KQSVD_OK;
  evaluation_t e;
  memset(&e, 0, sizeof e);
  memset(res, 0, sizeof *res);
  e.ctx = *ctx;
  e.obs = obs;
  e.cfg = *cfg;
  e.block_rows = cfg->block_rows;
  KQSVD_CALL(validate_inputs(&e));
  /* Decided alike on every rank, from the same files. */
  st = choose_ranks(&e);
  if (st == KQSVD_OK) st = plan(&e);
  if (st == KQSVD_ERR_USAGE) {
    kqsvd_agreed_usage(ctx, st);
    goto done;
  }
  KQSVD_CALL(kqsvd_mpi_agree(ctx->comm, st));
  if (ctx->rank == 0) announce(&e);
  KQSVD_CALL(eval_run(&e));
  KQSVD_CALL(kqsvd_mpi_agree(ctx->comm, ctx->rank == 0 ? fill_result(&e, res) : KQSVD_OK));
done:
  kqsvd_model_close(&e.model);
  kqsvd_proj_reader_free(&e.proj);
  free(e.seq_shard);
  free(e.seq_off);
  free(e.seq_len);
  free(e.rank_k);
  free(e.rank_v);
  free(e.head_k);
  free(e.head_v);
  free(e.err);
  return st;
}
