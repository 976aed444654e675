/* The device QR stage of `kqsvd calibrate`: every R factor of this rank's
 * items stays on the GPU while rows stream through.  A call queues, on the
 * stream that owns the factor (so updates of one factor stay in order while
 * other factors' run alongside): the copy of the rows into a pinned staging
 * buffer and to the device, their conversion to float64 (with a check for
 * NaN and Inf), and the QR of [R; rows] by cusolverDnXgeqrf, whose R
 * replaces the factor. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_check.h"
#include "kqsvd_gpu.h"
extern "C" {
#include "kqsvd_linalg.h"
}

typedef struct {
  cudaStream_t stream;
  cudaEvent_t done[2]; /* staging buffer b is free again */
  cusolverDnHandle_t solver;
  void *pinned[2], *raw[2]; /* host staging and device copies, used in turn so
                               that the next call's copy overlaps this QR */
  int next;
  double *A, *tau; /* (d + max_rows) x d work matrix, column-major */
  void *work_dev, *work_host;
  size_t work_dev_bytes, work_host_bytes;
  int *info;
  unsigned long long *bad; /* (tag << 32 | row) of the first non-finite element */
} lane_t;

struct kqsvd_gpu_fold {
  int device, d, nlanes;
  int64_t nfactors, max_rows;
  size_t row_bytes; /* d x the widest element type */
  double *R;        /* nfactors x d x d, column-major, upper triangles */
  double *host;     /* d x d scratch for load/sync */
  cusolverDnParams_t params;
  lane_t *lane;
};

__device__ static double decode(const void *x, int t, size_t k) {
  switch (t) {
  case KQSVD_F16: return (double)__half2float(((const __half *)x)[k]);
  case KQSVD_BF16: {
    const unsigned int bits = (unsigned int)((const unsigned short *)x)[k] << 16;
    return (double)__uint_as_float(bits);
  }
  case KQSVD_F32: return (double)((const float *)x)[k];
  default: return ((const double *)x)[k];
  }
}

/* Rows d .. d+n-1 of A (ld) <- X (n x d, row-major), and the first bad row. */
__global__ static void convert_rows(const void *X, int t, int n, int d, double *A, int ld,
                                    unsigned long long tag, unsigned long long *bad) {
  const size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= (size_t)n * d) return;
  const int i = (int)(k / d), j = (int)(k % d);
  const double v = decode(X, t, k);
  if (!isfinite(v)) atomicMin(bad, (tag << 32) | (unsigned long long)i);
  A[d + i + (size_t)j * ld] = v;
}

/* Top d x d of A (ld) <- R, or R <- the upper triangle of A's top (back). */
__global__ static void move_triangle(double *R, double *A, int d, int ld, int back) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x, j = blockIdx.y;
  if (i >= d) return;
  if (back)
    R[i + (size_t)j * d] = i <= j ? A[i + (size_t)j * ld] : 0.0;
  else
    A[i + (size_t)j * ld] = i <= j ? R[i + (size_t)j * d] : 0.0;
}

