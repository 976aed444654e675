#include "kqsvd_convert.h"
#include "kqsvd_isa.h"

#include <math.h>
#include <string.h>
#include <threads.h>

const char *kqsvd_tensor_name(kqsvd_tensor_t t) {
  return t == KQSVD_KEYS ? "keys" : t == KQSVD_VALUES ? "values" : "queries";
}

size_t kqsvd_dtype_size(kqsvd_dtype_t t) {
  switch (t) {
  case KQSVD_F16:
  case KQSVD_BF16: return 2;
  case KQSVD_F32: return 4;
  case KQSVD_F64: return 8;
  }
  return 0;
}

const char *kqsvd_dtype_name(kqsvd_dtype_t t) {
  switch (t) {
  case KQSVD_F16: return "f16";
  case KQSVD_BF16: return "bf16";
  case KQSVD_F32: return "f32";
  case KQSVD_F64: return "f64";
  }
  return "?";
}

kqsvd_status_t kqsvd_dtype_parse(const char *s, kqsvd_dtype_t *t) {
  kqsvd_status_t st = KQSVD_OK;
  static const kqsvd_dtype_t all[] = {KQSVD_F16, KQSVD_BF16, KQSVD_F32, KQSVD_F64};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
    if (strcmp(s, kqsvd_dtype_name(all[i])) == 0) {
      *t = all[i];
      return KQSVD_OK;
    }
  KQSVD_FAIL(KQSVD_ERR_USAGE, "unknown element type '%s' (expected f16, bf16, f32 or f64)", s);
done:
  return st;
}

/* Small IEEE-style binary formats: `ebits` exponent and `mbits` fraction bits. */
static double decode_small(uint32_t h, int ebits, int mbits) {
  const uint32_t emask = (1u << ebits) - 1, mmask = (1u << mbits) - 1;
  const int bias = (1 << (ebits - 1)) - 1;
  const uint32_t e = (h >> mbits) & emask, m = h & mmask;
  const double sign = (h >> (ebits + mbits)) & 1u ? -1.0 : 1.0;
  if (e == emask) return m ? NAN : sign * INFINITY;
  if (e == 0) return sign * ldexp((double)m, 1 - bias - mbits);
  return sign * ldexp((double)(m | (1u << mbits)), (int)e - bias - mbits);
}

static uint32_t round_shift(uint64_t m, int shift) {
  /* m >> shift, rounded to nearest, ties to even; shift in [1, 63]. */
  uint64_t q = m >> shift, rem = m & ((UINT64_C(1) << shift) - 1);
  uint64_t half = UINT64_C(1) << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) q++;
  return (uint32_t)q;
}

static uint32_t encode_small(double v, int ebits, int mbits) {
  const uint32_t emask = (1u << ebits) - 1;
  const int bias = (1 << (ebits - 1)) - 1;
  uint64_t x;
  memcpy(&x, &v, sizeof x);
  const uint32_t sign = (uint32_t)(x >> 63) << (ebits + mbits);
  const uint64_t ax = x & ~(UINT64_C(1) << 63);
  const uint32_t inf = emask << mbits;
  if (ax >= UINT64_C(0x7ff0000000000000)) /* Inf, or NaN kept quiet */
    return sign | inf | (ax > UINT64_C(0x7ff0000000000000) ? 1u << (mbits - 1) : 0u);
  int e2 = (int)(ax >> 52) - 1023;
  uint64_t m = ax & ((UINT64_C(1) << 52) - 1);
  if (ax >> 52)
    m |= UINT64_C(1) << 52;
  else
    e2 = -1022;
  if (e2 > bias) return sign | inf;
  if (e2 >= 1 - bias) {
    /* Normal target: a carry out of the fraction bumps the exponent, and
     * out of the largest finite value yields exactly Inf. */
    uint32_t q = round_shift(m, 52 - mbits);
    return sign | ((((uint32_t)(e2 + bias)) << mbits) + q - (1u << mbits));
  }
  const int shift = 52 - mbits + (1 - bias - e2);
  if (shift >= 64) return sign;
  return sign | round_shift(m, shift);
}

uint16_t kqsvd_f64_to_f16(double v) { return (uint16_t)encode_small(v, 5, 10); }
uint16_t kqsvd_f64_to_bf16(double v) { return (uint16_t)encode_small(v, 8, 7); }
double kqsvd_f16_to_f64(uint16_t h) { return decode_small(h, 5, 10); }
double kqsvd_bf16_to_f64(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return (double)f;
}

