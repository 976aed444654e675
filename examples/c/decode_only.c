/* A program that only decodes: it quantizes 64 tokens of 16 values each
 * at 4 bits with libkqsvd, scores a query against them as codes, and
 * checks the scores against the same tokens dequantized here from the
 * codes as docs/quantized-cache.md defines them (value = code * scale +
 * zero).  It includes kqsvd/decode.h, kqsvd/result.h and kqsvd/error.h
 * only, so it builds without MPI's headers:
 *
 *     cc -std=c11 -I PREFIX/include decode_only.c -L PREFIX/lib -lkqsvd -lm */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <kqsvd/decode.h>
#include <kqsvd/error.h>
#include <kqsvd/result.h>

enum { T = 64, N = 16, BITS = 4 };

/* IEEE binary16 bits as a float (normal and zero values; scales are). */
static float half(uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const float v = e ? ldexpf(1.0f + (float)m / 1024.0f, e - 15) : ldexpf((float)m / 1024.0f, -14);
  return h & 0x8000 ? -v : v;
}

int main(void) {
  float x[T * N], q[N], got[T] = {0};
  uint8_t codes[T * N * BITS / 8];
  uint16_t scale[T], zero[T];
  for (int i = 0; i < T * N; i++) x[i] = sinf(0.37f * (float)i) + 0.01f * (float)(i % 7);
  for (int j = 0; j < N; j++) q[j] = cosf(0.5f * (float)j);
  kqsvd_status_t st = kqsvd_codes_quantize(x, T, N, N, 1, BITS, N, codes, scale, zero);
  const kqsvd_codes_t c = {1, T, N, T, BITS, N, KQSVD_AXIS_TOKEN, codes, scale, zero};
  if (st == KQSVD_OK) st = kqsvd_codes_scores(&c, 1, 1, q, T, got, 1);
  if (st != KQSVD_OK) {
    fprintf(stderr, "decode_only: %s\n", kqsvd_last_error());
    return 1;
  }
  double worst = 0.0, top = 0.0;
  for (int t = 0; t < T; t++) {
    double s = 0.0;
    for (int j = 0; j < N; j++) {
      const int code = (codes[t * N * BITS / 8 + j / 2] >> (4 * (j % 2))) & 0xf;
      s += (double)q[j] * ((double)code * half(scale[t]) + half(zero[t]));
    }
    worst = fmax(worst, fabs((double)got[t] - s));
    top = fmax(top, fabs(s));
  }
  /* kqsvd/result.h links without the accumulator's header too. */
  kqsvd_result_t *res = NULL;
  kqsvd_result_free(&res);
  printf("decode_only: scores as codes vs dequantized here: %.2e of %.3f\n", worst, top);
  return worst <= 1e-5 * top ? 0 : 1;
}
