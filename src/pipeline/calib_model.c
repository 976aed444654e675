/* One model's calibration, from validated options to its written output:
 * input validation, the work plan under --mem-limit, the accumulator and
 * the W^O factors, the stages (calib_stream.c or calib_pqr.c, then
 * calib_finish.c), the summary; and what --skip-done and manifests compare
 * (the inputs hash). */
#include "calib.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kqsvd_gpu.h"
#include "kqsvd_h5.h"
#include "kqsvd_identity.h"
#include "kqsvd_isa.h"
#include "kqsvd_linalg.h"
#include "kqsvd_util.h"

void calib_inputs_hash(calib_t *c) {
  char policy[64];
  uint64_t h = kqsvd_hash_file(KQSVD_FNV_INIT, c->cfg.model_path);
  for (int s = 0; s < c->cfg.nshards; s++) h = kqsvd_hash_file(h, c->cfg.shards[s]);
  kqsvd_rank_policy_format(&c->cfg.ranks, policy, sizeof policy);
  h = kqsvd_fnv1a(h, policy, strlen(policy) + 1);
  h = kqsvd_fnv1a(h, &c->cfg.beta, sizeof c->cfg.beta);
  h = kqsvd_fnv1a(h, &c->cfg.qr_block, sizeof c->cfg.qr_block);
  if (c->cfg.head_groups != 1) h = kqsvd_fnv1a(h, &c->cfg.head_groups, sizeof(int64_t));
  /* Only the default method keeps the hash of outputs made before --qr. */
  if (c->cfg.qr != KQSVD_CALIB_QR_TSQR)
    h = kqsvd_fnv1a(h, kqsvd_calib_qr_name(c->cfg.qr), strlen(kqsvd_calib_qr_name(c->cfg.qr)) + 1);
  h = kqsvd_fnv1a(h, KQSVD_VERSION, sizeof KQSVD_VERSION);
  snprintf(c->inputs_hash, sizeof c->inputs_hash, "%016llx", (unsigned long long)h);
}

int calib_up_to_date(const calib_t *c) {
  char stored[64] = "";
  hid_t f = -1;
  struct stat sb;
  if (stat(c->cfg.out_path, &sb) != 0) return 0;
  if (kqsvd_h5_open_read(c->cfg.out_path, MPI_COMM_NULL, &f) != KQSVD_OK) {
    kqsvd_error_clear();
    return 0;
  }
  const int have =
      H5Aexists(f, "inputs_hash") > 0 &&
      kqsvd_h5_attr_str(f, c->cfg.out_path, "inputs_hash", stored, sizeof stored) == KQSVD_OK;
  kqsvd_error_clear();
  kqsvd_h5_close(&f);
  return have && strcmp(stored, c->inputs_hash) == 0;
}

/* Every rank opens the model (small) and ranks share the shard headers. */
static kqsvd_status_t validate_inputs(calib_t *c) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_shard_set_t set;
  memset(&set, 0, sizeof set);
  KQSVD_CALL(kqsvd_mpi_agree(c->ctx.comm, kqsvd_model_open(c->cfg.model_path, &c->model)));
  c->dims = *kqsvd_model_dims(c->model);
  c->d = c->dims.head_dim;
  c->group = c->dims.heads / c->dims.kv_heads;
  c->nitems = c->dims.layers * c->dims.kv_heads;
  KQSVD_CALL(kqsvd_scan_shards(&c->ctx, c->obs, "calibrate", c->cfg.shards, c->cfg.nshards,
                               &c->dims, c->cfg.model_path, kqsvd_model_rope(c->model),
                               kqsvd_dtype_size(kqsvd_model_dtype(c->model)), 0, &set));
  /* Carried into the output, so the projections say which keys they are
   * for; the shards agree with it (kqsvd_scan_shards). */
  snprintf(c->rope, sizeof c->rope, "%s", kqsvd_model_rope(c->model));
  c->shard_rows = set.rows;
  set.rows = NULL;
  c->elem_max = set.elem_max;
  c->tokens = set.tokens;
  c->sequences = set.sequences;
  c->seq_max = set.seq_max;
done:
  kqsvd_shard_set_free(&set);
  return st;
}

/* The split of rows and items, buffer sizes under --mem-limit, and the
 * fingerprint that ties checkpoints to exactly these inputs. */
