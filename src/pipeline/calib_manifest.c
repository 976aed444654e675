/* kqsvd calibrate --manifest: every model of a manifest in turn, each on all
 * ranks (so the ranks stay balanced whatever the models' sizes), each output
 * written as soon as its model is done.  A rerun skips the outputs that were
 * made from the same inputs and resumes the model that was cut short. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "calib.h"
#include "kqsvd_h5.h"
#include "kqsvd_identity.h"
#include "kqsvd_manifest.h"
#include "kqsvd_util.h"

/* Reads the manifest; a list of bad lines too long for the error record
 * goes to the observer (rank 0) before the error. */
static kqsvd_status_t read_manifest(const calib_t *base, kqsvd_manifest_t *m) {
  char *text = NULL;
  size_t len = 0;
  FILE *list = base->ctx.rank == 0 ? open_memstream(&text, &len) : NULL;
  const kqsvd_status_t st = kqsvd_manifest_read_report(base->cfg.manifest_path, list, m);
  if (list) fclose(list);
  if (text && len && base->obs && base->obs->log)
    base->obs->log(base->obs->ctx, KQSVD_LOG_NOTE, text);
  free(text);
  return st;
}

kqsvd_status_t calib_manifest(calib_t *base) {
  kqsvd_status_t st = KQSVD_OK;
  const kqsvd_ctx_t *ctx = &base->ctx;
  kqsvd_manifest_t m;
  char ckpt[PATH_MAX];
  int done_models = 0, skipped = 0;
  memset(&m, 0, sizeof m);
  /* Every rank reads it: the same file, and agreement on the outcome. */
  KQSVD_CALL(kqsvd_mpi_agree(ctx->comm, read_manifest(base, &m)));
  /* Every output's folder before any work, so a typo in the last line does
   * not surface hours later. */
  for (int i = 0; i < m.n; i++) {
    /* Folding a model's activations takes the model and PyTorch, which
     * this program has neither of: such a line is refused before any
     * model is calibrated, not met halfway through. */
    if (m.e[i].insitu) {
      int more = 0;
      for (int k = i + 1; k < m.n; k++) more += m.e[k].insitu;
      st =
          kqsvd_error_set(KQSVD_ERR_INPUT, __FILE__, __LINE__, __func__,
                          "%s:%d: %s names a model (hf:), not cache shards%s; kqsvd calibrate "
                          "reads caches: submit the manifest with slurm/kqsvd-submit, which runs "
                          "python -m kqsvd.calibrate_hf for such lines",
                          m.path, m.e[i].line, m.e[i].name, more ? " (and so do later lines)" : "");
      break;
    }
    /* A manifest remakes outputs whose inputs changed: no --force needed. */
    st = kqsvd_check_output("OUTPUT_H5", m.e[i].output, 1);
    if (st == KQSVD_OK && base->cfg.ckpt_dir) {
      snprintf(ckpt, sizeof ckpt, "%s/%s", base->cfg.ckpt_dir, m.e[i].name);
      st = kqsvd_check_checkpoint_dir(ckpt, m.e[i].output, NULL);
    }
    if (st != KQSVD_OK) {
      char where[PATH_MAX + 32];
      snprintf(where, sizeof where, "%s:%d", m.path, m.e[i].line);
      kqsvd_error_context(where);
      break;
    }
  }
  KQSVD_CALL(kqsvd_mpi_agree(ctx->comm, st));
  for (int i = 0; i < m.n; i++) {
    const kqsvd_manifest_entry_t *e = &m.e[i];
    calib_t c = *base;
    c.cfg.model_path = e->model;
    c.cfg.out_path = e->output;
    c.cfg.shards = e->shards;
    c.cfg.nshards = e->nshards;
    if (e->has_policy) c.cfg.ranks = e->policy;
    if (base->cfg.ckpt_dir) {
      snprintf(ckpt, sizeof ckpt, "%s/%s", base->cfg.ckpt_dir, e->name);
      c.cfg.ckpt_dir = ckpt;
    }
    calib_inputs_hash(&c);
    int skip = ctx->rank == 0 && calib_up_to_date(&c);
    KQSVD_MPI(MPI_Bcast(&skip, 1, MPI_INT, 0, ctx->comm));
    if (ctx->rank == 0)
      kqsvd_observe(base->obs, KQSVD_LOG_NOTE,
                    "kqsvd calibrate: model %d of %d, %s (%s line %d): %s\n", i + 1, m.n, e->name,
                    m.path, e->line,
                    skip ? "already done from these inputs, skipped" : "calibrating");
    if (skip) {
      skipped++;
      continue;
    }
    st = calib_model(&c);
    if (st != KQSVD_OK) {
      char where[PATH_MAX + 64];
      snprintf(where, sizeof where, "%s line %d (model %s)", m.path, e->line, e->name);
      kqsvd_error_context(where);
      goto done;
    }
    done_models++;
  }
  if (ctx->rank == 0)
    kqsvd_observe(base->obs, KQSVD_LOG_RESULT,
                  "manifest %s: %d model%s calibrated, %d already done\n", m.path, done_models,
                  done_models == 1 ? "" : "s", skipped);
done:
  kqsvd_manifest_free(&m);
  return st;
}
