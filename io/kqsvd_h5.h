/* HDF5 plumbing shared by every file format of docs/formats.md:
 * the status checker, attributes, element types and the common header
 * (format name, version and sizes).  Functions are not collective unless
 * they say so. */
#ifndef KQSVD_H5_H
#define KQSVD_H5_H

#include <hdf5.h>
#include <mpi.h>
#include <stdint.h>

#include "kqsvd_convert.h"
#include "kqsvd_dims.h"
#include "kqsvd_error.h"

/* HDF5 checker: a negative herr_t/hid_t becomes KQSVD_ERR_HDF5 with the
 * library's own error description. */
kqsvd_status_t kqsvd_h5_fail_(const char *call, const char *file, int line, const char *func);
#define KQSVD_H5(call)                                                                      \
  do {                                                                                      \
    if ((int64_t)(call) < 0) {                                                              \
      st = kqsvd_error_trace(kqsvd_h5_fail_(#call, __FILE__, __LINE__, __func__), __FILE__, \
                             __LINE__, __func__);                                           \
      goto done;                                                                            \
    }                                                                                       \
  } while (0)
#define KQSVD_H5_ID(var, call) \
  do {                         \
    (var) = (call);            \
    KQSVD_H5(var);             \
  } while (0)

/* Once per process: stops HDF5 printing its own error stacks. */
void kqsvd_h5_init(void);

/* Closes any HDF5 id kind (ignores ids < 0) and sets it to -1. */
void kqsvd_h5_close(hid_t *id);

/* Opens an existing file read-only, with the MPI-IO driver over `comm`
 * (collective) or, for MPI_COMM_NULL, the default driver (not collective).
 * Errors name the path: KQSVD_ERR_INPUT for a missing or non-HDF5 file. */
kqsvd_status_t kqsvd_h5_open_read(const char *path, MPI_Comm comm, hid_t *file);

/* Longest string attribute read, fixed or variable length alike. */
#define KQSVD_H5_STR_MAX 4096

/* Not collective.  Runs fn(ctx), which must only read `path` with the
 * default driver, in a forked child first, so that a crash or a hang of
 * libhdf5 on a damaged file becomes KQSVD_ERR_INPUT naming `path` (a
 * hang: after 15 s, or KQSVD_HEADER_TIMEOUT seconds); the
 * child's own error comes back as it is.  Returns KQSVD_OK when fn
 * succeeded there (the caller then reads the file itself).  Setting
 * KQSVD_NO_ISOLATION=1 runs fn here instead (for MPI stacks that forbid
 * fork()).  Errors: _INPUT, _IO (no pipe or fork), or fn's. */
kqsvd_status_t kqsvd_h5_isolate(const char *path, kqsvd_status_t (*fn)(void *), void *ctx);

/* How to open and close one kind of reader of a file. */
typedef struct kqsvd_h5_opener {
  kqsvd_status_t (*open)(const char *path, void **handle); /* *handle NULL when it fails */
  void (*close)(void *handle);
} kqsvd_h5_opener_t;

/* Not collective.  Opens `path` with op->open and closes it again in a
 * child process first (kqsvd_h5_isolate), then, unless `out` is NULL,
 * opens it here into *out (NULL on failure).  Errors: as
 * kqsvd_h5_isolate, or op->open's. */
kqsvd_status_t kqsvd_h5_isolated_open(const char *path, const kqsvd_h5_opener_t *op, void **out);

/* Scalar attributes.  Readers fail with KQSVD_ERR_INPUT naming the file and
 * attribute when it is missing, of the wrong kind, unreadable or (strings)
 * longer than KQSVD_H5_STR_MAX bytes; a longer string than n - 1 bytes is
 * cut to fit buf. */
kqsvd_status_t kqsvd_h5_attr_int(hid_t obj, const char *path, const char *name, int64_t *v);
kqsvd_status_t kqsvd_h5_attr_str(hid_t obj, const char *path, const char *name, char *buf,
                                 size_t n);
kqsvd_status_t kqsvd_h5_put_int(hid_t obj, const char *name, hid_t type, int64_t v);
kqsvd_status_t kqsvd_h5_put_double(hid_t obj, const char *name, double v);
kqsvd_status_t kqsvd_h5_put_str(hid_t obj, const char *name, const char *v);

/* Opens dataset `name` and checks it has `ndims` dimensions, returned in
 * dims.  Virtual and external datasets (data in other files) are refused.
 * Errors name the file and dataset. */
kqsvd_status_t kqsvd_h5_dataset(hid_t file, const char *path, const char *name, int ndims,
                                hsize_t *dims, hid_t *dset);

/* Classifies a cache or model dataset's elements: IEEE f16/f32/f64, or
 * uint16 with attribute dtype = "bfloat16" (any other type with that tag
 * is refused).  KQSVD_ERR_INPUT otherwise. */
kqsvd_status_t kqsvd_h5_elem_type(hid_t dset, const char *path, const char *name, kqsvd_dtype_t *t);

/* In-memory HDF5 type holding `t`'s bits unchanged (so reads do no value
 * conversion), and the matching file type for new datasets.  The caller
 * closes both with kqsvd_h5_close. */
kqsvd_status_t kqsvd_h5_mem_type(kqsvd_dtype_t t, hid_t *type);

/* Creates a chunk-free (contiguous) dataset of `t` elements; bf16 gets its
 * dtype attribute.  Collective when `file` was created with MPI-IO. */
kqsvd_status_t kqsvd_h5_create_dataset(hid_t file, const char *name, kqsvd_dtype_t t, int ndims,
                                       const hsize_t *dims, hid_t *dset);

/* kqsvd_dims_t, the header every kqsvd file carries: src/core/kqsvd_dims.h. */

/* Reads and checks the root attributes: kqsvd_format == `format`, version
 * 1, positive sizes, heads a multiple of kv_heads, causal 0 or 1 (when
 * `want_causal`).  Errors name the file and attribute. */
kqsvd_status_t kqsvd_h5_read_dims(hid_t file, const char *path, const char *format, int want_causal,
                                  kqsvd_dims_t *dims);
/* Writes the same attributes (collective under MPI-IO). */
kqsvd_status_t kqsvd_h5_write_dims(hid_t file, const char *format, const kqsvd_dims_t *dims,
                                   int with_causal);
/* Compares two headers, naming the first differing attribute and both
 * files (KQSVD_ERR_INPUT). */
kqsvd_status_t kqsvd_dims_match(const kqsvd_dims_t *a, const char *path_a, const kqsvd_dims_t *b,
                                const char *path_b);

#endif