static kqsvd_status_t plan(calib_t *c) {
  kqsvd_status_t st = KQSVD_OK;
  const int P = c->ctx.size;
  /* From here on the items are the group view's (calib.h). */
  c->G = c->cfg.head_groups;
  c->hd = c->d;
  c->m = c->group;
  KQSVD_CHECK(c->dims.kv_heads % c->G == 0, KQSVD_ERR_USAGE,
              "--head-groups %lld does not divide the %lld KV heads of %s", (long long)c->G,
              (long long)c->dims.kv_heads, c->cfg.model_path);
  c->dims.kv_heads /= c->G;
  c->dims.head_dim *= c->G;
  c->d = c->dims.head_dim;
  c->group = c->m * c->G;
  c->nitems = c->dims.layers * c->dims.kv_heads;
  KQSVD_CALL(kqsvd_rank_policy_check(&c->cfg.ranks, (int)c->dims.layers, (int)c->d));
  KQSVD_CALL(kqsvd_partition_rows(c->cfg.nshards, c->shard_rows, P, 0.1, &c->segs, &c->seg_first));
  kqsvd_partition_items(c->nitems, P, c->ctx.rank, &c->own0, &c->own1);

  const double mib = 1048576.0, d = (double)c->d;
  const double state = (double)c->nitems * CAL_NR * (double)kqsvd_tri_size((int)c->d) * 8.0;
  /* The accumulator's W factors (every item's, though a rank computes only
   * its own) and its work buffers. */
  const double rw = ((double)c->nitems * (double)kqsvd_tri_size((int)c->d) + 6.0 * d * d +
                     (double)(c->group + 3) * (double)c->cfg.qr_block * d) *
                    8.0;
  /* Solver, reduction messages (64 MiB at most) and library overheads; the
   * solver's own 32 d^2 doubles (workspace, one item's solution and R
   * factors) pass that only for the wide items of head groups (d > 627). */
  const double reserve = fmax(96.0 * mib, 32.0 * d * d * 8.0);
  /* On a GPU, 2 lanes x 2 pinned staging buffers of a read's rows too. */
  const double per_row = (double)(c->group + 2 * c->G) * (c->device >= 0 ? 5.0 : 1.0) *
                         (double)c->hd * (double)c->elem_max;
  /* --qr scalapack also holds the largest rank's rows of one stacked Q. */
  double block = 0;
  for (int p = 0; c->cfg.qr == KQSVD_CALIB_QR_SCALAPACK && p < P; p++) {
    /* pdgeqrf's workspace: about 16 (panel width) x (block + d + 16) doubles. */
    const double rows = (double)(calib_rank_rows(c, p) * c->group);
    const double b = (rows * d + 16.0 * (rows + d + 16.0)) * 8.0;
    block = b > block ? b : block;
  }
  const double avail = (double)c->cfg.mem_mib * mib - state - rw - reserve - block;
  KQSVD_CHECK(block == 0 || avail >= per_row * (double)c->cfg.qr_block, KQSVD_ERR_USAGE,
              "--qr scalapack holds each (layer, KV head)'s rows in memory: %.0f MiB per rank "
              "here; raise --mem-limit to at least %.0f MiB, use more ranks, or use --qr tsqr, "
              "which streams",
              block / mib,
              (state + rw + reserve + block + per_row * (double)c->cfg.qr_block) / mib + 1);
  int64_t rows = avail > 0 ? (int64_t)(avail / per_row) : 0;
  /* Larger reads buy nothing on the CPU (reads of 4 k to 64 k rows stream
   * at the same rate: docs/benchmarks.md) but resident memory; a GPU wants
   * large transfers. */
  const int64_t cap = c->device >= 0 ? 65536 : 8192;
  rows = rows > cap ? cap : rows;
  if (c->cfg.read_rows > 0 && c->cfg.read_rows < rows)
    rows = c->cfg.read_rows < c->cfg.qr_block ? c->cfg.qr_block : c->cfg.read_rows;
  rows -= rows % c->cfg.qr_block;
  KQSVD_CHECK(rows >= c->cfg.qr_block, KQSVD_ERR_USAGE,
              "--mem-limit %lld MiB is too small here: the R factors need %.2f MiB, reading "
              "needs %.2f MiB more and %.0f MiB are reserved; raise it to at least %.0f",
              (long long)c->cfg.mem_mib, (state + rw) / mib,
              per_row * (double)c->cfg.qr_block / mib, reserve / mib,
              (state + rw + reserve + per_row * (double)c->cfg.qr_block) / mib + 1);
  c->io_rows = rows;

  /* Anything that changes which rows meet which R factor, or the order of
   * the Householder updates, changes the checkpointed state. */
  uint64_t h = KQSVD_FNV_INIT;
  /* The GPU folds whole reads, so there the read size counts too. */
  const int64_t key[] = {1,
                         P,
                         c->cfg.qr_block,
                         c->dims.layers,
                         c->dims.heads,
                         c->dims.kv_heads,
                         c->d,
                         c->device >= 0 ? c->io_rows : -1};
  h = kqsvd_fnv1a(h, key, sizeof key);
  /* Only other methods change the hash, so TSQR checkpoints of earlier
   * versions stay valid. */
  if (c->cfg.qr != KQSVD_CALIB_QR_TSQR) h = kqsvd_fnv1a(h, &c->cfg.qr, sizeof c->cfg.qr);
  for (int s = 0; s < c->cfg.nshards; s++) {
    h = kqsvd_hash_file(h, c->cfg.shards[s]);
    h = kqsvd_fnv1a(h, &c->shard_rows[s], sizeof c->shard_rows[s]);
  }
  c->fingerprint = h;
  snprintf(c->about, sizeof c->about,
           "%d shards, %lld tokens, %d ranks, --qr %s, --qr-block %lld%s", c->cfg.nshards,
           (long long)c->tokens, P, kqsvd_calib_qr_name(c->cfg.qr), (long long)c->cfg.qr_block,
           c->device >= 0 ? ", on GPUs" : "");
done:
  return st;
}

