#include "kqsvd_identity.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "kqsvd_util.h"

uint64_t kqsvd_hash_file(uint64_t h, const char *path) {
  struct stat sb;
  char real[PATH_MAX];
  const char *name = realpath(path, real) ? real : path;
  h = kqsvd_fnv1a(h, name, strlen(name) + 1);
  /* A file rewritten within one second keeps its size and whole-second
   * mtime; the nanoseconds, the inode and the change time tell. */
  if (stat(path, &sb) == 0) {
    const int64_t meta[] = {(int64_t)sb.st_size,         (int64_t)sb.st_mtim.tv_sec,
                            (int64_t)sb.st_mtim.tv_nsec, (int64_t)sb.st_ctim.tv_sec,
                            (int64_t)sb.st_ctim.tv_nsec, (int64_t)sb.st_dev,
                            (int64_t)sb.st_ino};
    h = kqsvd_fnv1a(h, meta, sizeof meta);
  }
  return h;
}
