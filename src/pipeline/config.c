/* The pipeline's options: the spellings of --qr and --device, the
 * defaults and checks of a calibration's config, and agreed usage errors. */
#include <stdio.h>
#include <string.h>

#include "kqsvd_linalg.h"
#include "kqsvd_pipeline.h"

static const char *const qr_names[] = {"tsqr", "gram", "scalapack"};
static const char *const device_names[] = {"auto", "cpu", "cuda"};

const char *kqsvd_calib_qr_name(kqsvd_calib_qr_t q) { return (unsigned)q < 3 ? qr_names[q] : "?"; }

/* The index of `s` among the n names, else a usage error listing them
 * (`expected`) and naming `opt`. */
static kqsvd_status_t parse_name(const char *opt, const char *s, const char *const *names, int n,
                                 const char *expected, int *index) {
  kqsvd_status_t st = KQSVD_OK;
  *index = 0;
  while (*index < n && strcmp(s, names[*index]) != 0) ++*index;
  KQSVD_CHECK(*index < n, KQSVD_ERR_USAGE, "%s must be %s, got '%s'", opt, expected, s);
done:
  return st;
}

kqsvd_status_t kqsvd_calib_qr_parse(const char *opt, const char *s, kqsvd_calib_qr_t *q) {
  int i;
  const kqsvd_status_t st = parse_name(opt, s, qr_names, 3, "tsqr, gram or scalapack", &i);
  if (st == KQSVD_OK) *q = (kqsvd_calib_qr_t)i;
  return st;
}

kqsvd_status_t kqsvd_device_parse(const char *opt, const char *s, kqsvd_device_t *d) {
  int i;
  const kqsvd_status_t st = parse_name(opt, s, device_names, 3, "cpu, cuda or auto", &i);
  if (st == KQSVD_OK) *d = (kqsvd_device_t)i;
  return st;
}

void kqsvd_calib_config_default(kqsvd_calib_config_t *cfg) {
  memset(cfg, 0, sizeof *cfg);
  cfg->ranks = (kqsvd_rank_policy_t){KQSVD_RANKS_EPS, 0.1};
  cfg->beta = 1.0;
  cfg->ckpt_every = 60.0;
  cfg->qr_block = KQSVD_QR_BLOCK_DEFAULT;
  cfg->head_groups = 1;
  cfg->mem_mib = 1024;
  cfg->qr = KQSVD_CALIB_QR_TSQR;
  cfg->device = KQSVD_DEVICE_AUTO;
}

kqsvd_status_t kqsvd_calib_config_check(const kqsvd_calib_config_t *c, kqsvd_made_dirs_t *made) {
  kqsvd_status_t st = KQSVD_OK;
  KQSVD_CHECK(c->qr != KQSVD_CALIB_QR_SCALAPACK || !c->ckpt_dir, KQSVD_ERR_USAGE,
              "--checkpoint does not work with --qr scalapack, which keeps no running "
              "factors to save; use --qr tsqr");
  KQSVD_CHECK(c->qr != KQSVD_CALIB_QR_SCALAPACK || kqsvd_pqr_available(), KQSVD_ERR_USAGE,
              "--qr scalapack: this kqsvd was built without ScaLAPACK (Debian: apt-get install "
              "libscalapack-openmpi-dev, then rebuild)");
  KQSVD_CHECK(c->qr != KQSVD_CALIB_QR_SCALAPACK || c->device != KQSVD_DEVICE_CUDA, KQSVD_ERR_USAGE,
              "--device cuda runs --qr tsqr or gram; --qr scalapack runs on the CPU");
  KQSVD_CHECK(c->head_groups >= 1, KQSVD_ERR_USAGE, "--head-groups must be >= 1");
  KQSVD_CHECK(c->qr_block >= 1 && c->mem_mib >= 1 && c->read_rows >= 0 && c->beta > 0 &&
                  c->ckpt_every >= 0 && c->nshards >= 0,
              KQSVD_ERR_USAGE,
              "calibration config: qr_block, mem_mib and beta must be positive, read_rows, "
              "ckpt_every and nshards not negative");
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
  if (c->ckpt_dir) KQSVD_CALL(kqsvd_check_checkpoint_dir(c->ckpt_dir, c->out_path, made));
  {
    const char *named[] = {c->model_path}, *opts[] = {"--model"};
    KQSVD_CALL(kqsvd_check_file_args("--out", c->out_path, 1, named, opts, c->shards, c->nshards));
  }
  KQSVD_CALL(kqsvd_check_output("--out", c->out_path, c->force || c->skip_done));
done:
  return st;
}

kqsvd_status_t kqsvd_agreed_usage(const kqsvd_ctx_t *ctx, kqsvd_status_t st) {
  kqsvd_error_mark_collective(ctx->rank == 0);
  return st;
}
