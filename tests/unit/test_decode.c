/* The decode kernels (include/kqsvd/decode.h) against a direct reading of
 * the documented code layout written here: codes decoded bit by bit from
 * the packed bytes, values as code * scale + zero, sums in float64.  Every
 * number of bits, both axes, short tiles, several slices and queries, rows
 * longer than the tokens, 1 to 3 threads; and the refusals, which write
 * nothing. */
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "kqsvd/decode.h"
#include "kqsvd_convert.h"
#include "kqsvd_error.h"
#include "kqsvd_isa.h"

static uint64_t g_state = 88172645463325252ull;
static uint64_t next(void) {
  g_state ^= g_state << 13;
  g_state ^= g_state >> 7;
  g_state ^= g_state << 17;
  return g_state;
}
static double uniform(void) { return (double)(next() >> 11) * 0x1p-53; }

/* Code i of a packed row: bit k of the code is bit (bits * i + k) of the
 * row read as one little-endian number. */
static unsigned code_at(const uint8_t *row, int bits, int64_t i) {
  unsigned c = 0;
  for (int k = 0; k < bits; k++) {
    const int64_t bit = bits * i + k;
    c |= (unsigned)((row[bit / 8] >> (bit % 8)) & 1u) << k;
  }
  return c;
}

/* Value (s, t, j) of a description, in float64 from the float32 rule. */
static double value_at(const kqsvd_codes_t *c, int64_t s, int64_t t, int64_t j) {
  const int64_t pw_group = (c->group + 7) / 8 * c->bits, pw_cols = (c->cols + 7) / 8 * c->bits;
  const int64_t held = c->capacity ? c->capacity : c->tokens;
  unsigned code;
  int64_t e;
  if (c->axis == KQSVD_AXIS_CHANNEL) {
    const int64_t blk = (s * (held / c->group) + t / c->group) * c->cols + j;
    code = code_at(c->codes + blk * pw_group, c->bits, t % c->group);
    e = blk;
  } else {
    const int64_t tok = s * held + t, groups = (c->cols + c->group - 1) / c->group;
    code = code_at(c->codes + tok * pw_cols, c->bits, j);
    e = tok * groups + j / c->group;
  }
  const float sc = (float)kqsvd_f16_to_f64(c->scale[e]), z = (float)kqsvd_f16_to_f64(c->zero[e]);
  return (double)((float)code * sc + z);
}

/* One run of random codes, scales and zeros; capacity 0, or the tokens
 * its arrays are laid out for (the unused ones random too). */
static kqsvd_codes_t make_run(int bits, kqsvd_axis_t axis, int64_t slices, int64_t tokens,
                              int64_t cols, int group, int64_t capacity) {
  const int64_t held = capacity ? capacity : tokens;
  const int64_t pw = axis == KQSVD_AXIS_CHANNEL ? (group + 7) / 8 * bits : (cols + 7) / 8 * bits;
  const int64_t rows = axis == KQSVD_AXIS_CHANNEL ? slices * (held / group) * cols : slices * held;
  const int64_t nscale =
      axis == KQSVD_AXIS_CHANNEL ? rows : slices * held * ((cols + group - 1) / group);
  uint8_t *codes = malloc((size_t)(rows * pw) + 1);
  uint16_t *scale = malloc((size_t)nscale * 2 + 2), *zero = malloc((size_t)nscale * 2 + 2);
  for (int64_t i = 0; i < rows * pw; i++) codes[i] = (uint8_t)next();
  for (int64_t i = 0; i < nscale; i++) {
    scale[i] = kqsvd_f64_to_f16(0.01 + 0.5 * uniform());
    zero[i] = kqsvd_f64_to_f16(4.0 * uniform() - 2.0);
  }
  const kqsvd_codes_t c = {slices, tokens, cols, capacity, bits, group, axis, codes, scale, zero};
  return c;
}

static void free_run(kqsvd_codes_t *c) {
  free((void *)c->codes);
  free((void *)c->scale);
  free((void *)c->zero);
}

/* Value j of token t of slice s over the runs side by side. */
static double runs_value(const kqsvd_codes_t *runs, int nruns, int64_t s, int64_t t, int64_t j) {
  for (int r = 0; r < nruns; j -= runs[r].cols, r++)
    if (j < runs[r].cols) return value_at(runs + r, s, t, j);
  return NAN;
}

