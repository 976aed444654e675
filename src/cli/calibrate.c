/* kqsvd calibrate: the command line (options and help); the run is the
 * pipeline's kqsvd_calibrate (src/pipeline/calibrate.c). */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kqsvd_cli.h"
#include "kqsvd_linalg.h"
#include "kqsvd_mpi.h"
#include "kqsvd_util.h"

typedef struct calibrate_cmd {
  kqsvd_calib_config_t cfg;
  int policy_set;
  kqsvd_made_dirs_t made; /* the folders of --checkpoint this process made */
} calibrate_cmd_t;

static const char help_1[] =
    "usage: [mpirun -np N] kqsvd calibrate --model MODEL.h5 --out PROJ.h5 [OPTIONS] SHARD...\n"
    "       [mpirun -np N] kqsvd calibrate --manifest MANIFEST [OPTIONS]\n"
    "\n"
    "Streams the cache shards once, folds every (layer, KV head)'s K, stacked Q and V\n"
    "into float64 R factors (Householder QR per block, TSQR across ranks), and writes\n"
    "the kqsvd, ksvd and eigen projections with all d columns, spectra and ranks.\n"
    "\n"
    "  --model FILE           model file with o_proj (required)\n"
    "  --manifest FILE        calibrate every model of FILE in turn, on all ranks, instead\n"
    "                         of --model/--out/SHARD: lines 'NAME MODEL_H5 OUTPUT_H5\n"
    "                         SHARD_GLOB [EPS [VALID_GLOB]]', '#' comments, paths\n"
    "                         relative to FILE (docs/formats.md);\n"
    "                         outputs already made from the same inputs are skipped, and\n"
    "                         --checkpoint DIR keeps each model's in DIR/NAME\n"
    "  --skip-done            do nothing when OUT exists and was made from the same\n"
    "                         files and options (as --manifest does for every model);\n"
    "                         remake it otherwise\n"
    "  --out FILE             projections file to write (required); written under a\n"
    "                         temporary name and renamed when complete; an existing\n"
    "                         file is refused unless --force or --skip-done\n"
    "  --force                replace an existing OUT\n"
    "  --ranks POLICY         how rank_k and rank_v are chosen [eps:0.1]:\n"
    "                           eps:E     the paper's rule: per layer, the smallest rank\n"
    "                                     keeping 1 - E of the head-averaged energy of K\n"
    "                                     (V for values); the same for every method\n"
    "                           fixed:R   rank R everywhere\n"
    "                           budget:F  a fraction F of the full cache, spread over the\n"
    "                                     layers to minimise each method's tail energy\n"
    "  --eps E                same as --ranks eps:E\n"
    "  --beta X               key/query unbalance of the eigen method, > 0 [1]\n";
static const char help_2[] =
    "  --head-groups G        solve each group of G consecutive KV heads as one (G must\n"
    "                         divide the KV heads): keys side by side against the\n"
    "                         group's queries, one latent of rank R <= G d shared by\n"
    "                         the group; memory and time grow as (G d)^2 [1: per head]\n"
    "  --checkpoint DIR       save progress in DIR; rerunning the same command resumes\n"
    "  --checkpoint-every S   also checkpoint within a shard every S seconds, 0 = after\n"
    "                         every (layer, KV head) [60]; finished shards always are\n"
    "  --mem-limit MIB        memory bound per rank for factors and buffers [1024]\n"
    "  --qr-block N           rows per Householder update [256]\n"
    "  --read-rows N          rows per read, rounded to a multiple of --qr-block\n"
    "                         [as many as --mem-limit allows, at most 8192 (65536 on\n"
    "                         a GPU)]\n"
    "  --threads N            BLAS threads per rank [1]; use MPI ranks for cores\n"
    "  --qr METHOD            how cache rows become R factors [tsqr]:\n"
    "                           tsqr       streaming Householder QR, merged by a TSQR tree\n"
    "                           gram       float64 Gram matrix (SYRK; batched DGEMM on a\n"
    "                                      GPU, 30x faster there) and Cholesky: singular\n"
    "                                      values below ~1e-8 of the largest are lost, the\n"
    "                                      projections' score error is kept\n"
    "                           scalapack  ScaLAPACK pdgeqrf on a ranks x 1 grid; holds each\n"
    "                                      (layer, KV head)'s rows in memory (a benchmark\n"
    "                                      peer; no --checkpoint; CPU only)\n"
    "  --timings              print the time of each stage (slowest rank), the bytes\n"
    "                         read per second, the fold's GFLOP/s at 2 d^2 flops per row\n"
    "                         (QR-equivalent for gram) and the peak RSS per rank\n"
    "  --device D             where the QR stage runs: cpu, cuda (one GPU per rank: the\n"
    "                         node-local rank modulo the GPUs) or auto (cuda when this\n"
    "                         kqsvd has CUDA and sees a GPU) [auto]\n"
    "  --progress MODE        auto, bar, lines or off [auto]\n"
    "  -v, --verbose          print a trace with errors\n"
    "  -h, --help             this text\n";

