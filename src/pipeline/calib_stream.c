/* The streaming stage of kqsvd calibrate: every row of this rank's segments
 * is read once and folded into the running R factors of its (layer, KV
 * group), in the same order whatever the read size, so checkpoints resume
 * bit for bit. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "calib.h"
#include "kqsvd_gram.h"
#include "kqsvd_linalg.h"
#include "kqsvd_signal.h"
#include "kqsvd_util.h"

/* A shard cut between several ranks is opened with MPI-IO by exactly those
 * ranks; whole shards are opened by their one reader with the default
 * driver when their turn comes. */
typedef struct {
  kqsvd_shard_t *sh;
  MPI_Comm comm;
} shared_t;

typedef struct {
  calib_t *c;
  kqsvd_monitor_t *mon;
  shared_t *shared;   /* one per local segment */
  int64_t nseg, work; /* local segments; work units done */
  double last_save;
  int saves;
  int kept;     /* a checkpoint of this rank is in the folder (loaded or saved) */
  int signal;   /* the signal that stopped this rank (0: none) */
  int delay_ms; /* test hook: KQSVD_TEST_READ_DELAY_MS per read */
} stream_t;

/* Opens every shard this rank shares with others, together with exactly
 * the ranks that read part of it. */
static kqsvd_status_t open_shared(stream_t *s) {
  kqsvd_status_t st = KQSVD_OK;
  calib_t *c = s->c;
  const int me = c->ctx.rank;
  int *readers = NULL;
  MPI_Group world = MPI_GROUP_NULL, grp = MPI_GROUP_NULL;
  KQSVD_MALLOC(readers, c->ctx.size, "shard reader ranks");
  KQSVD_MPI(MPI_Comm_group(c->ctx.comm, &world));
  /* Every rank meets its shared shards in increasing order, so these
   * group-collective opens cannot deadlock.  A rank between two readers
   * may read nothing of the shard (fewer rows than ranks): it must not be
   * in the group, or the readers wait for it forever. */
  for (int64_t k = 0; k < s->nseg; k++) {
    const int64_t sh = c->segs[c->seg_first[me] + k].shard;
    const int n = kqsvd_partition_readers(c->segs, c->seg_first, c->ctx.size, sh, readers);
    if (n < 2) continue;
    KQSVD_MPI(MPI_Group_incl(world, n, readers, &grp));
    KQSVD_MPI(MPI_Comm_create_group(c->ctx.comm, grp, (int)(sh % 32768), &s->shared[k].comm));
    MPI_Group_free(&grp);
    KQSVD_CALL(kqsvd_shard_open(c->cfg.shards[sh], s->shared[k].comm, &s->shared[k].sh));
  }
done:
  if (grp != MPI_GROUP_NULL) MPI_Group_free(&grp);
  if (world != MPI_GROUP_NULL) MPI_Group_free(&world);
  free(readers);
  return st;
}

static void close_shared(stream_t *s) {
  for (int64_t k = 0; s->shared && k < s->nseg; k++) {
    kqsvd_shard_close(&s->shared[k].sh);
    if (s->shared[k].comm != MPI_COMM_NULL) MPI_Comm_free(&s->shared[k].comm);
  }
}

static kqsvd_status_t save_checkpoint(stream_t *s, int64_t seg, int64_t item) {
  kqsvd_status_t st = KQSVD_OK;
  calib_t *c = s->c;
  kqsvd_checkpoint_pos_t pos = {seg, item};
  if (c->gpu) KQSVD_CALL(calib_gpu_sync(c, 1));
  c->state = kqsvd_acc_state(c->acc); /* the item just finished, packed */
  if (item == c->nitems) pos.segment = seg + 1, pos.item = 0;
  KQSVD_CALL(kqsvd_checkpoint_save(
      c->cfg.ckpt_dir, c->ctx.rank, c->ctx.size, c->fingerprint, c->about, pos,
      c->nitems * CAL_NR * (int64_t)kqsvd_tri_size((int)c->d), c->state));
  s->last_save = kqsvd_now();
  s->saves++;
  s->kept = 1;
  /* Test hook: die like `kill -9` right after the n-th checkpoint. */
  const char *kill_after = getenv("KQSVD_TEST_KILL_AFTER_CHECKPOINTS");
  const char *kill_rank = getenv("KQSVD_TEST_KILL_RANK");
  if (kill_after && s->saves == atoi(kill_after) &&
      c->ctx.rank == (kill_rank ? atoi(kill_rank) : 0))
    raise(SIGKILL);
done:
  return st;
}