/* R factor of W^T for each owned item: the group's o_proj columns, read in
 * row chunks of o_proj and folded by the accumulator like cache rows (a
 * grouped item's blocks one KV head at a time). */
static kqsvd_status_t factor_wo(calib_t *c) {
  kqsvd_status_t st = KQSVD_OK;
  const int64_t d = c->hd, m = c->m, D = c->dims.hidden;
  const kqsvd_dtype_t t = kqsvd_model_dtype(c->model);
  const size_t raw_bytes =
      (size_t)(c->group + 2 * c->G) * (size_t)c->io_rows * (size_t)d * c->elem_max;
  /* Each read yields chunk * m rows of d; a multiple of --qr-block keeps the
   * Householder blocking, hence the result, independent of the read size. */
  int64_t a = m, b = c->cfg.qr_block;
  while (b) {
    const int64_t r = a % b;
    a = b, b = r;
  }
  const int64_t base = c->cfg.qr_block / a;
  int64_t chunk = (int64_t)(raw_bytes / ((size_t)(m * d) * kqsvd_dtype_size(t)));
  chunk = chunk < base ? base : chunk - chunk % base;
  for (int64_t i = c->own0 * c->G; i < c->own1 * c->G; i++) {
    const int64_t layer = i / (c->dims.kv_heads * c->G), g = i % (c->dims.kv_heads * c->G);
    for (int64_t r0 = 0; r0 < D; r0 += chunk) {
      const int64_t n = D - r0 < chunk ? D - r0 : chunk;
      KQSVD_CALL(kqsvd_model_read_oproj(c->model, layer, r0, n, g * m * d, m * d, c->raw));
      KQSVD_CALL(kqsvd_acc_absorb_wt(c->acc, layer, g, c->raw, t, n, m * d));
      const int64_t bad = kqsvd_acc_bad_row(c->acc);
      KQSVD_CHECK(bad < 0, KQSVD_ERR_DATA,
                  "%s: dataset 'o_proj': NaN or Inf at layer %lld, row %lld (head %lld's block)",
                  c->cfg.model_path, (long long)layer, (long long)(r0 + bad / m),
                  (long long)(g * m + bad % m));
    }
  }
done:
  return st;
}

/* The accumulator for this model: calibrate's factors, folded with its
 * --qr-block and method (pdgeqrf fills the state itself). */
static kqsvd_status_t make_accumulator(calib_t *c) {
  kqsvd_status_t st = KQSVD_OK;
  const kqsvd_shape_t shape = {c->dims.layers, c->dims.kv_heads * c->G, c->m, c->hd,
                               c->dims.hidden};
  kqsvd_acc_options_t opt;
  kqsvd_acc_options_default(&opt);
  opt.block_rows = c->cfg.qr_block;
  opt.head_groups = c->G;
  opt.qr = c->cfg.qr == KQSVD_CALIB_QR_GRAM ? KQSVD_QR_GRAM : KQSVD_QR_TSQR;
  KQSVD_CALL(kqsvd_acc_init(&shape, &opt, &c->acc));
  c->state = kqsvd_acc_state(c->acc);
done:
  return st;
}

