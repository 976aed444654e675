#include "kqsvd_h5.h"
#include "kqsvd_signal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

typedef struct {
  char top[256], inner[256];
} h5_messages_t;

static herr_t walk_cb(unsigned n, const H5E_error2_t *e, void *data) {
  h5_messages_t *m = data;
  if (n == 0) snprintf(m->top, sizeof m->top, "%s", e->desc ? e->desc : "");
  snprintf(m->inner, sizeof m->inner, "%s", e->desc ? e->desc : "");
  return 0;
}

kqsvd_status_t kqsvd_h5_fail_(const char *call, const char *file, int line, const char *func) {
  h5_messages_t m = {"", ""};
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, walk_cb, &m);
  H5Eclear2(H5E_DEFAULT);
  if (strcmp(m.top, m.inner) != 0 && m.inner[0])
    return kqsvd_error_set(KQSVD_ERR_HDF5, file, line, func, "HDF5: %s (%s) in %s", m.top, m.inner,
                           call);
  return kqsvd_error_set(KQSVD_ERR_HDF5, file, line, func, "HDF5: %s in %s",
                         m.top[0] ? m.top : "failure", call);
}

void kqsvd_h5_init(void) { H5Eset_auto2(H5E_DEFAULT, NULL, NULL); }

void kqsvd_h5_close(hid_t *id) {
  if (!id || *id < 0) return;
  switch (H5Iget_type(*id)) {
  case H5I_FILE: H5Fclose(*id); break;
  case H5I_GROUP: H5Gclose(*id); break;
  case H5I_DATASET: H5Dclose(*id); break;
  case H5I_DATASPACE: H5Sclose(*id); break;
  case H5I_DATATYPE: H5Tclose(*id); break;
  case H5I_ATTR: H5Aclose(*id); break;
  case H5I_GENPROP_LST: H5Pclose(*id); break;
  default: break;
  }
  *id = -1;
}

kqsvd_status_t kqsvd_h5_open_read(const char *path, MPI_Comm comm, hid_t *file) {
  kqsvd_status_t st = KQSVD_OK;
  hid_t fapl = -1;
  struct stat sb;
  *file = -1;
  kqsvd_signal_context(path);
  if (stat(path, &sb) != 0) {
    /* An unmatched shell pattern reaches us as itself. */
    KQSVD_CHECK(!strpbrk(path, "*?["), KQSVD_ERR_INPUT, "%s: no file matches this pattern", path);
    KQSVD_FAIL(KQSVD_ERR_INPUT, "%s: %s", path, strerror(errno));
  }
  KQSVD_CHECK(S_ISREG(sb.st_mode), KQSVD_ERR_INPUT, "%s: not a regular file", path);
  htri_t is = H5Fis_hdf5(path);
  H5Eclear2(H5E_DEFAULT);
  KQSVD_CHECK(is > 0, KQSVD_ERR_INPUT, "%s: not an HDF5 file", path);
  KQSVD_H5_ID(fapl, H5Pcreate(H5P_FILE_ACCESS));
  if (comm != MPI_COMM_NULL) KQSVD_H5(H5Pset_fapl_mpio(fapl, comm, MPI_INFO_NULL));
  *file = H5Fopen(path, H5F_ACC_RDONLY, fapl);
  if (*file < 0) {
    kqsvd_h5_fail_("H5Fopen", __FILE__, __LINE__, __func__);
    kqsvd_error_clear();
    KQSVD_FAIL(KQSVD_ERR_INPUT, "%s: cannot open as HDF5 (damaged or truncated file?)", path);
  }
done:
  kqsvd_h5_close(&fapl);
  return st;
}

/* A read that HDF5 refused: the file, the attribute and HDF5's reason
 * (out-of-range integers and damaged heaps end here). */