/* Every half is exactly a float; a 256 KiB table keeps the hot loop a load. */
static float g_f16_table[65536];
static once_flag g_f16_once = ONCE_FLAG_INIT;
static void f16_table_init(void) {
  for (uint32_t h = 0; h < 65536; h++) g_f16_table[h] = (float)kqsvd_f16_to_f64((uint16_t)h);
}

static inline double load_one(kqsvd_dtype_t type, const void *src, int64_t k, int *bad) {
  switch (type) {
  case KQSVD_F16: {
    uint16_t h = ((const uint16_t *)src)[k];
    *bad |= (h & 0x7c00u) == 0x7c00u;
    return g_f16_table[h];
  }
  case KQSVD_BF16: {
    uint16_t b = ((const uint16_t *)src)[k];
    *bad |= (b & 0x7f80u) == 0x7f80u;
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
  }
  case KQSVD_F32: {
    float f = ((const float *)src)[k];
    *bad |= !isfinite(f);
    return f;
  }
  case KQSVD_F64: {
    double x = ((const double *)src)[k];
    *bad |= !isfinite(x);
    return x;
  }
  }
  return 0.0;
}

/* Rows i0..i1-1, one element at a time; returns -1 or the first bad row. */
static int64_t transpose_rows(kqsvd_dtype_t type, const void *src, int64_t i0, int64_t i1, int d,
                              double *dst, int64_t ld) {
  int bad = 0;
  for (int j = 0; j < d; j++)
    for (int64_t i = i0; i < i1; i++) dst[j * ld + i] = load_one(type, src, i * d + j, &bad);
  if (bad) {
    for (int64_t i = i0; i < i1; i++) {
      int b = 0;
      for (int j = 0; j < d; j++) (void)load_one(type, src, i * d + j, &b);
      if (b) return i;
    }
  }
  return -1;
}

/* GCC only: the vector code relies on __builtin_shuffle. */
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#define HAVE_BF16_AVX512 1
typedef uint16_t tr_v8h __attribute__((vector_size(16)));
typedef uint16_t tr_v32h __attribute__((vector_size(64)));
typedef uint32_t tr_v8u __attribute__((vector_size(32)));
typedef float tr_v8f __attribute__((vector_size(32)));
typedef float tr_v16f __attribute__((vector_size(64)));
typedef double tr_v8d __attribute__((vector_size(64)));

/* The one selection point (kqsvd_isa.h): KQSVD_ISA=avx2 or base also turns
 * this path off, so every kernel of a run is of the set it names. */
static int bf16_avx512_ok(void) { return kqsvd_isa_active() == KQSVD_ISA_AVX512; }

/* Stores four transposed bf16 columns (8 each) as doubles: u16 k goes to
 * the top half of 32-bit lane k (bf16 is the top half of a float32), zeros
 * below, and the floats widen exactly. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static inline void
bf16_store_cols(tr_v32h t, double *dst, int64_t ld) {
  static const tr_v32h lo = {32, 0, 32, 1, 32, 2,  32, 3,  32, 4,  32, 5,  32, 6,  32, 7,
                             32, 8, 32, 9, 32, 10, 32, 11, 32, 12, 32, 13, 32, 14, 32, 15};
  const tr_v32h hi = lo + (tr_v32h){0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16,
                                    0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16};
  const tr_v32h zero = {0};
  for (int h = 0; h < 2; h++) {
    const tr_v16f w = (tr_v16f)__builtin_shuffle(t, zero, h ? hi : lo);
    for (int c = 0; c < 2; c++) {
      tr_v8f f;
      memcpy(&f, (const char *)&w + 32 * c, sizeof f);
      const tr_v8d x = __builtin_convertvector(f, tr_v8d);
      memcpy(dst + (2 * h + c) * ld, &x, sizeof x);
    }
  }
}

/* ROWS_AT_ONCE bf16 rows (stride d) by d8 columns (a multiple of 8) into
 * columns of dst, 8 x 8 tiles at a time: two 16-bit permutes transpose a
 * tile, then each column widens exactly to 8 doubles, one cache line of
 * dst.  Tiles go down the rows first, so each column of dst is written as
 * one run of ROWS_AT_ONCE doubles (a power-of-two ld sends every column to
 * the same cache set).  Returns nonzero when some element is NaN or Inf. */
