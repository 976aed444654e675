/* The device fold of `kqsvd calibrate`: every factor of this rank's items
 * stays on the GPU while rows stream through.  A call queues one item's
 * block (its keys, queries and values as read) on the stream of the item's
 * lane, so that updates of one item stay in order while other items' run
 * alongside: the copy into a pinned staging buffer (none when the block was
 * read straight into it) and to the device, the conversion to float64 with
 * a check for NaN and Inf, and the fold.  The QR method here factors
 * [R; rows] by cusolverDnXgeqrf for each factor in turn; the Gram method
 * (fold_gram.cu) updates all of the block's factors in a few batched
 * GEMMs. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "fold_impl.h"
#include "gpu_check.h"
extern "C" {
#include "kqsvd_linalg.h"
}

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

__global__ static void convert_rows(const void *X, int t, int heads, long long n, long long rows,
                                    int hd, double *dst, long long hs, long long rs, long long cs,
                                    unsigned long long tag, long long pos0,
                                    unsigned long long *bad) {
  const long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= (long long)heads * rows * hd) return;
  const int c = (int)(k % hd);
  const long long hi = k / hd, i = hi % rows, h = hi / rows;
  double v = 0.0;
  if (i < n) {
    v = decode(X, t, (size_t)((h * n + i) * hd + c));
    if (!isfinite(v)) atomicMin(bad, (tag << 32) | (unsigned long long)(pos0 + h * n + i));
  }
  dst[h * hs + i * rs + c * cs] = v;
}

void kqsvd_fold_convert(cudaStream_t stream, const void *X, int t, int heads, int64_t n,
                        int64_t rows, int hd, double *dst, int64_t hs, int64_t rs, int64_t cs,
                        unsigned long long tag, int64_t pos0, unsigned long long *bad) {
  const int threads = 256;
  const long long total = (long long)heads * rows * hd;
  convert_rows<<<(unsigned)((total + threads - 1) / threads), threads, 0, stream>>>(
      X, t, heads, n, rows, hd, dst, hs, rs, cs, tag, pos0, bad);
}

/* Top w x w of A (lda) <- R (ldR), or R <- the upper triangle of A's top (back). */
__global__ static void move_triangle(double *R, int ldR, double *A, int w, int lda, int back) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x, j = blockIdx.y;
  if (i >= w) return;
  if (back)
    R[i + (size_t)j * ldR] = i <= j ? A[i + (size_t)j * lda] : 0.0;
  else
    A[i + (size_t)j * lda] = i <= j ? R[i + (size_t)j * ldR] : 0.0;
}

/* The geqrf workspace of a lane for an lda x w matrix: grown when cuSOLVER
 * asks for more (it does not promise that a smaller matrix needs less). */
static kqsvd_status_t qr_workspace(kqsvd_gpu_fold_t *f, lane_t *ln, int64_t lda, int w) {
  kqsvd_status_t st = KQSVD_OK;
  size_t need_dev = 0, need_host = 0;
  KQSVD_CUSOLVER_CALL(cusolverDnXgeqrf_bufferSize(ln->solver, f->params, lda, w, CUDA_R_64F, ln->A,
                                                  lda, CUDA_R_64F, ln->tau, CUDA_R_64F, &need_dev,
                                                  &need_host));
  if (need_dev <= ln->work_dev_bytes && need_host <= ln->work_host_bytes) goto done;
  KQSVD_CUDA_CALL(cudaStreamSynchronize(ln->stream));
  if (need_dev > ln->work_dev_bytes) {
    KQSVD_CUDA_CALL(cudaFree(ln->work_dev));
    ln->work_dev = NULL;
    KQSVD_CUDA_CALL(cudaMalloc(&ln->work_dev, need_dev + 1));
    ln->work_dev_bytes = need_dev;
  }
  if (need_host > ln->work_host_bytes) {
    void *grown = realloc(ln->work_host, need_host + 1);
    KQSVD_CHECK(grown, KQSVD_ERR_NOMEM, "cannot grow cuSOLVER's host workspace");
    ln->work_host = grown;
    ln->work_host_bytes = need_host;
  }
done:
  return st;
}

/* R (w x w in a factor of leading dimension ldR) <- the R factor of
 * [R; rows], the rows being `heads` heads of X side by side. */