/* Side by side: rows j0 .. j0+nj of the G heads' blocks of n rows (as
 * read, [G][n][hd]) into c->joint, [nj][G hd]. */
static const char *join_heads(calib_t *c, const char *blocks, size_t esz, int64_t n, int64_t j0,
                              int64_t nj) {
  const size_t row = (size_t)c->hd * esz;
  for (int64_t i = 0; i < nj; i++)
    for (int64_t h = 0; h < c->G; h++)
      memcpy(c->joint + ((size_t)(i * c->G + h)) * row, blocks + ((size_t)(h * n + j0 + i)) * row,
             row);
  return c->joint;
}

/* Folds nj rows starting at row j0 of each block just read: keys, the
 * item's query heads, values ([G][n][hd], [G m][n][hd], [G][n][hd]). */
static kqsvd_status_t fold(stream_t *s, const kqsvd_shard_t *sh, int64_t item, int64_t r0,
                           int64_t n, int64_t j0, int64_t nj) {
  kqsvd_status_t st = KQSVD_OK;
  calib_t *c = s->c;
  const int64_t d = c->hd, m = c->m, G = c->G;
  const int64_t g0 = (item % c->dims.kv_heads) * G, layer = item / c->dims.kv_heads;
  const kqsvd_tensor_t tens[3] = {KQSVD_KEYS, KQSVD_QUERIES, KQSVD_VALUES};
  const int64_t heads[3] = {G, G * m, G};
  char *base = c->raw;
  for (int t = 0; t < 3; t++) {
    const kqsvd_dtype_t type = kqsvd_shard_dtype(sh, tens[t]);
    const size_t esz = kqsvd_dtype_size(type);
    const int q = tens[t] == KQSVD_QUERIES;
    /* Keys and values of a group fold as whole rows, queries per head. */
    for (int64_t h = 0; h < (q ? heads[t] : 1); h++) {
      const char *rows = base + (size_t)((h * n + j0) * d) * esz;
      if (!q && G > 1) rows = join_heads(c, base, esz, n, j0, nj);
      const double t0 = kqsvd_now();
      kqsvd_status_t got = kqsvd_acc_absorb(c->acc, tens[t], layer, q ? g0 + h / m : g0,
                                            q ? h % m : 0, rows, type, nj, q ? d : d * G);
      c->t_fold += kqsvd_now() - t0;
      c->rows_folded += (double)nj;
      c->flops_folded += 2.0 * (double)nj * (double)(q ? d * d : d * d * G * G);
      const int64_t bad = got == KQSVD_ERR_DATA ? kqsvd_acc_bad_row(c->acc) : -1;
      if (bad >= 0) kqsvd_error_clear(); /* named below, with the file and the shard's row */
      KQSVD_CHECK(bad < 0 || q || G == 1, KQSVD_ERR_DATA,
                  "%s: dataset '%s': NaN or Inf at layer %lld, heads %lld..%lld, row %lld",
                  kqsvd_shard_path(sh), kqsvd_tensor_name(tens[t]), (long long)layer, (long long)g0,
                  (long long)(g0 + G - 1), (long long)(r0 + j0 + bad));
      KQSVD_CHECK(bad < 0, KQSVD_ERR_DATA,
                  "%s: dataset '%s': NaN or Inf at layer %lld, head %lld, row %lld",
                  kqsvd_shard_path(sh), kqsvd_tensor_name(tens[t]), (long long)layer,
                  (long long)(q ? g0 * m + h : g0), (long long)(r0 + j0 + bad));
      KQSVD_CALL(got);
    }
    base += (size_t)(heads[t] * n * d) * esz;
  }
done:
  return st;
}

