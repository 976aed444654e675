/* The streaming stage of `kqsvd calibrate --qr scalapack`: the classic
 * distributed QR that TSQR is benchmarked against.  For each (layer, KV
 * group) and each of K, stacked Q and V, every rank reads all its rows into
 * a float64 row block of one matrix distributed over a ranks x 1 grid, and
 * ScaLAPACK's pdgeqrf factors it.  Memory per rank therefore grows with the
 * calibration set, unlike the TSQR stream. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "calib.h"
#include "kqsvd_linalg.h"
#include "kqsvd_util.h"

int64_t calib_rank_rows(const calib_t *c, int p) {
  int64_t n = 0;
  for (int64_t k = c->seg_first[p]; k < c->seg_first[p + 1]; k++)
    n += c->segs[k].row1 - c->segs[k].row0;
  return n;
}

typedef struct {
  calib_t *c;
  kqsvd_shard_t **sh; /* one per local segment, opened independently */
  const kqsvd_segment_t *segs;
  int64_t nseg, rows; /* local segments and their rows */
  kqsvd_pqr_t *pqr;
  kqsvd_monitor_t *mon;
  int64_t work;
} pqr_stream_t;

/* Reads tensor t of item `item` (nh heads from head0) into the local block:
 * head h's rows go to rows [h * s->rows, (h + 1) * s->rows), in segment
 * order (R does not depend on the order of rows). */
static kqsvd_status_t load(pqr_stream_t *s, int64_t item, kqsvd_tensor_t t, int *stop) {
  kqsvd_status_t st = KQSVD_OK;
  calib_t *c = s->c;
  const int64_t d = c->d, layer = item / c->dims.kv_heads, g = item % c->dims.kv_heads;
  const int64_t nh = t == KQSVD_QUERIES ? c->group : 1, head0 = t == KQSVD_QUERIES ? g * nh : g;
  double *A = kqsvd_pqr_local(s->pqr);
  const int64_t ld = kqsvd_pqr_ld(s->pqr);
  int64_t off = 0;
  for (int64_t k = 0; k < s->nseg && !*stop; k++) {
    const kqsvd_segment_t *seg = &s->segs[k];
    const kqsvd_dtype_t type = kqsvd_shard_dtype(s->sh[k], t);
    const size_t esz = kqsvd_dtype_size(type);
    for (int64_t r0 = seg->row0; r0 < seg->row1 && !*stop; r0 += c->io_rows) {
      const int64_t n = seg->row1 - r0 < c->io_rows ? seg->row1 - r0 : c->io_rows;
      double t0 = kqsvd_now();
      KQSVD_CALL(kqsvd_shard_read(s->sh[k], t, layer, head0, nh, r0, n, c->raw));
      c->t_read += kqsvd_now() - t0;
      c->bytes_read += (double)((size_t)(nh * n * d) * esz);
      t0 = kqsvd_now();
      for (int64_t h = 0; h < nh; h++) {
        const int64_t bad = kqsvd_convert_transpose(type, c->raw + (size_t)(h * n * d) * esz, n,
                                                    (int)d, A + h * s->rows + off, ld);
        KQSVD_CHECK(bad < 0, KQSVD_ERR_DATA,
                    "%s: dataset '%s': NaN or Inf at layer %lld, head %lld, row %lld",
                    kqsvd_shard_path(s->sh[k]), kqsvd_tensor_name(t), (long long)layer,
                    (long long)(head0 + h), (long long)(r0 + bad));
      }
      c->t_fold += kqsvd_now() - t0;
      off += n;
      s->work += n * nh;
      KQSVD_CALL(kqsvd_monitor_update(s->mon, s->work, stop));
    }
  }
done:
  return st;
}