enum {
  O_MODEL = 256,
  O_OUT,
  O_EPS,
  O_RANKS,
  O_BETA,
  O_CKPT,
  O_CKPT_EVERY,
  O_QRB,
  O_READ,
  O_MANIFEST,
  O_SKIP_DONE,
  O_DEVICE,
  O_QR,
  O_TIMINGS,
  O_FORCE,
  O_GROUPS
};

static const struct option longopts[] = {
    {"model", required_argument, NULL, O_MODEL},
    {"out", required_argument, NULL, O_OUT},
    {"eps", required_argument, NULL, O_EPS},
    {"ranks", required_argument, NULL, O_RANKS},
    {"beta", required_argument, NULL, O_BETA},
    {"checkpoint", required_argument, NULL, O_CKPT},
    {"checkpoint-every", required_argument, NULL, O_CKPT_EVERY},
    {"qr-block", required_argument, NULL, O_QRB},
    {"read-rows", required_argument, NULL, O_READ},
    {"manifest", required_argument, NULL, O_MANIFEST},
    {"skip-done", no_argument, NULL, O_SKIP_DONE},
    {"force", no_argument, NULL, O_FORCE},
    {"device", required_argument, NULL, O_DEVICE},
    {"qr", required_argument, NULL, O_QR},
    {"timings", no_argument, NULL, O_TIMINGS},
    {"head-groups", required_argument, NULL, O_GROUPS},
    KQSVD_RUN_LONGOPTS,
    KQSVD_LONGOPTS_END};

static void defaults(void *state) {
  calibrate_cmd_t *cmd = state;
  kqsvd_calib_config_default(&cmd->cfg);
}

/* --ranks or --eps, once. */
static kqsvd_status_t rank_policy(calibrate_cmd_t *cmd, int o, const char *arg) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_rank_policy_t *p = &cmd->cfg.ranks;
  KQSVD_CHECK(!cmd->policy_set, KQSVD_ERR_USAGE, "give --ranks or --eps once");
  cmd->policy_set = 1;
  if (o == O_EPS) {
    p->kind = KQSVD_RANKS_EPS;
    KQSVD_CALL(kqsvd_opt_double("--eps", arg, 0, 1, 1, 1, &p->value));
  } else {
    KQSVD_CALL(kqsvd_rank_policy_parse("--ranks", arg, p));
  }
done:
  return st;
}

