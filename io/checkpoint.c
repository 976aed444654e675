#include "kqsvd_checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kqsvd_h5.h"
#include "kqsvd_proj.h"
#include "kqsvd_signal.h"
#include "kqsvd_util.h"

static void ckpt_path(char *buf, size_t n, const char *dir, int rank, int nranks) {
  snprintf(buf, n, "%s/rank-%05d-of-%05d.h5", dir, rank, nranks);
}

/* Covers everything a resume trusts: the fingerprint, the position and
 * every bit of the state.  One word at a time, each step a bijection of
 * the running value, so a change confined to one word is always seen. */
static void checksum(const char *fingerprint, kqsvd_checkpoint_pos_t pos, int64_t nvals,
                     const double *state, char hex[32]) {
  uint64_t h = kqsvd_fnv1a(KQSVD_FNV_INIT, fingerprint, strlen(fingerprint));
  const int64_t head[3] = {pos.segment, pos.item, nvals};
  h = kqsvd_fnv1a(h, head, sizeof head);
  for (int64_t k = 0; k < nvals; k++) {
    uint64_t w;
    memcpy(&w, state + k, sizeof w);
    h = (h ^ w) * UINT64_C(0x100000001b3);
    h ^= h >> 29;
  }
  snprintf(hex, 32, "%016" PRIx64, h);
}

kqsvd_status_t kqsvd_checkpoint_save(const char *dir, int rank, int nranks, uint64_t fingerprint,
                                     const char *about, kqsvd_checkpoint_pos_t pos, int64_t nvals,
                                     const double *state) {
  kqsvd_status_t st = KQSVD_OK;
  char path[PATH_MAX];
  ckpt_path(path, sizeof path, dir, rank, nranks);
  if (kqsvd_mkdir_p(dir) != 0)
    KQSVD_FAIL(KQSVD_ERR_IO, "cannot create checkpoint folder %s: %s", dir, strerror(errno));
  KQSVD_CALL(kqsvd_checkpoint_save_file(path, fingerprint, about, pos, nvals, state));
done:
  return st;
}

