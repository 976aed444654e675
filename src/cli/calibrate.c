/* kqsvd calibrate: the command line (options and help); one model's run is
 * calib_model.c, a manifest's calib_manifest.c. */
#include "calibrate.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kqsvd_linalg.h"
#include "kqsvd_util.h"

static void calibrate_help(void) {
  printf(
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
      "  --beta X               key/query unbalance of the eigen method, > 0 [1]\n"
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
      "                           gram       float64 Gram matrix (SYRK) and Cholesky: half the\n"
      "                                      flops, but singular values below ~1e-8 of the\n"
      "                                      largest are lost (a benchmark peer)\n"
      "                           scalapack  ScaLAPACK pdgeqrf on a ranks x 1 grid; holds each\n"
      "                                      (layer, KV head)'s rows in memory (a benchmark\n"
      "                                      peer; no --checkpoint)\n"
      "                         gram and scalapack run on the CPU\n"
      "  --timings              print the time of each stage (slowest rank), the bytes\n"
      "                         read per second, the fold's GFLOP/s at 2 d^2 flops per row\n"
      "                         (QR-equivalent for gram) and the peak RSS per rank\n"
      "  --device D             where the QR stage runs: cpu, cuda (one GPU per rank: the\n"
      "                         node-local rank modulo the GPUs) or auto (cuda when this\n"
      "                         kqsvd has CUDA and sees a GPU) [auto]\n"
      "  --progress MODE        auto, bar, lines or off [auto]\n"
      "  -v, --verbose          print a trace with errors\n"
      "  -h, --help             this text\n");
}