static kqsvd_status_t attr_unreadable(const char *path, const char *name) {
  kqsvd_h5_fail_("H5Aread", __FILE__, __LINE__, __func__);
  char why[1024];
  snprintf(why, sizeof why, "%s", kqsvd_error_message());
  kqsvd_error_clear();
  return kqsvd_error_set(KQSVD_ERR_INPUT, __FILE__, __LINE__, __func__,
                         "%s: attribute '%s' cannot be read (%s)", path, name, why);
}

/* Opens attribute `name` of obj or fails naming it. */
static kqsvd_status_t open_attr(hid_t obj, const char *path, const char *name, hid_t *attr,
                                H5T_class_t *cls) {
  kqsvd_status_t st = KQSVD_OK;
  hid_t type = -1, space = -1;
  *attr = -1;
  htri_t exists = H5Aexists(obj, name);
  KQSVD_CHECK(exists > 0, KQSVD_ERR_INPUT, "%s: attribute '%s' is missing", path, name);
  KQSVD_H5_ID(*attr, H5Aopen(obj, name, H5P_DEFAULT));
  KQSVD_H5_ID(type, H5Aget_type(*attr));
  KQSVD_H5_ID(space, H5Aget_space(*attr));
  *cls = H5Tget_class(type);
  KQSVD_CHECK(H5Sget_simple_extent_npoints(space) == 1, KQSVD_ERR_INPUT,
              "%s: attribute '%s' must be a scalar", path, name);
done:
  kqsvd_h5_close(&type);
  kqsvd_h5_close(&space);
  if (st != KQSVD_OK) kqsvd_h5_close(attr);
  return st;
}

kqsvd_status_t kqsvd_h5_attr_int(hid_t obj, const char *path, const char *name, int64_t *v) {
  kqsvd_status_t st = KQSVD_OK;
  hid_t attr = -1;
  H5T_class_t cls;
  long long x = 0;
  KQSVD_CALL(open_attr(obj, path, name, &attr, &cls));
  KQSVD_CHECK(cls == H5T_INTEGER, KQSVD_ERR_INPUT, "%s: attribute '%s' must be an integer", path,
              name);
  if (H5Aread(attr, H5T_NATIVE_LLONG, &x) < 0) KQSVD_CALL(attr_unreadable(path, name));
  *v = x;
done:
  kqsvd_h5_close(&attr);
  return st;
}

kqsvd_status_t kqsvd_h5_attr_str(hid_t obj, const char *path, const char *name, char *buf,
                                 size_t n) {
  kqsvd_status_t st = KQSVD_OK;
  hid_t attr = -1, ftype = -1, mtype = -1;
  H5T_class_t cls;
  char *vstr = NULL, *tmp = NULL;
  KQSVD_CALL(open_attr(obj, path, name, &attr, &cls));
  KQSVD_CHECK(cls == H5T_STRING, KQSVD_ERR_INPUT, "%s: attribute '%s' must be a string", path,
              name);
  KQSVD_H5_ID(ftype, H5Aget_type(attr));
  if (H5Tis_variable_str(ftype) > 0) {
    /* h5py writes Python str attributes as variable-length strings. */
    KQSVD_H5_ID(mtype, H5Tcopy(H5T_C_S1));
    KQSVD_H5(H5Tset_cset(mtype, H5Tget_cset(ftype)));
    KQSVD_H5(H5Tset_size(mtype, H5T_VARIABLE));
    if (H5Aread(attr, mtype, &vstr) < 0) KQSVD_CALL(attr_unreadable(path, name));
    const size_t len = vstr ? strlen(vstr) : 0;
    KQSVD_CHECK(len <= KQSVD_H5_STR_MAX, KQSVD_ERR_INPUT,
                "%s: attribute '%s' is %zu bytes long; at most %d are accepted", path, name, len,
                KQSVD_H5_STR_MAX);
    snprintf(buf, n, "%s", vstr ? vstr : "");
  } else {
    /* The same limit as for variable-length strings. */
    const size_t len = H5Tget_size(ftype);
    KQSVD_CHECK(len <= KQSVD_H5_STR_MAX, KQSVD_ERR_INPUT,
                "%s: attribute '%s' is %zu bytes long; at most %d are accepted", path, name, len,
                KQSVD_H5_STR_MAX);
    KQSVD_MALLOC(tmp, len + 1, "a string attribute");
    /* The file's own type: the bytes as stored, which a conversion to a
     * NUL-terminated string would cut at the first NUL. */
    KQSVD_H5_ID(mtype, H5Tcopy(ftype));
    if (H5Aread(attr, mtype, tmp) < 0) KQSVD_CALL(attr_unreadable(path, name));
    tmp[len] = '\0';
    /* "cache\0model" would read as "cache" here but not elsewhere. */
    for (size_t k = strlen(tmp); k < len; k++)
      KQSVD_CHECK(tmp[k] == '\0', KQSVD_ERR_INPUT,
                  "%s: attribute '%s' holds a NUL byte before its end", path, name);
    if (H5Tget_strpad(ftype) == H5T_STR_SPACEPAD)
      for (size_t k = strlen(tmp); k > 0 && tmp[k - 1] == ' '; k--) tmp[k - 1] = '\0';
    snprintf(buf, n, "%s", tmp);
  }
done:
  if (vstr) H5free_memory(vstr);
  free(tmp);
  kqsvd_h5_close(&attr);
  kqsvd_h5_close(&ftype);
  kqsvd_h5_close(&mtype);
  return st;
}

