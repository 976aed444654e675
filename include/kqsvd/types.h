/* The types every part of the kqsvd library shares: status codes, element
 * types, cache tensors, methods and a model's shape. */
#ifndef KQSVD_PUBLIC_TYPES_H
#define KQSVD_PUBLIC_TYPES_H

#include <stddef.h>
#include <stdint.h>

/* Marks the library's public functions: the shared library exports these
 * and hides everything else. */
#if defined(__GNUC__) || defined(__clang__)
#define KQSVD_API __attribute__((visibility("default")))
#else
#define KQSVD_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Every fallible function returns one of these; the message of a failure
 * is kqsvd_last_error() (kqsvd/error.h). */
typedef enum kqsvd_status {
  KQSVD_OK = 0,
  KQSVD_ERR_USAGE,      /* impossible option or argument */
  KQSVD_ERR_INPUT,      /* malformed, missing or inconsistent input file */
  KQSVD_ERR_DATA,       /* NaN/Inf or otherwise unusable numbers in an input */
  KQSVD_ERR_IO,         /* operating-system file error */
  KQSVD_ERR_HDF5,       /* unexpected HDF5 library failure */
  KQSVD_ERR_MPI,        /* MPI library failure */
  KQSVD_ERR_LAPACK,     /* LAPACK numerical failure (info > 0) */
  KQSVD_ERR_CUDA,       /* CUDA, cuBLAS or cuSOLVER failure */
  KQSVD_ERR_NOMEM,      /* allocation failed or exceeds the memory limit */
  KQSVD_ERR_BUG,        /* broken internal invariant, e.g. LAPACK info < 0 */
  KQSVD_ERR_REMOTE,     /* another MPI rank failed and reports it */
  KQSVD_ERR_INTERRUPTED /* stopped by a signal at a safe point */
} kqsvd_status_t;

/* Element types of the data contract: IEEE half, bfloat16 (the top half of
 * a float32), float32, float64. */
typedef enum kqsvd_dtype { KQSVD_F16 = 0, KQSVD_BF16, KQSVD_F32, KQSVD_F64 } kqsvd_dtype_t;

/* The three cache tensors (the values are the contract's dataset order). */
typedef enum kqsvd_tensor { KQSVD_KEYS = 0, KQSVD_VALUES = 1, KQSVD_QUERIES = 2 } kqsvd_tensor_t;

/* The three projection methods, in the order of proj.h5's groups. */
typedef enum kqsvd_method {
  KQSVD_METHOD_KQSVD = 0, /* KQ-SVD: the optimal factorisation of K Q^T (and V W^O) */
  KQSVD_METHOD_KSVD = 1,  /* K-SVD: singular vectors of K (and V) */
  KQSVD_METHOD_EIGEN = 2, /* Eigen: singular vectors of [beta K; Q / beta] */
  KQSVD_NMETHODS = 3
} kqsvd_method_t;

/* A model's attention shape.  KV head g serves query heads g*group ..
 * g*group + group - 1 (Hugging Face's repeat_kv convention). */
typedef struct kqsvd_shape {
  int64_t layers;   /* L */
  int64_t kv_heads; /* Hkv */
  /* Query heads per KV head, Hq / Hkv (q_per_kv in the Python binding;
   * the name is kept for programs built against it). */
  int64_t group;
  int64_t head_dim; /* d */
  int64_t hidden;   /* D, the width of o_proj's output */
} kqsvd_shape_t;

/* Names: "ok", "usage error", ...; "f16", "bf16", "f32", "f64"; "keys",
 * "values", "queries"; "kqsvd", "ksvd", "eigen".  Not collective; never
 * NULL. */
KQSVD_API const char *kqsvd_status_name(kqsvd_status_t st);
KQSVD_API const char *kqsvd_dtype_name(kqsvd_dtype_t t);
KQSVD_API const char *kqsvd_tensor_name(kqsvd_tensor_t t);
KQSVD_API const char *kqsvd_method_name(kqsvd_method_t m);
/* Bytes per element of t. */
KQSVD_API size_t kqsvd_dtype_size(kqsvd_dtype_t t);

#ifdef __cplusplus
}
#endif

#endif