/* Every item's three factors, on every rank (no reduction follows). */
static kqsvd_status_t factor_all(pqr_stream_t *s) {
  kqsvd_status_t st = KQSVD_OK;
  calib_t *c = s->c;
  const int d = (int)c->d;
  const size_t tri = kqsvd_tri_size(d);
  const kqsvd_tensor_t tens[CAL_NR] = {KQSVD_KEYS, KQSVD_QUERIES, KQSVD_VALUES};
  const int64_t heads[CAL_NR] = {1, c->group, 1};
  double *R = NULL;
  int stop = 0;
  KQSVD_MALLOC(R, (size_t)d * (size_t)d, "R factor");
  for (int64_t i = 0; i < c->nitems; i++)
    for (int k = 0; k < CAL_NR; k++) {
      /* pdgeqrf is collective: a rank that failed to read must not leave
       * the others inside it. */
      const kqsvd_status_t local = load(s, i, tens[k], &stop);
      /* The others stop reading at their next block instead of finishing. */
      if (local != KQSVD_OK) kqsvd_monitor_raise(s->mon);
      KQSVD_CALL(
          kqsvd_mpi_agree(c->ctx.comm, stop && local == KQSVD_OK ? KQSVD_ERR_REMOTE : local));
      const double t0 = kqsvd_now();
      KQSVD_CALL(kqsvd_mpi_agree(c->ctx.comm, kqsvd_pqr_factor(s->pqr, heads[k] * s->rows, R)));
      c->t_fold += kqsvd_now() - t0;
      c->rows_folded += (double)(heads[k] * s->rows);
      kqsvd_tri_pack(d, R, c->state + ((size_t)i * CAL_NR + (size_t)k) * tri);
    }
done:
  free(R);
  return st;
}

kqsvd_status_t calib_stream_pqr(calib_t *c) {
  kqsvd_status_t st = KQSVD_OK, local = KQSVD_OK;
  MPI_Comm comm = c->ctx.comm;
  const int me = c->ctx.rank;
  pqr_stream_t s;
  memset(&s, 0, sizeof s);
  s.c = c;
  s.segs = c->segs + c->seg_first[me];
  s.nseg = c->seg_first[me + 1] - c->seg_first[me];
  s.rows = calib_rank_rows(c, me);

  /* The block holds the group's stacked queries, the largest matrix; plan()
   * counted it under --mem-limit. */
  KQSVD_CALL(kqsvd_mpi_agree(comm, kqsvd_pqr_init(comm, (int)c->d, s.rows * c->group, &s.pqr)));

  KQSVD_MALLOC(s.sh, (size_t)s.nseg + 1, "shard handles");
  for (int64_t k = 0; k < s.nseg; k++) s.sh[k] = NULL;
  for (int64_t k = 0; k < s.nseg && local == KQSVD_OK; k++)
    local = kqsvd_shard_open(c->cfg.shards[s.segs[k].shard], MPI_COMM_NULL, &s.sh[k]);
  KQSVD_CALL(kqsvd_mpi_agree(comm, local));

  const int64_t total = c->tokens * c->nitems * (c->group + 2);
  kqsvd_progress_fn show;
  void *show_ctx;
  double every;
  kqsvd_observe_begin(c->obs, "calibrate", c->tokens, 0, &show, &show_ctx, &every);
  KQSVD_CALL(kqsvd_monitor_init(comm, total, show, show_ctx, every, &s.mon));
  const double t0 = kqsvd_now();
  local = factor_all(&s);
  c->t_stream = kqsvd_now() - t0;
  c->streamed = (double)c->tokens;
  /* factor_all ends in agreement, so the monitor only drains and shows. */
  st = kqsvd_monitor_finish(s.mon, s.work, local);
done:
  kqsvd_monitor_free(&s.mon);
  for (int64_t k = 0; s.sh && k < s.nseg; k++) kqsvd_shard_close(&s.sh[k]);
  free(s.sh);
  /* Collective; only when every rank got here alike (else main() aborts). */
  if (st == KQSVD_OK || kqsvd_error_is_collective()) kqsvd_pqr_free(&s.pqr);
  return st;
}