static kqsvd_status_t put_attr(hid_t obj, const char *name, hid_t ftype, hid_t mtype,
                               const void *v) {
  kqsvd_status_t st = KQSVD_OK;
  hid_t space = -1, attr = -1;
  KQSVD_H5_ID(space, H5Screate(H5S_SCALAR));
  KQSVD_H5_ID(attr, H5Acreate2(obj, name, ftype, space, H5P_DEFAULT, H5P_DEFAULT));
  KQSVD_H5(H5Awrite(attr, mtype, v));
done:
  kqsvd_h5_close(&attr);
  kqsvd_h5_close(&space);
  return st;
}

kqsvd_status_t kqsvd_h5_put_int(hid_t obj, const char *name, hid_t type, int64_t v) {
  long long x = v;
  return put_attr(obj, name, type, H5T_NATIVE_LLONG, &x);
}

kqsvd_status_t kqsvd_h5_put_double(hid_t obj, const char *name, double v) {
  return put_attr(obj, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &v);
}

kqsvd_status_t kqsvd_h5_put_str(hid_t obj, const char *name, const char *v) {
  kqsvd_status_t st = KQSVD_OK;
  hid_t type = -1;
  KQSVD_H5_ID(type, H5Tcopy(H5T_C_S1));
  KQSVD_H5(H5Tset_size(type, H5T_VARIABLE));
  KQSVD_H5(H5Tset_cset(type, H5T_CSET_UTF8));
  KQSVD_CALL(put_attr(obj, name, type, type, &v));
done:
  kqsvd_h5_close(&type);
  return st;
}

/* Storage never written reads as fill values: 2^26 rows of zeros from a
 * file of a few kilobytes.  For chunked data every chunk must exist (the
 * space status says "part" for any compressed dataset, so chunks are
 * counted instead). */
