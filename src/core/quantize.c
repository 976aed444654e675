/* kqsvd_codes_quantize (include/kqsvd/decode.h): the new tokens of a
 * decode step quantized as docs/quantized-cache.md states it, to the last
 * bit of the Python reference (python/kqsvd/attention/quant.py), in one
 * call where the reference takes some twenty tensor operations per
 * token, each costing more than the arithmetic. */
#include <math.h>
#include <string.h>

#include "kqsvd/decode.h"
#include "kqsvd_convert.h"
#include "kqsvd_error.h"

/* A values_per_scale's float16 zero and scale (bits), from its float32 min and max;
 * false when either is not finite in float16. */
static bool group_scale(float lo, float hi, int bits, uint16_t *zero, uint16_t *scale) {
  const float top = (float)((1u << bits) - 1u);
  *zero = kqsvd_f64_to_f16((double)lo);
  *scale = kqsvd_f64_to_f16((double)((hi - lo) / top));
  return (*zero & 0x7c00u) != 0x7c00u && (*scale & 0x7c00u) != 0x7c00u;
}

static void group_range(const float *x, int64_t i0, int64_t i1, int64_t stride, float *lo,
                        float *hi) {
  *lo = *hi = x[i0 * stride];
  for (int64_t i = i0 + 1; i < i1; i++) {
    const float v = x[i * stride];
    /* NaN never compares: it makes the range NaN, refused as not finite */
    if (v != v) *lo = *hi = v;
    if (*lo == *lo) {
      *lo = v < *lo ? v : *lo;
      *hi = v > *hi ? v : *hi;
    }
  }
}

/* Every values_per_scale of rows x rows of n values is checked (shape, bits,
 * finite float16 zero and scale) before anything is written. */
static kqsvd_status_t check_rows(const char *fn, const float *x, int64_t rows, int64_t n,
                                 int64_t row_stride, int64_t stride, int bits, int values_per_scale,
                                 const void *codes, const void *scale, const void *zero) {
  kqsvd_status_t st = KQSVD_OK;
  KQSVD_CHECK(bits == 2 || bits == 3 || bits == 4 || bits == 8, KQSVD_ERR_USAGE,
              "%s: bits %d is not 2, 3, 4 or 8", fn, bits);
  KQSVD_CHECK(values_per_scale >= 1 && rows >= 0 && n >= 1, KQSVD_ERR_USAGE,
              "%s: %lld rows of %lld values in groups of %d is not a shape", fn, (long long)rows,
              (long long)n, values_per_scale);
  KQSVD_CHECK(rows == 0 || (x && codes && scale && zero), KQSVD_ERR_USAGE,
              "%s: the values, codes, scales and zeros must not be NULL", fn);
  const int64_t groups = (n + values_per_scale - 1) / values_per_scale;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t e = 0; e < groups; e++) {
      float lo, hi;
      uint16_t z, s;
      const int64_t i1 = (e + 1) * values_per_scale < n ? (e + 1) * values_per_scale : n;
      group_range(x + r * row_stride, e * values_per_scale, i1, stride, &lo, &hi);
      KQSVD_CHECK(group_scale(lo, hi, bits, &z, &s), KQSVD_ERR_DATA,
                  "a cached value is not finite or beyond float16's range (65504): it cannot "
                  "be quantized");
    }
done:
  return st;
}

/* The codes, scales and zeros of rows check_rows accepted. */
static void write_rows(const float *x, int64_t rows, int64_t n, int64_t row_stride, int64_t stride,
                       int bits, int values_per_scale, uint8_t *codes, uint16_t *scale,
                       uint16_t *zero) {
  const int64_t groups = (n + values_per_scale - 1) / values_per_scale, pw = (n + 7) / 8 * bits;
  const unsigned top = (1u << bits) - 1u;
  for (int64_t r = 0; r < rows; r++) {
    const float *row = x + r * row_stride;
    uint8_t *out = codes + r * pw;
    memset(out, 0, (size_t)pw);
    for (int64_t e = 0; e < groups; e++) {
      float lo, hi;
      const int64_t i1 = (e + 1) * values_per_scale < n ? (e + 1) * values_per_scale : n;
      group_range(row, e * values_per_scale, i1, stride, &lo, &hi);
      group_scale(lo, hi, bits, &zero[r * groups + e], &scale[r * groups + e]);
      const float s = (float)kqsvd_f16_to_f64(scale[r * groups + e]);
      const float z = (float)kqsvd_f16_to_f64(zero[r * groups + e]);
      for (int64_t i = e * values_per_scale; i < i1; i++) {
        /* round half to even (the default rounding mode), as torch.round */
        const float q = s > 0.0f ? nearbyintf((row[i * stride] - z) / s) : 0.0f;
        const unsigned c = q <= 0.0f ? 0u : q >= (float)top ? top : (unsigned)q;
        const int64_t bit = (int64_t)bits * i;
        /* bit offsets within a byte values_per_scale of 8 codes never straddle more
         * than two bytes for bits <= 8 */
        out[bit / 8] |= (uint8_t)(c << (bit % 8));
        if (bit % 8 + bits > 8) out[bit / 8 + 1] |= (uint8_t)(c >> (8 - bit % 8));
      }
    }
  }
}

kqsvd_status_t kqsvd_codes_quantize(const float *x, int64_t rows, int64_t n, int64_t row_stride,
                                    int64_t stride, int bits, int values_per_scale, uint8_t *codes,
                                    uint16_t *scale, uint16_t *zero) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_error_clear();
  KQSVD_CALL(check_rows("kqsvd_codes_quantize", x, rows, n, row_stride, stride, bits,
                        values_per_scale, codes, scale, zero));
  write_rows(x, rows, n, row_stride, stride, bits, values_per_scale, codes, scale, zero);
done:
  return kqsvd_api_return(st);
}

kqsvd_status_t kqsvd_codes_quantize_runs(const float *x, int64_t rows, int64_t row_stride,
                                         int64_t nruns, const int64_t *cols, const int32_t *bits,
                                         int values_per_scale, uint8_t *const *codes,
                                         uint16_t *const *scale, uint16_t *const *zero) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_error_clear();
  KQSVD_CHECK(nruns >= 1 && cols && bits && codes && scale && zero, KQSVD_ERR_USAGE,
              "kqsvd_codes_quantize_runs: %lld runs, or a NULL array", (long long)nruns);
  for (int64_t k = 0, off = 0; k < nruns; off += cols[k], k++)
    KQSVD_CALL(check_rows("kqsvd_codes_quantize_runs", x + off, rows, cols[k], row_stride, 1,
                          bits[k], values_per_scale, codes[k], scale[k], zero[k]));
  for (int64_t k = 0, off = 0; k < nruns; off += cols[k], k++)
    write_rows(x + off, rows, cols[k], row_stride, 1, bits[k], values_per_scale, codes[k], scale[k],
               zero[k]);
done:
  return kqsvd_api_return(st);
}
