/* The kernel of kqsvd_qr_absorb: Householder QR of [R; B], R upper
 * triangular, B a dense block of rows.
 *
 * Reflector j is [e_j; v_j], so every inner product only involves B.  The
 * columns are split recursively (Elmroth-Gustavson): factor the left part,
 * getting its block reflector I - V T V^T, apply it to the right part as
 *   W = T^T (R12 + V^T B2),  R12 -= W,  B2 -= V W,
 * then factor the right part.  T is only formed where an update needs it:
 * the outermost splits peel SPINE columns at a time, which keeps the extra
 * work of forming T (m n1 n2 flops per split) to a few percent, and halve
 * below.  Panels of PANEL columns are factored unblocked, one sweep over the
 * rows per column: each sweep applies the previous reflector and sums the
 * dot products of the next pivot column with all the panel's columns, which
 * give its norm, the updates of the other columns and its column of T.
 *
 * B is row-major: one panel row is one AVX-512 vector, and the rows arrive
 * row-major.  The hot loops exist twice, with GCC vector types for AVX-512
 * (where V^T B2 and B2 -= V W are register-tiled loops too) and as plain
 * loops built for AVX2 and baseline x86-64 (products by dgemm); the path is
 * chosen at run time (kqsvd_isa_active in isa.c: the CPU's best, or the
 * set the environment variable KQSVD_ISA names), so the build flags stay
 * generic.  A process takes one path throughout, a machine the same one
 * unless KQSVD_ISA differs, and the order of every sum depends only on m,
 * n and the path, so results are reproducible (they differ in the last
 * bits between paths, hence between machines, as OpenBLAS's do: FMA or
 * not, dgemm or not).  test_qr runs once per path. */
#include <cblas.h>
#include <lapacke.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kqsvd_isa.h"
#include "kqsvd_linalg.h"

#define PANEL 8     /* unblocked panel width: one vector of doubles */
#define SPINE 16    /* columns peeled per outermost split */
#define TILE_ROWS 8 /* register tile height of the products */

typedef double v8d __attribute__((vector_size(PANEL * sizeof(double))));
typedef int64_t v8l __attribute__((vector_size(PANEL * sizeof(int64_t))));
typedef float v8f __attribute__((vector_size(PANEL * sizeof(float))));
typedef uint32_t v8u __attribute__((vector_size(PANEL * sizeof(uint32_t))));
typedef uint16_t v8h __attribute__((vector_size(PANEL * sizeof(uint16_t))));

/* Unaligned vector access without breaking aliasing rules. */
#define LOAD(v, p) memcpy(&(v), (p), sizeof(v))
#define STORE(p, v) memcpy((p), &(v), sizeof(v))
#define INLINE static inline __attribute__((always_inline))

/* ISO C mode turns contraction off; fused multiply-adds are faster and
 * more accurate, and the operation order is fixed by the code anyway. */
#if defined(__GNUC__) && !defined(__clang__)
#define FMA_CONTRACT __attribute__((optimize("fp-contract=fast")))
#else
#define FMA_CONTRACT
#endif

#define UNPAREN(...) __VA_ARGS__

/* GCC only: the vector code relies on __builtin_shuffle. */
#ifdef KQSVD_ISA_X86_CLONES
#define HAVE_X86_CLONES 1
/* x86-64-v4: what every AVX-512 server core has (kqsvd_isa_supported
 * checks these features). */
#define AVX512_FN __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx512cd,fma")))
/* Defines `static void name(kqsvd_isa_t isa, params...)`: name##_vec (GCC
 * vectors of 8 doubles) on AVX-512, name##_plain (scalar loops the compiler
 * may vectorize) built for AVX2 or baseline x86-64 otherwise; 8-lane
 * vectors split into halves compile badly. */
#define MULTIVERSION(name, params, args)                                            \
  AVX512_FN FMA_CONTRACT static void name##_avx512 params { name##_vec args; }      \
  __attribute__((target("avx2,fma"))) FMA_CONTRACT static void name##_avx2 params { \
    name##_plain args;                                                              \
  }                                                                                 \
  static void name##_base params { name##_plain args; }                             \
  static void name(kqsvd_isa_t isa, UNPAREN params) {                               \
    switch (isa) {                                                                  \
    case KQSVD_ISA_AVX512: name##_avx512 args; break;                               \
    case KQSVD_ISA_AVX2: name##_avx2 args; break;                                   \
    default: name##_base args; break;                                               \
    }                                                                               \
  }
