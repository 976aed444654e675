/* The work of kqsvd evaluate: each rank walks its contiguous range of
 * (layer, sequence, row block) units, reading what each needs, and keeps
 * per-layer sums of per-sequence errors.  A sequence whose blocks were split
 * between ranks leaves a partial sum on each (at most two per rank), which
 * rank 0 merges: memory does not grow with the number of sequences. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eval_plan.h"

int64_t eval_blocks(const evaluation_t *e, int64_t len) {
  return (len + e->block_rows - 1) / e->block_rows;
}

double eval_unit_cost(const evaluation_t *e, int64_t len, int64_t blk) {
  const double b = (double)(len - blk * e->block_rows < e->block_rows ? len - blk * e->block_rows
                                                                      : e->block_rows);
  const double keys = e->dims.causal ? (double)(blk * e->block_rows) + b : (double)len;
  const double d = (double)e->d, hq = (double)e->dims.heads, hkv = (double)e->dims.kv_heads;
  /* Scores and their products with V (exact and three methods), the R
   * factor and compressions of K and V, and the output projections. */
  return 16.0 * hq * b * keys * d + 10.0 * hkv * (double)len * d * d +
         8.0 * b * hq * d * (double)e->dims.hidden;
}

static const char *const g_proj_names[4] = {"key_down", "query_down", "value_down", "value_up"};

/* Sums of one (layer, sequence) and its global index l * nseq + q. */
typedef struct {
  double gid;
  kqsvd_eval_sums_t s;
} partial_t;

typedef struct {
  evaluation_t *e;
  kqsvd_eval_ws_t *ws;
  kqsvd_eval_layer_t layer;
  double *proj, *W;  /* the current layer's projections and o_proj */
  double *K, *V, *Q; /* one KV group: whole sequence, and the block's queries */
  double *heads;     /* under head groups: the G heads' rows as read, before joining */
  char *raw;
  size_t raw_elems;
  int64_t cur_layer, cur_shard;
  kqsvd_shard_t *sh;
  double *acc; /* [L][KQSVD_NMETHODS][KQSVD_NMETRICS] sums over whole sequences */
  partial_t part[2];
  int npart;
  kqsvd_monitor_t *mon;
  int64_t work;
} run_t;

static kqsvd_status_t load_layer(run_t *r, int64_t l) {
  kqsvd_status_t st = KQSVD_OK;
  evaluation_t *e = r->e;
  const int64_t L = e->dims.layers, hd = e->dims.heads * e->d, D = e->dims.hidden;
  const size_t per = (size_t)(e->dims.kv_heads * e->d * e->d);
  for (int m = 0; m < KQSVD_NMETHODS; m++)
    for (int k = 0; k < 4; k++) {
      double *p = r->proj + ((size_t)m * 4 + (size_t)k) * per;
      KQSVD_CALL(
          kqsvd_proj_read(e->proj, kqsvd_method_name((kqsvd_method_t)m), g_proj_names[k], l, p));
      r->layer.proj[m][k] = p;
    }
  const kqsvd_dtype_t t = kqsvd_model_dtype(e->model);
  /* Under head groups, head h's block of o_proj sits at its KV head's place
   * in the G hd columns of h (zeros elsewhere), so that the padded outputs
   * meet exactly W^O_h. */
  const int64_t hw = e->dims.heads * e->hd, G = e->G, qpk = e->group / G;
  const int64_t chunk = (int64_t)(r->raw_elems / (size_t)hw);
  if (G > 1) memset(r->W, 0, (size_t)(D * hd) * sizeof(double));
  for (int64_t row = 0; row < D; row += chunk) {
    const int64_t n = D - row < chunk ? D - row : chunk;
    KQSVD_CALL(kqsvd_model_read_oproj(e->model, l, row, n, 0, hw, r->raw));
    double *dst = G > 1 ? r->heads : r->W + row * hd;
    const int64_t bad = kqsvd_convert_to_f64(t, r->raw, n * hw, dst);
    KQSVD_CHECK(bad < 0, KQSVD_ERR_DATA, "%s: dataset 'o_proj': NaN or Inf at layer %lld, row %lld",
                e->cfg.model_path, (long long)l, (long long)(row + bad / hw));
    for (int64_t i = 0; G > 1 && i < n; i++)
      for (int64_t h = 0; h < e->dims.heads; h++)
        memcpy(r->W + (row + i) * hd + h * e->d + ((h / qpk) % G) * e->hd, dst + i * hw + h * e->hd,
               (size_t)e->hd * sizeof(double));
  }
  const int64_t H = e->dims.kv_heads;
  for (int m = 0; m < KQSVD_NMETHODS; m++) {
    r->layer.rank_k[m] = e->rank_k[m * L + l];
    r->layer.rank_v[m] = e->rank_v[m * L + l];
    /* NULL keeps the per-layer ranks, so files without per-head ranks are
     * evaluated exactly as before. */
    r->layer.rank_k_heads[m] = e->has_heads[m] ? e->head_k + (m * L + l) * H : NULL;
    r->layer.rank_v_heads[m] = e->has_heads[m] ? e->head_v + (m * L + l) * H : NULL;
  }
  r->cur_layer = l;
done:
  return st;
}

