/* The Gram method of the device fold: a block's rows, converted to float64
 * in column-major panels, update the Gram matrices C += X^T X of all of
 * the item's factors at once.  A Gram matrix of G hd <= 8192 columns has
 * few output tiles, so a single GEMM over a long block would keep a few of
 * the GPU's multiprocessors busy; instead the rows are cut into chunks of
 * `chunk` rows, one strided-batched DGEMM (FP64 tensor cores) makes every
 * chunk's partial Gram matrix, and one kernel adds them to the factors.
 * Where keys, values and queries are equally wide (G = 1) that is one
 * GEMM call per block; with head groups, two (keys and values G hd wide,
 * query heads hd wide).  Each partial is a sum of `chunk` products and the
 * partials are summed in order, so the result does not depend on the lane
 * or on timing. */
#include <stdlib.h>
#include <string.h>

#include "fold_impl.h"
#include "gpu_check.h"
extern "C" {
#include "kqsvd_util.h"
}

enum { DEFAULT_CHUNK = 2048 };

int64_t kqsvd_fold_gram_chunk(const kqsvd_gpu_shape_t *s) {
  return s->chunk > 0 ? s->chunk : DEFAULT_CHUNK;
}

/* The block's panels: keys and values (G hd x npad each), then the query
 * heads (hd x G m npad). */
size_t kqsvd_fold_gram_a_doubles(const kqsvd_gpu_fold_t *f) {
  return (size_t)(2 * f->w + f->s.G * f->s.m * f->s.hd) * (size_t)f->npad_max;
}

size_t kqsvd_fold_gram_p_doubles(const kqsvd_gpu_fold_t *f) {
  const size_t nc = (size_t)(f->npad_max / kqsvd_fold_gram_chunk(&f->s));
  return nc * ((size_t)2 * f->w * f->w + (size_t)f->s.G * f->s.m * f->s.hd * f->s.hd);
}

/* The upper triangles of the item's factors (keys at R, queries at R + w^2,
 * values at R + 2 w^2) += the sum of their nc partials each: keys' and
 * values' partials first (w x w), then each query head's (hd x hd), head
 * (j, q) adding to the queries' diagonal block j. */
__global__ static void sum_partials(const double *P, int nc, int w, int hd, int G, int m,
                                    double *R) {
  long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long ww = (long long)w * w, hh = (long long)hd * hd;
  if (e < 2 * ww) {
    const int f = (int)(e / ww);
    const long long el = e % ww;
    if (el % w > el / w) return;
    double sum = 0.0;
    for (int p = 0; p < nc; p++) sum += P[((long long)f * nc + p) * ww + el];
    R[(f == 0 ? 0 : 2 * ww) + el] += sum;
    return;
  }
  e -= 2 * ww;
  if (e >= (long long)G * hh) return;
  const int j = (int)(e / hh);
  const long long el = e % hh;
  const int r = (int)(el % hd), s = (int)(el / hd);
  if (r > s) return;
  const double *Pq = P + 2LL * nc * ww;
  double sum = 0.0;
  for (int q = 0; q < m; q++)
    for (int p = 0; p < nc; p++) sum += Pq[(((long long)j * m + q) * nc + p) * hh + el];
  R[ww + (long long)j * hd * (w + 1) + r + (long long)s * w] += sum;
}

/* C_p = A_p A_p^T for `batch` consecutive panels A_p of `width` x c. */
static kqsvd_status_t partial_grams(lane_t *ln, int width, int c, const double *A, double *P,
                                    int batch) {
  kqsvd_status_t st = KQSVD_OK;
  const double one = 1.0, zero = 0.0;
  KQSVD_CUBLAS_CALL(cublasDgemmStridedBatched(
      ln->blas, CUBLAS_OP_N, CUBLAS_OP_T, width, width, c, &one, A, width, (long long)c * width, A,
      width, (long long)c * width, &zero, P, width, (long long)width * width, batch));
done:
  return st;
}

kqsvd_status_t kqsvd_fold_gram_block(kqsvd_gpu_fold_t *f, lane_t *ln, int64_t item, const char *raw,
                                     const size_t off[3], const kqsvd_dtype_t t[3], int64_t n,
                                     int64_t tag) {
  kqsvd_status_t st = KQSVD_OK;
  const int G = f->s.G, m = f->s.m, hd = f->s.hd, w = f->w;
  const int64_t chunk = kqsvd_fold_gram_chunk(&f->s);
  /* A short block is one chunk of its own length (rounded up to 8 rows). */
  const int64_t c = n < chunk ? (n + 7) / 8 * 8 : chunk;
  const int64_t npad = (n + c - 1) / c * c, nc = npad / c;
  const unsigned long long tg = (unsigned long long)tag;
  double *AK = ln->A, *AV = ln->A + (size_t)w * npad, *AQ = ln->A + (size_t)2 * w * npad;
  double *R = f->R + (size_t)(3 * item) * w * w;
  KQSVD_CHECK(c <= chunk && npad <= f->npad_max, KQSVD_ERR_BUG,
              "GPU fold: %lld rows exceed the Gram panels", (long long)n);
  /* Row i of the G key heads side by side is column i of AK. */
  kqsvd_fold_convert(ln->stream, raw + off[PART_K], (int)t[PART_K], G, n, npad, hd, AK, hd, w, 1,
                     tg, 0, ln->bad);
  kqsvd_fold_convert(ln->stream, raw + off[PART_V], (int)t[PART_V], G, n, npad, hd, AV, hd, w, 1,
                     tg, (int64_t)(G + G * m) * n, ln->bad);
  kqsvd_fold_convert(ln->stream, raw + off[PART_Q], (int)t[PART_Q], G * m, n, npad, hd, AQ,
                     npad * hd, hd, 1, tg, (int64_t)G * n, ln->bad);
  KQSVD_CUDA_CALL(cudaGetLastError());
  if (G == 1) { /* keys, values and queries alike: one call */
    KQSVD_CALL(partial_grams(ln, w, (int)c, ln->A, ln->P, (int)((2 + m) * nc)));
  } else {
    KQSVD_CALL(partial_grams(ln, w, (int)c, ln->A, ln->P, (int)(2 * nc)));
    KQSVD_CALL(
        partial_grams(ln, hd, (int)c, AQ, ln->P + (size_t)2 * nc * w * w, (int)(G * m * nc)));
  }
  {
    const long long total = 2LL * w * w + (long long)G * hd * hd;
    sum_partials<<<(unsigned)((total + 255) / 256), 256, 0, ln->stream>>>(ln->P, (int)nc, w, hd, G,
                                                                          m, R);
    KQSVD_CUDA_CALL(cudaGetLastError());
  }
done:
  return st;
}

