/* Element types: exact decoding of every bf16 and f16 bit pattern, correct
 * rounding of the encoders, and NaN/Inf detection in block conversions. */
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "kqsvd_convert.h"

static uint64_t bits(double x) {
  uint64_t u;
  memcpy(&u, &x, sizeof u);
  return u;
}

int main(void) {
  /* Every finite pattern decodes to a value that encodes back to itself. */
  int bad16 = 0, badbf = 0;
  for (uint32_t h = 0; h < 65536; h++) {
    const double x = kqsvd_f16_to_f64((uint16_t)h), y = kqsvd_bf16_to_f64((uint16_t)h);
    if ((h & 0x7c00u) != 0x7c00u && kqsvd_f64_to_f16(x) != h) bad16++;
    if ((h & 0x7f80u) != 0x7f80u && kqsvd_f64_to_bf16(y) != h) badbf++;
    if ((h & 0x7c00u) == 0x7c00u) CHECK(!isfinite(x), "f16 %04x should be Inf/NaN", h);
    if ((h & 0x7f80u) == 0x7f80u) CHECK(!isfinite(y), "bf16 %04x should be Inf/NaN", h);
  }
  CHECK(bad16 == 0, "%d f16 patterns do not round-trip", bad16);
  CHECK(badbf == 0, "%d bf16 patterns do not round-trip", badbf);

  /* Known values, from the IEEE 754 binary16 and bfloat16 layouts. */
  CHECK(kqsvd_f16_to_f64(0x3c00) == 1.0, "f16 one");
  CHECK(kqsvd_f16_to_f64(0xc000) == -2.0, "f16 minus two");
  CHECK(kqsvd_f16_to_f64(0x7bff) == 65504.0, "f16 max");
  CHECK(kqsvd_f16_to_f64(0x0001) == 0x1p-24, "f16 smallest subnormal");
  CHECK(kqsvd_f16_to_f64(0x03ff) == 1023 * 0x1p-24, "f16 largest subnormal");
  CHECK(kqsvd_f16_to_f64(0x0400) == 0x1p-14, "f16 smallest normal");
  CHECK(bits(kqsvd_f16_to_f64(0x8000)) == bits(-0.0), "f16 negative zero");
  CHECK(kqsvd_bf16_to_f64(0x3f80) == 1.0, "bf16 one");
  CHECK(kqsvd_bf16_to_f64(0xc0a0) == -5.0, "bf16 minus five");
  CHECK(kqsvd_bf16_to_f64(0x7f7f) == 0x1.fep127, "bf16 max");
  CHECK(kqsvd_bf16_to_f64(0x0001) == 0x1p-133, "bf16 smallest subnormal");
  CHECK(kqsvd_bf16_to_f64(0x3e20) == 0.15625, "bf16 0.15625");

  /* Round to nearest, ties to even, straight from float64. */
  CHECK(kqsvd_f64_to_f16(1.0 + 0x1p-11) == 0x3c00, "tie rounds to even (down)");
  CHECK(kqsvd_f64_to_f16(1.0 + 3 * 0x1p-11) == 0x3c02, "tie rounds to even (up)");
  CHECK(kqsvd_f64_to_f16(1.0 + 0x1p-11 + 0x1p-40) == 0x3c01, "above the tie rounds up");
  CHECK(kqsvd_f64_to_f16(65519.0) == 0x7bff, "just below overflow");
  CHECK(kqsvd_f64_to_f16(65520.0) == 0x7c00, "overflow to Inf");
  CHECK(kqsvd_f64_to_f16(0x1p-25) == 0x0000, "half the smallest subnormal ties to zero");
  CHECK(kqsvd_f64_to_f16(3 * 0x1p-26) == 0x0001, "above the tie rounds up to a subnormal");
  CHECK(kqsvd_f64_to_f16(-1e-30) == 0x8000, "tiny negative to negative zero");
  CHECK(kqsvd_f64_to_bf16(1.0 + 0x1p-8) == 0x3f80, "bf16 tie to even");
  /* Just above a tie: float64 -> float32 -> bf16 would round twice and give
   * 0x3f80; the direct encoder must give 0x3f81. */
  CHECK(kqsvd_f64_to_bf16(1.0 + 0x1p-8 + 0x1p-30) == 0x3f81, "bf16 no double rounding");
  CHECK(kqsvd_f64_to_f16(1.0 + 0x1p-11 + 0x1p-30) == 0x3c01, "f16 no double rounding");
  CHECK(kqsvd_f64_to_bf16(1e39) == 0x7f80, "bf16 overflow to Inf");
  CHECK((kqsvd_f64_to_f16(NAN) & 0x7c00) == 0x7c00 && (kqsvd_f64_to_f16(NAN) & 0x3ff),
        "NaN stays NaN");

  /* Block conversion: transposed layout and the first non-finite row. */
  enum { R = 19, D = 5 };
  float src[R * D];
  double dst[R * D];
  for (int i = 0; i < R * D; i++) src[i] = (float)i * 0.5f;
  CHECK(kqsvd_convert_transpose(KQSVD_F32, src, R, D, dst, R) == -1, "all finite");
  int wrong = 0;
  for (int i = 0; i < R; i++)
    for (int j = 0; j < D; j++) wrong += dst[j * R + i] != src[i * D + j];
  CHECK(wrong == 0, "%d misplaced elements", wrong);
  src[13 * D + 2] = INFINITY;
  src[15 * D + 0] = NAN;
  CHECK(kqsvd_convert_transpose(KQSVD_F32, src, R, D, dst, R) == 13, "first bad row");
  uint16_t h[4] = {0x3c00, 0x7e00, 0x3c00, 0x3c00};
  CHECK(kqsvd_convert_to_f64(KQSVD_F16, h, 4, dst) == 1, "f16 NaN found");
  uint16_t b[4] = {0x3f80, 0x3f80, 0xff80, 0x3f80};
  CHECK(kqsvd_convert_to_f64(KQSVD_BF16, b, 4, dst) == 2, "bf16 -Inf found");
  return check_exit("test_convert");
}
