/* Throughput of the streaming QR fold (kqsvd_qr_absorb) against dgemm on
 * one BLAS thread, and against the LAPACK dtpqrt kernel it replaced.
 *
 *   kqsvd_bench_qr [d [seconds_per_case]]      (defaults: 128, 0.3)
 *
 * Flop convention: 2 d^2 per folded row.  Each case is timed in 5 trials
 * and the best is printed, since other processes on a small machine only
 * ever slow a trial down.  Rows stream from a 16 Ki-row buffer, as a read
 * chunk would.  "old" is the replaced path (column-major conversion, which
 * is now faster for bf16, then LAPACK dtpqrt with nb = 32); "new" is
 * kqsvd_qr_absorb, conversion included. */
#include <cblas.h>
#include <lapacke.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kqsvd_convert.h"
#include "kqsvd_linalg.h"

enum { TRIALS = 5, SRC_ROWS = 16384 };

static double g_secs = 0.3;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static double normal(unsigned long long *s) {
  double u = 0.0;
  for (int k = 0; k < 12; k++) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    u += (double)(*s >> 11) * 0x1.0p-53;
  }
  return u - 6.0;
}

/* A timed case: runs one unit of work and returns its flops. */
typedef struct bench_case bench_case_t;
typedef double (*bench_fn)(bench_case_t *c);
struct bench_case {
  int d, m, n, k, block;
  char ta, tb;
  kqsvd_dtype_t type;
  const void *src;
  double *A, *B, *C, *R, *T, *work, *X;
  kqsvd_qr_ws_t *ws;
  int64_t row; /* next source row */
};

static double best_rate(bench_fn fn, bench_case_t *c) {
  double best = 0.0;
  for (int t = 0; t < TRIALS; t++) {
    double flops = 0.0, t0 = now(), dt = 0.0;
    do {
      flops += fn(c);
      dt = now() - t0;
    } while (dt < g_secs / TRIALS);
    if (flops / dt > best) best = flops / dt;
  }
  return best * 1e-9;
}

static double run_gemm(bench_case_t *c) {
  cblas_dgemm(CblasColMajor, c->ta == 'T' ? CblasTrans : CblasNoTrans,
              c->tb == 'T' ? CblasTrans : CblasNoTrans, c->m, c->n, c->k, 1.0, c->A,
              c->ta == 'T' ? c->k : c->m, c->B, c->tb == 'T' ? c->n : c->k, 1.0, c->C, c->m);
  return 2.0 * c->m * c->n * c->k;
}

/* Next `block` source rows (wrapping around the buffer). */
static const void *next_rows(bench_case_t *c) {
  if (c->row + c->block > SRC_ROWS) c->row = 0;
  const void *p = (const char *)c->src + (size_t)c->row * (size_t)c->d * kqsvd_dtype_size(c->type);
  c->row += c->block;
  return p;
}

/* The replaced kernel: transpose to column-major, LAPACK dtpqrt, nb = 32. */
static double run_old(bench_case_t *c) {
  const int d = c->d, nb = d < 32 ? d : 32;
  if (kqsvd_convert_transpose(c->type, next_rows(c), c->block, d, c->X, c->block) >= 0) abort();
  LAPACKE_dtpqrt_work(LAPACK_COL_MAJOR, c->block, d, 0, nb, c->R, d, c->X, c->block, c->T, nb,
                      c->work);
  return 2.0 * d * d * c->block;
}

static double run_new(bench_case_t *c) {
  int64_t bad = 0;
  if (kqsvd_qr_absorb(c->ws, c->R, next_rows(c), c->type, c->block, &bad) != KQSVD_OK || bad >= 0)
    abort();
  return 2.0 * c->d * c->d * c->block;
}

static double *alloc_fill(size_t n, unsigned long long *seed) {
  double *p = malloc(n * sizeof *p);
  if (!p) abort();
  for (size_t i = 0; i < n; i++) p[i] = normal(seed);
  return p;
}

