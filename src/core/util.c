#include "kqsvd/version.h"
#include "kqsvd_util.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

double kqsvd_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

uint64_t kqsvd_fnv1a(uint64_t h, const void *data, size_t n) {
  const unsigned char *p = data;
  for (size_t i = 0; i < n; i++) {
    h ^= p[i];
    h *= UINT64_C(0x100000001b3);
  }
  return h;
}

uint64_t kqsvd_mix64(uint64_t key, uint64_t counter) {
  uint64_t z = key * UINT64_C(0x9e3779b97f4a7c15) + counter * UINT64_C(0xd1b54a32d192ed03) +
               UINT64_C(0x632be59bd9b4e019);
  z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
  return z ^ (z >> 31);
}

double kqsvd_uniform(uint64_t key, uint64_t counter) {
  return ((double)(kqsvd_mix64(key, counter) >> 11) + 0.5) * 0x1.0p-53;
}

void kqsvd_normal2(uint64_t key, uint64_t counter, double *a, double *b) {
  const double u1 = kqsvd_uniform(key, 2 * counter), u2 = kqsvd_uniform(key, 2 * counter + 1);
  const double rad = sqrt(-2.0 * log(u1)), ang = 6.283185307179586 * u2;
  *a = rad * cos(ang);
  *b = rad * sin(ang);
}

