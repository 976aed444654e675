/* The manifest of `kqsvd calibrate --manifest` and slurm/kqsvd-submit: one
 * model per line,
 *     NAME MODEL_H5 OUTPUT_H5 SHARD_GLOB [EPS [VALID_GLOB]]
 * with `#` starting a comment.  Relative paths are relative to the
 * manifest's folder.  EPS is a number in (0, 1) or, as an extension, any
 * rank policy (eps:E, fixed:R, budget:F); VALID_GLOB (an extension) names
 * the validation shards that slurm/kqsvd-submit --evaluate uses.  Not
 * collective. */
#ifndef KQSVD_MANIFEST_H
#define KQSVD_MANIFEST_H

#include <stdint.h>

#include "kqsvd_error.h"
#include "kqsvd_rank.h"

typedef struct kqsvd_manifest_entry {
  int line;                        /* in the manifest, from 1 */
  char *name, *model, *output;     /* paths resolved against the manifest's folder */
  char *shard_glob, *valid_glob;   /* valid_glob is NULL when not given */
  char **shards;                   /* the calibration shards, sorted */
  int nshards;
  int has_policy;                  /* EPS given */
  kqsvd_rank_policy_t policy;
} kqsvd_manifest_entry_t;

typedef struct kqsvd_manifest {
  char *path;
  int n;
  kqsvd_manifest_entry_t *e;
} kqsvd_manifest_t;

/* Reads and checks a manifest: field counts, names (letters, digits, '.',
 * '_', '-'; unique), EPS, that each SHARD_GLOB (and VALID_GLOB) matches at
 * least one file, that the model file and each output's folder exist, and
 * that no output is given twice (however spelled) or is one of the inputs
 * or the manifest.  Outputs come back as real folder + file name.  Errors: KQSVD_ERR_INPUT as "MANIFEST:LINE: reason";
 * KQSVD_ERR_NOMEM. */
kqsvd_status_t kqsvd_manifest_read(const char *path, kqsvd_manifest_t *m);
void kqsvd_manifest_free(kqsvd_manifest_t *m);

#endif