kqsvd_status_t kqsvd_checkpoint_save_file(const char *path, uint64_t fingerprint, const char *about,
                                          kqsvd_checkpoint_pos_t pos, int64_t nvals,
                                          const double *state) {
  kqsvd_status_t st = KQSVD_OK;
  char tmp[PATH_MAX + 32] = "", fp[32], sum[32];
  hid_t file = -1, space = -1, ds = -1;
  KQSVD_CHECK(strlen(path) < PATH_MAX, KQSVD_ERR_USAGE, "checkpoint path too long: %.64s...", path);
  KQSVD_CHECK(strlen(path) + KQSVD_TMP_SUFFIX_MAX < sizeof tmp, KQSVD_ERR_USAGE,
              "checkpoint path too long: %.64s...", path);
  snprintf(fp, sizeof fp, "%016" PRIx64, fingerprint);
  checksum(fp, pos, nvals, state, sum);
  /* The space claimed before HDF5 writes (kqsvd_tmp_claim): a full disk
   * is an ordinary error naming the checkpoint, never a failing close. */
  const int64_t need = nvals * (int64_t)sizeof(double) + 64 * 1024;
  KQSVD_CALL(kqsvd_tmp_claim(path, tmp, sizeof tmp, need));
  kqsvd_signal_track(tmp);
  file = H5Fcreate(tmp, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  if (file < 0) KQSVD_FAIL(KQSVD_ERR_IO, "%s: cannot create the checkpoint's temporary file", path);
  KQSVD_CALL(kqsvd_reserve(path, tmp, need));
  KQSVD_CALL(kqsvd_h5_put_str(file, "kqsvd_format", "checkpoint"));
  KQSVD_CALL(kqsvd_h5_put_str(file, "fingerprint", fp));
  KQSVD_CALL(kqsvd_h5_put_str(file, "about", about));
  KQSVD_CALL(kqsvd_h5_put_int(file, "next_segment", H5T_STD_I64LE, pos.segment));
  KQSVD_CALL(kqsvd_h5_put_int(file, "next_item", H5T_STD_I64LE, pos.item));
  KQSVD_CALL(kqsvd_h5_put_str(file, "checksum", sum));
  const hsize_t n = (hsize_t)nvals;
  KQSVD_H5_ID(space, H5Screate_simple(1, &n, NULL));
  KQSVD_H5_ID(
      ds, H5Dcreate2(file, "state", H5T_IEEE_F64LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
  KQSVD_H5(H5Dwrite(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, state));
  kqsvd_h5_close(&ds);
  if (H5Fclose(file) < 0) {
    file = -1;
    kqsvd_h5_fail_("H5Fclose", __FILE__, __LINE__, __func__);
    kqsvd_error_mark_fatal();
    st = KQSVD_ERR_HDF5;
    goto done;
  }
  file = -1;
  KQSVD_CALL(kqsvd_proj_trim(tmp)); /* what the claim held beyond the end */
  KQSVD_CALL(kqsvd_publish(tmp, path));
done:
  if (st != KQSVD_OK && tmp[0]) kqsvd_error_context(tmp);
  kqsvd_h5_close(&ds);
  kqsvd_h5_close(&space);
  kqsvd_h5_close(&file);
  if (st != KQSVD_OK && tmp[0]) remove(tmp);
  if (tmp[0]) kqsvd_signal_untrack(tmp);
  return st;
}

/* A checkpoint of another rank count cannot be resumed: its rows were split
 * differently. */
static kqsvd_status_t check_rank_count(const char *dir, int nranks) {
  kqsvd_status_t st = KQSVD_OK;
  DIR *dp = opendir(dir);
  if (!dp) return KQSVD_OK;
  struct dirent *e;
  while ((e = readdir(dp))) {
    int r, n;
    char tail[8] = "";
    if (sscanf(e->d_name, "rank-%d-of-%d.%3s", &r, &n, tail) == 3 && strcmp(tail, "h5") == 0 &&
        n != nranks)
      KQSVD_FAIL(KQSVD_ERR_INPUT,
                 "checkpoint folder %s holds %s from a run with %d ranks, this run has %d; "
                 "rerun with %d ranks or use another --checkpoint folder",
                 dir, e->d_name, n, nranks, n);
  }
done:
  closedir(dp);
  return st;
}

typedef struct {
  const char *path;
  uint64_t fingerprint;
  int64_t nvals;
  double *state;
  kqsvd_checkpoint_pos_t *pos;
  int headers_only; /* the isolated check: the state is read once, here */
  const char *hint; /* what to do about a checkpoint of other inputs */
} load_t;

static kqsvd_status_t load_here(void *ctx) {
  kqsvd_status_t st = KQSVD_OK;
  const load_t *a = ctx;
  const char *path = a->path;
  char fp[32], have[64] = "", about[1024] = "", fmt[32] = "", stored[64] = "", sum[32];
  hid_t file = -1, ds = -1;
  snprintf(fp, sizeof fp, "%016" PRIx64, a->fingerprint);
  KQSVD_CALL(kqsvd_h5_open_read(path, MPI_COMM_NULL, &file));
  KQSVD_CALL(kqsvd_h5_attr_str(file, path, "kqsvd_format", fmt, sizeof fmt));
  KQSVD_CHECK(strcmp(fmt, "checkpoint") == 0, KQSVD_ERR_INPUT, "%s: not a kqsvd checkpoint", path);
  KQSVD_CALL(kqsvd_h5_attr_str(file, path, "fingerprint", have, sizeof have));
  KQSVD_CALL(kqsvd_h5_attr_str(file, path, "about", about, sizeof about));
  KQSVD_CHECK(strcmp(have, fp) == 0, KQSVD_ERR_INPUT,
              "%s was written for other inputs or options (%s); %s", path, about, a->hint);
  KQSVD_CHECK(H5Aexists(file, "checksum") > 0, KQSVD_ERR_INPUT,
              "%s has no checksum (written by an older kqsvd, or damaged); remove it to start "
              "over",
              path);
  KQSVD_CALL(kqsvd_h5_attr_str(file, path, "checksum", stored, sizeof stored));
  KQSVD_CALL(kqsvd_h5_attr_int(file, path, "next_segment", &a->pos->segment));
  KQSVD_CALL(kqsvd_h5_attr_int(file, path, "next_item", &a->pos->item));
  hsize_t n = 0;
  KQSVD_CALL(kqsvd_h5_dataset(file, path, "state", 1, &n, &ds));
  KQSVD_CHECK((int64_t)n == a->nvals, KQSVD_ERR_INPUT, "%s: state holds %llu values, expected %lld",
              path, (unsigned long long)n, (long long)a->nvals);
  if (a->headers_only) goto done;
  KQSVD_H5(H5Dread(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, a->state));
  /* Resuming from damaged factors would end in a wrong proj.h5 that
   * nothing downstream could tell from a right one. */
  checksum(fp, *a->pos, a->nvals, a->state, sum);
  KQSVD_CHECK(strcmp(sum, stored) == 0, KQSVD_ERR_INPUT,
              "%s: checksum mismatch (stored %s, contents give %s): the checkpoint is damaged; "
              "remove it to start over",
              path, stored, sum);
  for (int64_t k = 0; k < a->nvals; k++)
    KQSVD_CHECK(isfinite(a->state[k]), KQSVD_ERR_INPUT,
                "%s: dataset 'state' holds NaN or Inf at %lld: the checkpoint is damaged; "
                "remove it to start over",
                path, (long long)k);
done:
  if (st != KQSVD_OK) kqsvd_error_context(path);
  kqsvd_h5_close(&ds);
  kqsvd_h5_close(&file);
  return st;
}

kqsvd_status_t kqsvd_checkpoint_load(const char *dir, int rank, int nranks, uint64_t fingerprint,
                                     int64_t nvals, double *state, kqsvd_checkpoint_pos_t *pos,
                                     int *found) {
  kqsvd_status_t st = KQSVD_OK;
  char path[PATH_MAX];
  load_t a = {path,
              fingerprint,
              nvals,
              state,
              pos,
              1,
              "remove the folder or use another --checkpoint folder"};
  *found = 0;
  ckpt_path(path, sizeof path, dir, rank, nranks);
  KQSVD_CALL(check_rank_count(dir, nranks));
  if (access(path, F_OK) != 0) return KQSVD_OK;
  KQSVD_CALL(kqsvd_h5_isolate(path, load_here, &a));
  a.headers_only = 0;
  KQSVD_CALL(load_here(&a));
  *found = 1;
done:
  return st;
}

kqsvd_status_t kqsvd_checkpoint_load_file(const char *path, uint64_t fingerprint, int64_t nvals,
                                          double *state, kqsvd_checkpoint_pos_t *pos, int isolate) {
  kqsvd_status_t st = KQSVD_OK;
  load_t a = {path,
              fingerprint,
              nvals,
              state,
              pos,
              1,
              "load it into an accumulator of the shape and options that saved it"};
  KQSVD_CHECK(access(path, F_OK) == 0, KQSVD_ERR_INPUT, "%s: no such file", path);
  if (isolate) KQSVD_CALL(kqsvd_h5_isolate(path, load_here, &a));
  a.headers_only = 0;
  KQSVD_CALL(load_here(&a));
done:
  return st;
}

void kqsvd_checkpoint_remove(const char *dir, int rank, int nranks) {
  char path[PATH_MAX], stem[64];
  ckpt_path(path, sizeof path, dir, rank, nranks);
  remove(path);
  /* A save cut short by a crash (SIGKILL, a lost node) leaves its
   * temporary file, under a name no later save reuses. */
  snprintf(stem, sizeof stem, "%s.tmp-", strrchr(path, '/') + 1);
  DIR *dp = opendir(dir);
  if (!dp) return;
  for (struct dirent *e; (e = readdir(dp));) {
    if (strncmp(e->d_name, stem, strlen(stem)) != 0) continue;
    char old[PATH_MAX + 256];
    snprintf(old, sizeof old, "%s/%s", dir, e->d_name);
    remove(old);
  }
  closedir(dp);
}