/* Both products over the runs against the float64 reading, nq queries. */
static void check_runs(const kqsvd_codes_t *runs, int nruns, int64_t nq, int threads) {
  const int64_t slices = runs->slices, tokens = runs->tokens, ld = tokens + 3;
  int64_t cols = 0;
  for (int r = 0; r < nruns; r++) cols += runs[r].cols;
  float *q = malloc((size_t)(slices * nq * cols) * 4), *p = malloc((size_t)(slices * nq * ld) * 4);
  float *scores = malloc((size_t)(slices * nq * ld) * 4);
  float *out = malloc((size_t)(slices * nq * cols) * 4);
  for (int64_t i = 0; i < slices * nq * cols; i++) q[i] = (float)(2.0 * uniform() - 1.0);
  for (int64_t i = 0; i < slices * nq * ld; i++) {
    p[i] = (float)uniform();
    scores[i] = (float)i;
  }
  for (int64_t i = 0; i < slices * nq * cols; i++) out[i] = 1.0f;
  CHECK_OK(kqsvd_codes_scores(runs, nruns, nq, q, ld, scores, threads));
  CHECK_OK(kqsvd_codes_weigh(runs, nruns, nq, p, ld, out, threads));
  int bad_s = 0, bad_o = 0;
  for (int64_t s = 0; s < slices; s++)
    for (int64_t h = 0; h < nq; h++) {
      for (int64_t t = 0; t < ld; t++) {
        double want = (double)((s * nq + h) * ld + t), mag = 1.0;
        for (int64_t j = 0; t < tokens && j < cols; j++) {
          const double v = (double)q[(s * nq + h) * cols + j] * runs_value(runs, nruns, s, t, j);
          want += v;
          mag += fabs(v);
        }
        mag += fabs(want);
        bad_s += fabs((double)scores[(s * nq + h) * ld + t] - want) > 2e-6 * mag;
      }
      for (int64_t j = 0; j < cols; j++) {
        double want = 1.0, mag = 1.0;
        for (int64_t t = 0; t < tokens; t++) {
          const double v = (double)p[(s * nq + h) * ld + t] * runs_value(runs, nruns, s, t, j);
          want += v;
          mag += fabs(v);
        }
        bad_o += fabs((double)out[(s * nq + h) * cols + j] - want) > 2e-6 * mag;
      }
    }
  CHECK(bad_s == 0 && bad_o == 0,
        "%d runs, bits %d axis %d slices %lld tokens %lld (of %lld) cols %lld group %d nq %lld "
        "threads %d: %d scores and %d sums off",
        nruns, (int)runs->bits, (int)runs->axis, (long long)slices, (long long)tokens,
        (long long)runs->capacity, (long long)cols, (int)runs->group, (long long)nq, threads, bad_s,
        bad_o);
  free(q);
  free(p);
  free(scores);
  free(out);
}

static void one_case(int bits, kqsvd_axis_t axis, int64_t slices, int64_t tokens, int64_t cols,
                     int group, int64_t nq, int threads, int64_t capacity) {
  kqsvd_codes_t c = make_run(bits, axis, slices, tokens, cols, group, capacity);
  check_runs(&c, 1, nq, threads);
  free_run(&c);
}

/* Runs of their own bits, widths and capacities side by side. */
static void runs_case(kqsvd_axis_t axis, int64_t tokens, int threads) {
  const int group = 32, mult = axis == KQSVD_AXIS_CHANNEL ? group : 1;
  kqsvd_codes_t runs[4] = {make_run(8, axis, 2, tokens, 3, group, 0),
                           make_run(4, axis, 2, tokens, 26, group, tokens + 5 * mult),
                           make_run(3, axis, 2, tokens, 99, group, 0),
                           make_run(2, axis, 2, tokens, 63, group, tokens + 2 * mult)};
  check_runs(runs, 4, 9, threads);
  for (int r = 0; r < 4; r++) free_run(runs + r);
}