static kqsvd_status_t check_written(hid_t dset, hid_t dcpl, hid_t space, int nd,
                                    const hsize_t *dims, const char *path, const char *name) {
  kqsvd_status_t st = KQSVD_OK;
  hsize_t chunk[H5S_MAX_RANK], want = 1, have = 0;
  if (H5Sget_simple_extent_npoints(space) == 0) return KQSVD_OK;
  const H5D_layout_t layout = H5Pget_layout(dcpl);
  if (layout == H5D_CHUNKED) {
    KQSVD_CHECK(H5Pget_chunk(dcpl, nd, chunk) == nd, KQSVD_ERR_INPUT,
                "%s: dataset '%s' has a damaged chunk layout", path, name);
    for (int k = 0; k < nd; k++) want *= (dims[k] + chunk[k] - 1) / chunk[k];
    KQSVD_H5(H5Dget_num_chunks(dset, space, &have));
  } else if (layout == H5D_CONTIGUOUS) {
    H5D_space_status_t alloc = H5D_SPACE_STATUS_ERROR;
    KQSVD_H5(H5Dget_space_status(dset, &alloc));
    have = alloc == H5D_SPACE_STATUS_ALLOCATED;
  } else {
    have = want; /* compact data lives in the object header */
  }
  KQSVD_CHECK(have >= want, KQSVD_ERR_INPUT,
              "%s: dataset '%s' has %s of its data written (the file is incomplete)", path, name,
              have > 0 ? "only part" : "none");
done:
  return st;
}

kqsvd_status_t kqsvd_h5_dataset(hid_t file, const char *path, const char *name, int ndims,
                                hsize_t *dims, hid_t *dset) {
  kqsvd_status_t st = KQSVD_OK;
  hid_t space = -1, dcpl = -1;
  *dset = -1;
  htri_t exists = H5Lexists(file, name, H5P_DEFAULT);
  KQSVD_CHECK(exists > 0, KQSVD_ERR_INPUT, "%s: dataset '%s' is missing", path, name);
  *dset = H5Dopen2(file, name, H5P_DEFAULT);
  KQSVD_CHECK(*dset >= 0, KQSVD_ERR_INPUT, "%s: '%s' is not a readable dataset", path, name);
  KQSVD_H5_ID(dcpl, H5Dget_create_plist(*dset));
  /* Data in other files: a virtual dataset whose sources are missing reads
   * as fill values, and its parallel reads fail, so both kinds are refused
   * alike on every rank count. */
  KQSVD_CHECK(H5Pget_layout(dcpl) != H5D_VIRTUAL, KQSVD_ERR_INPUT,
              "%s: dataset '%s' is a virtual dataset (its data lives in other files); kqsvd "
              "reads only data stored in the file itself (h5repack can copy it in)",
              path, name);
  KQSVD_CHECK(H5Pget_external_count(dcpl) == 0, KQSVD_ERR_INPUT,
              "%s: dataset '%s' is stored in external files; kqsvd reads only data stored in "
              "the file itself (h5repack can copy it in)",
              path, name);
  KQSVD_H5_ID(space, H5Dget_space(*dset));
  const int nd = H5Sget_simple_extent_ndims(space);
  KQSVD_CHECK(nd == ndims, KQSVD_ERR_INPUT, "%s: dataset '%s' has %d dimensions, expected %d", path,
              name, nd, ndims);
  KQSVD_H5(H5Sget_simple_extent_dims(space, dims, NULL));
  KQSVD_CALL(check_written(*dset, dcpl, space, ndims, dims, path, name));
done:
  kqsvd_h5_close(&dcpl);
  kqsvd_h5_close(&space);
  if (st != KQSVD_OK) kqsvd_h5_close(dset);
  return st;
}

