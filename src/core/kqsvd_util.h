/* Small helpers shared by every layer: clock, hashing, formatting.
 * Not collective; thread-safe. */
#ifndef KQSVD_UTIL_H
#define KQSVD_UTIL_H

#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kqsvd_error.h"

/* Monotonic wall clock in seconds. */
double kqsvd_now(void);

/* 64-bit FNV-1a over bytes, chainable through `h` (start with
 * KQSVD_FNV_INIT).  Used for checkpoint fingerprints. */
#define KQSVD_FNV_INIT UINT64_C(0xcbf29ce484222325)
uint64_t kqsvd_fnv1a(uint64_t h, const void *data, size_t n);

/* Stateless mixing of a key and a counter into 64 random bits (splitmix64
 * finaliser), and a standard normal drawn from it.  Counter-based, so any
 * element of a synthetic set can be generated independently. */
uint64_t kqsvd_mix64(uint64_t key, uint64_t counter);
double kqsvd_normal(uint64_t key, uint64_t counter);
double kqsvd_uniform(uint64_t key, uint64_t counter); /* in (0, 1) */
/* Two independent standard normals from one Box-Muller pair. */
void kqsvd_normal2(uint64_t key, uint64_t counter, double *a, double *b);

/* Creates a folder and its missing parents, like `mkdir -p`; returns 0 or
 * -1 with errno set. */
int kqsvd_mkdir_p(const char *path);

/* The folders one kqsvd_mkdir_made made itself (its mkdir succeeded, not
 * EEXIST): the first end[i] bytes of `path` (the path asked for, repeated
 * and trailing '/' dropped), outermost first. */
typedef struct kqsvd_made_dirs {
  char path[PATH_MAX];
  unsigned short end[PATH_MAX / 2 + 1];
  int n;
} kqsvd_made_dirs_t;

/* kqsvd_mkdir_p, noting in `made` (may be NULL) the folders it made, for
 * kqsvd_rmdir_made after a failure: a run that wrote nothing leaves no
 * folder either, and never one that was there before or another made. */
int kqsvd_mkdir_made(const char *path, kqsvd_made_dirs_t *made);

/* Removes the folders `made` holds, deepest first, those that are empty;
 * then forgets them. */
void kqsvd_rmdir_made(kqsvd_made_dirs_t *made);

/* Longest suffix kqsvd appends to an output's name while writing it
 * (kqsvd_tmp_path: ".tmp-", a process id, "-" and a counter). */
#define KQSVD_TMP_SUFFIX_MAX 20

/* Writes into tmp (n bytes) the temporary name an output `path` is
 * written under: "PATH.tmp-PID-N", N counting the names this process has
 * made, so that two writers in one process (threads, a checkpoint and an
 * output) never share one.  Create it exclusively (O_EXCL, H5F_ACC_EXCL),
 * so that a link planted under that name is never followed.  Returns 0,
 * or -1 (tmp "") when the name does not fit.  Thread-safe. */
int kqsvd_tmp_path(const char *path, char *tmp, size_t n);

/* A text output's temporary file: names it (kqsvd_tmp_path, into tmp) and
 * opens it for writing, created exclusively.  NULL with errno set and tmp
 * "" when it cannot be made.  The caller closes it and hands it to
 * kqsvd_publish, or removes it. */
FILE *kqsvd_tmp_open(const char *path, char *tmp, size_t n);

/* The temporary file of an HDF5 output `path`, made before HDF5 writes a
 * byte of it: named (kqsvd_tmp_path, into tmp), created exclusively, and
 * `need` bytes claimed on its file system (kqsvd_reserve) to learn now
 * whether they fit, then emptied for H5Fcreate(H5F_ACC_TRUNC), after which
 * the writer claims them again (kqsvd_reserve) and trims the file when it
 * is closed.  A full disk is then an ordinary error here, naming `path`,
 * never a failing H5Fcreate or H5Fclose, which leave HDF5 unable to close
 * the file (and the process to exit cleanly).  On failure nothing is left
 * and tmp is "". */
kqsvd_status_t kqsvd_tmp_claim(const char *path, char *tmp, size_t n, int64_t need);

/* Makes the file system allocate `need` bytes of `file` now (the
 * temporary file of the output `path`), so that no later write to them
 * fails for want of space.  Errors name `path`: "PATH: no space left on
 * device (it needs X MiB, Y MiB free)".  KQSVD_ERR_IO. */
kqsvd_status_t kqsvd_reserve(const char *path, const char *file, int64_t need);

/* Whether `need` bytes are free on the file system of `path`'s folder
 * (statvfs), for an output HDF5 must create itself (a parallel file, or
 * one made under H5F_ACC_EXCL), so that a disk already full is the
 * ordinary error of kqsvd_reserve rather than a failing H5Fcreate.  A
 * look, not a claim: kqsvd_reserve claims the space once the file is
 * made.  KQSVD_ERR_IO. */
kqsvd_status_t kqsvd_check_space(const char *path, int64_t need);

/* Renames the finished temporary file `tmp` to `path`, unless `path` has
 * become something rename() must not replace (a device, FIFO, socket or
 * folder; a link is replaced itself, never followed).  Errors name `path`;
 * the caller removes `tmp` on failure. */
kqsvd_status_t kqsvd_publish(const char *tmp, const char *path);

/* kqsvd_publish, but never over a file already at `path`: the outputs were
 * checked before the run, so one there now appeared while the run worked
 * (another run of the same command); it is kept and the output is not
 * written (KQSVD_ERR_IO naming `path`).  For outputs written without
 * --force.  A hard link made exclusively, then `tmp` removed; where the
 * file system has no hard links, a rename after a look. */
kqsvd_status_t kqsvd_publish_new(const char *tmp, const char *path);

/* "1.23 k", "4.56 M" style rendering of a count into buf. */
const char *kqsvd_fmt_count(double v, char *buf, size_t n);
/* "1:02:03" style rendering of seconds into buf. */
const char *kqsvd_fmt_duration(double seconds, char *buf, size_t n);

#endif