extern "C" kqsvd_status_t kqsvd_gpu_fold_init(int device, int d, int64_t nfactors, int64_t max_rows,
                                              int elem_bytes, int nlanes, kqsvd_gpu_fold_t **out) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_gpu_fold_t *f = (kqsvd_gpu_fold_t *)calloc(1, sizeof *f);
  *out = NULL;
  kqsvd_error_clear(); /* the module's record: this call's failure only */
  cudaGetLastError();
  KQSVD_CHECK(f, KQSVD_ERR_NOMEM, "cannot allocate the GPU folder");
  KQSVD_CHECK(d >= 1 && nfactors >= 1 && max_rows >= 1 && nlanes >= 1, KQSVD_ERR_USAGE,
              "GPU folder: sizes must be positive");
  KQSVD_CHECK((int64_t)d + max_rows < INT_MAX / d, KQSVD_ERR_USAGE,
              "GPU folder: %lld rows per call are too many", (long long)max_rows);
  f->device = device, f->d = d, f->nfactors = nfactors, f->max_rows = max_rows;
  f->nlanes = nlanes;
  f->row_bytes = (size_t)d * (size_t)(elem_bytes >= 2 && elem_bytes <= 8 ? elem_bytes : 8);
  KQSVD_CUDA_CALL(cudaSetDevice(device));
  KQSVD_CUDA_CALL(cudaMalloc((void **)&f->R, (size_t)nfactors * d * d * sizeof(double)));
  KQSVD_CUDA_CALL(cudaMemset(f->R, 0, (size_t)nfactors * d * d * sizeof(double)));
  KQSVD_MALLOC(f->host, (size_t)d * d, "GPU folder scratch");
  KQSVD_CUSOLVER_CALL(cusolverDnCreateParams(&f->params));
  f->lane = (lane_t *)calloc((size_t)nlanes, sizeof(lane_t));
  KQSVD_CHECK(f->lane, KQSVD_ERR_NOMEM, "cannot allocate the GPU lanes");
  {
    const int64_t lda = d + max_rows;
    for (int l = 0; l < nlanes; l++) {
      lane_t *ln = &f->lane[l];
      KQSVD_CUDA_CALL(cudaStreamCreateWithFlags(&ln->stream, cudaStreamNonBlocking));
      for (int b = 0; b < 2; b++) {
        KQSVD_CUDA_CALL(cudaEventCreateWithFlags(&ln->done[b], cudaEventDisableTiming));
        KQSVD_CUDA_CALL(cudaMallocHost(&ln->pinned[b], (size_t)max_rows * f->row_bytes));
        KQSVD_CUDA_CALL(cudaMalloc(&ln->raw[b], (size_t)max_rows * f->row_bytes));
        KQSVD_CUDA_CALL(cudaEventRecord(ln->done[b], ln->stream));
      }
      KQSVD_CUSOLVER_CALL(cusolverDnCreate(&ln->solver));
      KQSVD_CUSOLVER_CALL(cusolverDnSetStream(ln->solver, ln->stream));
      KQSVD_CUDA_CALL(cudaMalloc((void **)&ln->A, (size_t)lda * d * sizeof(double)));
      KQSVD_CUDA_CALL(cudaMalloc((void **)&ln->tau, (size_t)d * sizeof(double)));
      KQSVD_CUDA_CALL(cudaMalloc((void **)&ln->info, sizeof(int)));
      KQSVD_CUDA_CALL(cudaMalloc((void **)&ln->bad, sizeof(unsigned long long)));
      KQSVD_CUDA_CALL(cudaMemset(ln->bad, 0xff, sizeof(unsigned long long)));
      KQSVD_CUSOLVER_CALL(cusolverDnXgeqrf_bufferSize(ln->solver, f->params, lda, d, CUDA_R_64F,
                                                      ln->A, lda, CUDA_R_64F, ln->tau, CUDA_R_64F,
                                                      &ln->work_dev_bytes, &ln->work_host_bytes));
      KQSVD_CUDA_CALL(cudaMalloc(&ln->work_dev, ln->work_dev_bytes + 1));
      ln->work_host = malloc(ln->work_host_bytes + 1);
      KQSVD_CHECK(ln->work_host, KQSVD_ERR_NOMEM, "cannot allocate cuSOLVER host workspace");
    }
  }
  /* The memsets above ran on the legacy stream, which the non-blocking
   * lanes do not wait for. */
  KQSVD_CUDA_CALL(cudaDeviceSynchronize());
  *out = f;
  f = NULL;
done:
  kqsvd_gpu_fold_free(&f);
  return st;
}