/* Reads tensor[layer][head0 .. +nheads)[row0 .. +nrows) as float64. */
static kqsvd_status_t read_rows(run_t *r, kqsvd_tensor_t t, int64_t layer, int64_t head0,
                                int64_t nheads, int64_t row0, int64_t nrows, double *dst) {
  kqsvd_status_t st = KQSVD_OK;
  const int64_t d = r->e->hd;
  KQSVD_CALL(kqsvd_shard_read(r->sh, t, layer, head0, nheads, row0, nrows, r->raw));
  const int64_t bad =
      kqsvd_convert_to_f64(kqsvd_shard_dtype(r->sh, t), r->raw, nheads * nrows * d, dst);
  KQSVD_CHECK(bad < 0, KQSVD_ERR_DATA,
              "%s: dataset '%s': NaN or Inf at layer %lld, head %lld, row %lld",
              kqsvd_shard_path(r->sh), kqsvd_tensor_name(t), (long long)layer,
              (long long)(head0 + bad / (nrows * d)), (long long)(row0 + (bad / d) % nrows));
done:
  return st;
}

/* A group of the view: its G heads' K and V rows side by side (T x G hd),
 * and its G m query heads' rows of the block, each padded to G hd with its
 * KV head's block in place. */
static kqsvd_status_t read_group(run_t *r, int64_t l, int64_t g, int64_t off, int64_t T,
                                 int64_t qrow0, int64_t nrows) {
  kqsvd_status_t st = KQSVD_OK;
  const evaluation_t *e = r->e;
  const int64_t G = e->G, hd = e->hd, w = e->d, mq = e->group, m = mq / G;
  const size_t row = (size_t)hd * sizeof(double);
  double *dst[2] = {r->K, r->V};
  const kqsvd_tensor_t kv[2] = {KQSVD_KEYS, KQSVD_VALUES};
  for (int k = 0; k < 2; k++) {
    KQSVD_CALL(read_rows(r, kv[k], l, g * G, G, off, T, r->heads));
    for (int64_t i = 0; i < T; i++)
      for (int64_t h = 0; h < G; h++)
        memcpy(dst[k] + i * w + h * hd, r->heads + (h * T + i) * hd, row);
  }
  KQSVD_CALL(read_rows(r, KQSVD_QUERIES, l, g * mq, mq, qrow0, nrows, r->heads));
  memset(r->Q, 0, (size_t)(mq * nrows * w) * sizeof(double));
  for (int64_t h = 0; h < mq; h++)
    for (int64_t i = 0; i < nrows; i++)
      memcpy(r->Q + (h * nrows + i) * w + (h / m) * hd, r->heads + (h * nrows + i) * hd, row);
done:
  return st;
}

/* One unit: query rows [row0, row0 + nrows) of sequence q in layer l. */
static kqsvd_status_t run_unit(run_t *r, int64_t l, int64_t q, int64_t row0, int64_t nrows,
                               kqsvd_eval_sums_t *sums) {
  kqsvd_status_t st = KQSVD_OK;
  evaluation_t *e = r->e;
  const int64_t m = e->group, off = e->seq_off[q], T = e->seq_len[q];
  if (l != r->cur_layer) KQSVD_CALL(load_layer(r, l));
  if (e->seq_shard[q] != r->cur_shard) {
    kqsvd_shard_close(&r->sh);
    r->cur_shard = -1;
    KQSVD_CALL(kqsvd_shard_open(e->cfg.shards[e->seq_shard[q]], MPI_COMM_NULL, &r->sh));
    r->cur_shard = e->seq_shard[q];
  }
  KQSVD_CALL(kqsvd_eval_begin(r->ws, &r->layer, T, row0, nrows));
  for (int64_t g = 0; g < e->dims.kv_heads; g++) {
    if (e->G == 1) {
      KQSVD_CALL(read_rows(r, KQSVD_KEYS, l, g, 1, off, T, r->K));
      KQSVD_CALL(read_rows(r, KQSVD_VALUES, l, g, 1, off, T, r->V));
      KQSVD_CALL(read_rows(r, KQSVD_QUERIES, l, g * m, m, off + row0, nrows, r->Q));
    } else {
      KQSVD_CALL(read_group(r, l, g, off, T, off + row0, nrows));
    }
    KQSVD_CALL(kqsvd_eval_group(r->ws, (int)g, r->K, r->V, r->Q, sums));
  }
  kqsvd_eval_end(r->ws, sums);
done:
  return st;
}