/* All rows of one segment for one item. */
static kqsvd_status_t stream_item(stream_t *s, kqsvd_shard_t *sh, const kqsvd_segment_t *seg,
                                  int64_t item, int *stop) {
  kqsvd_status_t st = KQSVD_OK;
  calib_t *c = s->c;
  const int64_t d = c->hd, G = c->G, g = (item % c->dims.kv_heads) * G;
  const int64_t layer = item / c->dims.kv_heads, mq = c->group; /* the group's query heads */
  /* The previous item goes back into the state, so that discarding this
   * one below cannot touch it. */
  if (!c->gpu) c->state = kqsvd_acc_state(c->acc);
  for (int64_t r0 = seg->row0; r0 < seg->row1 && !*stop; r0 += c->io_rows) {
    const int64_t n = seg->row1 - r0 < c->io_rows ? seg->row1 - r0 : c->io_rows;
    char *const block = c->gpu ? calib_gpu_buffer(c, item) : c->raw, *p = block;
    const double t0 = kqsvd_now();
    KQSVD_CALL(kqsvd_shard_read(sh, KQSVD_KEYS, layer, g, G, r0, n, p));
    p += (size_t)(G * n * d) * kqsvd_dtype_size(kqsvd_shard_dtype(sh, KQSVD_KEYS));
    KQSVD_CALL(kqsvd_shard_read(sh, KQSVD_QUERIES, layer, g * c->m, mq, r0, n, p));
    p += (size_t)(mq * n * d) * kqsvd_dtype_size(kqsvd_shard_dtype(sh, KQSVD_QUERIES));
    KQSVD_CALL(kqsvd_shard_read(sh, KQSVD_VALUES, layer, g, G, r0, n, p));
    p += (size_t)(G * n * d) * kqsvd_dtype_size(kqsvd_shard_dtype(sh, KQSVD_VALUES));
    if (s->delay_ms > 0) {
      const struct timespec pause = {s->delay_ms / 1000, (long)(s->delay_ms % 1000) * 1000000L};
      nanosleep(&pause, NULL);
    }
    c->t_read += kqsvd_now() - t0;
    c->bytes_read += (double)(p - block);
    /* Sub-blocks in row order, K then each query head then V: the order
     * of updates of each factor does not depend on io_rows.  The GPU takes
     * the whole block at once. */
    if (c->gpu) KQSVD_CALL(calib_gpu_fold_read(c, sh, item, r0, n, block));
    for (int64_t j0 = 0; !c->gpu && j0 < n; j0 += c->cfg.qr_block)
      KQSVD_CALL(fold(s, sh, item, r0, n, j0, n - j0 < c->cfg.qr_block ? n - j0 : c->cfg.qr_block));
    s->work += n * (mq + 2);
    KQSVD_CALL(kqsvd_monitor_update(s->mon, s->work, stop));
    if (!s->signal && kqsvd_signal_pending()) {
      s->signal = kqsvd_signal_pending();
      KQSVD_CALL(kqsvd_monitor_raise(s->mon));
      *stop = 1;
    }
  }
  /* A stopped item keeps the factors it had before it, so that a
   * checkpoint taken now resumes at its start. */
  if (!c->gpu && *stop) kqsvd_acc_discard(c->acc);
done:
  return st;
}