static kqsvd_status_t qr_fold(kqsvd_gpu_fold_t *f, lane_t *ln, double *R, int ldR, int w,
                              const void *X, kqsvd_dtype_t t, int heads, int64_t n,
                              unsigned long long tag, int64_t pos0) {
  kqsvd_status_t st = KQSVD_OK;
  const int64_t lda = w + n;
  const int hd = f->s.hd;
  const dim3 grid((unsigned)((w + 127) / 128), (unsigned)w);
  KQSVD_CALL(qr_workspace(f, ln, lda, w));
  kqsvd_fold_convert(ln->stream, X, (int)t, heads, n, n, hd, ln->A + w, (int64_t)hd * lda, 1, lda,
                     tag, pos0, ln->bad);
  move_triangle<<<grid, 128, 0, ln->stream>>>(R, ldR, ln->A, w, (int)lda, 0);
  KQSVD_CUDA_CALL(cudaGetLastError());
  KQSVD_CUSOLVER_CALL(cusolverDnXgeqrf(
      ln->solver, f->params, lda, w, CUDA_R_64F, ln->A, lda, CUDA_R_64F, ln->tau, CUDA_R_64F,
      ln->work_dev, ln->work_dev_bytes, ln->work_host, ln->work_host_bytes, ln->info));
  move_triangle<<<grid, 128, 0, ln->stream>>>(R, ldR, ln->A, w, (int)lda, 1);
  KQSVD_CUDA_CALL(cudaGetLastError());
done:
  return st;
}

/* The QR method on one block: keys, each query head, values in turn. */
static kqsvd_status_t qr_block(kqsvd_gpu_fold_t *f, lane_t *ln, int64_t item, const char *raw,
                               const size_t off[3], const kqsvd_dtype_t t[3], int64_t n,
                               int64_t tag) {
  kqsvd_status_t st = KQSVD_OK;
  const int G = f->s.G, m = f->s.m, hd = f->s.hd, w = f->w;
  const size_t dd = (size_t)w * w, head_q = (size_t)n * hd * kqsvd_dtype_size(t[PART_Q]);
  double *R = f->R + (size_t)(3 * item) * dd;
  KQSVD_CALL(qr_fold(f, ln, R, w, w, raw + off[PART_K], t[PART_K], G, n, tag, 0));
  for (int q = 0; q < G * m; q++)
    KQSVD_CALL(qr_fold(f, ln, R + dd + (size_t)(q / m) * hd * (w + 1), w, hd,
                       raw + off[PART_Q] + q * head_q, t[PART_Q], 1, n, tag, (int64_t)(G + q) * n));
  KQSVD_CALL(qr_fold(f, ln, R + 2 * dd, w, w, raw + off[PART_V], t[PART_V], G, n, tag,
                     (int64_t)(G + G * m) * n));
done:
  return st;
}

