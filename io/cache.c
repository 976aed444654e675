#include "kqsvd_cache.h"
#include "kqsvd_signal.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One numeric dataset: its handle, element type and the memory type that
 * reads its bits unchanged. */
typedef struct {
  hid_t dset, mtype;
  kqsvd_dtype_t type;
  hsize_t dims[4];
} tensor_t;

struct kqsvd_shard {
  char path[PATH_MAX];
  hid_t file;
  int collective;
  kqsvd_dims_t dims;
  int64_t T, S;
  int64_t *seq_lens;
  tensor_t t[3];
  char rope[32];
};

struct kqsvd_model {
  char path[PATH_MAX];
  hid_t file;
  kqsvd_dims_t dims;
  tensor_t o;
  char rope[32];
};

static void tensor_close(tensor_t *t) {
  kqsvd_h5_close(&t->dset);
  kqsvd_h5_close(&t->mtype);
}

/* Opens dataset `name`, checks its shape against want[] (-1: any) and
 * classifies its elements.  labels[] name the dimensions in messages. */
static kqsvd_status_t tensor_open(hid_t file, const char *path, const char *name, int nd,
                                  const int64_t *want, const char *const *labels, tensor_t *t) {
  kqsvd_status_t st = KQSVD_OK;
  hid_t ftype = -1;
  KQSVD_CALL(kqsvd_h5_dataset(file, path, name, nd, t->dims, &t->dset));
  for (int i = 0; i < nd; i++)
    KQSVD_CHECK(want[i] < 0 || (int64_t)t->dims[i] == want[i], KQSVD_ERR_INPUT,
                "%s: dataset '%s' has %s = %llu along axis %d, expected %lld", path, name,
                labels[i], (unsigned long long)t->dims[i], i, (long long)want[i]);
  KQSVD_CALL(kqsvd_h5_elem_type(t->dset, path, name, &t->type));
  if (t->type == KQSVD_BF16) {
    /* Native integer of the file's signedness: bits pass unchanged. */
    KQSVD_H5_ID(ftype, H5Dget_type(t->dset));
    KQSVD_H5_ID(t->mtype, H5Tget_native_type(ftype, H5T_DIR_ASCEND));
  } else {
    KQSVD_CALL(kqsvd_h5_mem_type(t->type, &t->mtype));
  }
done:
  kqsvd_h5_close(&ftype);
  return st;
}

/* Reads start[]/count[] of a 3- or 4-dimensional tensor into buf; a
 * failure (a truncated or damaged file) names the file and dataset. */
static kqsvd_status_t tensor_read(tensor_t *t, const char *path, const char *name, int nd,
                                  const hsize_t *start, const hsize_t *count, void *buf) {
  kqsvd_status_t st = KQSVD_OK;
  hid_t fspace = -1, mspace = -1;
  hsize_t n = 1;
  for (int i = 0; i < nd; i++) n *= count[i];
  if (n == 0) return KQSVD_OK;
  kqsvd_signal_context(path);
  KQSVD_H5_ID(fspace, H5Dget_space(t->dset));
  KQSVD_H5(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, start, NULL, count, NULL));
  KQSVD_H5_ID(mspace, H5Screate_simple(1, &n, NULL));
  if (H5Dread(t->dset, t->mtype, mspace, fspace, H5P_DEFAULT, buf) < 0) {
    kqsvd_h5_fail_("H5Dread", __FILE__, __LINE__, __func__);
    char why[1024];
    snprintf(why, sizeof why, "%s", kqsvd_error_message());
    kqsvd_error_clear();
    KQSVD_FAIL(KQSVD_ERR_INPUT, "%s: cannot read dataset '%s' at [%llu, %llu, %llu, ...] (%s)",
               path, name, (unsigned long long)start[0], (unsigned long long)start[1],
               (unsigned long long)start[2], why);
  }
done:
  kqsvd_h5_close(&fspace);
  kqsvd_h5_close(&mspace);
  return st;
}

/* The optional attribute `rope`: "pre", "post", or "" when absent.  Any
 * other value is refused: a reader that took it for "post" would mix keys
 * before and after RoPE. */
static kqsvd_status_t read_rope(hid_t file, const char *path, char *buf, size_t n) {
  kqsvd_status_t st = KQSVD_OK;
  htri_t has = -1;
  buf[0] = '\0';
  KQSVD_H5_ID(has, H5Aexists(file, "rope"));
  if (!has) goto done;
  KQSVD_CALL(kqsvd_h5_attr_str(file, path, "rope", buf, n));
  KQSVD_CHECK(strcmp(buf, "pre") == 0 || strcmp(buf, "post") == 0, KQSVD_ERR_INPUT,
              "%s: attribute 'rope' is \"%s\", expected \"pre\" or \"post\"", path, buf);
done:
  return st;
}

