/* kqsvd_codes_scores and kqsvd_codes_weigh (include/kqsvd/decode.h): a
 * decode step's two passes over a quantized cache, reading it as codes.
 *
 * Work is cut in tiles of tokens (a channel block, or 32 tokens on the
 * token axis).  Each tile's codes are decoded into a buffer of the thread
 * (a few tens of KiB, so it stays in the core's cache) and used at once by
 * every query of the slice; the inner loops run along a contiguous axis
 * without a reduction (tokens for scores, columns for sums), which the
 * compiler vectorizes without reassociating sums. */
#include "kqsvd/decode.h"

#include <stdlib.h>
#include <string.h>
#include <threads.h>

#ifdef _OPENMP
#include <omp.h>
#define THREAD_ID() omp_get_thread_num()
#define PARALLEL_FOR _Pragma("omp parallel for num_threads(threads) schedule(static)")
#else
#define THREAD_ID() 0
#define PARALLEL_FOR
#endif

#include "kqsvd_convert.h"
#include "kqsvd_error.h"
#include "kqsvd_isa.h"

/* Tokens per tile on the token axis (the channel axis tiles by block). */
#define TOKEN_TILE 32
#define TILE 32 /* the tile the unrolled kernels serve */

#if defined(__GNUC__) && !defined(__clang__)
#define FMA_CONTRACT __attribute__((optimize("fp-contract=fast")))
#else
#define FMA_CONTRACT
#endif

/* Bytes of a packed row of n codes. */
static int64_t packed_width(int64_t n, int bits) { return (n + 7) / 8 * bits; }

typedef struct tiling {
  const kqsvd_codes_t *runs;
  int64_t nruns;
  int64_t cols;  /* all runs' columns */
  int64_t tile;  /* tokens per tile */
  int64_t tiles; /* tiles per slice */
  int64_t width; /* floats of the unpacking buffer: max(tile, a run's cols) rounded up to 8 */
  int64_t ldx;   /* a decoded token's stride: cols rounded up to TILE, the padding zero */
  /* per run: its first column, the bytes of one packed row (a channel's
   * block, or a token), its scales per token, its tokens per slice */
  int64_t off[KQSVD_CODES_MAX_RUNS], row[KQSVD_CODES_MAX_RUNS], groups[KQSVD_CODES_MAX_RUNS],
      held[KQSVD_CODES_MAX_RUNS];
} tiling_t;

/* Every byte's codes as floats (2 and 4 bits), and every 12-bit half of 3
 * packed bytes' 4 codes (3 bits): a lookup and a 16-byte copy per byte
 * replace shifts, masks and int-to-float conversions per code, which cost
 * more than the arithmetic the codes feed. */
static float g_codes2[256][4], g_codes4[256][2], g_codes3[4096][4];
static once_flag g_tables_once = ONCE_FLAG_INIT;

static void make_tables(void) {
  for (unsigned v = 0; v < 256; v++) {
    for (unsigned k = 0; k < 4; k++) g_codes2[v][k] = (float)((v >> (2 * k)) & 3u);
    for (unsigned k = 0; k < 2; k++) g_codes4[v][k] = (float)((v >> (4 * k)) & 15u);
  }
  for (unsigned v = 0; v < 4096; v++)
    for (unsigned k = 0; k < 4; k++) g_codes3[v][k] = (float)((v >> (3 * k)) & 7u);
}

/* Decodes the codes of a packed row of n values (n rounded up to 8: rows
 * are padded) into out. */