kqsvd_status_t kqsvd_h5_elem_type(hid_t dset, const char *path, const char *name,
                                  kqsvd_dtype_t *t) {
  kqsvd_status_t st = KQSVD_OK;
  hid_t type = -1;
  KQSVD_H5_ID(type, H5Dget_type(dset));
  const H5T_class_t cls = H5Tget_class(type);
  const size_t size = H5Tget_size(type);
  char tag[64] = "";
  if (H5Aexists(dset, "dtype") > 0)
    KQSVD_CALL(kqsvd_h5_attr_str(dset, path, "dtype", tag, sizeof tag));
  /* bf16 bits in a float16 dataset would be decoded as IEEE half: the
   * contract stores them as uint16 and nothing else. */
  KQSVD_CHECK(strcmp(tag, "bfloat16") != 0 ||
                  (cls == H5T_INTEGER && size == 2 && H5Tget_sign(type) == H5T_SGN_NONE),
              KQSVD_ERR_INPUT,
              "%s: dataset '%s' has dtype = \"bfloat16\" but is not stored as 16-bit unsigned "
              "integers",
              path, name);
  if (cls == H5T_FLOAT && size == 2) {
    size_t spos, epos, esize, mpos, msize;
    KQSVD_H5(H5Tget_fields(type, &spos, &epos, &esize, &mpos, &msize));
    KQSVD_CHECK(spos == 15 && epos == 10 && esize == 5 && mpos == 0 && msize == 10 &&
                    H5Tget_ebias(type) == 15,
                KQSVD_ERR_INPUT, "%s: dataset '%s' is a 16-bit float that is not IEEE half", path,
                name);
    *t = KQSVD_F16;
  } else if (cls == H5T_FLOAT && (size == 4 || size == 8)) {
    *t = size == 4 ? KQSVD_F32 : KQSVD_F64;
  } else if (cls == H5T_INTEGER && size == 2) {
    KQSVD_CHECK(tag[0], KQSVD_ERR_INPUT,
                "%s: dataset '%s' holds 16-bit integers without the attribute "
                "dtype = \"bfloat16\"",
                path, name);
    KQSVD_CHECK(strcmp(tag, "bfloat16") == 0, KQSVD_ERR_INPUT,
                "%s: dataset '%s' has dtype = \"%s\" (only \"bfloat16\" is supported)", path, name,
                tag);
    *t = KQSVD_BF16;
  } else {
    KQSVD_FAIL(KQSVD_ERR_INPUT,
               "%s: dataset '%s' has unsupported elements (expected float16, bfloat16, "
               "float32 or float64)",
               path, name);
  }
done:
  kqsvd_h5_close(&type);
  return st;
}

kqsvd_status_t kqsvd_h5_mem_type(kqsvd_dtype_t t, hid_t *type) {
  kqsvd_status_t st = KQSVD_OK;
  *type = -1;
  switch (t) {
  case KQSVD_F16:
    /* The same construction as h5py's float16, so reads are no-ops. */
    KQSVD_H5_ID(*type, H5Tcopy(H5T_IEEE_F32LE));
    KQSVD_H5(H5Tset_fields(*type, 15, 10, 5, 0, 10));
    KQSVD_H5(H5Tset_size(*type, 2));
    KQSVD_H5(H5Tset_ebias(*type, 15));
    break;
  case KQSVD_BF16: KQSVD_H5_ID(*type, H5Tcopy(H5T_NATIVE_UINT16)); break;
  case KQSVD_F32: KQSVD_H5_ID(*type, H5Tcopy(H5T_NATIVE_FLOAT)); break;
  case KQSVD_F64: KQSVD_H5_ID(*type, H5Tcopy(H5T_NATIVE_DOUBLE)); break;
  }
done:
  return st;
}

kqsvd_status_t kqsvd_h5_create_dataset(hid_t file, const char *name, kqsvd_dtype_t t, int ndims,
                                       const hsize_t *dims, hid_t *dset) {
  kqsvd_status_t st = KQSVD_OK;
  hid_t type = -1, space = -1;
  *dset = -1;
  KQSVD_CALL(kqsvd_h5_mem_type(t, &type));
  KQSVD_H5_ID(space, H5Screate_simple(ndims, dims, NULL));
  KQSVD_H5_ID(*dset, H5Dcreate2(file, name, type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
  if (t == KQSVD_BF16) KQSVD_CALL(kqsvd_h5_put_str(*dset, "dtype", "bfloat16"));
done:
  kqsvd_h5_close(&type);
  kqsvd_h5_close(&space);
  return st;
}