#else
#define MULTIVERSION(name, params, args) \
  FMA_CONTRACT static void name(kqsvd_isa_t isa, UNPAREN params) { name##_plain args; }
#endif

/* ---- loading a block ----------------------------------------------------- */

#ifdef HAVE_X86_CLONES
/* Converts m rows of d elements to float64 rows of B (stride ldb); *bad
 * becomes nonzero when some element is NaN or Inf (exponent bits all set,
 * as in convert.c), and the caller then looks for the row.  The flags are
 * only reduced once per block. */
INLINE void load_vec(kqsvd_dtype_t type, const void *src, int m, int d, double *B, int ldb,
                     int *bad) {
  int tail = 0;
  switch (type) {
  case KQSVD_F64: {
    v8l flag = {0};
    const int64_t e = INT64_C(0x7ff0000000000000);
    for (int r = 0; r < m; r++) {
      const double *s = (const double *)src + (size_t)r * d;
      double *dst = B + (size_t)r * ldb;
      int j = 0;
      for (; j + PANEL <= d; j += PANEL) {
        v8l u;
        LOAD(u, s + j);
        flag |= (u & e) == e;
        STORE(dst + j, u);
      }
      for (; j < d; j++) tail |= !isfinite(dst[j] = s[j]);
    }
    for (int k = 0; k < PANEL; k++) tail |= flag[k] != 0;
    break;
  }
  case KQSVD_F32: {
    v8u flag = {0};
    for (int r = 0; r < m; r++) {
      const float *s = (const float *)src + (size_t)r * d;
      double *dst = B + (size_t)r * ldb;
      int j = 0;
      for (; j + PANEL <= d; j += PANEL) {
        v8u u;
        LOAD(u, s + j);
        flag |= (u & 0x7f800000u) == 0x7f800000u;
        const v8d x = __builtin_convertvector((v8f)u, v8d);
        STORE(dst + j, x);
      }
      for (; j < d; j++) tail |= !isfinite(dst[j] = s[j]);
    }
    for (int k = 0; k < PANEL; k++) tail |= flag[k] != 0;
    break;
  }
  case KQSVD_BF16: {
    /* bf16 is the top half of a float32, so the widening is exact. */
    v8h flag = {0};
    for (int r = 0; r < m; r++) {
      const uint16_t *s = (const uint16_t *)src + (size_t)r * d;
      double *dst = B + (size_t)r * ldb;
      int j = 0;
      for (; j + PANEL <= d; j += PANEL) {
        v8h h;
        LOAD(h, s + j);
        flag |= (h & 0x7f80u) == 0x7f80u;
        const v8d x = __builtin_convertvector((v8f)(__builtin_convertvector(h, v8u) << 16), v8d);
        STORE(dst + j, x);
      }
      for (; j < d; j++) {
        dst[j] = kqsvd_bf16_to_f64(s[j]);
        tail |= (s[j] & 0x7f80u) == 0x7f80u;
      }
    }
    for (int k = 0; k < PANEL; k++) tail |= flag[k] != 0;
    break;
  }
  case KQSVD_F16: /* convert.c's table */
    for (int r = 0; r < m && !tail; r++)
      tail = kqsvd_convert_to_f64(type, (const uint16_t *)src + (size_t)r * d, d,
                                  B + (size_t)r * ldb) >= 0;
    break;
  }
  *bad = tail;
}
#endif
INLINE void load_plain(kqsvd_dtype_t type, const void *src, int m, int d, double *B, int ldb,
                       int *bad) {
  int flag = 0;
  for (int r = 0; r < m && !flag; r++) {
    double *dst = B + (size_t)r * ldb;
    const size_t off = (size_t)r * d;
    switch (type) {
    case KQSVD_F64:
      for (int j = 0; j < d; j++) flag |= !isfinite(dst[j] = ((const double *)src)[off + j]);
      break;
    case KQSVD_F32:
      for (int j = 0; j < d; j++) flag |= !isfinite(dst[j] = ((const float *)src)[off + j]);
      break;
    case KQSVD_BF16:
      for (int j = 0; j < d; j++) {
        const uint16_t h = ((const uint16_t *)src)[off + j];
        flag |= (h & 0x7f80u) == 0x7f80u;
        dst[j] = kqsvd_bf16_to_f64(h);
      }
      break;
    case KQSVD_F16:
      flag = kqsvd_convert_to_f64(type, (const uint16_t *)src + off, d, dst) >= 0;
      break;
    }
  }
  *bad = flag;
}
MULTIVERSION(load,
             (kqsvd_dtype_t type, const void *src, int m, int d, double *B, int ldb, int *bad),
             (type, src, m, d, B, ldb, bad))

int64_t kqsvd_tpqr_load(kqsvd_dtype_t type, const void *src, int m, int d, double *B, int ldb) {
  const kqsvd_isa_t isa = kqsvd_isa_active();
  int bad = 0;
  load(isa, type, src, m, d, B, ldb, &bad);
  if (!bad) return -1;
  const size_t row_bytes = (size_t)d * kqsvd_dtype_size(type);
  for (int r = 0; r < m; r++) {
    load(isa, type, (const char *)src + (size_t)r * row_bytes, 1, d, B + (size_t)r * ldb, ldb,
         &bad);
    if (bad) return r;
  }
  return -1;
}

/* ---- panel sweeps -------------------------------------------------------- */

#ifdef HAVE_X86_CLONES
/* acc = sum over rows of row * row[i], after (when p >= 0) applying
 * reflector p to each row: row -= row[p] coef, coef vanishing on lanes <= p.
 * Lane p keeps the reflector unscaled (the panel scales all rows once at
 * its end), which leaves three vector operations per row.  Four
 * accumulators hide the add latency, combined in a fixed order. */
INLINE void sweep_vec(int m, double *B, int ldb, int p, const double *coef_in, int i,
                      double *acc_out) {
  v8d a[4] = {{0}, {0}, {0}, {0}}, coef;
  const v8l lane = {i, i, i, i, i, i, i, i};
  LOAD(coef, coef_in);
  int r = 0;
  if (p < 0) {
    for (; r + 4 <= m; r += 4)
#pragma GCC unroll 4
      for (int u = 0; u < 4; u++) {
        const double *b = B + (size_t)(r + u) * ldb;
        v8d x;
        LOAD(x, b);
        a[u] += x * b[i];
      }
    for (; r < m; r++) {
      const double *b = B + (size_t)r * ldb;
      v8d x;
      LOAD(x, b);
      a[0] += x * b[i];
    }
  } else {
    for (; r + 4 <= m; r += 4)
#pragma GCC unroll 4
      for (int u = 0; u < 4; u++) {
        double *b = B + (size_t)(r + u) * ldb;
        v8d x;
        LOAD(x, b);
        x -= b[p] * coef;
        STORE(b, x);
        /* Lane i from the register: reloading it from the row just
         * stored would wait on store forwarding. */
        a[u] += x * __builtin_shuffle(x, lane);
      }
    for (; r < m; r++) {
      double *b = B + (size_t)r * ldb;
      v8d x;
      LOAD(x, b);
      x -= b[p] * coef;
      STORE(b, x);
      a[0] += x * __builtin_shuffle(x, lane);
    }
  }
  const v8d acc = (a[0] + a[1]) + (a[2] + a[3]);
  STORE(acc_out, acc);
}
#endif
/* The same sums in the same order, in plain loops. */
INLINE void sweep_plain(int m, double *B, int ldb, int p, const double *coef_in, int i,
                        double *acc) {
  double a[4][PANEL] = {{0}}, coef[PANEL];
  memcpy(coef, coef_in, sizeof coef);
  for (int r = 0; r < m; r++) {
    double *b = B + (size_t)r * ldb, *ar = a[r < (m & ~3) ? r & 3 : 0];
    if (p >= 0) {
      const double s = b[p];
      for (int k = 0; k < PANEL; k++) b[k] -= s * coef[k];
    }
    const double t = b[i];
    for (int k = 0; k < PANEL; k++) ar[k] += b[k] * t;
  }
  for (int k = 0; k < PANEL; k++) acc[k] = (a[0][k] + a[1][k]) + (a[2][k] + a[3][k]);
}
MULTIVERSION(sweep, (int m, double *B, int ldb, int p, const double *coef, int i, double *acc),
             (m, B, ldb, p, coef, i, acc))

/* Multiplies every panel row lane by lane by sv. */
#ifdef HAVE_X86_CLONES
INLINE void scale_rows_vec(int m, double *B, int ldb, const double *sv_in) {
  v8d sv;
  LOAD(sv, sv_in);
  for (int r = 0; r < m; r++) {
    double *b = B + (size_t)r * ldb;
    v8d x;
    LOAD(x, b);
    x *= sv;
    STORE(b, x);
  }
}
#endif
INLINE void scale_rows_plain(int m, double *B, int ldb, const double *sv) {
  for (int r = 0; r < m; r++)
    for (int k = 0; k < PANEL; k++) B[(size_t)r * ldb + k] *= sv[k];
}
MULTIVERSION(scale_rows, (int m, double *B, int ldb, const double *sv), (m, B, ldb, sv))

/* ---- level-3 products ---------------------------------------------------- */

/* Both act on row-major blocks whose column counts are rounded up to whole
 * vectors: the pad columns of B are zero, so pad results are zero and pad
 * columns stay zero.  A is p columns (p a multiple of 8) and C q columns of
 * the same m rows of stride ld.  On AVX-512, tiles of 8 rows by 1-2
 * vectors keep 8-16 accumulators in registers; nothing is packed, as all
 * operands sit in L1 or L2. */
#ifdef HAVE_X86_CLONES
INLINE void gram_tile(int m, int nv, const double *A, const double *C, int ld, double *G, int ldg) {
  v8d acc[TILE_ROWS][2];
#pragma GCC unroll 8
  for (int k = 0; k < TILE_ROWS; k++)
#pragma GCC unroll 2
    for (int v = 0; v < nv; v++) acc[k][v] = (v8d){0};
  for (int r = 0; r < m; r++) {
    const double *a = A + (size_t)r * ld, *c = C + (size_t)r * ld;
    v8d x[2];
#pragma GCC unroll 2
    for (int v = 0; v < nv; v++) LOAD(x[v], c + v * PANEL);
#pragma GCC unroll 8
    for (int k = 0; k < TILE_ROWS; k++)
#pragma GCC unroll 2
      for (int v = 0; v < nv; v++) acc[k][v] += a[k] * x[v];
  }
#pragma GCC unroll 8
  for (int k = 0; k < TILE_ROWS; k++)
#pragma GCC unroll 2
    for (int v = 0; v < nv; v++) STORE(G + (size_t)k * ldg + v * PANEL, acc[k][v]);
}

AVX512_FN FMA_CONTRACT static void gram_avx512(int m, int p, int qv, const double *A,
                                               const double *C, int ld, double *G, int ldg) {
  for (int k0 = 0; k0 < p; k0 += TILE_ROWS) {
    int v = 0;
    for (; v + 2 <= qv; v += 2)
      gram_tile(m, 2, A + k0, C + v * PANEL, ld, G + (size_t)k0 * ldg + v * PANEL, ldg);
    if (v < qv) gram_tile(m, 1, A + k0, C + v * PANEL, ld, G + (size_t)k0 * ldg + v * PANEL, ldg);
  }
}

INLINE void update_tile(int nr, int nv, int p, const double *A, int ld, const double *W, int ldw,
                        double *C) {
  v8d acc[TILE_ROWS][2];
#pragma GCC unroll 8
  for (int i = 0; i < nr; i++)
#pragma GCC unroll 2
    for (int v = 0; v < nv; v++) LOAD(acc[i][v], C + (size_t)i * ld + v * PANEL);
  for (int k = 0; k < p; k++) {
    v8d w[2];
#pragma GCC unroll 2
    for (int v = 0; v < nv; v++) LOAD(w[v], W + (size_t)k * ldw + v * PANEL);
#pragma GCC unroll 8
    for (int i = 0; i < nr; i++)
#pragma GCC unroll 2
      for (int v = 0; v < nv; v++) acc[i][v] -= A[(size_t)i * ld + k] * w[v];
  }
#pragma GCC unroll 8
  for (int i = 0; i < nr; i++)
#pragma GCC unroll 2
    for (int v = 0; v < nv; v++) STORE(C + (size_t)i * ld + v * PANEL, acc[i][v]);
}

/* One row of tiles: nr rows, all qv vectors. */
INLINE void update_rows(int nr, int p, int qv, const double *A, int ld, const double *W, int ldw,
                        double *C) {
  int v = 0;
  for (; v + 2 <= qv; v += 2) update_tile(nr, 2, p, A, ld, W + v * PANEL, ldw, C + v * PANEL);
  if (v < qv) update_tile(nr, 1, p, A, ld, W + v * PANEL, ldw, C + v * PANEL);
}

AVX512_FN FMA_CONTRACT static void update_avx512(int m, int p, int qv, const double *A, int ld,
                                                 const double *W, int ldw, double *C) {
  int r = 0;
  for (; r + TILE_ROWS <= m; r += TILE_ROWS)
    update_rows(TILE_ROWS, p, qv, A + (size_t)r * ld, ld, W, ldw, C + (size_t)r * ld);
  for (; r < m; r++) update_rows(1, p, qv, A + (size_t)r * ld, ld, W, ldw, C + (size_t)r * ld);
}
#endif

/* G (p x q row-major, ldg) = A^T C.  dgemm sees row-major blocks as their
 * column-major transposes. */
static void gram(kqsvd_isa_t isa, int m, int p, int q, const double *A, const double *C, int ld,
                 double *G, int ldg) {
  const int qv = (q + PANEL - 1) / PANEL;
#ifdef HAVE_X86_CLONES
  if (isa == KQSVD_ISA_AVX512) {
    gram_avx512(m, p, qv, A, C, ld, G, ldg);
    return;
  }
#endif
  cblas_dgemm(CblasColMajor, CblasNoTrans, CblasTrans, qv * PANEL, p, m, 1.0, C, ld, A, ld, 0.0, G,
              ldg);
}

/* C -= A W, W p x q row-major (ldw) with zero pad columns. */
static void update(kqsvd_isa_t isa, int m, int p, int q, const double *A, int ld, const double *W,
                   int ldw, double *C) {
  const int qv = (q + PANEL - 1) / PANEL;
#ifdef HAVE_X86_CLONES
  if (isa == KQSVD_ISA_AVX512) {
    update_avx512(m, p, qv, A, ld, W, ldw, C);
    return;
  }
#endif
  cblas_dgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, qv * PANEL, m, p, -1.0, W, ldw, A, ld, 1.0,
              C, ld);
}

