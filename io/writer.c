#include "kqsvd_proj.h"
#include "kqsvd_signal.h"
#include "kqsvd_util.h"
#include "kqsvd_writer.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct kqsvd_writer {
  char path[PATH_MAX], tmp[PATH_MAX + 32];
  hid_t file, mtype;
  hid_t dset[3]; /* keys, values, queries; or o_proj in dset[0] */
  kqsvd_dtype_t type;
  int64_t d, width, need;
  void *buf;
  size_t cap;
};

/* Bytes a file holding `values` elements of type t takes, with an
 * allowance for HDF5's metadata (a few KiB for these few datasets). */
static int64_t size_estimate(int64_t values, kqsvd_dtype_t t) {
  const int64_t raw = values * (int64_t)kqsvd_dtype_size(t);
  return raw + 64 * 1024 + raw / 100;
}

/* The file is made under its temporary name with its space claimed
 * first (kqsvd_tmp_claim): a full disk is an ordinary error naming the
 * output, before HDF5 has written a byte. */
static kqsvd_status_t writer_new(const char *path, const kqsvd_dims_t *dims, kqsvd_dtype_t t,
                                 const char *format, int64_t need, kqsvd_writer_t **out) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_writer_t *w = calloc(1, sizeof *w);
  *out = NULL;
  KQSVD_CHECK(w, KQSVD_ERR_NOMEM, "cannot allocate a file writer");
  w->file = w->mtype = -1;
  for (int i = 0; i < 3; i++) w->dset[i] = -1;
  w->type = t;
  w->d = dims->head_dim;
  snprintf(w->path, sizeof w->path, "%s", path);
  w->need = need;
  KQSVD_CHECK(strlen(path) + KQSVD_TMP_SUFFIX_MAX < sizeof w->tmp, KQSVD_ERR_USAGE,
              "%.64s...: path too long", path);
  KQSVD_CALL(kqsvd_tmp_claim(path, w->tmp, sizeof w->tmp, need));
  kqsvd_signal_track(w->tmp);
  /* Ours, made exclusively by the claim: truncated, never followed. */
  w->file = H5Fcreate(w->tmp, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  if (w->file < 0) {
    kqsvd_h5_fail_("H5Fcreate", __FILE__, __LINE__, __func__);
    kqsvd_error_clear();
    KQSVD_FAIL(KQSVD_ERR_IO, "%s: cannot create its temporary file %s", w->path, w->tmp);
  }
  KQSVD_CALL(kqsvd_reserve(w->path, w->tmp, need));
  KQSVD_CALL(kqsvd_h5_mem_type(t, &w->mtype));
  KQSVD_CALL(kqsvd_h5_write_dims(w->file, format, dims, 1));
  *out = w;
  w = NULL;
done:
  kqsvd_writer_abort(&w);
  return st;
}

kqsvd_status_t kqsvd_cache_create(const char *path, const kqsvd_dims_t *dims, kqsvd_dtype_t t,
                                  int64_t nseq, const int64_t *seq_lens, kqsvd_writer_t **out) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_writer_t *w = NULL;
  hid_t ds = -1;
  int64_t T = 0;
  for (int64_t s = 0; s < nseq; s++) T += seq_lens[s];
  const int64_t values = dims->layers * (2 * dims->kv_heads + dims->heads) * T * dims->head_dim;
  KQSVD_CALL(writer_new(path, dims, t, "cache", size_estimate(values, t) + nseq * 8, &w));
  const hsize_t kv[4] = {(hsize_t)dims->layers, (hsize_t)dims->kv_heads, (hsize_t)T,
                         (hsize_t)dims->head_dim};
  const hsize_t q[4] = {(hsize_t)dims->layers, (hsize_t)dims->heads, (hsize_t)T,
                        (hsize_t)dims->head_dim};
  KQSVD_CALL(kqsvd_h5_create_dataset(w->file, "keys", t, 4, kv, &w->dset[KQSVD_KEYS]));
  KQSVD_CALL(kqsvd_h5_create_dataset(w->file, "values", t, 4, kv, &w->dset[KQSVD_VALUES]));
  KQSVD_CALL(kqsvd_h5_create_dataset(w->file, "queries", t, 4, q, &w->dset[KQSVD_QUERIES]));
  const hsize_t ns = (hsize_t)nseq;
  hid_t space = H5Screate_simple(1, &ns, NULL);
  KQSVD_H5(space);
  ds = H5Dcreate2(w->file, "seq_lens", H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  kqsvd_h5_close(&space);
  KQSVD_H5(ds);
  if (nseq) KQSVD_H5(H5Dwrite(ds, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, seq_lens));
  w->width = dims->head_dim;
  *out = w;
  w = NULL;
done:
  kqsvd_h5_close(&ds);
  kqsvd_writer_abort(&w);
  return st;
}

