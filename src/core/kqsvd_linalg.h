/* Dense kernels on d x d factors: streaming Householder QR, triangle merges,
 * SVD, and the LAPACK status checker.  Matrices are column-major unless a
 * comment says otherwise.  Nothing here is collective. */
#ifndef KQSVD_LINALG_H
#define KQSVD_LINALG_H

#include <stddef.h>
#include <stdint.h>

#include "kqsvd_convert.h"
#include "kqsvd_error.h"

/* LAPACK info check: < 0 is a kqsvd bug, > 0 a numerical failure. */
kqsvd_status_t kqsvd_lapack_check_(const char *routine, int info, const char *file, int line,
                                   const char *func);
#define KQSVD_LAPACK(routine, call) \
  KQSVD_CALL(kqsvd_lapack_check_((routine), (int)(call), __FILE__, __LINE__, __func__))

/* Rows folded per Householder update: large enough to amortize the d x d
 * work per block, small enough that a block and R stay in L2.  512 measured
 * 1-3% faster at d = 128 (bench/qr_kernel.c), within run-to-run noise, and
 * 1024 slower; 256 stays, as a change would invalidate every checkpoint.
 * Results depend on it only through round-off. */
#define KQSVD_QR_BLOCK_DEFAULT 256

typedef struct kqsvd_qr_ws kqsvd_qr_ws_t;

/* Workspace for folding rows of width d into R factors, `block_rows` rows at
 * a time.  Errors: KQSVD_ERR_USAGE for d or block_rows < 1, KQSVD_ERR_NOMEM. */
kqsvd_status_t kqsvd_qr_ws_init(int d, int block_rows, kqsvd_qr_ws_t **ws);
void kqsvd_qr_ws_free(kqsvd_qr_ws_t **ws);
/* Bytes kqsvd_qr_ws_init allocates for these sizes (memory planning). */
double kqsvd_qr_ws_bytes(int d, int block_rows);

/* R <- the R factor of [R; X], for X = n rows of d elements of `type`
 * (row-major, as stored in the caches).  R is d x d upper triangular with
 * ld = d; its strict lower part stays zero.  Sub-blocks of block_rows rows,
 * counted from the first row of each call, are converted to float64 and
 * folded by kqsvd_tpqr, so R depends only on the rows, the calls and
 * block_rows (bit for bit on a given machine).  When a NaN or Inf is met,
 * stops before that sub-block and sets *bad_row to the offending row (else
 * -1) without failing: the caller names the file and dataset.  Currently
 * cannot fail; callers should still check. */
kqsvd_status_t kqsvd_qr_absorb(kqsvd_qr_ws_t *ws, double *R, const void *X, kqsvd_dtype_t type,
                               int64_t n, int64_t *bad_row);

/* The kernel of kqsvd_qr_absorb (tpqr.c): R <- the R factor of [R; B] by
 * Householder reflections, for B m x n (m >= 1) row-major with row stride
 * ldb, a multiple of 8 >= n whose pad columns n..ldb-1 are zero (they stay
 * zero; kqsvd_tpqr_ld(n) also avoids cache-set conflicts).  B is overwritten
 * by the reflectors, R (ldr) is upper triangular and only its upper part is
 * touched; work holds kqsvd_tpqr_work_size(m, n) doubles.  The order of
 * operations depends only on m, n and the instruction set.  Cannot fail. */
int kqsvd_tpqr_ld(int n);
/* Loads m rows of d elements of `type` into such a B as float64; returns -1
 * or the first row holding a NaN or Inf (B is then partial). */
int64_t kqsvd_tpqr_load(kqsvd_dtype_t type, const void *src, int m, int d, double *B, int ldb);
size_t kqsvd_tpqr_work_size(int m, int n);
void kqsvd_tpqr(int m, int n, double *R, int ldr, double *B, int ldb, double *work);

/* R_top <- the R factor of [R_top; R_bot], both d x d upper triangular
 * (with kqsvd_tpqr when the workspace has at least d block rows, else
 * LAPACK dtpqrt).  Errors: KQSVD_ERR_LAPACK, _BUG. */
kqsvd_status_t kqsvd_qr_merge(kqsvd_qr_ws_t *ws, double *R_top, const double *R_bot);

/* Upper triangles packed column by column (LAPACK 'U' packed order). */
size_t kqsvd_tri_size(int d);
void kqsvd_tri_pack(int d, const double *R, double *P);
void kqsvd_tri_unpack(int d, const double *P, double *R);
/* Flips rows so the diagonal is non-negative (R is unique up to these signs). */
void kqsvd_r_fix_signs(int d, double *R);

/* Thin SVD of the m x n matrix A (destroyed).  s gets min(m,n) values in
 * descending order; U (m x k, ldu) and Vt (k x n, ldvt) may be NULL when not
 * wanted.  Uses dgesdd and falls back to dgesvd if it does not converge. */
kqsvd_status_t kqsvd_svd(int m, int n, double *A, int lda, double *s, double *U, int ldu,
                         double *Vt, int ldvt);

/* C (m x n) = op(A) op(B) with ta/tb 'N' or 'T' (thin dgemm wrapper). */
void kqsvd_gemm(char ta, char tb, int m, int n, int k, double alpha, const double *A, int lda,
                const double *B, int ldb, double beta, double *C, int ldc);

/* Restricts BLAS threads (OpenBLAS) so MPI ranks do not oversubscribe. */
void kqsvd_blas_set_threads(int n);

#endif