static inline void unpack(const uint8_t *row, int bits, int64_t n, float *out) {
  const int64_t words = (n + 7) / 8;
  switch (bits) {
  case 8:
    for (int64_t i = 0; i < n; i++) out[i] = (float)row[i];
    break;
  case 4:
    for (int64_t i = 0; i < 4 * words; i++) memcpy(out + 2 * i, g_codes4[row[i]], 8);
    break;
  case 3:
    for (int64_t w = 0; w < words; w++) {
      const uint8_t *r = row + 3 * w;
      const unsigned v = (unsigned)r[0] | (unsigned)r[1] << 8 | (unsigned)r[2] << 16;
      memcpy(out + 8 * w, g_codes3[v & 4095u], 16);
      memcpy(out + 8 * w + 4, g_codes3[v >> 12], 16);
    }
    break;
  case 2:
    for (int64_t i = 0; i < 2 * words; i++) memcpy(out + 4 * i, g_codes2[row[i]], 16);
    break;
  default: break;
  }
}

#define INLINE static inline __attribute__((always_inline))

/* Instruction sets of the kernels' clones, a constant in each. */
enum { ISA_BASE, ISA_AVX2, ISA_AVX512 };

#ifdef KQSVD_ISA_X86_CLONES
#include <immintrin.h>

/* 2, 4 and 8 bits unpacked 16 at a time in AVX-512 registers: each byte
 * copied to the lanes of its codes (a byte shuffle), widened to 32 bits,
 * shifted by the lane's place in its byte, masked and converted.  The
 * byte tables took half of a tile's time in the scores (0.38 ms of a
 * layer's at 8k tokens, 0.28 this way); on AVX2, 8 lanes at a time, the
 * tables were as fast and stay.  3 bits, whose codes cross bytes, keep
 * them too, as does a last word of 8 codes. */
#define SPREAD2 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3
#define SPREAD4 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7
#define SPREAD8 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15

__attribute__((target("avx512f,avx512bw,avx512vl"))) static inline void
unpack_avx512(const uint8_t *row, int bits, int64_t n, float *out) {
  const int64_t n8 = (n + 7) / 8 * 8;
  int64_t i = 0;
  if (bits == 2 || bits == 4 || bits == 8) {
    const __m128i spread = bits == 2   ? _mm_setr_epi8(SPREAD2)
                           : bits == 4 ? _mm_setr_epi8(SPREAD4)
                                       : _mm_setr_epi8(SPREAD8);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i shift = _mm512_mullo_epi32(
        _mm512_and_si512(lane, _mm512_set1_epi32(8 / bits - 1)), _mm512_set1_epi32(bits));
    const __m512i mask = _mm512_set1_epi32((1 << bits) - 1);
    for (; i + 16 <= n8; i += 16) {
      __m128i b;
      if (bits == 8) {
        b = _mm_loadu_si128((const __m128i *)(row + i));
      } else if (bits == 4) {
        int64_t w;
        memcpy(&w, row + i / 2, 8);
        b = _mm_shuffle_epi8(_mm_cvtsi64_si128(w), spread);
      } else {
        int32_t w;
        memcpy(&w, row + i / 4, 4);
        b = _mm_shuffle_epi8(_mm_cvtsi32_si128(w), spread);
      }
      const __m512i v = _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(b), shift), mask);
      _mm512_storeu_ps(out + i, _mm512_cvtepi32_ps(v));
    }
  }
  if (i < n) unpack(row + i * bits / 8, bits, n - i, out + i);
}

#endif

/* unpack() in the clone's instruction set. */
INLINE void unpack_in(int isa, const uint8_t *row, int bits, int64_t n, float *out) {
#ifdef KQSVD_ISA_X86_CLONES
  if (isa == ISA_AVX512) {
    unpack_avx512(row, bits, n, out);
    return;
  }
#endif
  (void)isa;
  unpack(row, bits, n, out);
}

/* A float16 scale or zero, widened exactly by moving its bits (a call
 * through ldexp per scale cost more than decoding the codes it scales). */
INLINE float half(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, em = h & 0x7fffu;
  uint32_t bits;
  float out;
  if (em >= 0x7c00u) { /* Inf, NaN */
    bits = sign | 0x7f800000u | (em & 0x3ffu) << 13;
  } else if (em >= 0x0400u) { /* normal: the exponent rebiased from 15 to 127 */
    bits = sign | (em + 0x1c000u) << 13;
  } else { /* zero and subnormals: m * 2^-24, exact in float */
    out = (float)em * 0x1p-24f;
    memcpy(&bits, &out, sizeof bits);
    bits |= sign;
  }
  memcpy(&out, &bits, sizeof out);
  return out;
}