extern "C" void kqsvd_gpu_fold_free(kqsvd_gpu_fold_t **fp) {
  kqsvd_gpu_fold_t *f = *fp;
  if (!f) return;
  cudaSetDevice(f->device);
  for (int l = 0; f->lane && l < f->nlanes; l++) {
    lane_t *ln = &f->lane[l];
    if (ln->stream) cudaStreamSynchronize(ln->stream);
    if (ln->solver) cusolverDnDestroy(ln->solver);
    for (int b = 0; b < 2; b++) {
      if (ln->done[b]) cudaEventDestroy(ln->done[b]);
      cudaFreeHost(ln->pinned[b]);
      cudaFree(ln->raw[b]);
    }
    if (ln->stream) cudaStreamDestroy(ln->stream);
    cudaFree(ln->A);
    cudaFree(ln->tau);
    cudaFree(ln->info);
    cudaFree(ln->bad);
    cudaFree(ln->work_dev);
    free(ln->work_host);
  }
  free(f->lane);
  if (f->params) cusolverDnDestroyParams(f->params);
  cudaFree(f->R);
  free(f->host);
  free(f);
  *fp = NULL;
  cudaGetLastError(); /* clear what a failed init may have left */
}

extern "C" kqsvd_status_t kqsvd_gpu_fold_load(kqsvd_gpu_fold_t *f, const double *packed) {
  kqsvd_status_t st = KQSVD_OK;
  const size_t tri = kqsvd_tri_size(f->d), dd = (size_t)f->d * f->d;
  kqsvd_error_clear();
  KQSVD_CUDA_CALL(cudaSetDevice(f->device));
  KQSVD_CUDA_CALL(cudaDeviceSynchronize());
  for (int64_t k = 0; k < f->nfactors; k++) {
    kqsvd_tri_unpack(f->d, packed + (size_t)k * tri, f->host);
    KQSVD_CUDA_CALL(
        cudaMemcpy(f->R + (size_t)k * dd, f->host, dd * sizeof(double), cudaMemcpyHostToDevice));
  }
  /* A copy from pageable memory may return before it lands. */
  KQSVD_CUDA_CALL(cudaDeviceSynchronize());
done:
  return st;
}

extern "C" kqsvd_status_t kqsvd_gpu_fold_rows(kqsvd_gpu_fold_t *f, int64_t k, const void *X,
                                              kqsvd_dtype_t t, int64_t n, int64_t tag) {
  kqsvd_status_t st = KQSVD_OK;
  const int d = f->d;
  lane_t *ln = &f->lane[k % f->nlanes];
  const int64_t lda = d + n;
  const size_t bytes = (size_t)n * d * kqsvd_dtype_size(t);
  double *R = f->R + (size_t)k * d * d;
  size_t need_dev = 0, need_host = 0;
  int b = 0; /* the staging buffer of this call */
  kqsvd_error_clear();
  KQSVD_CHECK(k >= 0 && k < f->nfactors && n >= 1 && n <= f->max_rows && tag >= 0 &&
                  tag < (INT64_C(1) << 31) && t >= KQSVD_F16 && t <= KQSVD_F64,
              KQSVD_ERR_BUG, "GPU fold: factor %lld, %lld rows, tag %lld, type %d out of range",
              (long long)k, (long long)n, (long long)tag, (int)t);
  KQSVD_CUDA_CALL(cudaSetDevice(f->device));
  /* cuSOLVER does not promise that a smaller matrix needs no more
   * workspace than the largest: ask, and grow when it does. */
  KQSVD_CUSOLVER_CALL(cusolverDnXgeqrf_bufferSize(ln->solver, f->params, lda, d, CUDA_R_64F, ln->A,
                                                  lda, CUDA_R_64F, ln->tau, CUDA_R_64F, &need_dev,
                                                  &need_host));
  if (need_dev > ln->work_dev_bytes || need_host > ln->work_host_bytes) {
    KQSVD_CUDA_CALL(cudaStreamSynchronize(ln->stream));
    if (need_dev > ln->work_dev_bytes) {
      KQSVD_CUDA_CALL(cudaFree(ln->work_dev));
      ln->work_dev = NULL;
      KQSVD_CUDA_CALL(cudaMalloc(&ln->work_dev, need_dev));
      ln->work_dev_bytes = need_dev;
    }
    if (need_host > ln->work_host_bytes) {
      void *grown = realloc(ln->work_host, need_host);
      KQSVD_CHECK(grown, KQSVD_ERR_NOMEM, "cannot grow cuSOLVER's host workspace");
      ln->work_host = grown;
      ln->work_host_bytes = need_host;
    }
  }
  KQSVD_CHECK(bytes <= (size_t)n * f->row_bytes, KQSVD_ERR_BUG,
              "GPU fold: %s rows are wider than the staging buffers", kqsvd_dtype_name(t));
  /* Buffers in turn: the wait is for the copy two calls back on this lane,
   * so the host fills one while the device copies from the other. */
  b = ln->next;
  ln->next ^= 1;
  KQSVD_CUDA_CALL(cudaEventSynchronize(ln->done[b]));
  memcpy(ln->pinned[b], X, bytes);
  KQSVD_CUDA_CALL(
      cudaMemcpyAsync(ln->raw[b], ln->pinned[b], bytes, cudaMemcpyHostToDevice, ln->stream));
  KQSVD_CUDA_CALL(cudaEventRecord(ln->done[b], ln->stream));
  {
    const int threads = 256;
    const size_t total = (size_t)n * d;
    convert_rows<<<(unsigned)((total + threads - 1) / threads), threads, 0, ln->stream>>>(
        ln->raw[b], (int)t, (int)n, d, ln->A, (int)lda, (unsigned long long)tag, ln->bad);
    move_triangle<<<dim3((unsigned)((d + 127) / 128), (unsigned)d), 128, 0, ln->stream>>>(
        R, ln->A, d, (int)lda, 0);
    KQSVD_CUDA_CALL(cudaGetLastError());
  }
  KQSVD_CUSOLVER_CALL(cusolverDnXgeqrf(
      ln->solver, f->params, lda, d, CUDA_R_64F, ln->A, lda, CUDA_R_64F, ln->tau, CUDA_R_64F,
      ln->work_dev, ln->work_dev_bytes, ln->work_host, ln->work_host_bytes, ln->info));
  move_triangle<<<dim3((unsigned)((d + 127) / 128), (unsigned)d), 128, 0, ln->stream>>>(
      R, ln->A, d, (int)lda, 1);
  KQSVD_CUDA_CALL(cudaGetLastError());
done:
  return st;
}

