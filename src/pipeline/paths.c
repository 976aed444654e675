/* Checks of output and input paths before any work, so that a typo fails
 * in a second rather than after hours of streaming. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kqsvd_pipeline.h"
#include "kqsvd_util.h"

/* The folder part of `path` ("." when it has none). */
static void folder_of(const char *path, char *dir, size_t n) {
  snprintf(dir, n, "%s", path);
  char *slash = strrchr(dir, '/');
  if (!slash)
    snprintf(dir, n, ".");
  else if (slash == dir)
    dir[1] = '\0';
  else
    *slash = '\0';
}

/* Whether a new file can be made in folder `dir`: tried, since access()
 * says yes to root on a read-only mount; but a folder nobody may write to
 * (mode a-w) is taken as read-only for root too, as its owner meant it.
 * The rule of the Python commands (kqsvd/formats/files.py, _probe). */
static kqsvd_status_t probe_folder(const char *name, const char *dir) {
  kqsvd_status_t st = KQSVD_OK;
  struct stat sb;
  char probe[PATH_MAX + 32];
  int fd = -1;
  KQSVD_CHECK(stat(dir, &sb) == 0, KQSVD_ERR_USAGE, "%s: folder %s: %s", name, dir,
              strerror(errno));
  KQSVD_CHECK(sb.st_mode & 0222, KQSVD_ERR_USAGE, "%s: the folder %s is read-only (mode %04o)",
              name, dir, (unsigned)(sb.st_mode & 07777));
  snprintf(probe, sizeof probe, "%s/.kqsvd-probe-XXXXXX", dir);
  fd = mkstemp(probe);
  KQSVD_CHECK(fd >= 0, KQSVD_ERR_USAGE, "%s: cannot create a file in %s: %s", name, dir,
              strerror(errno));
done:
  if (fd >= 0) {
    close(fd);
    unlink(probe);
  }
  return st;
}

kqsvd_status_t kqsvd_check_output_place(const char *opt, const char *path) {
  kqsvd_status_t st = KQSVD_OK;
  struct stat sb;
  char dir[PATH_MAX], name[PATH_MAX + 64];
  snprintf(name, sizeof name, "%s%s%s", opt ? opt : "", opt ? " " : "", path);
  folder_of(path, dir, sizeof dir);
  if (stat(path, &sb) == 0) {
    KQSVD_CHECK(!S_ISDIR(sb.st_mode), KQSVD_ERR_USAGE, "%s is a folder", name);
    /* rename() would put the output in place of a device such as
     * /dev/null, or of a FIFO another program reads: never wanted. */
    KQSVD_CHECK(S_ISREG(sb.st_mode), KQSVD_ERR_USAGE,
                "%s is not a regular file (a device, FIFO or socket); give a file name", name);
  }
  KQSVD_CHECK(stat(dir, &sb) == 0 && S_ISDIR(sb.st_mode), KQSVD_ERR_USAGE,
              "%s: folder %s does not exist", name, dir);
  KQSVD_CALL(probe_folder(name, dir));
done:
  return st;
}

/* A path that a job script or a log line can carry: no control bytes. */
static kqsvd_status_t printable(const char *name, const char *path) {
  kqsvd_status_t st = KQSVD_OK;
  for (const char *c = path; *c; c++)
    KQSVD_CHECK((unsigned char)*c >= 0x20 && *c != 0x7f, KQSVD_ERR_USAGE,
                "%s: the path holds a control character (byte 0x%02x)", name,
                (unsigned)(unsigned char)*c);
done:
  return st;
}