static kqsvd_status_t stream_segments(stream_t *s) {
  kqsvd_status_t st = KQSVD_OK;
  calib_t *c = s->c;
  kqsvd_shard_t *own = NULL;
  int stop = 0;
  int64_t k = c->pos.segment, i = 0;
  const kqsvd_segment_t *segs = c->segs + c->seg_first[c->ctx.rank];
  for (; k < s->nseg; k++) {
    kqsvd_shard_t *sh = s->shared[k].sh;
    if (!sh) {
      KQSVD_CALL(kqsvd_shard_open(c->cfg.shards[segs[k].shard], MPI_COMM_NULL, &own));
      sh = own;
    }
    for (i = k == c->pos.segment ? c->pos.item : 0; i < c->nitems; i++) {
      KQSVD_CALL(stream_item(s, sh, &segs[k], i, &stop));
      if (stop) break;
      /* Every finished segment is kept; long ones also on a timer. */
      const int last = i + 1 == c->nitems;
      if (c->cfg.ckpt_dir && (last || kqsvd_now() - s->last_save >= c->cfg.ckpt_every))
        KQSVD_CALL(save_checkpoint(s, k, i + 1));
    }
    /* A NaN met on the GPU is named while its shard is still open. */
    if (c->gpu) KQSVD_CALL(calib_gpu_sync(c, 0));
    kqsvd_shard_close(&own);
    if (stop) break;
  }
  /* One that came after the last block still stops the run here. */
  if (!stop && kqsvd_signal_pending()) s->signal = kqsvd_signal_pending(), stop = 1;
  /* Stopped by a signal here or by another rank: keep what is done.  On a
   * GPU the factors of the stopped item are already changed, so the last
   * regular checkpoint stands. */
  if (stop && c->cfg.ckpt_dir && !c->gpu && k < s->nseg) KQSVD_CALL(save_checkpoint(s, k, i));
  /* A GPU run stopped before its first checkpoint has none to name (and
   * leaves no empty folder it made). */
  const int saved = c->cfg.ckpt_dir && (s->kept || !c->gpu);
  if (stop && s->signal && saved)
    KQSVD_FAIL(KQSVD_ERR_INTERRUPTED,
               "interrupted by %s; checkpoint saved in %s: run the same command again to resume",
               strsignal(s->signal), c->cfg.ckpt_dir);
  if (stop && s->signal)
    KQSVD_FAIL(
        KQSVD_ERR_INTERRUPTED, "interrupted by %s; %s, so nothing is kept", strsignal(s->signal),
        c->cfg.ckpt_dir ? "it stopped before its first checkpoint" : "no --checkpoint was given");
  if (stop)
    st = KQSVD_ERR_REMOTE; /* the failing rank reports */
  else if (c->gpu)
    KQSVD_CALL(calib_gpu_sync(c, 1));
done:
  kqsvd_shard_close(&own);
  return st;
}

/* Work units: rows times the heads they are read for. */
static int64_t work_before(const calib_t *c, const kqsvd_segment_t *segs) {
  int64_t w = 0;
  for (int64_t k = 0; k < c->pos.segment; k++) w += (segs[k].row1 - segs[k].row0) * c->nitems;
  if (c->pos.item > 0) w += (segs[c->pos.segment].row1 - segs[c->pos.segment].row0) * c->pos.item;
  return w * (c->group + 2);
}

