/* The streaming stage of `kqsvd calibrate --qr scalapack`: the classic
 * distributed QR that TSQR is benchmarked against.  For each (layer, KV
 * group) and each of K, stacked Q and V, every rank reads all its rows into
 * a float64 row block of one matrix distributed over a ranks x 1 grid, and
 * ScaLAPACK's pdgeqrf factors it (with head groups: keys and values of the
 * G heads side by side, each KV head's stacked queries on their own).  Memory per rank therefore
 * grows with the calibration set, unlike the TSQR stream. */
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
  kqsvd_pqr_t *pqr;   /* G hd wide: keys, values, and the queries when G = 1 */
  kqsvd_pqr_t *pqr_q; /* head groups: hd wide, one KV head's stacked queries */
  kqsvd_monitor_t *mon;
  int64_t work;
} pqr_stream_t;

/* Reads tensor t of item `item` into the local block of `pqr`, in segment
 * order (R does not depend on the order of rows): the G keys or values
 * heads side by side (head h in columns [h hd, (h + 1) hd)), or the query
 * heads of the item's KV head j (all G m of them when G = 1) stacked (head
 * h in rows [h s->rows, (h + 1) s->rows)). */
static kqsvd_status_t load(pqr_stream_t *s, kqsvd_pqr_t *pqr, int64_t item, kqsvd_tensor_t t,
                           int64_t j, int *stop) {
  kqsvd_status_t st = KQSVD_OK;
  calib_t *c = s->c;
  const int64_t d = c->hd, G = c->G, layer = item / c->dims.kv_heads;
  const int64_t g0 = (item % c->dims.kv_heads) * G, q = t == KQSVD_QUERIES;
  const int64_t nh = q ? (G == 1 ? c->group : c->m) : G;
  const int64_t head0 = q ? (g0 + (G == 1 ? 0 : j)) * c->m : g0;
  double *A = kqsvd_pqr_local(pqr);
  const int64_t ld = kqsvd_pqr_ld(pqr);
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
        double *to = q ? A + h * s->rows + off : A + h * d * ld + off;
        const int64_t bad =
            kqsvd_convert_transpose(type, c->raw + (size_t)(h * n * d) * esz, n, (int)d, to, ld);
        KQSVD_CHECK(bad < 0, KQSVD_ERR_DATA,
                    "%s: dataset '%s': NaN or Inf at layer %lld, head %lld, row %lld",
                    kqsvd_shard_path(s->sh[k]), kqsvd_tensor_name(t), (long long)layer,
                    (long long)(head0 + h), (long long)(r0 + bad));
      }
      c->t_fold += kqsvd_now() - t0;
      off += n;
      s->work += n * (q ? nh : 1); /* as the stream counts: a group's keys once */
      KQSVD_CALL(kqsvd_monitor_update(s->mon, s->work, stop));
    }
  }
done:
  return st;
}

/* One factor: load, then pdgeqrf of the loaded rows into R (w x w). */
static kqsvd_status_t factor_one(pqr_stream_t *s, kqsvd_pqr_t *pqr, int64_t item, kqsvd_tensor_t t,
                                 int64_t j, int64_t heads, double *R, int *stop) {
  kqsvd_status_t st = KQSVD_OK;
  calib_t *c = s->c;
  /* pdgeqrf is collective: a rank that failed to read must not leave the
   * others inside it. */
  const kqsvd_status_t local = load(s, pqr, item, t, j, stop);
  /* The others stop reading at their next block instead of finishing. */
  if (local != KQSVD_OK) kqsvd_monitor_raise(s->mon);
  KQSVD_CALL(kqsvd_mpi_agree(c->ctx.comm, *stop && local == KQSVD_OK ? KQSVD_ERR_REMOTE : local));
  const double t0 = kqsvd_now();
  KQSVD_CALL(kqsvd_mpi_agree(c->ctx.comm, kqsvd_pqr_factor(pqr, heads * s->rows, R)));
  c->t_fold += kqsvd_now() - t0;
  c->rows_folded += (double)(heads * s->rows);
done:
  return st;
}

/* Every item's three factors, on every rank (no reduction follows).  With
 * head groups the queries' factor is block-diagonal: KV head j's block is
 * the R factor of its query heads stacked (R(Q_bd) = blockdiag(R_Qj)). */
static kqsvd_status_t factor_all(pqr_stream_t *s) {
  kqsvd_status_t st = KQSVD_OK;
  calib_t *c = s->c;
  const int d = (int)c->d, hd = (int)c->hd, G = (int)c->G;
  const size_t tri = kqsvd_tri_size(d);
  const kqsvd_tensor_t tens[CAL_NR] = {KQSVD_KEYS, KQSVD_QUERIES, KQSVD_VALUES};
  double *R = NULL, *Rj = NULL;
  int stop = 0;
  KQSVD_MALLOC(R, (size_t)d * (size_t)d, "R factor");
  KQSVD_MALLOC(Rj, (size_t)hd * (size_t)hd, "R factor of a KV head's queries");
  for (int64_t i = 0; i < c->nitems; i++)
    for (int k = 0; k < CAL_NR; k++) {
      if (tens[k] != KQSVD_QUERIES || G == 1) {
        KQSVD_CALL(factor_one(s, s->pqr, i, tens[k], 0, tens[k] == KQSVD_QUERIES ? c->group : 1, R,
                              &stop));
      } else {
        memset(R, 0, (size_t)d * (size_t)d * sizeof *R);
        for (int j = 0; j < G; j++) {
          KQSVD_CALL(factor_one(s, s->pqr_q, i, KQSVD_QUERIES, j, c->m, Rj, &stop));
          for (int col = 0; col < hd; col++)
            memcpy(R + ((size_t)j * hd + (size_t)col) * (size_t)d + (size_t)j * hd,
                   Rj + (size_t)col * hd, (size_t)hd * sizeof *R);
        }
      }
      kqsvd_tri_pack(d, R, c->state + ((size_t)i * CAL_NR + (size_t)k) * tri);
    }
done:
  free(R);
  free(Rj);
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
   * counted it under --mem-limit.  With head groups, keys and values are
   * G hd wide and each KV head's queries hd wide, in blocks of their own. */
  KQSVD_CALL(kqsvd_mpi_agree(
      comm, kqsvd_pqr_init(comm, (int)c->d, s.rows * (c->G == 1 ? c->group : 1), &s.pqr)));
  if (c->G > 1)
    KQSVD_CALL(kqsvd_mpi_agree(comm, kqsvd_pqr_init(comm, (int)c->hd, s.rows * c->m, &s.pqr_q)));

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
  if (st == KQSVD_OK || kqsvd_error_is_collective()) {
    kqsvd_pqr_free(&s.pqr);
    kqsvd_pqr_free(&s.pqr_q);
  }
  return st;
}
