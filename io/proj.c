#include "kqsvd_proj.h"
#include "kqsvd_util.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum {
  P_KEY_DOWN,
  P_QUERY_DOWN,
  P_VALUE_DOWN,
  P_VALUE_UP,
  P_SIGMA_K,
  P_SIGMA_V,
  P_RANK_K,
  P_RANK_V,
  P_N
};
static const char *const g_pnames[P_N] = {"key_down", "query_down", "value_down", "value_up",
                                          "sigma_k",  "sigma_v",    "rank_k",     "rank_v"};
enum { S_K, S_Q, S_V, S_KQT, S_VWO, S_N };
static const char *const g_snames[S_N] = {"K", "Q", "V", "KQt", "VWo"};

struct kqsvd_proj_writer {
  char path[4096];
  hid_t file;
  hid_t group[KQSVD_NMETHODS + 1];
  hid_t p[KQSVD_NMETHODS][P_N];
  hid_t s[S_N];
  int64_t d, layers, kv_heads;
};

static kqsvd_status_t create_ds(hid_t loc, const char *name, hid_t type, int nd,
                                const hsize_t *dims, hid_t *ds) {
  kqsvd_status_t st = KQSVD_OK;
  hid_t space = -1;
  KQSVD_H5_ID(space, H5Screate_simple(nd, dims, NULL));
  KQSVD_H5_ID(*ds, H5Dcreate2(loc, name, type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
done:
  kqsvd_h5_close(&space);
  return st;
}

kqsvd_status_t kqsvd_proj_create(const char *path, MPI_Comm comm, const kqsvd_proj_meta_t *meta,
                                 kqsvd_proj_writer_t **out) {
  kqsvd_status_t st = KQSVD_OK;
  hid_t fapl = -1;
  kqsvd_proj_writer_t *w = calloc(1, sizeof *w);
  *out = NULL;
  KQSVD_CHECK(w, KQSVD_ERR_NOMEM, "cannot allocate the projections writer");
  w->file = -1;
  for (int m = 0; m <= KQSVD_NMETHODS; m++) w->group[m] = -1;
  for (int m = 0; m < KQSVD_NMETHODS; m++)
    for (int i = 0; i < P_N; i++) w->p[m][i] = -1;
  for (int i = 0; i < S_N; i++) w->s[i] = -1;
  const kqsvd_dims_t *dm = &meta->dims;
  w->d = dm->head_dim;
  w->layers = dm->layers;
  w->kv_heads = dm->kv_heads;
  snprintf(w->path, sizeof w->path, "%s", path);
  KQSVD_H5_ID(fapl, H5Pcreate(H5P_FILE_ACCESS));
  /* MPI_COMM_NULL: one process writes with the default driver, no MPI needed
   * (the accumulator's kqsvd_result_write). */
  if (comm != MPI_COMM_NULL) KQSVD_H5(H5Pset_fapl_mpio(fapl, comm, MPI_INFO_NULL));
  w->file = H5Fcreate(path, H5F_ACC_EXCL, H5P_DEFAULT, fapl);
  if (w->file < 0) {
    kqsvd_h5_fail_("H5Fcreate", __FILE__, __LINE__, __func__);
    kqsvd_error_clear();
    KQSVD_FAIL(KQSVD_ERR_IO, "%s: cannot create file (does the folder exist and is it writable?)",
               path);
  }
  KQSVD_CALL(kqsvd_h5_write_dims(w->file, "projections", dm, 1));
  KQSVD_CALL(kqsvd_h5_put_double(w->file, "eps", meta->eps));
  KQSVD_CALL(kqsvd_h5_put_int(w->file, "tokens", H5T_STD_I64LE, meta->tokens));
  KQSVD_CALL(kqsvd_h5_put_int(w->file, "shards", H5T_STD_I64LE, meta->shards));
  KQSVD_CALL(kqsvd_h5_put_int(w->file, "qr_block_rows", H5T_STD_I64LE, meta->qr_block));
  KQSVD_CALL(kqsvd_h5_put_str(w->file, "kqsvd_version", KQSVD_VERSION));
  if (meta->rank_policy) KQSVD_CALL(kqsvd_h5_put_str(w->file, "rank_policy", meta->rank_policy));
  if (meta->inputs_hash) KQSVD_CALL(kqsvd_h5_put_str(w->file, "inputs_hash", meta->inputs_hash));
  if (meta->rope) KQSVD_CALL(kqsvd_h5_put_str(w->file, "rope", meta->rope));
  if (meta->head_groups > 1)
    KQSVD_CALL(kqsvd_h5_put_int(w->file, "head_groups", H5T_STD_I64LE, meta->head_groups));
  if (meta->seq_len > 0)
    KQSVD_CALL(kqsvd_h5_put_int(w->file, "seq_len", H5T_STD_I64LE, meta->seq_len));

  const hsize_t mat[4] = {(hsize_t)dm->layers, (hsize_t)dm->kv_heads, (hsize_t)dm->head_dim,
                          (hsize_t)dm->head_dim};
  const hsize_t lay[1] = {(hsize_t)dm->layers};
  for (int m = 0; m < KQSVD_NMETHODS; m++) {
    char name[32];
    snprintf(name, sizeof name, "/%s", kqsvd_method_name((kqsvd_method_t)m));
    KQSVD_H5_ID(w->group[m], H5Gcreate2(w->file, name, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
    for (int i = 0; i < P_N; i++) {
      const int nd = i <= P_VALUE_UP ? 4 : i <= P_SIGMA_V ? 3 : 1;
      KQSVD_CALL(create_ds(w->group[m], g_pnames[i], i >= P_RANK_K ? H5T_STD_I32LE : H5T_IEEE_F64LE,
                           nd, nd == 1 ? lay : mat, &w->p[m][i]));
    }
    if (m == KQSVD_METHOD_EIGEN) KQSVD_CALL(kqsvd_h5_put_double(w->group[m], "beta", meta->beta));
  }
  KQSVD_H5_ID(w->group[KQSVD_NMETHODS],
              H5Gcreate2(w->file, "/spectra", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
  for (int i = 0; i < S_N; i++)
    KQSVD_CALL(create_ds(w->group[KQSVD_NMETHODS], g_snames[i], H5T_IEEE_F64LE, 3, mat, &w->s[i]));
  *out = w;
  w = NULL;
done:
  kqsvd_h5_close(&fapl);
  if (st != KQSVD_OK) kqsvd_error_context(path);
  if (w) kqsvd_proj_close(&w);
  return st;
}

int64_t kqsvd_proj_size_estimate(const kqsvd_dims_t *dm) {
  const int64_t items = dm->layers * dm->kv_heads, d = dm->head_dim;
  /* Per method 4 matrices, 2 spectra and 2 rank vectors; 5 spectra. */
  const int64_t raw =
      KQSVD_NMETHODS * (items * (4 * d * d + 2 * d) * 8 + 2 * dm->layers * 4) + 5 * items * d * 8;
  /* The metadata of the 32 datasets and their attributes takes ~20 KiB. */
  return raw + 64 * 1024 + raw / 100;
}

kqsvd_status_t kqsvd_proj_reserve(const kqsvd_proj_writer_t *w, const char *final_path) {
  return kqsvd_reserve(final_path, w->path,
                       kqsvd_proj_size_estimate(&(kqsvd_dims_t){
                           .layers = w->layers, .kv_heads = w->kv_heads, .head_dim = w->d}));
}

kqsvd_status_t kqsvd_proj_trim(const char *path) {
  kqsvd_status_t st = KQSVD_OK;
  hid_t file = -1;
  haddr_t eoa = 0;
  struct stat sb;
  KQSVD_CALL(kqsvd_h5_open_read(path, MPI_COMM_NULL, &file));
  KQSVD_H5(H5Fget_eoa(file, &eoa));
  kqsvd_h5_close(&file);
  KQSVD_CHECK(stat(path, &sb) == 0, KQSVD_ERR_IO, "%s: %s", path, strerror(errno));
  if ((haddr_t)sb.st_size > eoa)
    KQSVD_CHECK(truncate(path, (off_t)eoa) == 0, KQSVD_ERR_IO, "%s: cannot trim it: %s", path,
                strerror(errno));
done:
  kqsvd_h5_close(&file);
  return st;
}

/* Writes `n` float64 values at [layer, head, ...] of a 3- or 4-d dataset. */
static kqsvd_status_t put_slice(hid_t ds, int nd, int64_t layer, int64_t head, int64_t d,
                                const double *v) {
  kqsvd_status_t st = KQSVD_OK;
  hid_t fspace = -1, mspace = -1;
  const hsize_t start[4] = {(hsize_t)layer, (hsize_t)head, 0, 0};
  const hsize_t count[4] = {1, 1, (hsize_t)d, (hsize_t)d};
  hsize_t n = nd == 4 ? (hsize_t)(d * d) : (hsize_t)d;
  KQSVD_H5_ID(fspace, H5Dget_space(ds));
  KQSVD_H5(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, start, NULL, count, NULL));
  KQSVD_H5_ID(mspace, H5Screate_simple(1, &n, NULL));
  KQSVD_H5(H5Dwrite(ds, H5T_NATIVE_DOUBLE, mspace, fspace, H5P_DEFAULT, v));
done:
  kqsvd_h5_close(&fspace);
  kqsvd_h5_close(&mspace);
  return st;
}

kqsvd_status_t kqsvd_proj_write_item(kqsvd_proj_writer_t *w, int64_t layer, int64_t kv_head,
                                     const kqsvd_solution_t *sol) {
  kqsvd_status_t st = KQSVD_OK;
  for (int m = 0; m < KQSVD_NMETHODS; m++) {
    const kqsvd_projection_t *p = &sol->method[m];
    const double *v[P_RANK_K] = {p->key_down, p->query_down, p->value_down,
                                 p->value_up, p->sigma_k,    p->sigma_v};
    for (int i = 0; i < P_RANK_K; i++)
      KQSVD_CALL(put_slice(w->p[m][i], i <= P_VALUE_UP ? 4 : 3, layer, kv_head, w->d, v[i]));
  }
  const double *s[S_N] = {sol->spec_K, sol->spec_Q, sol->spec_V, sol->spec_KQt, sol->spec_VWo};
  for (int i = 0; i < S_N; i++) KQSVD_CALL(put_slice(w->s[i], 3, layer, kv_head, w->d, s[i]));
done:
  if (st != KQSVD_OK) kqsvd_error_context(w->path);
  return st;
}

kqsvd_status_t kqsvd_proj_write_ranks(kqsvd_proj_writer_t *w, const int32_t *rank_k,
                                      const int32_t *rank_v) {
  kqsvd_status_t st = KQSVD_OK;
  const int64_t L = w->layers;
  for (int m = 0; m < KQSVD_NMETHODS; m++) {
    KQSVD_H5(H5Dwrite(w->p[m][P_RANK_K], H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT,
                      rank_k + m * L));
    KQSVD_H5(H5Dwrite(w->p[m][P_RANK_V], H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT,
                      rank_v + m * L));
  }
done:
  if (st != KQSVD_OK) kqsvd_error_context(w->path);
  return st;
}

kqsvd_status_t kqsvd_proj_close(kqsvd_proj_writer_t **wp) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_proj_writer_t *w = *wp;
  if (!w) return KQSVD_OK;
  *wp = NULL;
  for (int m = 0; m < KQSVD_NMETHODS; m++)
    for (int i = 0; i < P_N; i++) kqsvd_h5_close(&w->p[m][i]);
  for (int i = 0; i < S_N; i++) kqsvd_h5_close(&w->s[i]);
  for (int m = 0; m <= KQSVD_NMETHODS; m++) kqsvd_h5_close(&w->group[m]);
  if (w->file >= 0) KQSVD_H5(H5Fclose(w->file));
done:
  if (st != KQSVD_OK) {
    kqsvd_error_context(w->path);
    /* HDF5 keeps a file whose close failed and crashes closing it again at
     * shutdown: end with MPI_Abort instead of MPI_Finalize. */
    kqsvd_error_mark_fatal();
  }
  free(w);
  return st;
}

/* ---- reading ----------------------------------------------------------- */

struct kqsvd_proj_reader {
  char path[PATH_MAX];
  hid_t file;
  kqsvd_dims_t dims;
  double eps, beta;
  int64_t tokens, head_groups;
  char policy[64];
  int head_ranks[KQSVD_NMETHODS]; /* the group holds rank_k_heads and rank_v_heads */
};

/* Checks that group/name exists with the shape of the contract and
 * elements of class `cls`. */
static kqsvd_status_t check_dataset(kqsvd_proj_reader_t *r, const char *group, const char *name,
                                    int nd, H5T_class_t cls) {
  kqsvd_status_t st = KQSVD_OK;
  hid_t ds = -1, type = -1;
  hsize_t got[4] = {0, 0, 0, 0};
  char full[96];
  const kqsvd_dims_t *dm = &r->dims;
  const hsize_t want[4] = {(hsize_t)dm->layers, (hsize_t)dm->kv_heads, (hsize_t)dm->head_dim,
                           (hsize_t)dm->head_dim};
  snprintf(full, sizeof full, "%s/%s", group, name);
  KQSVD_CALL(kqsvd_h5_dataset(r->file, r->path, full, nd, got, &ds));
  for (int k = 0; k < nd; k++)
    KQSVD_CHECK(got[k] == want[k], KQSVD_ERR_INPUT,
                "%s: dataset '%s' has extent %llu in dimension %d, expected %llu", r->path, full,
                (unsigned long long)got[k], k, (unsigned long long)want[k]);
  KQSVD_H5_ID(type, H5Dget_type(ds));
  KQSVD_CHECK(H5Tget_class(type) == cls, KQSVD_ERR_INPUT, "%s: dataset '%s' must hold %s", r->path,
              full, cls == H5T_FLOAT ? "floating-point numbers" : "integers");
done:
  kqsvd_h5_close(&type);
  kqsvd_h5_close(&ds);
  return st;
}

/* The per-head ranks extension of one method's group: absent, or both
 * datasets, [L, Hkv] integers (docs/formats.md 5.3).  Their values are
 * checked where they are used (kqsvd_proj_read_head_ranks), as rank_k's. */
static kqsvd_status_t check_head_ranks(kqsvd_proj_reader_t *r, const char *group, int *has) {
  kqsvd_status_t st = KQSVD_OK;
  char k[96], v[96];
  snprintf(k, sizeof k, "%s/rank_k_heads", group);
  snprintf(v, sizeof v, "%s/rank_v_heads", group);
  const int hk = H5Lexists(r->file, k, H5P_DEFAULT) > 0;
  const int hv = H5Lexists(r->file, v, H5P_DEFAULT) > 0;
  /* One without the other would leave one side of the cache unspecified. */
  KQSVD_CHECK(hk == hv, KQSVD_ERR_INPUT,
              "%s: dataset '%s' is missing; per-head ranks need both '%s' and '%s'", r->path,
              hk ? v : k, k, v);
  *has = hk;
  if (hk) {
    KQSVD_CALL(check_dataset(r, group, "rank_k_heads", 2, H5T_INTEGER));
    KQSVD_CALL(check_dataset(r, group, "rank_v_heads", 2, H5T_INTEGER));
  }
done:
  return st;
}

static kqsvd_status_t proj_open_here(const char *path, void **out);

static void proj_drop(void *r) {
  kqsvd_proj_reader_t *p = r;
  kqsvd_proj_reader_free(&p);
}

kqsvd_status_t kqsvd_proj_open(const char *path, kqsvd_proj_reader_t **out) {
  static const kqsvd_h5_opener_t opener = {proj_open_here, proj_drop};
  void *r = NULL;
  const kqsvd_status_t st = kqsvd_h5_isolated_open(path, &opener, &r);
  *out = r;
  return st;
}

static kqsvd_status_t proj_open_here(const char *path, void **out) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_proj_reader_t *r = calloc(1, sizeof *r);
  hid_t grp = -1;
  *out = NULL;
  KQSVD_CHECK(r, KQSVD_ERR_NOMEM, "cannot allocate a projections reader");
  r->file = -1;
  snprintf(r->path, sizeof r->path, "%s", path);
  KQSVD_CALL(kqsvd_h5_open_read(path, MPI_COMM_NULL, &r->file));
  KQSVD_CALL(kqsvd_h5_read_dims(r->file, path, "projections", 0, &r->dims));
  r->dims.causal = -1;
  KQSVD_CALL(kqsvd_h5_attr_int(r->file, path, "tokens", &r->tokens));
  r->eps = NAN;
  if (H5Aexists(r->file, "eps") > 0) {
    hid_t a = H5Aopen(r->file, "eps", H5P_DEFAULT);
    if (a < 0 || H5Aread(a, H5T_NATIVE_DOUBLE, &r->eps) < 0) r->eps = NAN;
    kqsvd_h5_close(&a);
  }
  if (H5Aexists(r->file, "rank_policy") > 0)
    KQSVD_CALL(kqsvd_h5_attr_str(r->file, path, "rank_policy", r->policy, sizeof r->policy));
  r->head_groups = 1;
  if (H5Aexists(r->file, "head_groups") > 0) {
    KQSVD_CALL(kqsvd_h5_attr_int(r->file, path, "head_groups", &r->head_groups));
    KQSVD_CHECK(r->head_groups >= 1 && r->dims.head_dim % r->head_groups == 0, KQSVD_ERR_INPUT,
                "%s: attribute 'head_groups' = %lld must be >= 1 and divide head_dim = %lld", path,
                (long long)r->head_groups, (long long)r->dims.head_dim);
  }
  const char *groups[KQSVD_NMETHODS + 1] = {"kqsvd", "ksvd", "eigen", "spectra"};
  for (int g = 0; g <= KQSVD_NMETHODS; g++)
    KQSVD_CHECK(H5Lexists(r->file, groups[g], H5P_DEFAULT) > 0, KQSVD_ERR_INPUT,
                "%s: group '/%s' is missing", path, groups[g]);
  for (int m = 0; m < KQSVD_NMETHODS; m++)
    for (int i = 0; i < P_N; i++)
      KQSVD_CALL(check_dataset(r, groups[m], g_pnames[i],
                               i <= P_VALUE_UP  ? 4
                               : i <= P_SIGMA_V ? 3
                                                : 1,
                               i >= P_RANK_K ? H5T_INTEGER : H5T_FLOAT));
  for (int m = 0; m < KQSVD_NMETHODS; m++)
    KQSVD_CALL(check_head_ranks(r, groups[m], &r->head_ranks[m]));
  for (int i = 0; i < S_N; i++) KQSVD_CALL(check_dataset(r, "spectra", g_snames[i], 3, H5T_FLOAT));
  r->beta = 1.0;
  KQSVD_H5_ID(grp, H5Gopen2(r->file, "eigen", H5P_DEFAULT));
  if (H5Aexists(grp, "beta") > 0) {
    hid_t a = H5Aopen(grp, "beta", H5P_DEFAULT);
    const herr_t e = a < 0 ? -1 : H5Aread(a, H5T_NATIVE_DOUBLE, &r->beta);
    kqsvd_h5_close(&a);
    KQSVD_CHECK(e >= 0 && isfinite(r->beta) && r->beta > 0, KQSVD_ERR_INPUT,
                "%s: attribute '/eigen/beta' must be a positive number", path);
  }
  *out = r;
  r = NULL;
done:
  kqsvd_h5_close(&grp);
  if (st != KQSVD_OK) kqsvd_error_context(path);
  kqsvd_proj_reader_free(&r);
  return st;
}

void kqsvd_proj_reader_free(kqsvd_proj_reader_t **r) {
  if (!r || !*r) return;
  kqsvd_h5_close(&(*r)->file);
  free(*r);
  *r = NULL;
}

const kqsvd_dims_t *kqsvd_proj_dims(const kqsvd_proj_reader_t *r) { return &r->dims; }
double kqsvd_proj_beta(const kqsvd_proj_reader_t *r) { return r->beta; }
double kqsvd_proj_eps(const kqsvd_proj_reader_t *r) { return r->eps; }
int64_t kqsvd_proj_head_groups(const kqsvd_proj_reader_t *r) { return r->head_groups; }
int64_t kqsvd_proj_tokens(const kqsvd_proj_reader_t *r) { return r->tokens; }
const char *kqsvd_proj_policy(const kqsvd_proj_reader_t *r) { return r->policy; }
int kqsvd_proj_has_head_ranks(const kqsvd_proj_reader_t *r, kqsvd_method_t m) {
  return m >= 0 && m < KQSVD_NMETHODS && r->head_ranks[m];
}

kqsvd_status_t kqsvd_proj_read(kqsvd_proj_reader_t *r, const char *group, const char *name,
                               int64_t layer, double *buf) {
  kqsvd_status_t st = KQSVD_OK;
  hid_t ds = -1, fspace = -1, mspace = -1;
  char full[96];
  snprintf(full, sizeof full, "%s/%s", group, name);
  KQSVD_H5_ID(ds, H5Dopen2(r->file, full, H5P_DEFAULT));
  KQSVD_H5_ID(fspace, H5Dget_space(ds));
  const int nd = H5Sget_simple_extent_ndims(fspace);
  hsize_t dims[4] = {0, 0, 0, 0}, start[4] = {0, 0, 0, 0};
  KQSVD_H5(H5Sget_simple_extent_dims(fspace, dims, NULL));
  if (layer >= 0) {
    start[0] = (hsize_t)layer;
    dims[0] = 1;
    KQSVD_H5(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, start, NULL, dims, NULL));
  }
  hsize_t n = 1;
  for (int k = 0; k < nd; k++) n *= dims[k];
  KQSVD_H5_ID(mspace, H5Screate_simple(1, &n, NULL));
  KQSVD_H5(H5Dread(ds, H5T_NATIVE_DOUBLE, mspace, fspace, H5P_DEFAULT, buf));
  const hsize_t per_layer = n / dims[0];
  for (hsize_t k = 0; k < n; k++)
    KQSVD_CHECK(isfinite(buf[k]), KQSVD_ERR_DATA, "%s: dataset '%s': NaN or Inf at layer %lld",
                r->path, full, (long long)(layer >= 0 ? layer : (int64_t)(k / per_layer)));
done:
  /* A damaged chunk ("inflate() failed") must name the file and dataset. */
  if (st != KQSVD_OK) {
    kqsvd_error_context(full);
    kqsvd_error_context(r->path);
  }
  kqsvd_h5_close(&mspace);
  kqsvd_h5_close(&fspace);
  kqsvd_h5_close(&ds);
  return st;
}

kqsvd_status_t kqsvd_proj_read_ranks(kqsvd_proj_reader_t *r, kqsvd_method_t m, int32_t *rank_k,
                                     int32_t *rank_v) {
  kqsvd_status_t st = KQSVD_OK;
  hid_t ds = -1;
  for (int side = 0; side < 2; side++) {
    char full[96];
    int32_t *v = side ? rank_v : rank_k;
    snprintf(full, sizeof full, "%s/%s", kqsvd_method_name(m), side ? "rank_v" : "rank_k");
    KQSVD_H5_ID(ds, H5Dopen2(r->file, full, H5P_DEFAULT));
    KQSVD_H5(H5Dread(ds, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, v));
    kqsvd_h5_close(&ds);
    for (int64_t l = 0; l < r->dims.layers; l++)
      KQSVD_CHECK(v[l] >= 1 && v[l] <= r->dims.head_dim, KQSVD_ERR_INPUT,
                  "%s: dataset '%s': layer %lld has rank %d, outside [1, head_dim = %lld]", r->path,
                  full, (long long)l, v[l], (long long)r->dims.head_dim);
  }
done:
  if (st != KQSVD_OK) kqsvd_error_context(r->path);
  kqsvd_h5_close(&ds);
  return st;
}

kqsvd_status_t kqsvd_proj_read_head_ranks(kqsvd_proj_reader_t *r, kqsvd_method_t m,
                                          int32_t *rank_k_heads, int32_t *rank_v_heads) {
  kqsvd_status_t st = KQSVD_OK;
  hid_t ds = -1;
  int32_t *layer = NULL;
  int64_t *wide = NULL;
  const int64_t L = r->dims.layers, H = r->dims.kv_heads, d = r->dims.head_dim;
  const char *g = kqsvd_method_name(m);
  KQSVD_CHECK(kqsvd_proj_has_head_ranks(r, m), KQSVD_ERR_BUG,
              "%s: group '/%s' has no per-head ranks", r->path, g);
  KQSVD_MALLOC(layer, (size_t)(2 * L), "ranks");
  /* Read 64 bits wide, so that a message quotes a large value as stored
   * rather than as HDF5 clamps it to 32 bits. */
  KQSVD_MALLOC(wide, (size_t)(L * H), "per-head ranks");
  KQSVD_CALL(kqsvd_proj_read_ranks(r, m, layer, layer + L));
  for (int side = 0; side < 2; side++) {
    char full[96];
    int32_t *v = side ? rank_v_heads : rank_k_heads;
    const char *name = side ? "rank_v" : "rank_k";
    snprintf(full, sizeof full, "%s/%s_heads", g, name);
    KQSVD_H5_ID(ds, H5Dopen2(r->file, full, H5P_DEFAULT));
    KQSVD_H5(H5Dread(ds, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, wide));
    kqsvd_h5_close(&ds);
    for (int64_t l = 0; l < L; l++) {
      int32_t top = 0;
      for (int64_t h = 0; h < H; h++) {
        const int64_t x = wide[l * H + h];
        KQSVD_CHECK(x >= 1 && x <= d, KQSVD_ERR_INPUT,
                    "%s: dataset '%s': layer %lld, KV head %lld has rank %lld, outside [1, "
                    "head_dim = %lld]",
                    r->path, full, (long long)l, (long long)h, (long long)x, (long long)d);
        v[l * H + h] = (int32_t)x;
        top = (int32_t)x > top ? (int32_t)x : top;
      }
      /* A reader of the per-layer form alone must still keep every head's
       * columns, so the per-layer rank is the heads' maximum, no more. */
      KQSVD_CHECK(layer[side * L + l] == top, KQSVD_ERR_INPUT,
                  "%s: dataset '%s/%s': layer %lld has rank %d, but the largest of its KV heads' "
                  "ranks in '%s' is %d (they must be equal)",
                  r->path, g, name, (long long)l, layer[side * L + l], full, top);
    }
  }
done:
  if (st != KQSVD_OK) kqsvd_error_context(r->path);
  kqsvd_h5_close(&ds);
  free(layer);
  free(wide);
  return st;
}