kqsvd_status_t calib_stream(calib_t *c) {
  kqsvd_status_t st = KQSVD_OK, local = KQSVD_OK;
  MPI_Comm comm = c->ctx.comm;
  stream_t s;
  memset(&s, 0, sizeof s);
  s.c = c;
  /* Test hook: slow reads, so that a test can signal a run mid-stream. */
  s.delay_ms = getenv("KQSVD_TEST_READ_DELAY_MS") ? atoi(getenv("KQSVD_TEST_READ_DELAY_MS")) : 0;
  s.nseg = c->seg_first[c->ctx.rank + 1] - c->seg_first[c->ctx.rank];
  const int64_t nvals = kqsvd_acc_state_doubles(c->acc);
  c->state = kqsvd_acc_state(c->acc);
  c->pos.segment = c->pos.item = 0;
  int found = 0;
  if (c->cfg.ckpt_dir) {
    local = kqsvd_checkpoint_load(c->cfg.ckpt_dir, c->ctx.rank, c->ctx.size, c->fingerprint, nvals,
                                  c->state, &c->pos, &found);
    if (local == KQSVD_OK &&
        (c->pos.segment < 0 || c->pos.segment > s.nseg || c->pos.item < 0 ||
         c->pos.item >= c->nitems || (c->pos.segment == s.nseg && c->pos.item != 0)))
      local = kqsvd_error_set(KQSVD_ERR_INPUT, __FILE__, __LINE__, __func__,
                              "checkpoint in %s does not fit this run's plan", c->cfg.ckpt_dir);
    KQSVD_CALL(kqsvd_mpi_agree(comm, local));
  }
  KQSVD_MALLOC(s.shared, (size_t)s.nseg + 1, "shared shard handles");
  for (int64_t k = 0; k <= s.nseg; k++) s.shared[k].sh = NULL, s.shared[k].comm = MPI_COMM_NULL;
  st = open_shared(&s);
  if (st != KQSVD_OK) {
    /* Partners of a failed group-collective open stay blocked in it, so no
     * agreement can be reached: main() aborts every rank. */
    s.nseg = 0;
    kqsvd_error_mark_local();
    goto done;
  }

  if (c->device >= 0) KQSVD_CALL(kqsvd_mpi_agree(comm, calib_gpu_start(c, c->device)));
  s.work = work_before(c, c->segs + c->seg_first[c->ctx.rank]);
  int64_t base = 0;
  int resumed = 0;
  KQSVD_MPI(MPI_Allreduce(&s.work, &base, 1, MPI_INT64_T, MPI_SUM, comm));
  KQSVD_MPI(MPI_Allreduce(&found, &resumed, 1, MPI_INT, MPI_SUM, comm));
  const int64_t total = c->tokens * c->nitems * (c->group + 2);
  if (c->ctx.rank == 0 && resumed)
    kqsvd_observe(c->obs, KQSVD_LOG_INFO,
                  "kqsvd calibrate: resuming %d of %d ranks from "
                  "checkpoints in %s, %.1f%% already done\n",
                  resumed, c->ctx.size, c->cfg.ckpt_dir, 100.0 * (double)base / (double)total);
  kqsvd_progress_fn show;
  void *show_ctx;
  double every;
  kqsvd_observe_begin(c->obs, "calibrate", c->tokens, base, &show, &show_ctx, &every);
  KQSVD_CALL(kqsvd_monitor_init(comm, total, show, show_ctx, every, &s.mon));
  s.last_save = kqsvd_now();
  s.kept = found;
  const double t0 = kqsvd_now();
  /* A signal now stops every rank at its next block, with a checkpoint. */
  kqsvd_signal_defer(1);
  local = stream_segments(&s);
  kqsvd_signal_defer(0);
  if (local != KQSVD_OK && local != KQSVD_ERR_REMOTE) KQSVD_CALL(kqsvd_monitor_raise(s.mon));
  c->t_stream = kqsvd_now() - t0;
  c->streamed = (double)c->tokens * (double)(total - base) / (double)total;
  c->state = kqsvd_acc_state(c->acc); /* the last item, packed for the reduction */
  st = kqsvd_monitor_finish(s.mon, s.work, local);
done:
  /* Collective closes of shared shards, in the order they were opened; only
   * when every rank knows the outcome (otherwise main() aborts). */
  if (st == KQSVD_OK || kqsvd_error_is_collective()) close_shared(&s);
  kqsvd_monitor_free(&s.mon);
  calib_gpu_stop(c);
  free(s.shared);
  return st;
}