static kqsvd_status_t read_seq_lens(kqsvd_shard_t *sh) {
  kqsvd_status_t st = KQSVD_OK;
  hid_t dset = -1, type = -1;
  hsize_t n = 0;
  long long *lens = NULL;
  KQSVD_CALL(kqsvd_h5_dataset(sh->file, sh->path, "seq_lens", 1, &n, &dset));
  KQSVD_H5_ID(type, H5Dget_type(dset));
  KQSVD_CHECK(H5Tget_class(type) == H5T_INTEGER, KQSVD_ERR_INPUT,
              "%s: dataset 'seq_lens' must hold integers", sh->path);
  /* Every sequence holds a row: more lengths than rows is damage, and must
   * not size an allocation. */
  KQSVD_CHECK((int64_t)n <= sh->T, KQSVD_ERR_INPUT,
              "%s: seq_lens has %llu entries but the caches hold only T = %lld rows", sh->path,
              (unsigned long long)n, (long long)sh->T);
  KQSVD_MALLOC(lens, n ? n : 1, "seq_lens");
  if (n) KQSVD_H5(H5Dread(dset, H5T_NATIVE_LLONG, H5S_ALL, H5S_ALL, H5P_DEFAULT, lens));
  /* Each length is checked against what is left of T before it is added,
   * so no sum can overflow (lengths near 2^62 would wrap back to T). */
  long long left = sh->T;
  for (hsize_t i = 0; i < n; i++) {
    KQSVD_CHECK(lens[i] >= 1, KQSVD_ERR_INPUT, "%s: seq_lens[%llu] = %lld, must be >= 1", sh->path,
                (unsigned long long)i, lens[i]);
    KQSVD_CHECK(lens[i] <= left, KQSVD_ERR_INPUT,
                "%s: seq_lens[%llu] = %lld goes past the T = %lld rows the caches hold "
                "(%lld left after the sequences before it)",
                sh->path, (unsigned long long)i, lens[i], (long long)sh->T, left);
    left -= lens[i];
  }
  KQSVD_CHECK(left == 0, KQSVD_ERR_INPUT,
              "%s: seq_lens sums to %lld but the caches hold T = %lld rows", sh->path,
              (long long)sh->T - left, (long long)sh->T);
  sh->S = (int64_t)n;
  KQSVD_MALLOC(sh->seq_lens, n ? n : 1, "seq_lens");
  for (hsize_t i = 0; i < n; i++) sh->seq_lens[i] = (int64_t)lens[i];
done:
  free(lens);
  kqsvd_h5_close(&type);
  kqsvd_h5_close(&dset);
  return st;
}

kqsvd_status_t kqsvd_shard_open(const char *path, MPI_Comm comm, kqsvd_shard_t **out) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_shard_t *sh = calloc(1, sizeof *sh);
  *out = NULL;
  KQSVD_CHECK(sh, KQSVD_ERR_NOMEM, "cannot allocate a shard handle");
  sh->file = -1;
  for (int i = 0; i < 3; i++) sh->t[i].dset = sh->t[i].mtype = -1;
  snprintf(sh->path, sizeof sh->path, "%s", path);
  sh->collective = comm != MPI_COMM_NULL;
  KQSVD_CALL(kqsvd_h5_open_read(path, comm, &sh->file));
  KQSVD_CALL(kqsvd_h5_read_dims(sh->file, path, "cache", 1, &sh->dims));
  const kqsvd_dims_t *d = &sh->dims;
  static const char *const labels[4] = {"num_layers", "heads", "T", "head_dim"};
  const int64_t want_kv[4] = {d->layers, d->kv_heads, -1, d->head_dim};
  KQSVD_CALL(tensor_open(sh->file, path, "keys", 4, want_kv, labels, &sh->t[KQSVD_KEYS]));
  sh->T = (int64_t)sh->t[KQSVD_KEYS].dims[2];
  const int64_t want_v[4] = {d->layers, d->kv_heads, sh->T, d->head_dim};
  const int64_t want_q[4] = {d->layers, d->heads, sh->T, d->head_dim};
  KQSVD_CALL(tensor_open(sh->file, path, "values", 4, want_v, labels, &sh->t[KQSVD_VALUES]));
  KQSVD_CALL(tensor_open(sh->file, path, "queries", 4, want_q, labels, &sh->t[KQSVD_QUERIES]));
  KQSVD_CALL(read_seq_lens(sh));
  KQSVD_CALL(read_rope(sh->file, path, sh->rope, sizeof sh->rope));
  *out = sh;
  sh = NULL;
done:
  if (st != KQSVD_OK) kqsvd_error_context(path);
  kqsvd_shard_close(&sh);
  return st;
}

void kqsvd_shard_close(kqsvd_shard_t **sh) {
  if (!sh || !*sh) return;
  for (int i = 0; i < 3; i++) tensor_close(&(*sh)->t[i]);
  kqsvd_h5_close(&(*sh)->file);
  free((*sh)->seq_lens);
  free(*sh);
  *sh = NULL;
}