extern "C" kqsvd_status_t kqsvd_gpu_fold_init(int device, const kqsvd_gpu_shape_t *s,
                                              kqsvd_gpu_fold_t **out) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_gpu_fold_t *f = (kqsvd_gpu_fold_t *)calloc(1, sizeof *f);
  *out = NULL;
  kqsvd_error_clear(); /* the module's record: this call's failure only */
  cudaGetLastError();
  KQSVD_CHECK(f, KQSVD_ERR_NOMEM, "cannot allocate the GPU folder");
  KQSVD_CHECK(s->hd >= 1 && s->G >= 1 && s->m >= 1 && s->nitems >= 1 && s->max_rows >= 1 &&
                  s->nlanes >= 1 && s->chunk >= 0 && s->hd <= 4096 && s->G <= 4096 &&
                  (int64_t)s->hd * s->G <= 8192 && s->m <= 4096,
              KQSVD_ERR_USAGE, "GPU folder: sizes out of range");
  KQSVD_CHECK(s->method == KQSVD_GPU_QR || s->method == KQSVD_GPU_GRAM, KQSVD_ERR_USAGE,
              "GPU folder: unknown method %d", (int)s->method);
  f->device = device, f->s = *s;
  f->w = s->hd * s->G;
  f->heads = 2 * s->G + s->G * s->m;
  f->nfactors = 3 * s->nitems;
  /* Rows of a block are counted in 32 bits in NaN reports, and in ints by
   * cuSOLVER and cuBLAS. */
  KQSVD_CHECK((int64_t)f->heads * (s->max_rows + 8192) < INT_MAX &&
                  (int64_t)f->w + s->max_rows < INT_MAX / f->w,
              KQSVD_ERR_USAGE, "GPU folder: %lld rows per call are too many",
              (long long)s->max_rows);
  {
    const int64_t chunk = kqsvd_fold_gram_chunk(s);
    f->npad_max = (s->max_rows + chunk - 1) / chunk * chunk;
  }
  f->block_bytes = (size_t)f->heads * (size_t)s->max_rows * (size_t)s->hd *
                   (size_t)(s->elem_bytes >= 2 && s->elem_bytes <= 8 ? s->elem_bytes : 8);
  KQSVD_CUDA_CALL(cudaSetDevice(device));
  KQSVD_CUDA_CALL(cudaMalloc((void **)&f->R, (size_t)f->nfactors * f->w * f->w * sizeof(double)));
  KQSVD_CUDA_CALL(cudaMemset(f->R, 0, (size_t)f->nfactors * f->w * f->w * sizeof(double)));
  KQSVD_MALLOC(f->host, (size_t)f->w * f->w, "GPU folder scratch");
  KQSVD_CUSOLVER_CALL(cusolverDnCreateParams(&f->params));
  f->lane = (lane_t *)calloc((size_t)s->nlanes, sizeof(lane_t));
  KQSVD_CHECK(f->lane, KQSVD_ERR_NOMEM, "cannot allocate the GPU lanes");
  for (int l = 0; l < s->nlanes; l++) {
    lane_t *ln = &f->lane[l];
    KQSVD_CUDA_CALL(cudaStreamCreateWithFlags(&ln->stream, cudaStreamNonBlocking));
    for (int b = 0; b < 2; b++) {
      KQSVD_CUDA_CALL(cudaEventCreateWithFlags(&ln->done[b], cudaEventDisableTiming));
      KQSVD_CUDA_CALL(cudaMallocHost(&ln->pinned[b], f->block_bytes));
      KQSVD_CUDA_CALL(cudaMalloc(&ln->raw[b], f->block_bytes));
      KQSVD_CUDA_CALL(cudaEventRecord(ln->done[b], ln->stream));
    }
    KQSVD_CUDA_CALL(cudaMalloc((void **)&ln->info, sizeof(int)));
    KQSVD_CUDA_CALL(cudaMemset(ln->info, 0, sizeof(int)));
    KQSVD_CUDA_CALL(cudaMalloc((void **)&ln->bad, sizeof(unsigned long long)));
    KQSVD_CUDA_CALL(cudaMemset(ln->bad, 0xff, sizeof(unsigned long long)));
    if (s->method == KQSVD_GPU_GRAM) {
      KQSVD_CUBLAS_CALL(cublasCreate(&ln->blas));
      KQSVD_CUBLAS_CALL(cublasSetStream(ln->blas, ln->stream));
      KQSVD_CUDA_CALL(cudaMalloc((void **)&ln->A, kqsvd_fold_gram_a_doubles(f) * sizeof(double)));
      KQSVD_CUDA_CALL(cudaMalloc((void **)&ln->P, kqsvd_fold_gram_p_doubles(f) * sizeof(double)));
    } else {
      const int64_t lda = f->w + s->max_rows;
      KQSVD_CUSOLVER_CALL(cusolverDnCreate(&ln->solver));
      KQSVD_CUSOLVER_CALL(cusolverDnSetStream(ln->solver, ln->stream));
      KQSVD_CUDA_CALL(cudaMalloc((void **)&ln->A, (size_t)lda * f->w * sizeof(double)));
      KQSVD_CUDA_CALL(cudaMalloc((void **)&ln->tau, (size_t)f->w * sizeof(double)));
      KQSVD_CALL(qr_workspace(f, ln, lda, f->w));
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
  for (int l = 0; f->lane && l < f->s.nlanes; l++) {
    lane_t *ln = &f->lane[l];
    if (ln->stream) cudaStreamSynchronize(ln->stream);
    if (ln->solver) cusolverDnDestroy(ln->solver);
    if (ln->blas) cublasDestroy(ln->blas);
    for (int b = 0; b < 2; b++) {
      if (ln->done[b]) cudaEventDestroy(ln->done[b]);
      cudaFreeHost(ln->pinned[b]);
      cudaFree(ln->raw[b]);
    }
    if (ln->stream) cudaStreamDestroy(ln->stream);
    cudaFree(ln->A);
    cudaFree(ln->P);
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
  const size_t tri = kqsvd_tri_size(f->w), dd = (size_t)f->w * f->w;
  kqsvd_error_clear();
  KQSVD_CUDA_CALL(cudaSetDevice(f->device));
  KQSVD_CUDA_CALL(cudaDeviceSynchronize());
  for (int64_t k = 0; k < f->nfactors; k++) {
    kqsvd_tri_unpack(f->w, packed + (size_t)k * tri, f->host);
    KQSVD_CUDA_CALL(
        cudaMemcpy(f->R + (size_t)k * dd, f->host, dd * sizeof(double), cudaMemcpyHostToDevice));
  }
  /* A copy from pageable memory may return before it lands. */
  KQSVD_CUDA_CALL(cudaDeviceSynchronize());
done:
  return st;
}

extern "C" void *kqsvd_gpu_fold_stage(kqsvd_gpu_fold_t *f, int64_t item) {
  if (item < 0 || item >= f->s.nitems || cudaSetDevice(f->device) != cudaSuccess) return NULL;
  lane_t *ln = &f->lane[item % f->s.nlanes];
  if (cudaEventSynchronize(ln->done[ln->next]) != cudaSuccess) return NULL;
  return ln->pinned[ln->next];
}

extern "C" kqsvd_status_t kqsvd_gpu_fold_item(kqsvd_gpu_fold_t *f, int64_t item, const void *X,
                                              const kqsvd_dtype_t t[3], int64_t n, int on_device,
                                              int64_t tag) {
  kqsvd_status_t st = KQSVD_OK;
  const int G = f->s.G, m = f->s.m;
  const int64_t heads[3] = {G, (int64_t)G * m, G};
  size_t off[3], bytes = 0;
  const char *raw = (const char *)X;
  kqsvd_error_clear();
  KQSVD_CHECK(item >= 0 && item < f->s.nitems && n >= 1 && n <= f->s.max_rows && tag >= 0 &&
                  tag < (INT64_C(1) << 31) && X,
              KQSVD_ERR_BUG, "GPU fold: item %lld, %lld rows, tag %lld out of range",
              (long long)item, (long long)n, (long long)tag);
  for (int p = 0; p < 3; p++) {
    KQSVD_CHECK(t[p] >= KQSVD_F16 && t[p] <= KQSVD_F64, KQSVD_ERR_BUG,
                "GPU fold: element type %d out of range", (int)t[p]);
    off[p] = bytes;
    bytes += (size_t)heads[p] * (size_t)n * (size_t)f->s.hd * kqsvd_dtype_size(t[p]);
  }
  KQSVD_CHECK(bytes <= f->block_bytes, KQSVD_ERR_BUG,
              "GPU fold: a block of %zu bytes is larger than the staging buffers", bytes);
  KQSVD_CUDA_CALL(cudaSetDevice(f->device));
  {
    lane_t *ln = &f->lane[item % f->s.nlanes];
    if (!on_device) {
      /* Buffers in turn: the wait is for the copy two calls back on this
       * lane, so the host fills one while the device copies the other. */
      const int b = ln->next;
      ln->next ^= 1;
      KQSVD_CUDA_CALL(cudaEventSynchronize(ln->done[b]));
      if (X != ln->pinned[b]) memcpy(ln->pinned[b], X, bytes);
      KQSVD_CUDA_CALL(
          cudaMemcpyAsync(ln->raw[b], ln->pinned[b], bytes, cudaMemcpyHostToDevice, ln->stream));
      KQSVD_CUDA_CALL(cudaEventRecord(ln->done[b], ln->stream));
      raw = (const char *)ln->raw[b];
    }
    if (f->s.method == KQSVD_GPU_GRAM)
      KQSVD_CALL(kqsvd_fold_gram_block(f, ln, item, raw, off, t, n, tag));
    else
      KQSVD_CALL(qr_block(f, ln, item, raw, off, t, n, tag));
  }
done:
  return st;
}

extern "C" kqsvd_status_t kqsvd_gpu_fold_sync(kqsvd_gpu_fold_t *f, double *packed, int64_t *bad_tag,
                                              int64_t *bad_row) {
  kqsvd_status_t st = KQSVD_OK;
  unsigned long long first = ~0ULL;
  const size_t tri = kqsvd_tri_size(f->w), dd = (size_t)f->w * f->w;
  *bad_tag = *bad_row = -1;
  kqsvd_error_clear();
  KQSVD_CUDA_CALL(cudaSetDevice(f->device));
  for (int l = 0; l < f->s.nlanes; l++) {
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
    for (int l = 0; l < f->s.nlanes; l++)
      KQSVD_CUDA_CALL(cudaMemset(f->lane[l].bad, 0xff, sizeof(unsigned long long)));
    /* Legacy-stream memsets: done before the lanes run again. */
    KQSVD_CUDA_CALL(cudaDeviceSynchronize());
  }
  for (int64_t k = 0; packed && k < f->nfactors; k++) {
    KQSVD_CUDA_CALL(
        cudaMemcpy(f->host, f->R + (size_t)k * dd, dd * sizeof(double), cudaMemcpyDeviceToHost));
    kqsvd_tri_pack(f->w, f->host, packed + (size_t)k * tri);
  }
done:
  return st;
}