int main(int argc, char **argv) {
  const int d = argc > 1 ? atoi(argv[1]) : 128;
  if (argc > 2) g_secs = atof(argv[2]);
  if (d < 1 || d > 4096 || !(g_secs > 0)) {
    fprintf(stderr, "usage: kqsvd_bench_qr [d [seconds_per_case]]\n");
    return 2;
  }
  kqsvd_blas_set_threads(1);
  unsigned long long seed = 7;
  bench_case_t c = {.d = d};

  /* dgemm: a large square product as the peak, then the shapes of the
   * kernel's trailing updates: rank-16 updates of the remaining columns
   * (B2 -= V W, and V^T B2 with the block's rows as inner dimension). */
  const int big = 2048, rest = d > 16 ? d - 16 : 1;
  c.A = alloc_fill((size_t)big * big, &seed);
  c.B = alloc_fill((size_t)big * big, &seed);
  c.C = alloc_fill((size_t)big * big, &seed);
  struct {
    const char *what;
    int m, n, k;
    char ta, tb;
  } gemms[] = {
      {"square 2048 (peak)", big, big, big, 'N', 'N'},
      {"256 x d x d", 256, d, d, 'N', 'N'},
      {"512 x (d-16) x 16", 512, rest, 16, 'N', 'N'},
      {"16 x (d-16) x 512, A^T B", 16, rest, 512, 'T', 'N'},
  };
  double peak = 0.0;
  printf("kqsvd_bench_qr: d = %d, 1 BLAS thread, best of %d trials, 2 d^2 flops per row\n\n", d,
         TRIALS);
  for (size_t g = 0; g < sizeof gemms / sizeof gemms[0]; g++) {
    c.m = gemms[g].m, c.n = gemms[g].n, c.k = gemms[g].k;
    c.ta = gemms[g].ta, c.tb = gemms[g].tb;
    const double r = best_rate(run_gemm, &c);
    if (g == 0) peak = r;
    printf("dgemm %-27s %6.1f GFLOP/s\n", gemms[g].what, r);
  }
  free(c.A);
  free(c.B);
  free(c.C);

  /* Source rows in both element types. */
  double *src64 = alloc_fill((size_t)SRC_ROWS * d, &seed);
  uint16_t *src16 = malloc((size_t)SRC_ROWS * d * sizeof *src16);
  if (!src16) abort();
  kqsvd_convert_from_f64(KQSVD_BF16, src64, (int64_t)SRC_ROWS * d, src16);
  c.R = calloc((size_t)d * d, sizeof(double));
  c.T = malloc((size_t)32 * d * sizeof(double));
  c.work = malloc((size_t)32 * d * sizeof(double));
  c.X = malloc((size_t)1024 * d * sizeof(double));
  if (!c.R || !c.T || !c.work || !c.X) abort();

  printf("\nfold of [R; X] (GFLOP/s, %% of peak dgemm)\n");
  printf("%6s  %15s %15s %15s %15s\n", "block", "old f64", "old bf16", "new f64", "new bf16");
  const int blocks[] = {256, 512, 1024};
  for (size_t b = 0; b < sizeof blocks / sizeof blocks[0]; b++) {
    double r[4];
    c.block = blocks[b];
    if (kqsvd_qr_ws_init(d, c.block, &c.ws) != KQSVD_OK) abort();
    for (int v = 0; v < 4; v++) {
      c.type = v % 2 ? KQSVD_BF16 : KQSVD_F64;
      c.src = v % 2 ? (const void *)src16 : (const void *)src64;
      c.row = 0;
      /* A well-conditioned running R, as after the first blocks of a run. */
      memset(c.R, 0, (size_t)d * d * sizeof(double));
      for (int i = 0; i < d; i++) c.R[(size_t)i * d + i] = 100.0;
      r[v] = best_rate(v < 2 ? run_old : run_new, &c);
    }
    printf("%6d ", c.block);
    for (int v = 0; v < 4; v++) printf(" %7.1f (%3.0f%%)", r[v], 100.0 * r[v] / peak);
    printf("\n");
    kqsvd_qr_ws_free(&c.ws);
  }
  free(src64);
  free(src16);
  free(c.R);
  free(c.T);
  free(c.work);
  free(c.X);
  return 0;
}