const kqsvd_dims_t *kqsvd_shard_dims(const kqsvd_shard_t *sh) { return &sh->dims; }
const char *kqsvd_shard_path(const kqsvd_shard_t *sh) { return sh->path; }
int64_t kqsvd_shard_tokens(const kqsvd_shard_t *sh) { return sh->T; }
int64_t kqsvd_shard_sequences(const kqsvd_shard_t *sh) { return sh->S; }
const int64_t *kqsvd_shard_seq_lens(const kqsvd_shard_t *sh) { return sh->seq_lens; }
kqsvd_dtype_t kqsvd_shard_dtype(const kqsvd_shard_t *sh, kqsvd_tensor_t t) { return sh->t[t].type; }
const char *kqsvd_shard_rope(const kqsvd_shard_t *sh) { return sh->rope; }

kqsvd_status_t kqsvd_shard_read(kqsvd_shard_t *sh, kqsvd_tensor_t t, int64_t layer, int64_t head0,
                                int64_t nheads, int64_t row0, int64_t nrows, void *buf) {
  const hsize_t start[4] = {(hsize_t)layer, (hsize_t)head0, (hsize_t)row0, 0};
  const hsize_t count[4] = {1, (hsize_t)nheads, (hsize_t)nrows, (hsize_t)sh->dims.head_dim};
  return tensor_read(&sh->t[t], sh->path, kqsvd_tensor_name(t), 4, start, count, buf);
}

static kqsvd_status_t shard_open_here(const char *path, void **out) {
  kqsvd_shard_t *sh = NULL;
  const kqsvd_status_t st = kqsvd_shard_open(path, MPI_COMM_NULL, &sh);
  *out = sh;
  return st;
}

static void shard_drop(void *sh) {
  kqsvd_shard_t *p = sh;
  kqsvd_shard_close(&p);
}

kqsvd_status_t kqsvd_shard_check(const char *path) {
  static const kqsvd_h5_opener_t opener = {shard_open_here, shard_drop};
  return kqsvd_h5_isolated_open(path, &opener, NULL);
}

static kqsvd_status_t model_open_here(const char *path, void **out);

static void model_drop(void *m) {
  kqsvd_model_t *p = m;
  kqsvd_model_close(&p);
}

kqsvd_status_t kqsvd_model_open(const char *path, kqsvd_model_t **out) {
  static const kqsvd_h5_opener_t opener = {model_open_here, model_drop};
  void *m = NULL;
  const kqsvd_status_t st = kqsvd_h5_isolated_open(path, &opener, &m);
  *out = m;
  return st;
}

static kqsvd_status_t model_open_here(const char *path, void **out) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_model_t *m = calloc(1, sizeof *m);
  *out = NULL;
  KQSVD_CHECK(m, KQSVD_ERR_NOMEM, "cannot allocate a model handle");
  m->file = m->o.dset = m->o.mtype = -1;
  snprintf(m->path, sizeof m->path, "%s", path);
  KQSVD_CALL(kqsvd_h5_open_read(path, MPI_COMM_NULL, &m->file));
  KQSVD_CALL(kqsvd_h5_read_dims(m->file, path, "model", 1, &m->dims));
  static const char *const labels[3] = {"num_layers", "hidden_size", "num_heads*head_dim"};
  const int64_t want[3] = {m->dims.layers, m->dims.hidden, m->dims.heads * m->dims.head_dim};
  KQSVD_CALL(tensor_open(m->file, path, "o_proj", 3, want, labels, &m->o));
  KQSVD_CALL(read_rope(m->file, path, m->rope, sizeof m->rope));
  *out = m;
  m = NULL;
done:
  if (st != KQSVD_OK) kqsvd_error_context(path);
  kqsvd_model_close(&m);
  return st;
}

void kqsvd_model_close(kqsvd_model_t **m) {
  if (!m || !*m) return;
  tensor_close(&(*m)->o);
  kqsvd_h5_close(&(*m)->file);
  free(*m);
  *m = NULL;
}

const kqsvd_dims_t *kqsvd_model_dims(const kqsvd_model_t *m) { return &m->dims; }
kqsvd_dtype_t kqsvd_model_dtype(const kqsvd_model_t *m) { return m->o.type; }
const char *kqsvd_model_rope(const kqsvd_model_t *m) { return m->rope; }

kqsvd_status_t kqsvd_model_read_oproj(kqsvd_model_t *m, int64_t layer, int64_t row0, int64_t nrows,
                                      int64_t col0, int64_t ncols, void *buf) {
  const hsize_t start[3] = {(hsize_t)layer, (hsize_t)row0, (hsize_t)col0};
  const hsize_t count[3] = {1, (hsize_t)nrows, (hsize_t)ncols};
  return tensor_read(&m->o, m->path, "o_proj", 3, start, count, buf);
}
