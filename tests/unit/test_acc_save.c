/* kqsvd_acc_save's output checks: the rename at its end once turned
 * /dev/null into a regular file.  Each refused path must be left
 * exactly as it was, with nothing else written beside it; an existing
 * file is replaced only with force. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include "check.h"
#include "kqsvd/kqsvd.h"
#include "kqsvd_error.h"

static const kqsvd_shape_t SHAPE = {1, 1, 1, 4, 4};

/* Entries of dir other than "." and "..". */
static int entries(const char *dir) {
  DIR *d = opendir(dir);
  int n = 0;
  if (!d) return -1;
  for (struct dirent *e; (e = readdir(d));)
    n += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
  closedir(d);
  return n;
}

/* A refused save: KQSVD_ERR_USAGE, a message naming the path and holding
 * `says` (never a temporary name), the path's file type unchanged. */
static void refused(kqsvd_acc_t *acc, const char *path, int force, const char *says) {
  struct stat before, after;
  const int had = lstat(path, &before) == 0;
  const kqsvd_status_t st = kqsvd_acc_save(acc, path, force);
  CHECK(st == KQSVD_ERR_USAGE, "%s (force %d): status %d, %s", path, force, (int)st,
        kqsvd_last_error());
  CHECK(strstr(kqsvd_last_error(), path) && strstr(kqsvd_last_error(), says),
        "%s: message '%s' should name it and say '%s'", path, kqsvd_last_error(), says);
  CHECK(!strstr(kqsvd_last_error(), ".tmp-"), "a temporary name in '%s'", kqsvd_last_error());
  kqsvd_error_clear();
  if (had) {
    CHECK(lstat(path, &after) == 0 && (after.st_mode & S_IFMT) == (before.st_mode & S_IFMT) &&
              after.st_ino == before.st_ino,
          "%s was replaced", path);
  }
}

int main(void) {
  char dir[] = "/tmp/kqsvd-acc-save-XXXXXX", path[256], fifo[256], link[256], sock[256];
  char sub[256], ro[256], rofile[300], dev[256];
  float rows[4 * 4];
  kqsvd_acc_t *acc = NULL, *back = NULL;
  CHECK(mkdtemp(dir) != NULL, "mkdtemp: %s", strerror(errno));
  for (int i = 0; i < 16; i++) rows[i] = (float)(i % 5) - 1.5f;
  CHECK_OK(kqsvd_acc_init(&SHAPE, NULL, &acc));
  CHECK_OK(kqsvd_acc_absorb(acc, KQSVD_KEYS, 0, 0, 0, rows, KQSVD_F32, 4, 4));

  /* Never a device, a FIFO, a socket, a link to one or a folder, force or
   * not.  The device is a private node like /dev/null (made as root), so
   * that a regression replaces it and not the machine's. */
  snprintf(dev, sizeof dev, "%s/null-device.h5", dir);
  const int have_dev = mknod(dev, S_IFCHR | 0666, makedev(1, 3)) == 0;
  if (!have_dev) printf("test_acc_save: not root, the device case is left out\n");
  for (int force = 0; force <= 1; force++) {
    if (have_dev) refused(acc, dev, force, "not a regular file");
    snprintf(fifo, sizeof fifo, "%s/fifo.h5", dir);
    if (force == 0) CHECK(mkfifo(fifo, 0600) == 0, "mkfifo: %s", strerror(errno));
    refused(acc, fifo, force, "not a regular file");
    snprintf(link, sizeof link, "%s/null.h5", dir);
    if (force == 0)
      CHECK(symlink(have_dev ? dev : fifo, link) == 0, "symlink: %s", strerror(errno));
    refused(acc, link, force, "not a regular file");
    snprintf(sock, sizeof sock, "%s/sock.h5", dir);
    if (force == 0) {
      struct sockaddr_un a = {.sun_family = AF_UNIX};
      CHECK(strlen(sock) < sizeof a.sun_path, "socket path too long");
      memcpy(a.sun_path, sock, strlen(sock) + 1);
      const int s = socket(AF_UNIX, SOCK_STREAM, 0);
      CHECK(s >= 0 && bind(s, (struct sockaddr *)&a, sizeof a) == 0, "socket: %s", strerror(errno));
      close(s);
    }
    refused(acc, sock, force, "not a regular file");
    snprintf(sub, sizeof sub, "%s/folder", dir);
    if (force == 0) CHECK(mkdir(sub, 0700) == 0, "mkdir: %s", strerror(errno));
    refused(acc, sub, force, "folder");
  }
  CHECK(entries(dir) == 4 + have_dev, "only the planted entries remain (%d)", entries(dir));

  /* A folder that is missing or takes no file. */
  snprintf(path, sizeof path, "%s/missing/x.h5", dir);
  refused(acc, path, 1, "does not exist");
  snprintf(ro, sizeof ro, "%s/read-only", dir);
  CHECK(mkdir(ro, 0555) == 0, "mkdir: %s", strerror(errno));
  snprintf(rofile, sizeof rofile, "%s/x.h5", ro);
  refused(acc, rofile, 1, "read-only");
  CHECK(entries(ro) == 0, "nothing written in the read-only folder");

  /* A new file; replaced only with force, and then loadable. */
  snprintf(path, sizeof path, "%s/acc.h5", dir);
  CHECK_OK(kqsvd_acc_save(acc, path, 0));
  struct stat first, second;
  CHECK(stat(path, &first) == 0, "saved");
  refused(acc, path, 0, "exists");
  CHECK(stat(path, &second) == 0 && second.st_ino == first.st_ino, "kept without force");
  CHECK_OK(kqsvd_acc_absorb(acc, KQSVD_KEYS, 0, 0, 0, rows, KQSVD_F32, 2, 4));
  CHECK_OK(kqsvd_acc_save(acc, path, 1));
  CHECK(stat(path, &second) == 0 && second.st_ino != first.st_ino && S_ISREG(second.st_mode),
        "replaced with force, by a rename");
  CHECK_OK(kqsvd_acc_init(&SHAPE, NULL, &back));
  CHECK_OK(kqsvd_acc_load(back, path));
  CHECK(kqsvd_acc_tokens(back) == 6, "the replacing factors are loaded: %lld rows",
        (long long)kqsvd_acc_tokens(back));
  /* No temporary file is left: the planted four, read-only/ and acc.h5. */
  CHECK(entries(dir) == 6 + have_dev, "no temporary file left (%d entries)", entries(dir));
  /* A name with no room for the temporary suffix: refused before the
   * work, naming the path, not the temporary name after it. */
  char longname[600];
  snprintf(longname, sizeof longname, "%s/%0250d.h5", dir, 0);
  refused(acc, longname, 1, "at most");

  kqsvd_acc_free(&acc);
  kqsvd_acc_free(&back);
  char cmd[300];
  snprintf(cmd, sizeof cmd, "chmod -R u+w '%s' && rm -rf '%s'", dir, dir);
  CHECK(system(cmd) == 0, "cleanup");
  return check_exit("test_acc_save");
}