/* Every float16 zero comes back exact: one token, code 0, weight 1. */
static void every_half(void) {
  uint8_t *codes = calloc(65536, 8); /* a row of 8 padded codes per slice */
  uint16_t *zero = malloc(65536 * 2), *scale = calloc(65536, 2);
  float p[1] = {1.0f}, *out = calloc(65536, 4);
  for (uint32_t h = 0; h < 65536; h++) zero[h] = (uint16_t)h;
  /* 65536 slices of one token of one column, on the token axis */
  const kqsvd_codes_t c = {65536, 1, 1, 0, 8, 1, KQSVD_AXIS_TOKEN, codes, scale, zero};
  float *pp = malloc(65536 * 4);
  for (int i = 0; i < 65536; i++) pp[i] = p[0];
  CHECK_OK(kqsvd_codes_weigh(&c, 1, 1, pp, 1, out, 2));
  int bad = 0;
  for (uint32_t h = 0; h < 65536; h++) {
    const double want = kqsvd_f16_to_f64((uint16_t)h);
    if ((h & 0x7c00u) == 0x7c00u) continue; /* Inf and NaN: never a stored zero */
    bad += (double)out[h] != want;
  }
  CHECK(bad == 0, "%d float16 values not widened exactly", bad);
  free(codes);
  free(zero);
  free(scale);
  free(out);
  free(pp);
}

/* Runs quantized in one call are each run quantized alone; a bad value
 * in the last run leaves every output untouched. */
static void quantize_runs(void) {
  enum { ROWS = 5, N = 45 };
  const int64_t cols[3] = {7, 30, 8};
  const int32_t bits[3] = {8, 3, 2};
  float x[ROWS * N];
  for (int i = 0; i < ROWS * N; i++) x[i] = (float)(6.0 * uniform() - 3.0);
  uint8_t codes[3][ROWS * 16], want_c[ROWS * 16];
  uint16_t scale[3][ROWS * 8], zero[3][ROWS * 8], want_s[ROWS * 8], want_z[ROWS * 8];
  uint8_t *cp[3] = {codes[0], codes[1], codes[2]};
  uint16_t *sp[3] = {scale[0], scale[1], scale[2]}, *zp[3] = {zero[0], zero[1], zero[2]};
  CHECK_OK(kqsvd_codes_quantize_runs(x, ROWS, N, 3, cols, bits, 4, cp, sp, zp));
  for (int k = 0, off = 0; k < 3; off += (int)cols[k], k++) {
    CHECK_OK(
        kqsvd_codes_quantize(x + off, ROWS, cols[k], N, 1, bits[k], 4, want_c, want_s, want_z));
    const size_t pw = (size_t)(cols[k] + 7) / 8 * (size_t)bits[k],
                 groups = (size_t)(cols[k] + 3) / 4;
    CHECK(memcmp(codes[k], want_c, ROWS * pw) == 0, "run %d codes", k);
    CHECK(memcmp(scale[k], want_s, ROWS * groups * 2) == 0, "run %d scales", k);
    CHECK(memcmp(zero[k], want_z, ROWS * groups * 2) == 0, "run %d zeros", k);
  }
  memset(codes, 0xab, sizeof codes);
  x[ROWS * N - 1] = NAN;
  CHECK(kqsvd_codes_quantize_runs(x, ROWS, N, 3, cols, bits, 4, cp, sp, zp) == KQSVD_ERR_DATA,
        "a NaN");
  CHECK(codes[0][0] == 0xab && codes[1][0] == 0xab, "a refused call wrote codes");
  kqsvd_error_clear();
}

