#include "kqsvd_isa.h"
#include "kqsvd_linalg.h"

#include <cblas.h>
#include <float.h>
#include <lapacke.h>
#include <stdlib.h>
#include <string.h>

#ifdef KQSVD_HAVE_OPENBLAS_THREADS
void openblas_set_num_threads(int num_threads);
#endif

/* Inner block of dtpqrt in merges: 16-32 measured fastest for d = 128. */
#define TPQRT_NB 32

struct kqsvd_qr_ws {
  int d, block_rows, nb, ldx;
  double *X;     /* block_rows x ldx, row-major, 64-byte aligned; the pad
                  * columns d..ldx-1 are zero and the kernel keeps them so */
  double *work;  /* kqsvd_tpqr scratch */
  double *T;     /* nb x d block reflector factors (merges) */
  double *mwork; /* nb x d (merges) */
  double *tri;   /* d x d scratch for merges */
};

kqsvd_status_t kqsvd_lapack_check_(const char *routine, int info, const char *file, int line,
                                   const char *func) {
  if (info == 0) return KQSVD_OK;
  if (info == LAPACK_WORK_MEMORY_ERROR || info == LAPACK_TRANSPOSE_MEMORY_ERROR)
    return kqsvd_error_set(KQSVD_ERR_NOMEM, file, line, func, "LAPACK %s: out of memory", routine);
  if (info < 0)
    return kqsvd_error_set(KQSVD_ERR_BUG, file, line, func,
                           "LAPACK %s: argument %d had an illegal value (a kqsvd bug)", routine,
                           -info);
  return kqsvd_error_set(KQSVD_ERR_LAPACK, file, line, func,
                         "LAPACK %s failed to converge (info = %d)", routine, info);
}

double kqsvd_qr_ws_bytes(int d, int block_rows) {
  const double nb = d < TPQRT_NB ? d : TPQRT_NB;
  return ((double)block_rows * kqsvd_tpqr_ld(d) + (double)kqsvd_tpqr_work_size(block_rows, d) +
          2.0 * nb * d + (double)d * d) *
         sizeof(double);
}

kqsvd_status_t kqsvd_qr_ws_init(int d, int block_rows, kqsvd_qr_ws_t **out) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_qr_ws_t *ws = NULL;
  *out = NULL;
  KQSVD_CALL(kqsvd_isa_select(NULL)); /* an invalid KQSVD_ISA fails here */
  KQSVD_CHECK(d >= 1 && block_rows >= 1, KQSVD_ERR_USAGE,
              "QR workspace needs d >= 1 and block rows >= 1 (got %d, %d)", d, block_rows);
  ws = calloc(1, sizeof *ws);
  KQSVD_CHECK(ws, KQSVD_ERR_NOMEM, "cannot allocate QR workspace");
  ws->d = d;
  ws->block_rows = block_rows;
  ws->nb = d < TPQRT_NB ? d : TPQRT_NB;
  ws->ldx = kqsvd_tpqr_ld(d);
  /* Whole cache lines per row (ldx is a multiple of 8 doubles). */
  const size_t xsize = (size_t)block_rows * (size_t)ws->ldx * sizeof(double);
  ws->X = aligned_alloc(64, xsize);
  KQSVD_CHECK(ws->X, KQSVD_ERR_NOMEM, "cannot allocate QR block buffer (%zu bytes)", xsize);
  memset(ws->X, 0, xsize);
  KQSVD_MALLOC(ws->work, kqsvd_tpqr_work_size(block_rows, d), "QR kernel scratch");
  KQSVD_MALLOC(ws->T, (size_t)ws->nb * (size_t)d, "QR reflector factors");
  KQSVD_MALLOC(ws->mwork, (size_t)ws->nb * (size_t)d, "QR work");
  KQSVD_MALLOC(ws->tri, (size_t)d * (size_t)d, "QR merge scratch");
  *out = ws;
  ws = NULL;
done:
  kqsvd_qr_ws_free(&ws);
  return st;
}

void kqsvd_qr_ws_free(kqsvd_qr_ws_t **ws) {
  if (!ws || !*ws) return;
  free((*ws)->X);
  free((*ws)->work);
  free((*ws)->T);
  free((*ws)->mwork);
  free((*ws)->tri);
  free(*ws);
  *ws = NULL;
}

/* Sub-blocks start at the first row of each call, so the order of updates
 * is fixed by the calls and block_rows alone. */
kqsvd_status_t kqsvd_qr_absorb(kqsvd_qr_ws_t *ws, double *R, const void *X, kqsvd_dtype_t type,
                               int64_t n, int64_t *bad_row) {
  const int d = ws->d;
  const size_t esz = kqsvd_dtype_size(type);
  *bad_row = -1;
  for (int64_t r0 = 0; r0 < n; r0 += ws->block_rows) {
    const int m = (int)(n - r0 < ws->block_rows ? n - r0 : ws->block_rows);
    const char *src = (const char *)X + (size_t)r0 * (size_t)d * esz;
    const int64_t bad = kqsvd_tpqr_load(type, src, m, d, ws->X, ws->ldx);
    if (bad >= 0) {
      *bad_row = r0 + bad;
      break;
    }
    kqsvd_tpqr(m, d, R, d, ws->X, ws->ldx, ws->work);
  }
  return KQSVD_OK;
}