/* A sequence is finished on this rank: whole ones go into the layer sums,
 * cut ones wait for rank 0. */
static void close_sequence(run_t *r, int64_t l, int64_t q, int whole, const kqsvd_eval_sums_t *s) {
  if (whole) {
    double *a = r->acc + (size_t)l * KQSVD_NMETHODS * KQSVD_NMETRICS;
    for (int m = 0; m < KQSVD_NMETHODS; m++)
      for (int k = 0; k < KQSVD_NMETRICS; k++)
        a[m * KQSVD_NMETRICS + k] += kqsvd_eval_ratio(s, m, k);
  } else {
    r->part[r->npart].gid = (double)(l * r->e->nseq + q);
    r->part[r->npart].s = *s;
    r->npart++;
  }
}

static kqsvd_status_t run_units(run_t *r, double scale, int *stop) {
  kqsvd_status_t st = KQSVD_OK;
  evaluation_t *e = r->e;
  int64_t u = 0;
  for (int64_t l = 0; l < e->dims.layers && u < e->u1 && !*stop; l++)
    for (int64_t q = 0; q < e->nseq && u < e->u1 && !*stop; q++) {
      const int64_t nb = eval_blocks(e, e->seq_len[q]);
      if (u + nb <= e->u0) { /* before this rank's range */
        u += nb;
        continue;
      }
      kqsvd_eval_sums_t sums;
      memset(&sums, 0, sizeof sums);
      int done_blocks = 0;
      for (int64_t k = 0; k < nb; k++, u++) {
        if (u < e->u0 || u >= e->u1 || *stop) continue;
        const int64_t row0 = k * e->block_rows;
        const int64_t n =
            e->seq_len[q] - row0 < e->block_rows ? e->seq_len[q] - row0 : e->block_rows;
        KQSVD_CALL(run_unit(r, l, q, row0, n, &sums));
        done_blocks++;
        r->work += llround(eval_unit_cost(e, e->seq_len[q], k) * scale);
        KQSVD_CALL(kqsvd_monitor_update(r->mon, r->work, stop));
      }
      if (!*stop) close_sequence(r, l, q, done_blocks == nb, &sums);
    }
done:
  return st;
}

/* Rank 0 merges the partial sequences (adjacent in rank order, since the
 * ranges are contiguous) and turns sums into per-layer averages. */
static kqsvd_status_t combine(run_t *r) {
  kqsvd_status_t st = KQSVD_OK;
  evaluation_t *e = r->e;
  MPI_Comm comm = e->ctx.comm;
  const int root = e->ctx.rank == 0, P = e->ctx.size;
  const int64_t L = e->dims.layers, per = KQSVD_NMETHODS * KQSVD_NMETRICS;
  partial_t *all = NULL;
  int n_int = 0, bytes = 0;
  KQSVD_TO_INT(L * per, &n_int, "evaluation sums");
  KQSVD_TO_INT(2 * sizeof(partial_t), &bytes, "partial sums");
  kqsvd_status_t local = KQSVD_OK;
  if (root) {
    all = malloc((size_t)(2 * P) * sizeof *all);
    e->err = malloc((size_t)(L * per) * sizeof *e->err);
    if (!all || !e->err)
      local = kqsvd_error_set(KQSVD_ERR_NOMEM, __FILE__, __LINE__, __func__,
                              "cannot allocate the evaluation results");
  }
  KQSVD_CALL(kqsvd_mpi_agree(comm, local));
  KQSVD_MPI(MPI_Reduce(root ? MPI_IN_PLACE : r->acc, r->acc, n_int, MPI_DOUBLE, MPI_SUM, 0, comm));
  for (int k = r->npart; k < 2; k++) {
    memset(&r->part[k], 0, sizeof r->part[k]);
    r->part[k].gid = -1.0;
  }
  KQSVD_MPI(MPI_Gather(r->part, bytes, MPI_BYTE, all, bytes, MPI_BYTE, 0, comm));
  if (!root) goto done;
  for (int k = 0; k < 2 * P;) {
    if (all[k].gid < 0) {
      k++;
      continue;
    }
    kqsvd_eval_sums_t s = all[k].s;
    int j = k + 1;
    for (; j < 2 * P && (all[j].gid < 0 || all[j].gid == all[k].gid); j++)
      if (all[j].gid == all[k].gid) kqsvd_eval_sums_add(&s, &all[j].s);
    const int64_t gid = (int64_t)all[k].gid;
    close_sequence(r, gid / e->nseq, gid % e->nseq, 1, &s);
    k = j;
  }
  for (int64_t l = 0; l < L; l++)
    for (int m = 0; m < KQSVD_NMETHODS; m++)
      for (int k = 0; k < KQSVD_NMETRICS; k++)
        e->err[((size_t)m * L + l) * KQSVD_NMETRICS + k] =
            r->acc[(size_t)l * per + m * KQSVD_NMETRICS + k] / (double)e->nseq;
done:
  free(all);
  return st;
}

