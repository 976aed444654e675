/* The Gram alternative to the streaming QR (`calibrate --qr gram`): one pass
 * of float64 SYRK updates G += X^T X, then an R factor with R^T R = G.  It
 * does half the flops of Householder QR, but squares the condition number:
 * singular values below about sqrt(eps) * sigma_max are lost.  Kept as a
 * benchmark peer and for well-conditioned data; TSQR is the default.
 * Nothing here is collective. */
#ifndef KQSVD_GRAM_H
#define KQSVD_GRAM_H

#include <stdint.h>

#include "kqsvd_convert.h"
#include "kqsvd_error.h"

/* G <- G + X^T X for X = n rows of d elements of `type` (row-major), read in
 * sub-blocks of `block_rows` rows converted into `buf` (block_rows x d
 * doubles).  Only the upper triangle of the column-major d x d G is used.
 * A NaN or Inf stops before its sub-block and sets *bad_row (else -1)
 * without failing, like kqsvd_qr_absorb. */
void kqsvd_gram_absorb(int d, double *G, const void *X, kqsvd_dtype_t type, int64_t n, double *buf,
                       int block_rows, int64_t *bad_row);

/* In place: the upper triangle of G (d x d, column-major) becomes an upper
 * triangular R with R^T R = G and a non-negative diagonal; the strict lower
 * part is zeroed.  Cholesky when G is numerically positive definite;
 * otherwise (rank-deficient or zero data) G's eigenvalues are clipped at
 * zero and R is the QR factor of diag(sqrt(lambda)) V^T.
 * Errors: KQSVD_ERR_LAPACK, _NOMEM, _BUG. */
kqsvd_status_t kqsvd_gram_to_r(int d, double *G);

#endif