static void refusals(void) {
  uint8_t codes[64] = {0};
  uint16_t scale[64] = {0};
  float q[64] = {0}, out[64], before[64];
  for (int i = 0; i < 64; i++) out[i] = before[i] = (float)i;
  const kqsvd_codes_t good = {1, 8, 4, 0, 4, 8, KQSVD_AXIS_CHANNEL, codes, scale, scale};
  kqsvd_codes_t c = good;
  c.bits = 5;
  CHECK(kqsvd_codes_scores(&c, 1, 1, q, 8, out, 1) == KQSVD_ERR_USAGE, "5 bits");
  CHECK(strstr(kqsvd_error_message(), "bits 5") != NULL, "message: %s", kqsvd_error_message());
  c = good;
  c.tokens = 12;
  CHECK(kqsvd_codes_weigh(&c, 1, 1, q, 12, out, 1) == KQSVD_ERR_USAGE, "a partial block");
  c = good;
  CHECK(kqsvd_codes_scores(&c, 1, 1, q, 7, out, 1) == KQSVD_ERR_USAGE, "a short row");
  CHECK(kqsvd_codes_scores(&c, 1, 0, q, 8, out, 1) == KQSVD_ERR_USAGE, "no query");
  c.capacity = 4;
  CHECK(kqsvd_codes_scores(&c, 1, 1, q, 8, out, 1) == KQSVD_ERR_USAGE, "capacity below tokens");
  c.capacity = 12;
  CHECK(kqsvd_codes_scores(&c, 1, 1, q, 8, out, 1) == KQSVD_ERR_USAGE, "capacity not in blocks");
  c = good;
  CHECK(kqsvd_codes_weigh(&c, 1, 1, q, 8, out, 0) == KQSVD_ERR_USAGE, "no thread");
  c.codes = NULL;
  CHECK(kqsvd_codes_weigh(&c, 1, 1, q, 8, out, 1) == KQSVD_ERR_USAGE, "no codes");
  c = good;
  c.axis = (kqsvd_axis_t)7;
  CHECK(kqsvd_codes_weigh(&c, 1, 1, q, 8, out, 1) == KQSVD_ERR_USAGE, "axis 7");
  kqsvd_codes_t two[2] = {good, good};
  two[1].tokens = 16;
  CHECK(kqsvd_codes_scores(two, 2, 1, q, 16, out, 1) == KQSVD_ERR_USAGE, "runs that disagree");
  CHECK(kqsvd_codes_scores(two, 0, 1, q, 16, out, 1) == KQSVD_ERR_USAGE, "no run");
  CHECK(memcmp(out, before, sizeof out) == 0, "a refused call wrote its output");
  kqsvd_error_clear();
  c = good;
  c.tokens = 0;
  CHECK_OK(kqsvd_codes_scores(&c, 1, 1, q, 8, out, 2));
  CHECK(memcmp(out, before, sizeof out) == 0, "no tokens changed the scores");
}

int main(void) {
  kqsvd_isa_t isa;
  if (kqsvd_isa_select(&isa) != KQSVD_OK) { /* KQSVD_ISA names a set this CPU lacks */
    printf("test_decode: skipped: %s\n", kqsvd_error_message());
    return 77;
  }
  const int all_bits[] = {2, 3, 4, 8};
  for (int b = 0; b < 4; b++)
    for (int threads = 1; threads <= 3; threads++) {
      /* the unrolled tiles of 32 and the plain loops, short last tiles,
       * columns not a multiple of 8 or 32, queries not a multiple of 3 */
      one_case(all_bits[b], KQSVD_AXIS_CHANNEL, 2, 96, 37, 32, 9, threads, 0);
      one_case(all_bits[b], KQSVD_AXIS_CHANNEL, 3, 64, 37, 32, 9, threads, 128);
      one_case(all_bits[b], KQSVD_AXIS_CHANNEL, 1, 40, 5, 8, 2, threads, 0);
      one_case(all_bits[b], KQSVD_AXIS_CHANNEL, 3, 30, 70, 3, 1, threads, 0);
      one_case(all_bits[b], KQSVD_AXIS_TOKEN, 2, 77, 37, 32, 9, threads, 0);
      one_case(all_bits[b], KQSVD_AXIS_TOKEN, 2, 45, 37, 32, 9, threads, 80);
      one_case(all_bits[b], KQSVD_AXIS_TOKEN, 1, 5, 64, 8, 4, threads, 0);
      one_case(all_bits[b], KQSVD_AXIS_TOKEN, 5, 33, 3, 2, 3, threads, 0);
    }
  for (int threads = 1; threads <= 2; threads++) {
    runs_case(KQSVD_AXIS_CHANNEL, 96, threads);
    runs_case(KQSVD_AXIS_TOKEN, 77, threads);
  }
  every_half();
  quantize_runs();
  refusals();
  return check_exit("test_decode");
}