/* Tile k of slice s decoded into x, as [tokens][cols] (transposed = 0) or
 * [cols][tokens]; tmp holds one unpacked row.  Returns the tile's tokens. */
INLINE int64_t decode_tile(const tiling_t *g, int64_t s, int64_t k, int transposed, float *x,
                           float *tmp, const int isa) {
  const kqsvd_codes_t *c0 = g->runs;
  if (c0->axis == KQSVD_AXIS_CHANNEL) {
    const int64_t tt = g->tile;
    for (int64_t r = 0; r < g->nruns; r++) {
      const kqsvd_codes_t *c = g->runs + r;
      const int64_t base = (s * (g->held[r] / tt) + k) * c->cols, off = g->off[r];
      for (int64_t j = 0; j < c->cols; j++) {
        unpack_in(isa, c->codes + (base + j) * g->row[r], c->bits, tt, tmp);
        const float sc = half(c->scale[base + j]), z = half(c->zero[base + j]);
        if (transposed) {
          for (int64_t t = 0; t < tt; t++) x[(off + j) * tt + t] = tmp[t] * sc + z;
        } else {
          for (int64_t t = 0; t < tt; t++) x[t * g->ldx + off + j] = tmp[t] * sc + z;
        }
      }
    }
    return tt;
  }
  const int64_t t0 = k * g->tile, gr = c0->group;
  const int64_t tt = c0->tokens - t0 < g->tile ? c0->tokens - t0 : g->tile;
  if (transposed && tt < g->tile) /* a short last tile: the kernels read whole ones */
    for (int64_t j = 0; j < g->cols; j++)
      for (int64_t t = tt; t < g->tile; t++) x[j * g->tile + t] = 0.0f;
  for (int64_t r = 0; r < g->nruns; r++) {
    const kqsvd_codes_t *c = g->runs + r;
    const int64_t cols = c->cols, off = g->off[r];
    for (int64_t t = 0; t < tt; t++) {
      const int64_t tok = s * g->held[r] + t0 + t;
      unpack_in(isa, c->codes + tok * g->row[r], c->bits, cols, tmp);
      const uint16_t *scales = c->scale + tok * g->groups[r], *zeros = c->zero + tok * g->groups[r];
      for (int64_t j0 = 0, e = 0; j0 < cols; j0 += gr, e++) {
        const int64_t j1 = j0 + gr < cols ? j0 + gr : cols;
        const float sc = half(scales[e]), z = half(zeros[e]);
        if (transposed) {
          for (int64_t j = j0; j < j1; j++) x[(off + j) * g->tile + t] = tmp[j] * sc + z;
        } else {
          for (int64_t j = j0; j < j1; j++) x[t * g->ldx + off + j] = tmp[j] * sc + z;
        }
      }
    }
  }
  return tt;
}

/* The register blocks of the tile kernels: hb queries by TILE tokens (or
 * columns) of accumulators, fixed sizes the compiler unrolls: 3 x 32 in 12
 * of AVX2's 16 registers, 9 x 32 in 18 of AVX-512's 32 (one pass over a
 * tile for a group of 9 query heads).  nq is padded to a multiple of hb
 * with zero queries. */
#define HB_MAX 9

/* One tile's scores: s[h][t] += sum_j q[h][j] xT[j][t] (q padded to a
 * multiple of hb rows), the sums running along tokens in column order. */