#define ROWS_AT_ONCE 32
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static int
bf16_rows_avx512(const uint16_t *src, int d, int d8, double *dst, int64_t ld) {
  /* Lane c*8 + r of the result takes row r, column c of the tile; rows 0-3
   * are in the first operand, rows 4-7 in the second (index 32 on). */
  static const tr_v32h cols0 = {0, 8,  16, 24, 32, 40, 48, 56, 1, 9,  17, 25, 33, 41, 49, 57,
                                2, 10, 18, 26, 34, 42, 50, 58, 3, 11, 19, 27, 35, 43, 51, 59};
  const tr_v32h cols1 = cols0 + 4;
  tr_v32h flag = {0};
  for (int j0 = 0; j0 < d8; j0 += 8)
    for (int i0 = 0; i0 < ROWS_AT_ONCE; i0 += 8) {
      const uint16_t *s = src + (size_t)i0 * d + j0;
      tr_v32h z0, z1;
      for (int r = 0; r < 4; r++) {
        memcpy((char *)&z0 + 16 * r, s + (size_t)r * d, 16);
        memcpy((char *)&z1 + 16 * r, s + (size_t)(r + 4) * d, 16);
      }
      flag |= (tr_v32h)((z0 & 0x7f80u) == 0x7f80u) | (tr_v32h)((z1 & 0x7f80u) == 0x7f80u);
      double *o = dst + (size_t)j0 * ld + i0;
      bf16_store_cols(__builtin_shuffle(z0, z1, cols0), o, ld);
      bf16_store_cols(__builtin_shuffle(z0, z1, cols1), o + 4 * ld, ld);
    }
  int any = 0;
  for (int k = 0; k < 32; k++) any |= flag[k] != 0;
  return any;
}

static int64_t transpose_bf16_avx512(const uint16_t *src, int64_t rows, int d, double *dst,
                                     int64_t ld) {
  const int d8 = d / 8 * 8;
  int64_t i0 = 0;
  for (; i0 + ROWS_AT_ONCE <= rows; i0 += ROWS_AT_ONCE) {
    int bad = bf16_rows_avx512(src + i0 * d, d, d8, dst + i0, ld);
    for (int j = d8; j < d; j++)
      for (int64_t i = i0; i < i0 + ROWS_AT_ONCE; i++)
        dst[j * ld + i] = load_one(KQSVD_BF16, src, i * d + j, &bad);
    if (bad) return transpose_rows(KQSVD_BF16, src, i0, i0 + ROWS_AT_ONCE, d, dst, ld);
  }
  for (; i0 < rows; i0 += 8) {
    const int64_t bad =
        transpose_rows(KQSVD_BF16, src, i0, i0 + 8 < rows ? i0 + 8 : rows, d, dst, ld);
    if (bad >= 0) return bad;
  }
  return -1;
}
#endif

int64_t kqsvd_convert_transpose(kqsvd_dtype_t type, const void *src, int64_t rows, int d,
                                double *dst, int64_t ld) {
  if (type == KQSVD_F16) call_once(&g_f16_once, f16_table_init);
#ifdef HAVE_BF16_AVX512
  if (type == KQSVD_BF16 && bf16_avx512_ok()) return transpose_bf16_avx512(src, rows, d, dst, ld);
#endif
  /* Tiles of 8 rows write whole cache lines of the column-major target. */
  for (int64_t i0 = 0; i0 < rows; i0 += 8) {
    const int64_t bad = transpose_rows(type, src, i0, i0 + 8 < rows ? i0 + 8 : rows, d, dst, ld);
    if (bad >= 0) return bad;
  }
  return -1;
}

int64_t kqsvd_convert_to_f64(kqsvd_dtype_t type, const void *src, int64_t n, double *dst) {
  if (type == KQSVD_F16) call_once(&g_f16_once, f16_table_init);
  int bad = 0;
  for (int64_t k = 0; k < n; k++) dst[k] = load_one(type, src, k, &bad);
  if (bad)
    for (int64_t k = 0; k < n; k++)
      if (!isfinite(dst[k])) return k;
  return -1;
}

void kqsvd_convert_from_f64(kqsvd_dtype_t type, const double *src, int64_t n, void *dst) {
  switch (type) {
  case KQSVD_F16:
    for (int64_t k = 0; k < n; k++) ((uint16_t *)dst)[k] = kqsvd_f64_to_f16(src[k]);
    break;
  case KQSVD_BF16:
    for (int64_t k = 0; k < n; k++) ((uint16_t *)dst)[k] = kqsvd_f64_to_bf16(src[k]);
    break;
  case KQSVD_F32:
    for (int64_t k = 0; k < n; k++) ((float *)dst)[k] = (float)src[k];
    break;
  case KQSVD_F64: memcpy(dst, src, (size_t)n * sizeof(double)); break;
  }
}
