/* Attention over a quantized cache without a float copy of it.
 *
 * A decode step reads every cached token once for its scores and once for
 * the weighted sum of values.  Dequantizing the whole cache to floats
 * first, as a framework would, writes and reads back four bytes per value
 * where the codes hold a few bits: at long context that traffic, not the
 * arithmetic, sets the step's time.  These two calls decode the codes a
 * tile of tokens at a time into a buffer that stays in the core's cache
 * and use it at once, so the cache is read as codes.
 *
 * The codes are those of docs/quantized-cache.md: groups of `group`
 * values quantized min-max to `bits` bits, codes packed eight to `bits`
 * bytes little-endian, each packed row padded with zero codes to a
 * multiple of 8; a value is code * scale + zero, in float32 from the
 * float16 scale and zero.  On the channel axis a group is one column's
 * `group` consecutive tokens (a block); on the token axis, `group`
 * consecutive columns of one token. */
#ifndef KQSVD_PUBLIC_DECODE_H
#define KQSVD_PUBLIC_DECODE_H

#include <stdint.h>

#include "kqsvd/types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kqsvd_axis { KQSVD_AXIS_CHANNEL = 0, KQSVD_AXIS_TOKEN = 1 } kqsvd_axis_t;

/* One side (keys or values) of a quantized cache: `slices` independent
 * (sequence, head) slices of `tokens` tokens of `cols` values each, all
 * arrays dense in the order given, each slice's part laid out for
 * `capacity` tokens.  With pw(n) = ceil(n / 8) * bits:
 *   channel axis (tokens a multiple of group):
 *     codes [slices][tokens / group][cols][pw(group)],
 *     scale and zero [slices][tokens / group][cols];
 *   token axis:
 *     codes [slices][tokens][pw(cols)],
 *     scale and zero [slices][tokens][ceil(cols / group)]. */
typedef struct kqsvd_codes {
  int64_t slices, tokens, cols;
  /* Tokens each slice's arrays are laid out for: >= tokens (a multiple of
   * group on the channel axis), so a cache can grow in place; 0 means
   * `tokens`. */
  int64_t capacity;
  int32_t bits; /* 2, 3, 4 or 8 */
  /* Values per scale (and zero), >= 1: the quantization group; the
   * name is kept for programs built against it. */
  int32_t group;
  kqsvd_axis_t axis;
  const uint8_t *codes;
  const uint16_t *scale, *zero; /* IEEE binary16 bits */
} kqsvd_codes_t;

/* The most runs one call takes. */
#define KQSVD_CODES_MAX_RUNS 16

/* Scores over `nruns` runs of columns side by side (a cache whose columns
 * come in runs of their own bits: all runs with the same slices, tokens,
 * group and axis; C the sum of their columns, x[s][t] a token's C values):
 * scores[s][h][t] += sum_j q[s][h][j] x[s][t][j] for the nq queries of
 * each slice (q [slices][nq][C]) and its tokens t < tokens; scores is
 * [slices][nq][ld], ld >= tokens, so the quantized tokens can be the first
 * of a longer row.  Sums of C products in float32, as a float32 matrix
 * product takes them.
 *
 * Not collective.  `threads` (>= 1) OpenMP threads where the library is
 * built with OpenMP.  Returns KQSVD_ERR_USAGE for an impossible
 * description (bits, group, runs that disagree, a token count not a
 * multiple of the group on the channel axis, NULL arrays, ld < tokens)
 * and KQSVD_ERR_NOMEM when its tile buffers cannot be allocated; nothing
 * is written then. */
KQSVD_API kqsvd_status_t kqsvd_codes_scores(const kqsvd_codes_t *runs, int64_t nruns, int64_t nq,
                                            const float *q, int64_t ld, float *scores, int threads);

/* Weighted sums over runs side by side, as kqsvd_codes_scores: out[s][h][j]
 * += sum_t p[s][h][t] x[s][t][j], with the weights p [slices][nq][ld] (the
 * first `tokens` of each row are read) and out [slices][nq][C].  Each
 * tile's sum in float32, the sum over tiles in float64; the split of the
 * tokens among threads, and with it the last bits of the result, depends
 * on `threads` and `slices` only.  Not collective; threads and errors as
 * kqsvd_codes_scores. */
KQSVD_API kqsvd_status_t kqsvd_codes_weigh(const kqsvd_codes_t *runs, int64_t nruns, int64_t nq,
                                           const float *p, int64_t ld, float *out, int threads);

/* Quantizes `rows` rows of n values (row r's value i at x[r * row_stride
 * + i * stride]) in groups of `values_per_scale` along the row, exactly as
 * docs/quantized-cache.md states it: codes [rows][pw(n)], scale and zero
 * [rows][ceil(n / values_per_scale)] as binary16 bits.  Not collective.  Returns
 * KQSVD_ERR_USAGE for an impossible shape or bits, KQSVD_ERR_DATA when a
 * value is not finite or a group's zero or scale exceeds float16's range;
 * nothing is written then. */
KQSVD_API kqsvd_status_t kqsvd_codes_quantize(const float *x, int64_t rows, int64_t n,
                                              int64_t row_stride, int64_t stride, int bits,
                                              int values_per_scale, uint8_t *codes, uint16_t *scale,
                                              uint16_t *zero);

/* Quantizes rows of runs side by side: row r's run k is the cols[k]
 * values from x[r * row_stride + cols[0] + ... + cols[k - 1]], quantized
 * at bits[k] as kqsvd_codes_quantize does into codes[k], scale[k] and
 * zero[k] (dense, [rows][...]).  One call for a token's runs of columns of
 * their own bits.  Not collective; errors as kqsvd_codes_quantize, every
 * run checked before any is written. */
KQSVD_API kqsvd_status_t kqsvd_codes_quantize_runs(const float *x, int64_t rows, int64_t row_stride,
                                                   int64_t nruns, const int64_t *cols,
                                                   const int32_t *bits, int values_per_scale,
                                                   uint8_t *const *codes, uint16_t *const *scale,
                                                   uint16_t *const *zero);

#ifdef __cplusplus
}
#endif

#endif