INLINE void scores_plain(const tiling_t *g, int64_t s, int64_t k, const float *q, int64_t nq,
                         float *scores, int64_t ld, float *x, const int hb, const int isa) {
  const int64_t cols = g->cols, tile = g->tile, nqp = (nq + hb - 1) / hb * hb;
  const int64_t tt = decode_tile(g, s, k, 1, x, x + tile * g->ldx, isa);
  q += s * nqp * cols;
  scores += s * nq * ld + k * tile;
  if (tile == TILE) {
    for (int64_t h0 = 0; h0 < nqp; h0 += hb) {
      float a[HB_MAX][TILE] = {{0.0f}};
      for (int64_t j = 0; j < cols; j++) {
        const float *xj = x + j * TILE;
        for (int hh = 0; hh < hb; hh++) {
          const float qj = q[(h0 + hh) * cols + j];
          for (int t = 0; t < TILE; t++) a[hh][t] += qj * xj[t];
        }
      }
      for (int64_t hh = 0; hh < hb && h0 + hh < nq; hh++)
        for (int64_t t = 0; t < tt; t++) scores[(h0 + hh) * ld + t] += a[hh][t];
    }
    return;
  }
  float *acc = x + tile * g->ldx + g->width;
  for (int64_t h = 0; h < nq; h++) {
    for (int64_t t = 0; t < tt; t++) acc[t] = 0.0f;
    for (int64_t j = 0; j < cols; j++) {
      const float qj = q[h * cols + j];
      const float *xj = x + j * tile;
      for (int64_t t = 0; t < tt; t++) acc[t] += qj * xj[t];
    }
    for (int64_t t = 0; t < tt; t++) scores[h * ld + t] += acc[t];
  }
}

/* Tiles added up in float32 before their sum joins the float64 one. */
#define FLUSH_TILES 8

/* Tiles k0..k1 of slice s weighed: sum_t p[h][t] x[t][j] in float32 over
 * up to FLUSH_TILES tiles (acc), then added to the float64 sums.  w holds a
 * tile's weights, padded with zero rows and tokens. */
INLINE void weigh_plain(const tiling_t *g, int64_t s, int64_t k0, int64_t k1, const float *p,
                        int64_t nq, int64_t ld, float *x, double *sum, const int hb,
                        const int isa) {
  const int64_t cols = g->cols, tile = g->tile, ldx = g->ldx;
  const int64_t nqp = (nq + hb - 1) / hb * hb;
  float *w = x + tile * ldx + g->width, *acc = w + nqp * tile;
  p += s * nq * ld;
  memset(acc, 0, (size_t)(nqp * ldx) * sizeof *acc);
  for (int64_t k = k0; k < k1; k++) {
    const int64_t tt = decode_tile(g, s, k, 0, x, x + tile * ldx, isa);
    for (int64_t h = 0; h < nqp; h++)
      for (int64_t t = 0; t < tile; t++)
        w[h * tile + t] = h < nq && t < tt ? p[h * ld + k * tile + t] : 0.0f;
    if (tile == TILE) {
      for (int64_t j0 = 0; j0 < cols; j0 += TILE)
        for (int64_t h0 = 0; h0 < nqp; h0 += hb) {
          float a[HB_MAX][TILE] = {{0.0f}};
          for (int64_t t = 0; t < tt; t++) {
            const float *xt = x + t * ldx + j0;
            for (int hh = 0; hh < hb; hh++) {
              const float wt = w[(h0 + hh) * TILE + t];
              for (int j = 0; j < TILE; j++) a[hh][j] += wt * xt[j];
            }
          }
          for (int hh = 0; hh < hb; hh++)
            for (int j = 0; j < TILE; j++) acc[(h0 + hh) * ldx + j0 + j] += a[hh][j];
        }
    } else {
      for (int64_t h = 0; h < nq; h++)
        for (int64_t t = 0; t < tt; t++) {
          const float wt = w[h * tile + t];
          for (int64_t j = 0; j < cols; j++) acc[h * ldx + j] += wt * x[t * ldx + j];
        }
    }
    if ((k - k0) % FLUSH_TILES == FLUSH_TILES - 1 || k == k1 - 1) {
      for (int64_t h = 0; h < nq; h++)
        for (int64_t j = 0; j < cols; j++) sum[h * cols + j] += (double)acc[h * ldx + j];
      memset(acc, 0, (size_t)(nqp * ldx) * sizeof *acc);
    }
  }
}