/* Uniform bf16 values in [-0.5, 0.5) from a 64-bit LCG (never zeros,
 * which can run faster than real data). */
static void random_bf16(unsigned short *x, size_t count) {
  unsigned long long s = 0x9e3779b97f4a7c15ULL;
  for (size_t i = 0; i < count; i++) {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    const float v = (float)(s >> 40) / 16777216.0f - 0.5f;
    unsigned int bits;
    memcpy(&bits, &v, sizeof bits);
    x[i] = (unsigned short)(bits >> 16);
  }
}

extern "C" kqsvd_status_t kqsvd_gpu_fold_rate(int device, const kqsvd_gpu_shape_t *shape, int64_t n,
                                              int reps, double *on_device, double *from_host) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_gpu_shape_t s = *shape;
  kqsvd_gpu_fold_t *f = NULL;
  unsigned short *host = NULL;
  void *dev = NULL;
  const kqsvd_dtype_t t[3] = {KQSVD_BF16, KQSVD_BF16, KQSVD_BF16};
  int64_t bad_tag = 0, bad_row = 0;
  size_t count = 0;
  double t0 = 0.0;
  s.max_rows = n;
  s.elem_bytes = 2;
  kqsvd_error_clear();
  KQSVD_CHECK(reps >= 1 && s.nitems >= 1, KQSVD_ERR_USAGE, "fold_rate: reps and items >= 1");
  KQSVD_CALL(kqsvd_gpu_fold_init(device, &s, &f));
  count = (size_t)f->heads * (size_t)n * (size_t)s.hd;
  KQSVD_MALLOC(host, count, "benchmark rows");
  random_bf16(host, count);
  KQSVD_CUDA_CALL(cudaMalloc(&dev, count * sizeof *host));
  KQSVD_CUDA_CALL(cudaMemcpy(dev, host, count * sizeof *host, cudaMemcpyHostToDevice));
  /* Warm-up: every item once (library kernels load, workspaces grow). */
  for (int64_t i = 0; i < s.nitems; i++) KQSVD_CALL(kqsvd_gpu_fold_item(f, i, dev, t, n, 1, 0));
  KQSVD_CALL(kqsvd_gpu_fold_sync(f, NULL, &bad_tag, &bad_row));
  t0 = kqsvd_now();
  for (int r = 0; r < reps; r++) KQSVD_CALL(kqsvd_gpu_fold_item(f, r % s.nitems, dev, t, n, 1, 0));
  KQSVD_CALL(kqsvd_gpu_fold_sync(f, NULL, &bad_tag, &bad_row));
  *on_device = (kqsvd_now() - t0) / reps;
  /* Both staging buffers of every lane hold the rows, so that the timed
   * calls copy nothing on the host: as when calibrate reads into them. */
  for (int64_t i = 0; i < 2 * s.nitems; i++) {
    void *p = kqsvd_gpu_fold_stage(f, i % s.nitems);
    KQSVD_CHECK(p, KQSVD_ERR_CUDA, "fold_rate: no staging buffer");
    memcpy(p, host, count * sizeof *host);
    KQSVD_CALL(kqsvd_gpu_fold_item(f, i % s.nitems, p, t, n, 0, 0));
  }
  KQSVD_CALL(kqsvd_gpu_fold_sync(f, NULL, &bad_tag, &bad_row));
  t0 = kqsvd_now();
  for (int r = 0; r < reps; r++) {
    void *p = kqsvd_gpu_fold_stage(f, r % s.nitems);
    KQSVD_CHECK(p, KQSVD_ERR_CUDA, "fold_rate: no staging buffer");
    KQSVD_CALL(kqsvd_gpu_fold_item(f, r % s.nitems, p, t, n, 0, 0));
  }
  KQSVD_CALL(kqsvd_gpu_fold_sync(f, NULL, &bad_tag, &bad_row));
  *from_host = (kqsvd_now() - t0) / reps;
  KQSVD_CHECK(bad_tag < 0, KQSVD_ERR_BUG, "fold_rate: finite rows reported as NaN");
done:
  cudaFree(dev);
  free(host);
  kqsvd_gpu_fold_free(&f);
  return st;
}