kqsvd_status_t eval_run(evaluation_t *e) {
  kqsvd_status_t st = KQSVD_OK, local = KQSVD_OK;
  run_t r;
  memset(&r, 0, sizeof r);
  r.e = e;
  r.cur_layer = r.cur_shard = -1;
  const int64_t d = e->d, hd = e->dims.heads * d, b = e->block_rows;
  int64_t raw = e->max_T * d > e->group * b * d ? e->max_T * d : e->group * b * d;
  r.raw_elems = (size_t)(raw > hd ? raw : hd);
  /* Progress counts units of about a millionth of the total cost. */
  const double scale = 1e6 / (e->layer_cost > 0 ? e->layer_cost : 1.0) / (double)e->dims.layers;
  int64_t total_work = 0;
  for (int64_t q = 0; q < e->nseq; q++)
    for (int64_t k = 0; k < eval_blocks(e, e->seq_len[q]); k++)
      total_work += llround(eval_unit_cost(e, e->seq_len[q], k) * scale);
  total_work *= e->dims.layers;

  local = kqsvd_eval_ws_init((int)e->dims.heads, (int)d, (int)e->dims.hidden, e->max_T, b, &r.ws);
  if (local == KQSVD_OK) {
    r.proj = malloc((size_t)(KQSVD_NMETHODS * 4 * e->dims.kv_heads * d * d) * sizeof(double));
    r.W = malloc((size_t)(e->dims.hidden * hd) * sizeof(double));
    r.K = malloc((size_t)(e->max_T * d) * sizeof(double));
    r.V = malloc((size_t)(e->max_T * d) * sizeof(double));
    r.Q = malloc((size_t)(e->group * b * d) * sizeof(double));
    r.raw = malloc(r.raw_elems * e->elem_max);
    if (e->G > 1) r.heads = malloc(r.raw_elems * sizeof(double));
    r.acc = calloc((size_t)(e->dims.layers * KQSVD_NMETHODS * KQSVD_NMETRICS), sizeof(double));
    if (!r.proj || !r.W || !r.K || !r.V || !r.Q || !r.raw || !r.acc || (e->G > 1 && !r.heads))
      local = kqsvd_error_set(KQSVD_ERR_NOMEM, __FILE__, __LINE__, __func__,
                              "cannot allocate %.0f MiB for the evaluation; lower --block-rows",
                              e->mem_need / 1048576.0);
  }
  KQSVD_CALL(kqsvd_mpi_agree(e->ctx.comm, local));
  r.layer.heads = (int)e->dims.heads;
  r.layer.kv_heads = (int)e->dims.kv_heads;
  r.layer.d = (int)d;
  r.layer.scale_dim = (int)e->hd;
  r.layer.hidden = (int)e->dims.hidden;
  r.layer.causal = (int)e->dims.causal;
  r.layer.o_proj = r.W;

  kqsvd_progress_fn show;
  void *show_ctx;
  double every;
  kqsvd_observe_begin(e->obs, "evaluate", e->tokens, 0, &show, &show_ctx, &every);
  KQSVD_CALL(kqsvd_monitor_init(e->ctx.comm, total_work, show, show_ctx, every, &r.mon));
  int stop = 0;
  local = run_units(&r, scale, &stop);
  if (local == KQSVD_OK && stop) local = KQSVD_ERR_REMOTE; /* the failing rank reports */
  if (local != KQSVD_OK && local != KQSVD_ERR_REMOTE) KQSVD_CALL(kqsvd_monitor_raise(r.mon));
  KQSVD_CALL(kqsvd_monitor_finish(r.mon, r.work, local));
  KQSVD_CALL(combine(&r));
done:
  kqsvd_monitor_free(&r.mon);
  kqsvd_shard_close(&r.sh);
  kqsvd_eval_ws_free(&r.ws);
  free(r.proj);
  free(r.W);
  free(r.K);
  free(r.V);
  free(r.Q);
  free(r.raw);
  free(r.heads);
  free(r.acc);
  return st;
}