#define SCORES_PARAMS                                                                              \
  (const tiling_t *g, int64_t s, int64_t k, const float *q, int64_t nq, float *scores, int64_t ld, \
   float *x)
#define WEIGH_PARAMS                                                                             \
  (const tiling_t *g, int64_t s, int64_t k0, int64_t k1, const float *p, int64_t nq, int64_t ld, \
   float *x, double *sum)

typedef void(scores_fn) SCORES_PARAMS;
typedef void(weigh_fn) WEIGH_PARAMS;

#define KERNELS(attrs, suffix, hb, isa)                    \
  attrs static void scores_##suffix SCORES_PARAMS {        \
    scores_plain(g, s, k, q, nq, scores, ld, x, hb, isa);  \
  }                                                        \
  attrs static void weigh_##suffix WEIGH_PARAMS {          \
    weigh_plain(g, s, k0, k1, p, nq, ld, x, sum, hb, isa); \
  }
KERNELS(FMA_CONTRACT, base, 3, ISA_BASE)
#ifdef KQSVD_ISA_X86_CLONES
#define AVX2_FN __attribute__((target("avx2,fma"))) FMA_CONTRACT
#define AVX512_FN                                                          \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx512cd,fma," \
                        "prefer-vector-width=512"))) FMA_CONTRACT
KERNELS(AVX2_FN, avx2, 3, ISA_AVX2)
KERNELS(AVX512_FN, avx512_3, 3, ISA_AVX512)
KERNELS(AVX512_FN, avx512_9, 9, ISA_AVX512)
#endif

/* The kernels for an instruction set and a number of queries per slice,
 * and their query block. */
static int pick(kqsvd_isa_t isa, int64_t nq, scores_fn **scores, weigh_fn **weigh) {
#ifdef KQSVD_ISA_X86_CLONES
  if (isa == KQSVD_ISA_AVX512 && nq > 6) {
    *scores = scores_avx512_9, *weigh = weigh_avx512_9;
    return 9;
  }
  if (isa == KQSVD_ISA_AVX512) {
    *scores = scores_avx512_3, *weigh = weigh_avx512_3;
    return 3;
  }
  if (isa == KQSVD_ISA_AVX2) {
    *scores = scores_avx2, *weigh = weigh_avx2;
    return 3;
  }
#endif
  *scores = scores_base, *weigh = weigh_base;
  return 3;
}