static kqsvd_status_t option(void *state, int o, const char *arg) {
  kqsvd_status_t st = KQSVD_OK;
  calibrate_cmd_t *cmd = state;
  kqsvd_calib_config_t *c = &cmd->cfg;
  switch (o) {
  case O_MODEL: c->model_path = arg; break;
  case O_OUT: c->out_path = arg; break;
  case O_EPS:
  case O_RANKS: KQSVD_CALL(rank_policy(cmd, o, arg)); break;
  case O_BETA: KQSVD_CALL(kqsvd_opt_double("--beta", arg, 0, 1e30, 1, 0, &c->beta)); break;
  case O_CKPT: c->ckpt_dir = arg; break;
  case O_MANIFEST: c->manifest_path = arg; break;
  case O_SKIP_DONE: c->skip_done = 1; break;
  case O_FORCE: c->force = 1; break;
  case O_DEVICE: KQSVD_CALL(kqsvd_device_parse("--device", arg, &c->device)); break;
  case O_QR: KQSVD_CALL(kqsvd_calib_qr_parse("--qr", arg, &c->qr)); break;
  case O_TIMINGS: c->timings = 1; break;
  case O_CKPT_EVERY:
    KQSVD_CALL(kqsvd_opt_double("--checkpoint-every", arg, 0, 1e9, 0, 0, &c->ckpt_every));
    break;
  case O_QRB: KQSVD_CALL(kqsvd_opt_int("--qr-block", arg, 1, 1 << 20, &c->qr_block)); break;
  case O_READ: KQSVD_CALL(kqsvd_opt_int("--read-rows", arg, 1, 1 << 24, &c->read_rows)); break;
  case O_GROUPS:
    KQSVD_CALL(kqsvd_opt_int("--head-groups", arg, 1, 1 << 12, &c->head_groups));
    break;
  default: KQSVD_FAIL(KQSVD_ERR_BUG, "unhandled option %d", o);
  }
done:
  return st;
}

static kqsvd_status_t operands(void *state, const kqsvd_run_opts_t *opts, int n, char **args) {
  kqsvd_status_t st = KQSVD_OK;
  calibrate_cmd_t *cmd = state;
  kqsvd_calib_config_t *c = &cmd->cfg;
  c->nshards = n;
  c->shards = args;
  c->mem_mib = opts->mem_mib;
  /* A rank whose mkdir finds the folder made by another notes nothing, and
   * leaves the removal to that one. */
  KQSVD_CALL(kqsvd_calib_config_check(c, &cmd->made));
done:
  return st;
}

static kqsvd_status_t run(kqsvd_cli_t *cli, void *state, const kqsvd_run_opts_t *opts) {
  kqsvd_status_t st = KQSVD_OK;
  calibrate_cmd_t *cmd = state;
  kqsvd_cli_observer_t obs;
  kqsvd_cli_observer_init(&obs, opts->progress, cli->verbose);
  kqsvd_blas_set_threads((int)opts->threads);
  const kqsvd_ctx_t ctx = {cli->comm, cli->rank, cli->size};
  st = kqsvd_calibrate(&ctx, &cmd->cfg, &obs.obs);
  if (st != KQSVD_OK) kqsvd_usage_hint("calibrate");
  KQSVD_CALL(st);
done:
  return st;
}

/* A run that fails leaves no --checkpoint folder it made, as long as it is
 * empty (a stopped run keeps its checkpoints there); once every rank
 * knows, so that none is writing there still, and removed by one rank,
 * since the ranks' mkdirs share the path's components out among them. */
static void end(kqsvd_cli_t *cli, void *state, kqsvd_status_t st) {
  calibrate_cmd_t *cmd = state;
  if (st != KQSVD_OK && (cli->size == 1 || kqsvd_error_is_collective()))
    kqsvd_mpi_rmdir_made(cli->size > 1 ? cli->comm : MPI_COMM_NULL, &cmd->made);
}

const kqsvd_command_t kqsvd_command_calibrate = {
    .name = "calibrate",
    .about = "compute kqsvd, ksvd and eigen projections from caches",
    .mpi = 1,
    .h5 = 1,
    .help = {help_1, help_2},
    .shortopts = ":hv",
    .longopts = longopts,
    .size = sizeof(calibrate_cmd_t),
    .defaults = defaults,
    .option = option,
    .operands = operands,
    .run = run,
    .end = end,
};
