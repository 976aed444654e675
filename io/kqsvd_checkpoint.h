/* Per-rank checkpoints of the streaming stage: the rank's running R factors
 * and how far it got.  Each rank owns DIR/rank-R-of-N.h5, so saving and
 * loading are not collective.  Files are written under a temporary name and
 * renamed, so a kill leaves either the previous checkpoint or the new one. */
#ifndef KQSVD_CHECKPOINT_H
#define KQSVD_CHECKPOINT_H

#include <stdint.h>

#include "kqsvd_error.h"

typedef struct kqsvd_checkpoint_pos {
  int64_t segment; /* index of the first segment not yet fully done */
  int64_t item;    /* items of that segment already folded in */
} kqsvd_checkpoint_pos_t;

/* Saves state (nvals doubles) with the run's fingerprint, a readable
 * description of what it covers and a checksum of the contents.  Errors:
 * KQSVD_ERR_IO, _HDF5. */
kqsvd_status_t kqsvd_checkpoint_save(const char *dir, int rank, int nranks, uint64_t fingerprint,
                                     const char *about, kqsvd_checkpoint_pos_t pos, int64_t nvals,
                                     const double *state);

/* Loads this rank's checkpoint if there is one (*found = 0 otherwise),
 * its headers read in a child process first (kqsvd_h5_isolate).  Refuses,
 * with KQSVD_ERR_INPUT naming the file, a checkpoint written by a run with
 * another number of ranks, other inputs or other options, and one whose
 * checksum does not match its contents or whose state is not finite. */
kqsvd_status_t kqsvd_checkpoint_load(const char *dir, int rank, int nranks, uint64_t fingerprint,
                                     int64_t nvals, double *state, kqsvd_checkpoint_pos_t *pos,
                                     int *found);

/* The same for one file at `path` (the accumulator's save and load): save
 * does not create folders; load fails with KQSVD_ERR_INPUT naming the file
 * when it does not exist, and reads the headers in a child process first
 * only when `isolate` (a library in a threaded host must not fork).  Not
 * collective. */
kqsvd_status_t kqsvd_checkpoint_save_file(const char *path, uint64_t fingerprint, const char *about,
                                          kqsvd_checkpoint_pos_t pos, int64_t nvals,
                                          const double *state);
kqsvd_status_t kqsvd_checkpoint_load_file(const char *path, uint64_t fingerprint, int64_t nvals,
                                          double *state, kqsvd_checkpoint_pos_t *pos, int isolate);

/* Deletes this rank's checkpoint file, and the temporary files of saves
 * that a crash cut short (after a successful run).  Not collective. */
void kqsvd_checkpoint_remove(const char *dir, int rank, int nranks);

#endif