double kqsvd_normal(uint64_t key, uint64_t counter) {
  /* Box-Muller on two independent counters. */
  const double u1 = kqsvd_uniform(key, 2 * counter), u2 = kqsvd_uniform(key, 2 * counter + 1);
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

const char *kqsvd_fmt_count(double v, char *buf, size_t n) {
  static const char *unit[] = {"", " k", " M", " G", " T"};
  int u = 0;
  while (fabs(v) >= 1000.0 && u < 4) v /= 1000.0, u++;
  snprintf(buf, n, u ? "%.2f%s" : "%.0f%s", v, unit[u]);
  return buf;
}

const char *kqsvd_fmt_duration(double s, char *buf, size_t n) {
  if (!(s >= 0) || s > 1e8) {
    snprintf(buf, n, "--:--");
    return buf;
  }
  long t = (long)(s + 0.5);
  if (t >= 3600)
    snprintf(buf, n, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
  else
    snprintf(buf, n, "%ld:%02ld", t / 60, t % 60);
  return buf;
}

int kqsvd_mkdir_p(const char *path) { return kqsvd_mkdir_made(path, NULL); }

/* A mkdir of each component in turn, on the path with its repeated and
 * trailing '/' dropped: a component is recorded only when this mkdir made
 * it, so a folder that was there (or that another made meanwhile, or that
 * a ".." leads back to) is never counted as this run's. */
int kqsvd_mkdir_made(const char *path, kqsvd_made_dirs_t *made) {
  kqsvd_made_dirs_t own;
  kqsvd_made_dirs_t *r = made ? made : &own;
  size_t n = 0;
  r->n = 0;
  r->path[0] = '\0';
  for (const char *p = path; *p; p++) {
    if (*p == '/' && n > 0 && r->path[n - 1] == '/') continue;
    if (n + 1 >= sizeof r->path) {
      r->path[0] = '\0';
      errno = ENAMETOOLONG;
      return -1;
    }
    r->path[n++] = *p;
  }
  if (n > 1 && r->path[n - 1] == '/') n--;
  r->path[n] = '\0';
  if (n == 0) {
    errno = ENOENT;
    return -1;
  }
  for (size_t i = 1; i <= n; i++) {
    if (i < n && r->path[i] != '/') continue;
    r->path[i] = '\0';
    const int rc = mkdir(r->path, 0777);
    const int e = errno;
    if (i < n) r->path[i] = '/';
    if (rc == 0)
      r->end[r->n++] = (unsigned short)i;
    else if (e != EEXIST) {
      errno = e;
      return -1;
    }
  }
  return 0;
}

void kqsvd_rmdir_made(kqsvd_made_dirs_t *made) {
  /* Deepest first; each one that is not empty stays (rmdir refuses it). */
  for (int k = made->n - 1; k >= 0; k--) {
    const char c = made->path[made->end[k]];
    made->path[made->end[k]] = '\0';
    rmdir(made->path);
    made->path[made->end[k]] = c;
  }
  made->n = 0;
}

int kqsvd_tmp_path(const char *path, char *tmp, size_t n) {
  static _Atomic unsigned long made;
  const unsigned long k = atomic_fetch_add(&made, 1) % 100000;
  const int w = snprintf(tmp, n, "%s.tmp-%ld-%lu", path, (long)getpid(), k);
  if (w >= 0 && (size_t)w < n) return 0;
  tmp[0] = '\0'; /* no cut name for a caller to remove */
  return -1;
}

FILE *kqsvd_tmp_open(const char *path, char *tmp, size_t n) {
  if (kqsvd_tmp_path(path, tmp, n) != 0) {
    errno = ENAMETOOLONG;
    return NULL;
  }
  const int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL, 0666);
  FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
  if (!f) {
    const int e = errno;
    if (fd >= 0) {
      close(fd);
      remove(tmp);
    }
    tmp[0] = '\0'; /* what is there now, if anything, is not ours */
    errno = e;
  }
  return f;
}

/* "PATH: no space left on device (it needs X MiB, Y MiB free)", or the
 * error `rc` when another. */
static kqsvd_status_t no_room(const char *path, const char *where, int rc, int64_t need) {
  kqsvd_status_t st = KQSVD_OK;
  struct statvfs vfs;
  const double free_mib =
      statvfs(where, &vfs) == 0 ? (double)vfs.f_bavail * (double)vfs.f_frsize / 1048576.0 : -1.0;
  KQSVD_FAIL(KQSVD_ERR_IO, "%s: %s (it needs %.1f MiB, %.1f MiB free)", path,
             rc == ENOSPC || rc == EDQUOT ? "no space left on device" : strerror(rc),
             (double)need / 1048576.0, free_mib);
done:
  return st;
}

kqsvd_status_t kqsvd_check_space(const char *path, int64_t need) {
  struct statvfs vfs;
  char dir[PATH_MAX];
  snprintf(dir, sizeof dir, "%s", path);
  char *slash = strrchr(dir, '/');
  if (!slash)
    snprintf(dir, sizeof dir, ".");
  else
    slash[slash == dir] = '\0';                 /* "/x" -> "/" */
  if (statvfs(dir, &vfs) != 0) return KQSVD_OK; /* the create says what is wrong */
  if ((double)vfs.f_bavail * (double)vfs.f_frsize >= (double)need) return KQSVD_OK;
  return no_room(path, dir, ENOSPC, need);
}

kqsvd_status_t kqsvd_reserve(const char *path, const char *file, int64_t need) {
  kqsvd_status_t st = KQSVD_OK;
  const int fd = open(file, O_WRONLY);
  KQSVD_CHECK(fd >= 0, KQSVD_ERR_IO, "%s: cannot open %s to reserve its space: %s", path, file,
              strerror(errno));
  const int rc = posix_fallocate(fd, 0, (off_t)need);
  close(fd);
  if (rc != 0) KQSVD_CALL(no_room(path, file, rc, need));
done:
  return st;
}

kqsvd_status_t kqsvd_tmp_claim(const char *path, char *tmp, size_t n, int64_t need) {
  kqsvd_status_t st = KQSVD_OK;
  FILE *f = kqsvd_tmp_open(path, tmp, n);
  KQSVD_CHECK(f, KQSVD_ERR_IO, "%s: cannot create its temporary file: %s", path,
              errno == ENOSPC || errno == EDQUOT ? "no space left on device" : strerror(errno));
  fclose(f);
  KQSVD_CALL(kqsvd_reserve(path, tmp, need));
  KQSVD_CHECK(truncate(tmp, 0) == 0, KQSVD_ERR_IO, "%s: cannot empty %s: %s", path, tmp,
              strerror(errno));
done:
  if (st != KQSVD_OK && tmp[0]) {
    remove(tmp);
    tmp[0] = '\0';
  }
  return st;
}

/* The output was checked before the run, but runs are long and the name
 * may since have become, say, a device node, which rename() replaces. */
static kqsvd_status_t still_replaceable(const char *path) {
  kqsvd_status_t st = KQSVD_OK;
  struct stat sb;
  KQSVD_CHECK(lstat(path, &sb) != 0 || S_ISREG(sb.st_mode) || S_ISLNK(sb.st_mode), KQSVD_ERR_IO,
              "%s is no longer a regular file (now a device, FIFO, socket or folder); it is left "
              "as it is and the output is not written",
              path);
done:
  return st;
}

kqsvd_status_t kqsvd_publish(const char *tmp, const char *path) {
  kqsvd_status_t st = KQSVD_OK;
  KQSVD_CALL(still_replaceable(path));
  KQSVD_CHECK(rename(tmp, path) == 0, KQSVD_ERR_IO, "cannot rename %s to %s: %s", tmp, path,
              strerror(errno));
done:
  return st;
}

kqsvd_status_t kqsvd_publish_new(const char *tmp, const char *path) {
  kqsvd_status_t st = KQSVD_OK;
  struct stat sb;
  KQSVD_CALL(still_replaceable(path));
  if (link(tmp, path) != 0) {
    const int e = errno;
    const int no_links = e == EPERM || e == EOPNOTSUPP || e == ENOSYS || e == EMLINK;
    KQSVD_CHECK(e != EEXIST && (!no_links || lstat(path, &sb) != 0), KQSVD_ERR_IO,
                "%s appeared while the run worked; nothing written (give --force to replace it)",
                path);
    KQSVD_CHECK(no_links, KQSVD_ERR_IO, "cannot rename %s to %s: %s", tmp, path, strerror(e));
    KQSVD_CHECK(rename(tmp, path) == 0, KQSVD_ERR_IO, "cannot rename %s to %s: %s", tmp, path,
                strerror(errno));
  } else {
    KQSVD_CHECK(unlink(tmp) == 0, KQSVD_ERR_IO, "%s: cannot remove %s: %s", path, tmp,
                strerror(errno));
  }
done:
  return st;
}

const char *kqsvd_version(void) { return KQSVD_VERSION; }