extern "C" kqsvd_status_t kqsvd_gpu_fold_sync(kqsvd_gpu_fold_t *f, double *packed, int64_t *bad_tag,
                                              int64_t *bad_row) {
  kqsvd_status_t st = KQSVD_OK;
  unsigned long long first = ~0ULL;
  const size_t tri = kqsvd_tri_size(f->d), dd = (size_t)f->d * f->d;
  *bad_tag = *bad_row = -1;
  kqsvd_error_clear();
  KQSVD_CUDA_CALL(cudaSetDevice(f->device));
  for (int l = 0; l < f->nlanes; l++) {
    lane_t *ln = &f->lane[l];
    unsigned long long b = 0;
    int info = 0;
    KQSVD_CUDA_CALL(cudaStreamSynchronize(ln->stream));
    KQSVD_CUDA_CALL(cudaMemcpy(&b, ln->bad, sizeof b, cudaMemcpyDeviceToHost));
    KQSVD_CUDA_CALL(cudaMemcpy(&info, ln->info, sizeof info, cudaMemcpyDeviceToHost));
    KQSVD_CHECK(info >= 0, KQSVD_ERR_BUG, "cusolverDnXgeqrf: argument %d is wrong (a kqsvd bug)",
                -info);
    first = b < first ? b : first;
  }
  if (first != ~0ULL) {
    *bad_tag = (int64_t)(first >> 32);
    *bad_row = (int64_t)(first & 0xffffffffULL);
    for (int l = 0; l < f->nlanes; l++)
      KQSVD_CUDA_CALL(cudaMemset(f->lane[l].bad, 0xff, sizeof(unsigned long long)));
    /* Legacy-stream memsets: done before the lanes run again. */
    KQSVD_CUDA_CALL(cudaDeviceSynchronize());
  }
  for (int64_t k = 0; packed && k < f->nfactors; k++) {
    KQSVD_CUDA_CALL(
        cudaMemcpy(f->host, f->R + (size_t)k * dd, dd * sizeof(double), cudaMemcpyDeviceToHost));
    kqsvd_tri_pack(f->d, f->host, packed + (size_t)k * tri);
  }
done:
  return st;
}
