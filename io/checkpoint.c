#include "kqsvd_checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kqsvd_h5.h"
#include "kqsvd_util.h"

static void ckpt_path(char *buf, size_t n, const char *dir, int rank, int nranks) {
  snprintf(buf, n, "%s/rank-%05d-of-%05d.h5", dir, rank, nranks);
}

kqsvd_status_t kqsvd_checkpoint_save(const char *dir, int rank, int nranks, uint64_t fingerprint,
                                     const char *about, kqsvd_checkpoint_pos_t pos,
                                     int64_t nvals, const double *state) {
  kqsvd_status_t st = KQSVD_OK;
  char path[PATH_MAX], tmp[PATH_MAX + 8], fp[32];
  hid_t file = -1, space = -1, ds = -1;
  ckpt_path(path, sizeof path, dir, rank, nranks);
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  snprintf(fp, sizeof fp, "%016" PRIx64, fingerprint);
  if (kqsvd_mkdir_p(dir) != 0)
    KQSVD_FAIL(KQSVD_ERR_IO, "cannot create checkpoint folder %s: %s", dir, strerror(errno));
  file = H5Fcreate(tmp, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  KQSVD_CHECK(file >= 0, KQSVD_ERR_IO, "%s: cannot create checkpoint file", tmp);
  KQSVD_CALL(kqsvd_h5_put_str(file, "kqsvd_format", "checkpoint"));
  KQSVD_CALL(kqsvd_h5_put_str(file, "fingerprint", fp));
  KQSVD_CALL(kqsvd_h5_put_str(file, "about", about));
  KQSVD_CALL(kqsvd_h5_put_int(file, "next_segment", H5T_STD_I64LE, pos.segment));
  KQSVD_CALL(kqsvd_h5_put_int(file, "next_item", H5T_STD_I64LE, pos.item));
  const hsize_t n = (hsize_t)nvals;
  KQSVD_H5_ID(space, H5Screate_simple(1, &n, NULL));
  KQSVD_H5_ID(ds, H5Dcreate2(file, "state", H5T_IEEE_F64LE, space, H5P_DEFAULT, H5P_DEFAULT,
                             H5P_DEFAULT));
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
  KQSVD_CHECK(rename(tmp, path) == 0, KQSVD_ERR_IO, "cannot rename %s to %s: %s", tmp, path,
              strerror(errno));
done:
  if (st != KQSVD_OK) kqsvd_error_context(tmp);
  kqsvd_h5_close(&ds);
  kqsvd_h5_close(&space);
  kqsvd_h5_close(&file);
  if (st != KQSVD_OK) remove(tmp);
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

kqsvd_status_t kqsvd_checkpoint_load(const char *dir, int rank, int nranks, uint64_t fingerprint,
                                     int64_t nvals, double *state, kqsvd_checkpoint_pos_t *pos,
                                     int *found) {
  kqsvd_status_t st = KQSVD_OK;
  char path[PATH_MAX], fp[32], have[64] = "", about[1024] = "", fmt[32] = "";
  hid_t file = -1, ds = -1;
  *found = 0;
  ckpt_path(path, sizeof path, dir, rank, nranks);
  KQSVD_CALL(check_rank_count(dir, nranks));
  if (access(path, F_OK) != 0) return KQSVD_OK;
  snprintf(fp, sizeof fp, "%016" PRIx64, fingerprint);
  KQSVD_CALL(kqsvd_h5_open_read(path, MPI_COMM_NULL, &file));
  KQSVD_CALL(kqsvd_h5_attr_str(file, path, "kqsvd_format", fmt, sizeof fmt));
  KQSVD_CHECK(strcmp(fmt, "checkpoint") == 0, KQSVD_ERR_INPUT, "%s: not a kqsvd checkpoint",
              path);
  KQSVD_CALL(kqsvd_h5_attr_str(file, path, "fingerprint", have, sizeof have));
  KQSVD_CALL(kqsvd_h5_attr_str(file, path, "about", about, sizeof about));
  KQSVD_CHECK(strcmp(have, fp) == 0, KQSVD_ERR_INPUT,
              "%s was written for other inputs or options (%s); remove the folder or use "
              "another --checkpoint folder",
              path, about);
  KQSVD_CALL(kqsvd_h5_attr_int(file, path, "next_segment", &pos->segment));
  KQSVD_CALL(kqsvd_h5_attr_int(file, path, "next_item", &pos->item));
  hsize_t n = 0;
  KQSVD_CALL(kqsvd_h5_dataset(file, path, "state", 1, &n, &ds));
  KQSVD_CHECK((int64_t)n == nvals, KQSVD_ERR_INPUT, "%s: state holds %llu values, expected %lld",
              path, (unsigned long long)n, (long long)nvals);
  KQSVD_H5(H5Dread(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, state));
  *found = 1;
done:
  if (st != KQSVD_OK) kqsvd_error_context(path);
  kqsvd_h5_close(&ds);
  kqsvd_h5_close(&file);
  return st;
}

void kqsvd_checkpoint_remove(const char *dir, int rank, int nranks) {
  char path[PATH_MAX];
  ckpt_path(path, sizeof path, dir, rank, nranks);
  remove(path);
}