static kqsvd_status_t parse(calib_t *c, int argc, char **argv) {
  kqsvd_status_t st = KQSVD_OK;
  enum { O_MODEL = 256, O_OUT, O_EPS, O_RANKS, O_BETA, O_CKPT, O_CKPT_EVERY, O_QRB, O_READ,
         O_MANIFEST, O_SKIP_DONE, O_DEVICE, O_QR, O_TIMINGS, O_FORCE };
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
      KQSVD_RUN_LONGOPTS,
      {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0}};
  c->ranks = (kqsvd_rank_policy_t){KQSVD_RANKS_EPS, 0.1};
  c->device_opt = "auto";
  int policy_set = 0;
  c->beta = 1.0;
  c->ckpt_every = 60.0;
  int handled = 0;
  kqsvd_run_opts_default(&c->run);
  c->qr_block = KQSVD_QR_BLOCK_DEFAULT;
  optind = 1;
  for (;;) {
    int o;
    KQSVD_CALL(kqsvd_getopt(argc, argv, ":hv", longopts, &o));
    if (o == -1) break;
    switch (o) {
    case O_MODEL: c->model_path = optarg; break;
    case O_OUT: c->out_path = optarg; break;
    case O_EPS:
    case O_RANKS:
      KQSVD_CHECK(!policy_set, KQSVD_ERR_USAGE, "give --ranks or --eps once");
      policy_set = 1;
      if (o == O_EPS) {
        c->ranks.kind = KQSVD_RANKS_EPS;
        KQSVD_CALL(kqsvd_opt_double("--eps", optarg, 0, 1, 1, 1, &c->ranks.value));
      } else {
        KQSVD_CALL(kqsvd_rank_policy_parse("--ranks", optarg, &c->ranks));
      }
      break;
    case O_BETA: KQSVD_CALL(kqsvd_opt_double("--beta", optarg, 0, 1e30, 1, 0, &c->beta)); break;
    case O_CKPT: c->ckpt_dir = optarg; break;
    case O_MANIFEST: c->manifest_path = optarg; break;
    case O_SKIP_DONE: c->skip_done = 1; break;
    case O_FORCE: c->force = 1; break;
    case O_DEVICE:
      KQSVD_CHECK(!strcmp(optarg, "cpu") || !strcmp(optarg, "cuda") || !strcmp(optarg, "auto"),
                  KQSVD_ERR_USAGE, "--device must be cpu, cuda or auto, got '%s'", optarg);
      c->device_opt = optarg;
      break;
    case O_QR: {
      int found = 0;
      for (calib_qr_t q = CAL_QR_TSQR; q <= CAL_QR_SCALAPACK; q++)
        if (!strcmp(optarg, calib_qr_name(q))) c->qr = q, found = 1;
      KQSVD_CHECK(found, KQSVD_ERR_USAGE, "--qr must be tsqr, gram or scalapack, got '%s'", optarg);
      break;
    }
    case O_TIMINGS: c->timings = 1; break;
    case O_CKPT_EVERY:
      KQSVD_CALL(kqsvd_opt_double("--checkpoint-every", optarg, 0, 1e9, 0, 0, &c->ckpt_every));
      break;
    case O_QRB: KQSVD_CALL(kqsvd_opt_int("--qr-block", optarg, 1, 1 << 20, &c->qr_block)); break;
    case O_READ: KQSVD_CALL(kqsvd_opt_int("--read-rows", optarg, 1, 1 << 24, &c->read_rows)); break;
    case 'h':
      if (c->cli->rank == 0) calibrate_help();
      c->help = 1;
      return KQSVD_OK;
    default:
      KQSVD_CALL(kqsvd_run_option(c->cli, o, optarg, &c->run, &handled));
      KQSVD_CHECK(handled, KQSVD_ERR_BUG, "unhandled option %d", o);
    }
  }
  c->nshards = argc - optind;
  c->shards = argv + optind;
  KQSVD_CHECK(c->qr != CAL_QR_SCALAPACK || !c->ckpt_dir, KQSVD_ERR_USAGE,
              "--checkpoint does not work with --qr scalapack, which keeps no running "
              "factors to save; use --qr tsqr");
  KQSVD_CHECK(c->qr != CAL_QR_SCALAPACK || kqsvd_pqr_available(), KQSVD_ERR_USAGE,
              "--qr scalapack: this kqsvd was built without ScaLAPACK (Debian: apt-get install "
              "libscalapack-openmpi-dev, then rebuild)");
  KQSVD_CHECK(c->qr == CAL_QR_TSQR || strcmp(c->device_opt, "cuda") != 0, KQSVD_ERR_USAGE,
              "--device cuda runs the tsqr method only; --qr %s runs on the CPU",
              calib_qr_name(c->qr));
  if (c->manifest_path) {
    KQSVD_CHECK(!c->force, KQSVD_ERR_USAGE,
                "--force does not apply to --manifest, which remakes only the outputs whose "
                "inputs changed");
    KQSVD_CHECK(!c->model_path && !c->out_path && c->nshards == 0, KQSVD_ERR_USAGE,
                "--manifest names the models, outputs and shards: give no --model, --out or "
                "shards with it");
    goto done;
  }
  KQSVD_CHECK(c->model_path, KQSVD_ERR_USAGE, "--model is required (or --manifest)");
  KQSVD_CHECK(c->out_path, KQSVD_ERR_USAGE, "--out is required");
  KQSVD_CHECK(c->nshards > 0, KQSVD_ERR_USAGE, "no cache shards given");
  if (c->ckpt_dir) KQSVD_CALL(kqsvd_check_checkpoint_dir(c->ckpt_dir, c->out_path));
  {
    const char *named[] = {c->model_path}, *opts[] = {"--model"};
    KQSVD_CALL(kqsvd_check_file_args("--out", c->out_path, 1, named, opts, c->shards, c->nshards));
  }
  KQSVD_CALL(kqsvd_check_output("--out", c->out_path, c->force || c->skip_done));
done:
  return st;
}

kqsvd_status_t kqsvd_cmd_calibrate(kqsvd_cli_t *cli, int argc, char **argv) {
  kqsvd_status_t st = KQSVD_OK;
  calib_t c;
  memset(&c, 0, sizeof c);
  c.cli = cli;
  /* Options are checked against the file system too, which may look
   * different from another node: agree rather than assume. */
  st = parse(&c, argc, argv);
  if (st == KQSVD_ERR_USAGE) kqsvd_usage_error(cli, "calibrate", st);
  KQSVD_CALL(kqsvd_mpi_agree(cli->comm, st));
  if (c.help) return KQSVD_OK;
  kqsvd_cli_observer_t obs;
  kqsvd_cli_observer_init(&obs, c.run.progress);
  c.obs = &obs.obs;
  kqsvd_blas_set_threads((int)c.run.threads);
  KQSVD_CALL(c.manifest_path ? calib_manifest(&c) : calib_model(&c));
done:
  return st;
}