kqsvd_status_t kqsvd_check_folder_output(const char *opt, const char *dir) {
  kqsvd_status_t st = KQSVD_OK;
  struct stat sb;
  char where[PATH_MAX], name[PATH_MAX + 64];
  KQSVD_CHECK(*dir, KQSVD_ERR_USAGE, "%s: give a folder", opt);
  KQSVD_CHECK(strlen(dir) + 32 < PATH_MAX, KQSVD_ERR_USAGE, "%s: the path is too long", opt);
  snprintf(name, sizeof name, "%s %s", opt, dir);
  KQSVD_CALL(printable(opt, dir));
  if (stat(dir, &sb) == 0)
    KQSVD_CHECK(S_ISDIR(sb.st_mode), KQSVD_ERR_USAGE,
                "%s is %s, not a folder; give a folder (made if missing)", name,
                S_ISREG(sb.st_mode) ? "a file" : "a device, FIFO or socket");
  else
    KQSVD_CHECK(lstat(dir, &sb) != 0, KQSVD_ERR_USAGE,
                "%s is a link to nothing; give a folder (made if missing)", name);
  /* The part that exists decides: the run makes the rest. */
  snprintf(where, sizeof where, "%s", dir);
  while (stat(where, &sb) != 0) {
    char *slash = strrchr(where, '/');
    if (!slash)
      snprintf(where, sizeof where, ".");
    else if (slash == where)
      where[1] = '\0';
    else
      *slash = '\0';
    if (strcmp(where, ".") == 0 || strcmp(where, "/") == 0) break;
  }
  KQSVD_CHECK(stat(where, &sb) == 0 && S_ISDIR(sb.st_mode), KQSVD_ERR_USAGE,
              "%s: %s is not a folder", name, where);
  KQSVD_CALL(probe_folder(name, where));
done:
  return st;
}

kqsvd_status_t kqsvd_check_output(const char *opt, const char *path, int force) {
  kqsvd_status_t st = KQSVD_OK;
  const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
  /* opt NULL: a library call, whose caller names no option. */
  const char *who = opt ? opt : path;
  KQSVD_CHECK(*path, KQSVD_ERR_USAGE, "%s: give a file name", opt ? opt : "the output");
  /* Outputs are written as NAME.tmp-PID-N first: that name must fit too,
   * or the failure comes only after the whole run (deep inside MPI-IO). */
  KQSVD_CHECK(*base, KQSVD_ERR_USAGE, "%s%s%s names a folder, not a file", opt ? opt : "",
              opt ? " " : "", path);
  KQSVD_CHECK(strlen(base) + KQSVD_TMP_SUFFIX_MAX <= NAME_MAX, KQSVD_ERR_USAGE,
              "%s: the file name is %zu bytes long; at most %d fit with the temporary suffix "
              "kqsvd writes under (%s ...)",
              who, strlen(base), NAME_MAX - KQSVD_TMP_SUFFIX_MAX, path);
  KQSVD_CHECK(strlen(path) + KQSVD_TMP_SUFFIX_MAX < PATH_MAX, KQSVD_ERR_USAGE,
              "%s: the path is %zu bytes long; at most %d are supported", who, strlen(path),
              PATH_MAX - 1 - KQSVD_TMP_SUFFIX_MAX);
  KQSVD_CALL(printable(who, path));
  KQSVD_CALL(kqsvd_check_output_place(opt, path));
  /* A calibration takes hours: replacing one needs saying so.  lstat: a
   * link to nothing is a name taken too, which the final rename (never
   * replacing without force) would refuse after all the work. */
  struct stat taken;
  if (opt)
    KQSVD_CHECK(force || lstat(path, &taken) != 0, KQSVD_ERR_USAGE,
                "%s %s already exists; give --force to replace it", opt, path);
  else
    KQSVD_CHECK(force || lstat(path, &taken) != 0, KQSVD_ERR_USAGE,
                "%s exists; it is replaced only when asked to (force)", path);
done:
  return st;
}

