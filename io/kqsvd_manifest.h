/* The manifest of `kqsvd calibrate --manifest` and slurm/kqsvd-submit: one
 * model per line,
 *     NAME MODEL_H5 OUTPUT_H5 SHARD_GLOB [EPS [VALID_GLOB]]
 * or, naming a model to calibrate in situ (python -m kqsvd.calibrate_hf:
 * no caches; slurm/kqsvd-submit runs it, kqsvd calibrate cannot),
 *     NAME hf:MODEL OUTPUT_H5 TEXT SEQ_LEN NUM_SEQS [EPS [VALID_TEXT]]
 * with `#` starting a comment.  Relative paths are relative to the
 * manifest's folder.  EPS is a number in (0, 1) or, as an extension, any
 * rank policy (eps:E, fixed:R, budget:F); VALID_GLOB (an extension) names
 * the validation shards that slurm/kqsvd-submit --evaluate uses.  Not
 * collective. */
#ifndef KQSVD_MANIFEST_H
#define KQSVD_MANIFEST_H

#include <stdint.h>
#include <stdio.h>

#include "kqsvd_error.h"
#include "kqsvd_rank.h"

/* A manifest is a short text file: anything bigger is a mistake (a data
 * file named by accident), refused before it is read. */
#define KQSVD_MANIFEST_MAX_LINE (64 * 1024)
#define KQSVD_MANIFEST_MAX_BYTES (16 * 1024 * 1024)
#define KQSVD_MANIFEST_MAX_NAME 200

typedef struct kqsvd_manifest_entry {
  int line; /* in the manifest, from 1 */
  /* Absolute and normalised: no "." or ".." components, the folders
   * resolved with realpath; the last component (or, in a glob, everything
   * from the first component with a wildcard) as written. */
  char *name, *model, *output;
  char *shard_glob, *valid_glob; /* valid_glob is NULL when not given */
  char **shards;                 /* the calibration shards, sorted */
  int nshards;
  char **valid; /* the validation shards, sorted (none without VALID_GLOB) */
  int nvalid;
  int has_policy; /* EPS given */
  /* An hf: line: model is the model's folder or GGUF file; no shards. */
  int insitu;
  char *text, *valid_text; /* valid_text is NULL when not given */
  int64_t seq_len, num_seqs;
  kqsvd_rank_policy_t policy;
} kqsvd_manifest_entry_t;

typedef struct kqsvd_manifest {
  char *path;
  int n;
  kqsvd_manifest_entry_t *e;
} kqsvd_manifest_t;

/* Reads and checks a manifest: that it is a regular file of at most
 * KQSVD_MANIFEST_MAX_BYTES with lines of at most KQSVD_MANIFEST_MAX_LINE
 * bytes and no control characters but blanks; field counts; names
 * (letters, digits, '.', '_', '-', not first; at most
 * KQSVD_MANIFEST_MAX_NAME; unique); EPS; SEQ_LEN and NUM_SEQS (1 to
 * 2^24); that the model (an hf: model also a folder), the texts and every
 * file a glob matches are regular files whose resolved paths hold no
 * control character (job scripts pass them on as text); that each glob
 * matches at least one file and each output's folder exists; and that no
 * output is given twice (however spelled) or is any line's model, shard,
 * validation shard or text, or the manifest.  Every bad line is reported, one
 * "MANIFEST:LINE: reason" each, in one KQSVD_ERR_INPUT; when they do not
 * all fit the error record, they go to `report` first (rank 0 passes
 * stderr, the other ranks NULL) or, when it is NULL, the first ones are
 * kept with a count of the rest.  Errors also: KQSVD_ERR_NOMEM. */
kqsvd_status_t kqsvd_manifest_read_report(const char *path, FILE *report, kqsvd_manifest_t *m);
/* The same with report NULL. */
kqsvd_status_t kqsvd_manifest_read(const char *path, kqsvd_manifest_t *m);
void kqsvd_manifest_free(kqsvd_manifest_t *m);

#endif