/* Checks the runs and the call's arguments; fills the tiling. */
static kqsvd_status_t check(const char *fn, const kqsvd_codes_t *runs, int64_t nruns, int64_t nq,
                            const void *in, int64_t ld, const void *out, int threads, tiling_t *g) {
  kqsvd_status_t st = KQSVD_OK;
  KQSVD_CHECK(runs != NULL && in != NULL && out != NULL, KQSVD_ERR_USAGE,
              "%s: the codes, the queries or weights, and the output must not be NULL", fn);
  KQSVD_CHECK(nruns >= 1 && nruns <= KQSVD_CODES_MAX_RUNS && nq >= 1 && threads >= 1,
              KQSVD_ERR_USAGE, "%s: %lld runs (1..%d), %lld queries, %d threads", fn,
              (long long)nruns, KQSVD_CODES_MAX_RUNS, (long long)nq, threads);
  const kqsvd_codes_t *c0 = runs;
  KQSVD_CHECK(c0->axis == KQSVD_AXIS_CHANNEL || c0->axis == KQSVD_AXIS_TOKEN, KQSVD_ERR_USAGE,
              "%s: axis %d is neither channel (0) nor token (1)", fn, (int)c0->axis);
  KQSVD_CHECK(c0->group >= 1 && c0->group <= 4096, KQSVD_ERR_USAGE,
              "%s: group %d is not in 1..4096", fn, (int)c0->group);
  KQSVD_CHECK(c0->slices >= 0 && c0->tokens >= 0, KQSVD_ERR_USAGE,
              "%s: %lld slices of %lld tokens is not a shape", fn, (long long)c0->slices,
              (long long)c0->tokens);
  KQSVD_CHECK(c0->axis == KQSVD_AXIS_TOKEN || c0->tokens % c0->group == 0, KQSVD_ERR_USAGE,
              "%s: %lld tokens are not whole blocks of %d on the channel axis", fn,
              (long long)c0->tokens, (int)c0->group);
  KQSVD_CHECK(ld >= c0->tokens, KQSVD_ERR_USAGE, "%s: row length %lld is below %lld tokens", fn,
              (long long)ld, (long long)c0->tokens);
  call_once(&g_tables_once, make_tables);
  g->runs = runs;
  g->nruns = nruns;
  g->cols = 0;
  g->tile = c0->axis == KQSVD_AXIS_CHANNEL ? c0->group : TOKEN_TILE;
  g->width = g->tile;
  for (int64_t r = 0; r < nruns; r++) {
    const kqsvd_codes_t *c = runs + r;
    KQSVD_CHECK(c->slices == c0->slices && c->tokens == c0->tokens && c->group == c0->group &&
                    c->axis == c0->axis,
                KQSVD_ERR_USAGE, "%s: run %lld holds other slices, tokens, groups or axis", fn,
                (long long)r);
    KQSVD_CHECK(c->bits == 2 || c->bits == 3 || c->bits == 4 || c->bits == 8, KQSVD_ERR_USAGE,
                "%s: run %lld: bits %d is not 2, 3, 4 or 8", fn, (long long)r, (int)c->bits);
    KQSVD_CHECK(c->cols >= 1 && c->cols <= (1 << 20), KQSVD_ERR_USAGE, "%s: run %lld: %lld columns",
                fn, (long long)r, (long long)c->cols);
    KQSVD_CHECK(c->capacity == 0 || (c->capacity >= c->tokens &&
                                     (c->axis == KQSVD_AXIS_TOKEN || c->capacity % c->group == 0)),
                KQSVD_ERR_USAGE,
                "%s: run %lld: capacity %lld is below %lld tokens or not whole "
                "blocks",
                fn, (long long)r, (long long)c->capacity, (long long)c->tokens);
    KQSVD_CHECK(c->tokens == 0 || c->slices == 0 ||
                    (c->codes != NULL && c->scale != NULL && c->zero != NULL),
                KQSVD_ERR_USAGE, "%s: run %lld: codes, scale and zero must not be NULL", fn,
                (long long)r);
    g->off[r] = g->cols;
    g->cols += c->cols;
    g->row[r] = packed_width(c->axis == KQSVD_AXIS_CHANNEL ? c->group : c->cols, c->bits);
    g->groups[r] = (c->cols + c->group - 1) / c->group;
    g->held[r] = c->capacity ? c->capacity : c->tokens;
    if (c->cols > g->width) g->width = c->cols;
  }
  g->width = (g->width + 7) / 8 * 8;
  g->tiles = (c0->tokens + g->tile - 1) / g->tile;
  g->ldx = (g->cols + TILE - 1) / TILE * TILE;
done:
  return st;
}