kqsvd_status_t kqsvd_model_create(const char *path, const kqsvd_dims_t *dims, kqsvd_dtype_t t,
                                  kqsvd_writer_t **out) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_writer_t *w = NULL;
  KQSVD_CALL(
      writer_new(path, dims, t, "model",
                 size_estimate(dims->layers * dims->hidden * dims->heads * dims->head_dim, t), &w));
  const hsize_t o[3] = {(hsize_t)dims->layers, (hsize_t)dims->hidden,
                        (hsize_t)(dims->heads * dims->head_dim)};
  KQSVD_CALL(kqsvd_h5_create_dataset(w->file, "o_proj", t, 3, o, &w->dset[0]));
  w->width = dims->heads * dims->head_dim;
  *out = w;
  w = NULL;
done:
  kqsvd_writer_abort(&w);
  return st;
}

/* Converts n values into the writer's element type in its own buffer. */
static kqsvd_status_t encode(kqsvd_writer_t *w, const double *v, int64_t n) {
  kqsvd_status_t st = KQSVD_OK;
  const size_t need = (size_t)n * kqsvd_dtype_size(w->type);
  if (need > w->cap) {
    void *p = realloc(w->buf, need);
    KQSVD_CHECK(p, KQSVD_ERR_NOMEM, "cannot allocate %zu bytes of write buffer", need);
    w->buf = p;
    w->cap = need;
  }
  kqsvd_convert_from_f64(w->type, v, n, w->buf);
done:
  return st;
}

static kqsvd_status_t put(kqsvd_writer_t *w, hid_t dset, int nd, const hsize_t *start,
                          const hsize_t *count, const double *rows) {
  kqsvd_status_t st = KQSVD_OK;
  hid_t fspace = -1, mspace = -1;
  hsize_t n = 1;
  for (int i = 0; i < nd; i++) n *= count[i];
  if (n == 0) return KQSVD_OK;
  KQSVD_CALL(encode(w, rows, (int64_t)n));
  KQSVD_H5_ID(fspace, H5Dget_space(dset));
  KQSVD_H5(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, start, NULL, count, NULL));
  KQSVD_H5_ID(mspace, H5Screate_simple(1, &n, NULL));
  KQSVD_H5(H5Dwrite(dset, w->mtype, mspace, fspace, H5P_DEFAULT, w->buf));
done:
  if (st != KQSVD_OK) kqsvd_error_context(w->tmp);
  kqsvd_h5_close(&fspace);
  kqsvd_h5_close(&mspace);
  return st;
}

kqsvd_status_t kqsvd_cache_put(kqsvd_writer_t *w, kqsvd_tensor_t t, int64_t layer, int64_t head,
                               int64_t row0, int64_t nrows, const double *rows) {
  const hsize_t start[4] = {(hsize_t)layer, (hsize_t)head, (hsize_t)row0, 0};
  const hsize_t count[4] = {1, 1, (hsize_t)nrows, (hsize_t)w->d};
  return put(w, w->dset[t], 4, start, count, rows);
}

kqsvd_status_t kqsvd_model_put_oproj(kqsvd_writer_t *w, int64_t layer, int64_t row0, int64_t nrows,
                                     const double *rows) {
  const hsize_t start[3] = {(hsize_t)layer, (hsize_t)row0, 0};
  const hsize_t count[3] = {1, (hsize_t)nrows, (hsize_t)w->width};
  return put(w, w->dset[0], 3, start, count, rows);
}

static void writer_close(kqsvd_writer_t *w) {
  for (int i = 0; i < 3; i++) kqsvd_h5_close(&w->dset[i]);
  kqsvd_h5_close(&w->mtype);
  kqsvd_h5_close(&w->file);
  free(w->buf);
}

kqsvd_status_t kqsvd_writer_commit(kqsvd_writer_t **wp) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_writer_t *w = *wp;
  *wp = NULL;
  for (int i = 0; i < 3; i++) kqsvd_h5_close(&w->dset[i]);
  if (H5Fclose(w->file) < 0) {
    kqsvd_h5_fail_("H5Fclose", __FILE__, __LINE__, __func__);
    kqsvd_error_context(w->tmp);
    kqsvd_error_mark_fatal();
    st = KQSVD_ERR_HDF5;
    w->file = -1;
    goto done;
  }
  w->file = -1;
  KQSVD_CALL(kqsvd_proj_trim(w->tmp)); /* what the claim held beyond the end */
  /* synth --force removes the set it replaces first: a file there now is
   * another run's. */
  KQSVD_CALL(kqsvd_publish_new(w->tmp, w->path));
done:
  if (st != KQSVD_OK) remove(w->tmp);
  kqsvd_signal_untrack(w->tmp);
  writer_close(w);
  free(w);
  return st;
}

void kqsvd_writer_abort(kqsvd_writer_t **wp) {
  if (!wp || !*wp) return;
  writer_close(*wp);
  remove((*wp)->tmp);
  kqsvd_signal_untrack((*wp)->tmp);
  free(*wp);
  *wp = NULL;
}
