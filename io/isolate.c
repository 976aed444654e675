/* Reading a damaged file's headers can crash libhdf5 itself (a corrupt
 * attribute heap in H5Aread, a corrupt object header in H5Aexists) or make
 * it loop.  kqsvd cannot validate HDF5's own structures before HDF5 reads
 * them, so it lets a child process read them first: a crash or a hang there
 * becomes an error naming the file, and this process, which may hold MPI
 * state, never runs into it. */
#include "kqsvd_h5.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

/* What the child sends back: its status and message. */
typedef struct {
  int code;
  char message[1024];
} verdict_t;

/* A header check takes milliseconds, even on a busy parallel file system;
 * damaged B-trees can make HDF5 loop forever.  KQSVD_HEADER_TIMEOUT (in
 * seconds) changes the limit. */
#define CHILD_SECONDS 15

static unsigned child_seconds(void) {
  const char *s = getenv("KQSVD_HEADER_TIMEOUT");
  const long v = s ? strtol(s, NULL, 10) : 0;
  return v > 0 && v < 86400 ? (unsigned)v : CHILD_SECONDS;
}

static void child(int fd, kqsvd_status_t (*fn)(void *), void *ctx) {
  verdict_t v;
  memset(&v, 0, sizeof v);
  /* The parent reports; a crash here must not dump core or print a
   * sanitizer's report over the one clear message. */
  const struct rlimit none = {0, 0};
  setrlimit(RLIMIT_CORE, &none);
  const int devnull = open("/dev/null", O_WRONLY);
  if (devnull >= 0) dup2(devnull, STDERR_FILENO);
  alarm(child_seconds());
  kqsvd_error_clear();
  v.code = (int)fn(ctx);
  snprintf(v.message, sizeof v.message, "%s", kqsvd_error_message());
  ssize_t left = (ssize_t)sizeof v;
  const char *p = (const char *)&v;
  while (left > 0) {
    const ssize_t w = write(fd, p, (size_t)left);
    if (w <= 0) _exit(3);
    p += w, left -= w;
  }
  /* No atexit handlers or MPI finalization: they belong to the parent. */
  _exit(0);
}

kqsvd_status_t kqsvd_h5_isolate(const char *path, kqsvd_status_t (*fn)(void *), void *ctx) {
  kqsvd_status_t st = KQSVD_OK;
  int fds[2] = {-1, -1}, status = 0;
  verdict_t v;
  size_t got = 0;
  memset(&v, 0, sizeof v);
  const char *off = getenv("KQSVD_NO_ISOLATION");
  if (off && *off && strcmp(off, "0") != 0) return fn(ctx);
  KQSVD_CHECK(pipe(fds) == 0, KQSVD_ERR_IO, "%s: cannot create a pipe to check it: %s", path,
              strerror(errno));
  fflush(NULL); /* buffered output must not be written twice */
  const pid_t pid = fork();
  KQSVD_CHECK(pid >= 0, KQSVD_ERR_IO, "%s: cannot fork to check it: %s", path, strerror(errno));
  if (pid == 0) {
    close(fds[0]);
    child(fds[1], fn, ctx);
  }
  close(fds[1]);
  fds[1] = -1;
  while (got < sizeof v) {
    const ssize_t r = read(fds[0], (char *)&v + got, sizeof v - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    got += (size_t)r;
  }
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM)
    KQSVD_FAIL(KQSVD_ERR_INPUT,
               "%s: the HDF5 library did not finish reading its headers within %u s: the file "
               "is damaged (KQSVD_HEADER_TIMEOUT sets the limit)",
               path, child_seconds());
  if (WIFSIGNALED(status))
    KQSVD_FAIL(KQSVD_ERR_INPUT,
               "%s: the HDF5 library crashed (%s) reading its headers: the file is damaged", path,
               strsignal(WTERMSIG(status)));
  KQSVD_CHECK(got == sizeof v && WIFEXITED(status) && WEXITSTATUS(status) == 0, KQSVD_ERR_INPUT,
              "%s: reading its headers failed inside the HDF5 library (exit status %d): the "
              "file is damaged",
              path, WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  v.message[sizeof v.message - 1] = '\0';
  if (v.code != KQSVD_OK) {
    st = kqsvd_error_set((kqsvd_status_t)v.code, __FILE__, __LINE__, __func__, "%s", v.message);
    kqsvd_error_context(path);
  }
done:
  if (fds[0] >= 0) close(fds[0]);
  if (fds[1] >= 0) close(fds[1]);
  return st;
}

/* What the child opens: a path and how. */
typedef struct {
  const char *path;
  const kqsvd_h5_opener_t *op;
} trial_t;

static kqsvd_status_t open_close(void *ctx) {
  const trial_t *t = ctx;
  void *handle = NULL;
  const kqsvd_status_t st = t->op->open(t->path, &handle);
  if (handle) t->op->close(handle);
  return st;
}

kqsvd_status_t kqsvd_h5_isolated_open(const char *path, const kqsvd_h5_opener_t *op, void **out) {
  kqsvd_status_t st = KQSVD_OK;
  trial_t t = {path, op};
  if (out) *out = NULL;
  KQSVD_CALL(kqsvd_h5_isolate(path, open_close, &t));
  if (out) KQSVD_CALL(op->open(path, out));
done:
  return st;
}