kqsvd_status_t kqsvd_qr_merge(kqsvd_qr_ws_t *ws, double *R_top, const double *R_bot) {
  kqsvd_status_t st = KQSVD_OK;
  const int d = ws->d;
  if (ws->block_rows >= d) {
    /* The streaming kernel ignores R_bot's zeros (2 d^3 flops against
     * dtpqrt's 2/3 d^3), yet runs faster than dtpqrt's level-2 panels; the
     * merges are the TSQR tree's work at scale (docs/benchmarks.md). */
    for (int i = 0; i < d; i++)
      for (int j = 0; j < d; j++)
        ws->X[(size_t)i * ws->ldx + j] = j >= i ? R_bot[(size_t)j * d + i] : 0.0;
    kqsvd_tpqr(d, d, R_top, d, ws->X, ws->ldx, ws->work);
    goto done;
  }
  memcpy(ws->tri, R_bot, (size_t)d * (size_t)d * sizeof(double));
  /* l = d: the bottom block is itself triangular, which dtpqrt exploits. */
  KQSVD_LAPACK("dtpqrt", LAPACKE_dtpqrt_work(LAPACK_COL_MAJOR, d, d, d, ws->nb, R_top, d, ws->tri,
                                             d, ws->T, ws->nb, ws->mwork));
done:
  return st;
}

size_t kqsvd_tri_size(int d) { return (size_t)d * (size_t)(d + 1) / 2; }

void kqsvd_tri_pack(int d, const double *R, double *P) {
  for (int j = 0; j < d; j++)
    for (int i = 0; i <= j; i++) *P++ = R[(size_t)j * d + i];
}

void kqsvd_tri_unpack(int d, const double *P, double *R) {
  for (int j = 0; j < d; j++)
    for (int i = 0; i < d; i++) R[(size_t)j * d + i] = i <= j ? *P++ : 0.0;
}

void kqsvd_r_fix_signs(int d, double *R) {
  for (int i = 0; i < d; i++)
    if (R[(size_t)i * d + i] < 0)
      for (int j = i; j < d; j++) R[(size_t)j * d + i] = -R[(size_t)j * d + i];
}

kqsvd_status_t kqsvd_svd(int m, int n, double *A, int lda, double *s, double *U, int ldu,
                         double *Vt, int ldvt) {
  kqsvd_status_t st = KQSVD_OK;
  const int k = m < n ? m : n;
  const int want = U || Vt;
  double *copy = NULL, *u = U, *vt = Vt, *superb = NULL;
  int lu = ldu, lvt = ldvt;
  if (want && !U) {
    KQSVD_MALLOC(u, (size_t)m * (size_t)k, "SVD scratch U");
    lu = m;
  }
  if (want && !Vt) {
    KQSVD_MALLOC(vt, (size_t)k * (size_t)n, "SVD scratch Vt");
    lvt = k;
  }
  /* dgesdd can fail to converge where dgesvd does not; keep A to retry. */
  KQSVD_MALLOC(copy, (size_t)lda * (size_t)n, "SVD input copy");
  memcpy(copy, A, (size_t)lda * (size_t)n * sizeof(double));
  lapack_int info = LAPACKE_dgesdd(LAPACK_COL_MAJOR, want ? 'S' : 'N', m, n, A, lda, s, u,
                                   want ? lu : 1, vt, want ? lvt : 1);
  if (info > 0) {
    memcpy(A, copy, (size_t)lda * (size_t)n * sizeof(double));
    KQSVD_MALLOC(superb, (size_t)(k > 1 ? k : 1), "dgesvd work");
    KQSVD_LAPACK("dgesvd",
                 LAPACKE_dgesvd(LAPACK_COL_MAJOR, want ? 'S' : 'N', want ? 'S' : 'N', m, n, A, lda,
                                s, u, want ? lu : 1, vt, want ? lvt : 1, superb));
  } else {
    KQSVD_LAPACK("dgesdd", info);
  }
done:
  if (u != U) free(u);
  if (vt != Vt) free(vt);
  free(copy);
  free(superb);
  return st;
}

void kqsvd_gemm(char ta, char tb, int m, int n, int k, double alpha, const double *A, int lda,
                const double *B, int ldb, double beta, double *C, int ldc) {
  cblas_dgemm(CblasColMajor, ta == 'T' ? CblasTrans : CblasNoTrans,
              tb == 'T' ? CblasTrans : CblasNoTrans, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc);
}

void kqsvd_blas_set_threads(int n) {
#ifdef KQSVD_HAVE_OPENBLAS_THREADS
  openblas_set_num_threads(n > 0 ? n : 1);
#else
  (void)n;
#endif
}