/* ---- factorization ------------------------------------------------------- */

/* Reflector i when the sums of squares are unsafe (near underflow or
 * overflow): LAPACK's dlarfg on a copy, leaving column i scaled, then the
 * dot products with it. */
static double slow_reflector(kqsvd_isa_t isa, int m, double *B, int ldb, int i, double *alpha,
                             double *tmp, double *acc) {
  static const double unused[PANEL] = {0};
  double tau = 0.0;
  for (int r = 0; r < m; r++) tmp[r] = B[(size_t)r * ldb + i];
  LAPACKE_dlarfg_work(m + 1, alpha, tmp, 1, &tau);
  for (int r = 0; r < m; r++) B[(size_t)r * ldb + i] = tmp[r];
  sweep(isa, m, B, ldb, -1, unused, i, acc);
  return tau;
}

/* Unblocked QR of nb <= PANEL columns (B row-major; lanes beyond nb are
 * read but never changed).  Reflector i is [e_i; sv[i] u_i], u_i left in
 * lane i until the final scaling; its tau and scale follow dlarfg. */
static void panel(kqsvd_isa_t isa, int m, int nb, double *R, int ldr, double *B, int ldb, double *T,
                  int ldt, double *tmp) {
  double acc[PANEL], coef[PANEL] = {0}, y[PANEL], sv[PANEL];
  for (int k = 0; k < PANEL; k++) sv[k] = 1.0;
  for (int i = 0; i < nb; i++) {
    sweep(isa, m, B, ldb, i - 1, coef, i, acc);
    double *alpha = R + (size_t)i * ldr + i, tau = 0.0, f = 1.0;
    const double sq = acc[i], a = *alpha;
    int finite = 1;
    for (int k = 0; k < nb; k++) finite &= isfinite(acc[k]);
    /* Away from underflow and overflow, a plain sum of squares is as
     * accurate as dnrm2's scaled one (and the dots' underflows are below
     * any rounding of R); otherwise, zero columns included, dlarfg decides. */
    if (finite && sq >= 0x1p-900) {
      const double h = fabs(a) < 0x1p500 && sq < 0x1p1000 ? sqrt(a * a + sq) : hypot(a, sqrt(sq));
      const double beta = -copysign(h, a);
      tau = (beta - a) / beta;
      f = 1.0 / (a - beta);
      *alpha = beta;
    } else {
      tau = slow_reflector(isa, m, B, ldb, i, alpha, tmp, acc);
    }
    /* y = v_i^T [v_0 .. v_{i-1}, x_i .. x_{nb-1}] */
    sv[i] = f;
    for (int j = 0; j < i; j++) y[j] = f * sv[j] * acc[j];
    for (int k = i; k < nb; k++) y[k] = f * acc[k];
    for (int k = 0; k < PANEL; k++) coef[k] = 0.0;
    for (int k = i + 1; k < nb; k++) {
      double *rik = R + (size_t)k * ldr + i;
      const double w = tau * (*rik + y[k]);
      *rik -= w;
      coef[k] = f * w; /* the next sweep subtracts u_i[r] coef */
    }
    /* T(0:i, i) = -tau T(0:i, 0:i) y(0:i), T row-major */
    for (int j = 0; j < i; j++) {
      const double *tj = T + (size_t)j * ldt;
      double s = 0.0;
      for (int l = j; l < i; l++) s += tj[l] * y[l];
      T[(size_t)j * ldt + i] = -tau * s;
    }
    T[(size_t)i * ldt + i] = tau;
  }
  scale_rows(isa, m, B, ldb, sv);
}

