/* The device fold's state, shared by its sources (private to gpu/):
 * fold.cu (the lanes, staging, the QR method, load and sync) and
 * fold_gram.cu (the Gram method and the benchmark's rate). */
#ifndef KQSVD_FOLD_IMPL_H
#define KQSVD_FOLD_IMPL_H

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>

#include "kqsvd_gpu.h"

typedef struct {
  cudaStream_t stream;
  cudaEvent_t done[2];      /* staging buffer b is free again */
  void *pinned[2], *raw[2]; /* host staging and device copies, used in turn so
                               that the next call's copy overlaps this fold */
  int next;
  cusolverDnHandle_t solver; /* QR */
  cublasHandle_t blas;       /* GRAM */
  double *A;                 /* QR: (w + max_rows) x w work matrix; GRAM: the block in float64 */
  double *P;                 /* GRAM: the chunks' partial Gram matrices */
  double *tau;               /* QR */
  void *work_dev, *work_host;
  size_t work_dev_bytes, work_host_bytes;
  int *info;
  unsigned long long *bad; /* (tag << 32 | row) of the first non-finite element */
} lane_t;

struct kqsvd_gpu_fold {
  int device;
  kqsvd_gpu_shape_t s;
  int w;              /* a factor's width, G hd */
  int heads;          /* heads of a block: 2 G + G m */
  int64_t nfactors;   /* 3 nitems */
  int64_t npad_max;   /* GRAM: max_rows rounded up to whole chunks */
  size_t block_bytes; /* one staging buffer: heads x max_rows x hd x elem_bytes */
  double *R;          /* nfactors x w x w, column-major */
  double *host;       /* w x w scratch for load and sync */
  cusolverDnParams_t params;
  lane_t *lane;
};

/* The block's parts in order: keys (G heads), queries (G m), values (G). */
enum { PART_K = 0, PART_Q = 1, PART_V = 2 };

/* Rows [0, rows) of `heads` heads of X (row-major [heads][n][hd], type t)
 * as float64 into dst: head h's row i, column c at h hs + i rs + c cs; rows
 * past n are written as zeros.  A NaN or Inf lowers *bad to tag << 32 |
 * (pos0 + h n + i).  Queued on `stream`. */
void kqsvd_fold_convert(cudaStream_t stream, const void *X, int t, int heads, int64_t n,
                        int64_t rows, int hd, double *dst, int64_t hs, int64_t rs, int64_t cs,
                        unsigned long long tag, int64_t pos0, unsigned long long *bad);

/* The Gram method's work on a lane (fold_gram.cu): sizes for fold_init,
 * and one block's update of item `item`'s three factors from its raw copy
 * on the device (parts at byte offsets off[3], types t[3]). */
int64_t kqsvd_fold_gram_chunk(const kqsvd_gpu_shape_t *s);
size_t kqsvd_fold_gram_a_doubles(const kqsvd_gpu_fold_t *f);
size_t kqsvd_fold_gram_p_doubles(const kqsvd_gpu_fold_t *f);
kqsvd_status_t kqsvd_fold_gram_block(kqsvd_gpu_fold_t *f, lane_t *ln, int64_t item, const char *raw,
                                     const size_t off[3], const kqsvd_dtype_t t[3], int64_t n,
                                     int64_t tag);

#endif