static void announce(const calib_t *c) {
  char tok[32];
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  if (c->ctx.size == 1 && cores > 1)
    kqsvd_observe(c->obs, KQSVD_LOG_INFO,
                  "kqsvd calibrate: one rank on a %ld-core machine; "
                  "'mpirun -np %ld kqsvd calibrate ...' uses them all\n",
                  cores, cores);
  kqsvd_fmt_count((double)c->tokens, tok, sizeof tok);
  kqsvd_observe(c->obs, KQSVD_LOG_INFO,
                "kqsvd calibrate: %d shard%s, %s tokens in %lld sequence%s; %lld layers x %lld KV "
                "heads x %lld quer%s each, d = %lld; %d rank%s, %lld rows per read\n",
                c->cfg.nshards, c->cfg.nshards == 1 ? "" : "s", tok, (long long)c->sequences,
                c->sequences == 1 ? "" : "s", (long long)c->dims.layers,
                (long long)(c->dims.kv_heads * c->G), (long long)c->m, c->m == 1 ? "y" : "ies",
                (long long)c->hd, c->ctx.size, c->ctx.size == 1 ? "" : "s", (long long)c->io_rows);
  if (c->G > 1)
    kqsvd_observe(c->obs, KQSVD_LOG_INFO,
                  "kqsvd calibrate: head groups of %lld KV heads: %lld (layer, group) problems "
                  "%lld wide\n",
                  (long long)c->G, (long long)c->nitems, (long long)c->d);
  if (c->device >= 0)
    kqsvd_observe(c->obs, KQSVD_LOG_INFO,
                  "kqsvd calibrate: the QR stage runs on GPUs (rank 0: device %d)\n", c->device);
}

/* The observer's report of the written model, with --timings: the slowest
 * rank's stage times, the summed bytes and rows, the largest peak RSS.
 * Collective (the timings' reductions). */
static kqsvd_status_t report(const calib_t *c) {
  kqsvd_status_t st = KQSVD_OK;
  const double wall = kqsvd_now() - c->t_start;
  kqsvd_calib_timings_t tm;
  memset(&tm, 0, sizeof tm);
  tm.qr = kqsvd_calib_qr_name(c->cfg.qr), tm.ranks = c->ctx.size, tm.wall = wall;
  const int root = c->ctx.rank == 0;
  if (c->cfg.timings) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double mx[5] = {c->t_read, c->t_fold, c->t_reduce, c->t_solve, (double)ru.ru_maxrss / 1024.0};
    double sum[4] = {c->bytes_read, c->rows_folded, c->t_fold, c->flops_folded};
    KQSVD_MPI(MPI_Reduce(root ? MPI_IN_PLACE : mx, mx, 5, MPI_DOUBLE, MPI_MAX, 0, c->ctx.comm));
    KQSVD_MPI(MPI_Reduce(root ? MPI_IN_PLACE : sum, sum, 4, MPI_DOUBLE, MPI_SUM, 0, c->ctx.comm));
    const double P = (double)c->ctx.size, d = (double)c->d;
    tm.read = mx[0], tm.bytes = sum[0], tm.read_rate = mx[0] > 0 ? sum[0] / P / mx[0] : 0.0;
    tm.fold = mx[1], tm.rows = sum[1];
    /* Per rank: all rows over all ranks' fold time, so a rank's average. */
    const double flops = c->G > 1 ? sum[3] : sum[1] * 2.0 * d * d;
    tm.fold_gflops = sum[2] > 0 ? flops / sum[2] / 1e9 : 0.0;
    tm.reduce = mx[2], tm.solve = mx[3], tm.peak_rss_mib = mx[4];
  }
  if (!root) goto done;
  char policy[64];
  kqsvd_rank_policy_format(&c->cfg.ranks, policy, sizeof policy);
  const kqsvd_calib_report_t r = {c->cfg.out_path,
                                  policy,
                                  c->dims.layers,
                                  c->d,
                                  c->rank_k,
                                  c->rank_v,
                                  c->cfg.ranks.kind == KQSVD_RANKS_BUDGET,
                                  c->cfg.beta,
                                  wall,
                                  c->streamed / (c->t_stream > 0 ? c->t_stream : 1e-9),
                                  c->cfg.timings ? &tm : NULL};
  kqsvd_observe_calibrated(c->obs, &r);
done:
  return st;
}