/* Factors columns 0..n-1 of [R; B]; T (row-major, upper) gets the block
 * reflector factor when want_t.  Left parts are multiples of PANEL wide, so
 * a vector that crosses column n ends in the matrix's own zero pad. */
static void rec(kqsvd_isa_t isa, int m, int n, double *R, int ldr, double *B, int ldb, double *T,
                int ldt, int want_t, double *W, double *tmp) {
  if (n <= PANEL) {
    panel(isa, m, n, R, ldr, B, ldb, T, ldt, tmp);
    return;
  }
  int n1 = (n / 2) / PANEL * PANEL;
  if (!want_t && SPINE < n) n1 = SPINE;
  if (n1 < PANEL) n1 = PANEL;
  const int n2 = n - n1, ldw = (n2 + PANEL - 1) / PANEL * PANEL;
  double *R12 = R + (size_t)n1 * ldr, *R22 = R12 + n1, *B2 = B + n1;
  double *T12 = T + n1, *T22 = T + (size_t)n1 * ldt + n1;
  rec(isa, m, n1, R, ldr, B, ldb, T, ldt, 1, W, tmp);
  /* W = T1^T (R12 + V1^T B2); dtrmm sees row-major W and T transposed. */
  gram(isa, m, n1, n2, B, B2, ldb, W, ldw);
  for (int j = 0; j < n2; j++)
    for (int i = 0; i < n1; i++) W[(size_t)i * ldw + j] += R12[(size_t)j * ldr + i];
  cblas_dtrmm(CblasColMajor, CblasRight, CblasLower, CblasTrans, CblasNonUnit, n2, n1, 1.0, T, ldt,
              W, ldw);
  for (int j = 0; j < n2; j++)
    for (int i = 0; i < n1; i++) R12[(size_t)j * ldr + i] -= W[(size_t)i * ldw + j];
  update(isa, m, n1, n2, B, ldb, W, ldw, B2);
  rec(isa, m, n2, R22, ldr, B2, ldb, T22, ldt, want_t, W, tmp);
  if (want_t) {
    /* T12 = -T1 (V1^T V2) T2 */
    gram(isa, m, n1, n2, B, B2, ldb, T12, ldt);
    cblas_dtrmm(CblasColMajor, CblasRight, CblasLower, CblasNoTrans, CblasNonUnit, n2, n1, -1.0, T,
                ldt, T12, ldt);
    cblas_dtrmm(CblasColMajor, CblasLeft, CblasLower, CblasNoTrans, CblasNonUnit, n2, n1, 1.0, T22,
                ldt, T12, ldt);
  }
}

int kqsvd_tpqr_ld(int n) {
  /* An odd number of cache lines per row spreads a panel's rows over all L1
   * sets; a power-of-two stride (1 KiB at d = 128) piles them into a few
   * and costs a quarter of the speed. */
  const int ld = (n + PANEL - 1) / PANEL * PANEL;
  return (ld / PANEL) % 2 ? ld : ld + PANEL;
}

/* T and W (n x ld each) and one column of B. */
size_t kqsvd_tpqr_work_size(int m, int n) {
  return 2 * (size_t)n * (size_t)kqsvd_tpqr_ld(n) + (size_t)m;
}

void kqsvd_tpqr_isa(kqsvd_isa_t isa, int m, int n, double *R, int ldr, double *B, int ldb,
                    double *work) {
  const int ld = kqsvd_tpqr_ld(n);
  double *T = work, *W = T + (size_t)n * ld, *tmp = W + (size_t)n * ld;
  rec(isa, m, n, R, ldr, B, ldb, T, ld, 0, W, tmp);
}

void kqsvd_tpqr(int m, int n, double *R, int ldr, double *B, int ldb, double *work) {
  kqsvd_tpqr_isa(kqsvd_isa_active(), m, n, R, ldr, B, ldb, work);
}
