/* Element types of the data contract and exact conversions to float64.
 * Nothing here is collective; all functions are thread-safe. */
#ifndef KQSVD_CONVERT_H
#define KQSVD_CONVERT_H

#include <stddef.h>
#include <stdint.h>

#include "kqsvd_error.h"

/* Parses "f16", "bf16", "f32" or "f64"; KQSVD_ERR_USAGE otherwise. */
kqsvd_status_t kqsvd_dtype_parse(const char *s, kqsvd_dtype_t *t);

/* Exact decodes, and encodes rounding to nearest, ties to even, directly from
 * float64 (no double rounding through float32). */
double kqsvd_f16_to_f64(uint16_t h);
double kqsvd_bf16_to_f64(uint16_t b);
uint16_t kqsvd_f64_to_f16(double v);
uint16_t kqsvd_f64_to_bf16(double v);

/* Converts `rows` row-major rows of `d` elements to float64, transposed into
 * column-major `dst` with leading dimension `ld` (dst[j*ld+i] = src[i*d+j]).
 * Returns -1, or the first row holding a NaN or Inf (dst is then partial). */
int64_t kqsvd_convert_transpose(kqsvd_dtype_t type, const void *src, int64_t rows, int d,
                                double *dst, int64_t ld);

/* Converts n elements to float64; returns -1 or the first non-finite index. */
int64_t kqsvd_convert_to_f64(kqsvd_dtype_t type, const void *src, int64_t n, double *dst);

/* Encodes n float64 values as `type` (round to nearest even). */
void kqsvd_convert_from_f64(kqsvd_dtype_t type, const double *src, int64_t n, void *dst);

#endif