/* --device: one GPU per rank, the node-local rank modulo the devices. */
static kqsvd_status_t choose_device(calib_t *c) {
  kqsvd_status_t st = KQSVD_OK, local = KQSVD_OK;
  MPI_Comm node = MPI_COMM_NULL;
  int lrank = 0;
  /* --device cpu does not even ask the driver. */
  const int ndev = c->cfg.device != KQSVD_DEVICE_CPU && c->cfg.qr != KQSVD_CALIB_QR_SCALAPACK
                       ? calib_gpu_devices()
                       : 0;
  KQSVD_MPI(MPI_Comm_split_type(c->ctx.comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  KQSVD_MPI(MPI_Comm_rank(node, &lrank));
  c->device = -1;
  /* auto also needs the module; cuda insists, and a missing module is then
   * reported when it is loaded. */
  const int have = ndev > 0 && (c->cfg.device == KQSVD_DEVICE_CUDA ||
                                access(kqsvd_gpu_module_path(), R_OK) == 0);
  if (c->cfg.device != KQSVD_DEVICE_CPU && have) c->device = lrank % ndev;
  /* auto falls back to the CPU when the module cannot be loaded (an old
   * driver, a missing CUDA library), saying why. */
  const kqsvd_gpu_api_t *api = NULL;
  if (c->device >= 0 && c->cfg.device == KQSVD_DEVICE_AUTO && kqsvd_gpu_open(&api) != KQSVD_OK) {
    if (lrank == 0)
      kqsvd_observe(c->obs, KQSVD_LOG_WARNING,
                    "kqsvd calibrate: warning: GPU present but not usable, using the CPU: %s\n",
                    kqsvd_error_message());
    kqsvd_error_clear();
    c->device = -1;
  }
  if (c->cfg.device == KQSVD_DEVICE_CUDA && ndev == 0)
    local = kqsvd_error_set(KQSVD_ERR_USAGE, __FILE__, __LINE__, __func__,
                            "--device cuda: the CUDA driver reports no GPU to this rank");
  KQSVD_CALL(kqsvd_mpi_agree(c->ctx.comm, local));
done:
  if (node != MPI_COMM_NULL) MPI_Comm_free(&node);
  return st;
}

kqsvd_status_t calib_model(calib_t *c) {
  kqsvd_status_t st = KQSVD_OK;
  const kqsvd_ctx_t *ctx = &c->ctx;
  c->t_start = kqsvd_now();
  KQSVD_CALL(validate_inputs(c));
  KQSVD_CALL(choose_device(c));
  st = plan(c);
  if (st == KQSVD_ERR_USAGE) { /* decided alike on every rank */
    kqsvd_agreed_usage(ctx, st);
    goto done;
  }
  KQSVD_CALL(st);
  calib_inputs_hash(c);
  if (c->cfg.skip_done && !c->cfg.manifest_path) {
    int skip = ctx->rank == 0 && calib_up_to_date(c);
    KQSVD_MPI(MPI_Bcast(&skip, 1, MPI_INT, 0, ctx->comm));
    if (skip) {
      if (ctx->rank == 0)
        kqsvd_observe(c->obs, KQSVD_LOG_RESULT,
                      "%s is already made from these inputs: nothing to do\n", c->cfg.out_path);
      goto done;
    }
  }
  if (ctx->rank == 0) announce(c);
  KQSVD_MALLOC(c->raw,
               (size_t)(c->group + 2 * c->G) * (size_t)c->io_rows * (size_t)c->hd * c->elem_max,
               "read buffer");
  if (c->G > 1)
    KQSVD_MALLOC(c->joint, (size_t)c->cfg.qr_block * (size_t)c->d * c->elem_max, "group rows");
  KQSVD_CALL(kqsvd_mpi_agree(ctx->comm, make_accumulator(c)));
  KQSVD_CALL(kqsvd_mpi_agree(ctx->comm, factor_wo(c)));
  if (ctx->rank == 0) /* KQSVD_ISA is valid: factor_wo checked it */
    kqsvd_observe(c->obs, KQSVD_LOG_DETAIL, "kqsvd calibrate: CPU QR kernels: %s\n",
                  kqsvd_isa_name(kqsvd_isa_active()));
  kqsvd_model_close(&c->model);
  KQSVD_CALL(c->cfg.qr == KQSVD_CALIB_QR_SCALAPACK ? calib_stream_pqr(c) : calib_stream(c));
  KQSVD_CALL(calib_finish(c));
  if (c->cfg.ckpt_dir) kqsvd_checkpoint_remove(c->cfg.ckpt_dir, ctx->rank, ctx->size);
  KQSVD_CALL(report(c));
done:
  kqsvd_model_close(&c->model);
  kqsvd_acc_free(&c->acc);
  c->state = NULL;
  void *owned[] = {c->shard_rows, c->segs, c->seg_first, c->raw, c->joint, c->rank_k, c->rank_v};
  for (size_t k = 0; k < sizeof owned / sizeof owned[0]; k++) free(owned[k]);
  c->shard_rows = NULL, c->segs = NULL, c->seg_first = NULL;
  c->raw = c->joint = NULL, c->rank_k = c->rank_v = NULL;
  return st;
}