kqsvd_status_t kqsvd_codes_scores(const kqsvd_codes_t *runs, int64_t nruns, int64_t nq,
                                  const float *q, int64_t ld, float *scores, int threads) {
  kqsvd_status_t st = KQSVD_OK;
  float *buf = NULL, *qp = NULL;
  tiling_t g;
  kqsvd_error_clear();
  KQSVD_CALL(check("kqsvd_codes_scores", runs, nruns, nq, q, ld, scores, threads, &g));
  const int64_t slices = runs->slices, cols = g.cols;
  const int64_t items = slices * g.tiles;
  if (items == 0) goto done;
  if (threads > items) threads = (int)items;
  scores_fn *scores_k;
  weigh_fn *weigh_k;
  const int hb = pick(kqsvd_isa_active(), nq, &scores_k, &weigh_k);
  const int64_t per = g.tile * g.ldx + 2 * g.width; /* tile, unpacked row, sums */
  const int64_t nqp = (nq + hb - 1) / hb * hb;
  KQSVD_MALLOC(buf, (size_t)threads * (size_t)per, "decode tiles");
  KQSVD_MALLOC(qp, (size_t)(slices * nqp * cols), "decode queries");
  for (int64_t s = 0; s < slices; s++)
    for (int64_t h = 0; h < nqp; h++)
      for (int64_t j = 0; j < cols; j++)
        qp[(s * nqp + h) * cols + j] = h < nq ? q[(s * nq + h) * cols + j] : 0.0f;
  PARALLEL_FOR
  for (int64_t i = 0; i < items; i++) {
    float *x = buf + (size_t)THREAD_ID() * (size_t)per;
    scores_k(&g, i / g.tiles, i % g.tiles, qp, nq, scores, ld, x);
  }
done:
  free(buf);
  free(qp);
  return kqsvd_api_return(st);
}

kqsvd_status_t kqsvd_codes_weigh(const kqsvd_codes_t *runs, int64_t nruns, int64_t nq,
                                 const float *p, int64_t ld, float *out, int threads) {
  kqsvd_status_t st = KQSVD_OK;
  float *buf = NULL;
  double *sums = NULL;
  tiling_t g;
  kqsvd_error_clear();
  KQSVD_CALL(check("kqsvd_codes_weigh", runs, nruns, nq, p, ld, out, threads, &g));
  const int64_t slices = runs->slices;
  if (slices == 0 || g.tiles == 0) goto done;
  /* A slice per item when there are enough; else each slice's tiles cut
   * in as many chunks as threads, summed in chunk order afterwards, so the
   * result does not depend on which thread ran which chunk. */
  const int64_t chunks = slices >= threads ? 1 : (threads + slices - 1) / slices;
  const int64_t items = slices * chunks, block = nq * g.cols;
  if (threads > items) threads = (int)items;
  scores_fn *scores_k;
  weigh_fn *weigh_k;
  const int hb = pick(kqsvd_isa_active(), nq, &scores_k, &weigh_k);
  /* tile, unpacked row, a tile's weights, its float32 sums */
  const int64_t nqp = (nq + hb - 1) / hb * hb;
  const int64_t per = g.tile * g.ldx + g.width + nqp * g.tile + nqp * g.ldx; /* + sums */
  KQSVD_MALLOC(buf, (size_t)threads * (size_t)per, "decode tiles");
  memset(buf, 0, (size_t)threads * (size_t)per * sizeof *buf); /* the tiles' column padding */
  KQSVD_MALLOC(sums, (size_t)items * (size_t)block, "decode sums");
  memset(sums, 0, (size_t)items * (size_t)block * sizeof *sums);
  PARALLEL_FOR
  for (int64_t i = 0; i < items; i++) {
    float *x = buf + (size_t)THREAD_ID() * (size_t)per;
    const int64_t s = i / chunks, part = i % chunks;
    const int64_t k0 = g.tiles * part / chunks, k1 = g.tiles * (part + 1) / chunks;
    weigh_k(&g, s, k0, k1, p, nq, ld, x, sums + i * block);
  }
  for (int64_t s = 0; s < slices; s++)
    for (int64_t e = 0; e < block; e++) {
      double v = 0.0;
      for (int64_t part = 0; part < chunks; part++) v += sums[(s * chunks + part) * block + e];
      out[s * block + e] += (float)v;
    }
done:
  free(buf);
  free(sums);
  return kqsvd_api_return(st);
}
