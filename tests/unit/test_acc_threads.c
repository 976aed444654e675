/* The accumulator from several threads, one handle each, without MPI: rows,
 * save and load (HDF5, behind the library's lock) in a loop, and each
 * thread's factors checked against a single-threaded run.  Then each
 * failing call reports its own message, not an earlier one. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <threads.h>
#include <unistd.h>

#include "check.h"
#include "kqsvd/kqsvd.h"
#include "kqsvd_error.h"
#include <stdint.h>

enum { NTHREADS = 4, ROUNDS = 12, D = 8, T = 200 };
static const kqsvd_shape_t SHAPE = {2, 2, 2, D, 16};

/* Folds ROUNDS batches into a new accumulator, saving and loading it after
 * each; R receives the keys' factor of (1, 1). */
static int feed(int id, int roundtrip, double *R) {
  kqsvd_acc_t *acc = NULL, *back = NULL;
  char path[128];
  float rows[T * D];
  unsigned long long s = 17ULL + (unsigned long long)id;
  snprintf(path, sizeof path, "%s/kqsvd-threads-%d-%d.h5",
           getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", (int)getpid(), id);
  if (kqsvd_acc_init(&SHAPE, NULL, &acc) != KQSVD_OK) return 1;
  for (int r = 0; r < ROUNDS; r++) {
    for (int i = 0; i < T * D; i++) rows[i] = (float)test_normal(&s);
    if (kqsvd_acc_absorb(acc, KQSVD_KEYS, 1, 1, 0, rows, KQSVD_F32, T, D) != KQSVD_OK) return 1;
    if (!roundtrip) continue;
    if (kqsvd_acc_save(acc, path, 1) != KQSVD_OK) return 1;
    if (kqsvd_acc_init(&SHAPE, NULL, &back) != KQSVD_OK || kqsvd_acc_load(back, path) != KQSVD_OK)
      return 1;
    kqsvd_acc_free(&acc);
    acc = back;
    back = NULL;
  }
  int rc = kqsvd_acc_factor(acc, KQSVD_KEYS, 1, 1, R) != KQSVD_OK;
  kqsvd_acc_free(&acc);
  remove(path);
  return rc;
}

static double g_R[NTHREADS][D * D];
static int worker(void *arg) {
  const int id = (int)(intptr_t)arg;
  return feed(id, 1, g_R[id]);
}

int main(void) {
  thrd_t th[NTHREADS];
  for (int t = 0; t < NTHREADS; t++) thrd_create(&th[t], worker, (void *)(intptr_t)t);
  for (int t = 0; t < NTHREADS; t++) {
    int rc = 1;
    thrd_join(th[t], &rc);
    CHECK(rc == 0, "thread %d failed: %s", t, kqsvd_last_error());
    double ref[D * D];
    CHECK(feed(t, 0, ref) == 0, "reference %d", t);
    CHECK(memcmp(ref, g_R[t], sizeof ref) == 0, "thread %d: save/load changed the factors", t);
  }
  /* Fresh messages: two different failures in a row. */
  kqsvd_acc_t *acc = NULL;
  float one[D] = {0};
  CHECK_OK(kqsvd_acc_init(&SHAPE, NULL, &acc));
  CHECK(kqsvd_acc_absorb(acc, KQSVD_KEYS, 9, 0, 0, one, KQSVD_F32, 1, D) == KQSVD_ERR_USAGE,
        "layer");
  CHECK(strstr(kqsvd_last_error(), "layer 9") != NULL, "%s", kqsvd_last_error());
  CHECK(kqsvd_acc_absorb(acc, KQSVD_KEYS, 0, 0, 3, one, KQSVD_F32, 1, D) == KQSVD_ERR_USAGE,
        "query");
  CHECK(strstr(kqsvd_last_error(), "query 3") != NULL, "second failure, own message: %s",
        kqsvd_last_error());
  CHECK(kqsvd_acc_factor(acc, (kqsvd_tensor_t)7, 0, 0, g_R[0]) == KQSVD_ERR_USAGE, "tensor 7");
  CHECK_OK(kqsvd_acc_absorb(acc, KQSVD_KEYS, 0, 0, 0, one, KQSVD_F32, 1, D));
  CHECK(kqsvd_last_status() == KQSVD_OK, "a successful call leaves no error");
  /* HDF5's own diagnostics stay off the host's stderr: a file that is
   * not HDF5 fails inside libhdf5. */
  char errpath[] = "/tmp/kqsvd-stderr-XXXXXX";
  const int fd = mkstemp(errpath), saved = dup(2);
  CHECK(write(fd, "not hdf5", 8) == 8, "write");
  dup2(fd, 2);
  const kqsvd_status_t bad = kqsvd_acc_load(acc, errpath);
  fflush(stderr);
  dup2(saved, 2);
  char text[4096] = "";
  const ssize_t got = pread(fd, text, sizeof text - 1, 0);
  text[got > 0 ? got : 0] = '\0';
  close(fd);
  close(saved);
  remove(errpath);
  CHECK(bad != KQSVD_OK && strstr(kqsvd_last_error(), errpath) != NULL,
        "loading a file that is not HDF5: %s", kqsvd_last_error());
  CHECK(strstr(text, "HDF5-DIAG") == NULL, "HDF5 printed to stderr: %.200s", text);
  kqsvd_acc_free(&acc);
  return check_exit("test_acc_threads");
}