/* roles[i] names in[i] in messages ("--model", "shard 3"). */
static kqsvd_status_t check_files(const char *out_opt, const char *out, const char *const *in,
                                  const char *const *roles, int nin) {
  kqsvd_status_t st = KQSVD_OK;
  struct stat o;
  const int out_exists = out && stat(out, &o) == 0;
  for (int i = 0; i < nin; i++) {
    struct stat a;
    if (stat(in[i], &a) != 0) continue;
    KQSVD_CHECK(!out_exists || a.st_dev != o.st_dev || a.st_ino != o.st_ino, KQSVD_ERR_USAGE,
                "%s %s is also an input (%s): the output would replace it", out_opt, out, roles[i]);
    for (int j = 0; j < i; j++) {
      struct stat b;
      KQSVD_CHECK(stat(in[j], &b) != 0 || a.st_dev != b.st_dev || a.st_ino != b.st_ino,
                  KQSVD_ERR_USAGE, "%s is given twice: as %s and as %s (%s)", in[i], roles[j],
                  roles[i], in[j]);
    }
  }
done:
  return st;
}

kqsvd_status_t kqsvd_check_file_args(const char *out_opt, const char *out, int nnamed,
                                     const char *const *named, const char *const *named_opts,
                                     char **shards, int nshards) {
  kqsvd_status_t st = KQSVD_OK;
  const char **in = NULL, **roles = NULL;
  char *labels = NULL;
  const size_t lab = 32, n = (size_t)nnamed + (size_t)nshards;
  KQSVD_MALLOC(in, n, "the file list");
  KQSVD_MALLOC(roles, n, "the file list");
  KQSVD_MALLOC(labels, (size_t)nshards * lab + 1, "the file list");
  for (int i = 0; i < nnamed; i++) in[i] = named[i], roles[i] = named_opts[i];
  for (int i = 0; i < nshards; i++) {
    snprintf(labels + (size_t)i * lab, lab, "shard %d", i + 1);
    in[nnamed + i] = shards[i];
    roles[nnamed + i] = labels + (size_t)i * lab;
  }
  KQSVD_CALL(check_files(out_opt, out, in, roles, (int)n));
done:
  free(in);
  free(roles);
  free(labels);
  return st;
}

kqsvd_status_t kqsvd_check_checkpoint_dir(const char *dir, const char *out,
                                          kqsvd_made_dirs_t *made) {
  kqsvd_status_t st = KQSVD_OK;
  struct stat sb;
  char real_dir[PATH_MAX], out_dir[PATH_MAX], real_out[PATH_MAX], name[PATH_MAX + 16];
  KQSVD_CHECK(!out || strcmp(dir, out) != 0, KQSVD_ERR_USAGE,
              "--checkpoint %s is the --out path; give the checkpoints a folder of their own", dir);
  KQSVD_CHECK(stat(dir, &sb) != 0 || S_ISDIR(sb.st_mode), KQSVD_ERR_USAGE,
              "--checkpoint %s exists and is not a folder", dir);
  KQSVD_CHECK(kqsvd_mkdir_made(dir, made) == 0, KQSVD_ERR_USAGE,
              "--checkpoint %s: cannot create it (%s)", dir, strerror(errno));
  /* Found now, not after the first segment has been streamed. */
  snprintf(name, sizeof name, "--checkpoint %s", dir);
  KQSVD_CALL(probe_folder(name, dir));
  KQSVD_CHECK(realpath(dir, real_dir), KQSVD_ERR_USAGE, "--checkpoint %s: %s", dir,
              strerror(errno));
  if (out) {
    folder_of(out, out_dir, sizeof out_dir);
    /* Checkpoint files are deleted when the run ends: an output among
     * them could go with them. */
    const size_t n = strlen(real_dir);
    KQSVD_CHECK(!realpath(out_dir, real_out) ||
                    !(strncmp(real_out, real_dir, n) == 0 &&
                      (real_out[n] == '\0' || real_out[n] == '/' || n == 1)),
                KQSVD_ERR_USAGE,
                "--out %s lies inside the --checkpoint folder %s; write it elsewhere", out, dir);
  }
done:
  return st;
}
