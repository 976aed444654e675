/* kqsvd calibrate --manifest: every model of a manifest in turn, each on all
 * ranks (so the ranks stay balanced whatever the models' sizes), each output
 * written as soon as its model is done.  A rerun skips the outputs that were
 * made from the same inputs and resumes the model that was cut short. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "calibrate.h"
#include "kqsvd_h5.h"
#include "kqsvd_identity.h"
#include "kqsvd_manifest.h"
#include "kqsvd_util.h"

kqsvd_status_t calib_manifest(calib_t *base) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_cli_t *cli = base->cli;
  kqsvd_manifest_t m;
  char ckpt[PATH_MAX];
  int done_models = 0, skipped = 0;
  memset(&m, 0, sizeof m);
  /* Every rank reads it: the same file, and agreement on the outcome. */
  KQSVD_CALL(kqsvd_mpi_agree(
      cli->comm, kqsvd_manifest_read_report(base->manifest_path, cli->rank == 0 ? stderr : NULL, &m)));
  /* Every output's folder before any work, so a typo in the last line does
   * not surface hours later. */
  for (int i = 0; i < m.n; i++) {
    /* A manifest remakes outputs whose inputs changed: no --force needed. */
    st = kqsvd_check_output("OUTPUT_H5", m.e[i].output, 1);
    if (st == KQSVD_OK && base->ckpt_dir) {
      snprintf(ckpt, sizeof ckpt, "%s/%s", base->ckpt_dir, m.e[i].name);
      st = kqsvd_check_checkpoint_dir(ckpt, m.e[i].output);
    }
    if (st != KQSVD_OK) {
      char where[PATH_MAX + 32];
      snprintf(where, sizeof where, "%s:%d", m.path, m.e[i].line);
      kqsvd_error_context(where);
      break;
    }
  }
  KQSVD_CALL(kqsvd_mpi_agree(cli->comm, st));
  for (int i = 0; i < m.n; i++) {
    const kqsvd_manifest_entry_t *e = &m.e[i];
    calib_t c = *base;
    c.model_path = e->model;
    c.out_path = e->output;
    c.shards = e->shards;
    c.nshards = e->nshards;
    if (e->has_policy) c.ranks = e->policy;
    if (base->ckpt_dir) {
      snprintf(ckpt, sizeof ckpt, "%s/%s", base->ckpt_dir, e->name);
      c.ckpt_dir = ckpt;
    }
    calib_inputs_hash(&c);
    int skip = cli->rank == 0 && calib_up_to_date(&c);
    KQSVD_MPI(MPI_Bcast(&skip, 1, MPI_INT, 0, cli->comm));
    if (cli->rank == 0)
      kqsvd_observe(base->obs, KQSVD_LOG_NOTE, "kqsvd calibrate: model %d of %d, %s (%s line %d): %s\n", i + 1, m.n,
              e->name, m.path, e->line, skip ? "already done from these inputs, skipped"
                                              : "calibrating");
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
    fflush(stdout);
  }
  if (cli->rank == 0)
    kqsvd_observe(base->obs, KQSVD_LOG_RESULT, "manifest %s: %d model%s calibrated, %d already done\n", m.path, done_models,
           done_models == 1 ? "" : "s", skipped);
done:
  kqsvd_manifest_free(&m);
  return st;
}
