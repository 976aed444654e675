/* The machine's limits that kqsvd's rates are compared with:
 *   kqsvd_bench_machine dgemm THREADS     OpenBLAS dgemm GFLOP/s (n = 2048, best of 5)
 *   kqsvd_bench_machine read FILE...      raw sequential read rate of FILEs, from the page
 *                                         cache (warm: read twice, the second timed) and,
 *                                         where the kernel honours it, cold (after
 *                                         posix_fadvise DONTNEED)
 * Prints key=value lines for bench/calibrate_bench.py. */
#include <cblas.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kqsvd_linalg.h"
#include "kqsvd_util.h"

static int dgemm_rate(int threads) {
  const int n = 2048;
  double *A = malloc(sizeof(double) * n * n), *B = malloc(sizeof(double) * n * n),
         *C = malloc(sizeof(double) * n * n);
  if (!A || !B || !C) return 1;
  for (size_t i = 0; i < (size_t)n * n; i++) A[i] = B[i] = C[i] = 1.0 / (double)(i % 97 + 1);
  kqsvd_blas_set_threads(threads);
  double best = 1e30;
  for (int rep = 0; rep < 6; rep++) {
    const double t0 = kqsvd_now();
    cblas_dgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0, A, n, B, n, 0.0, C, n);
    const double t = kqsvd_now() - t0;
    if (rep > 0 && t < best) best = t; /* the first warms caches and threads */
  }
  printf("dgemm_threads=%d dgemm_gflops=%.2f\n", threads, 2.0 * n * (double)n * n / best / 1e9);
  free(A), free(B), free(C);
  return 0;
}

/* Seconds to read every file once, in 4 MiB reads; -1 on error. */
static double read_all(int nfiles, char **files, int drop, double *bytes) {
  static char buf[4 << 20];
  *bytes = 0;
  const double t0 = kqsvd_now();
  for (int i = 0; i < nfiles; i++) {
    const int fd = open(files[i], O_RDONLY);
    if (fd < 0) {
      perror(files[i]);
      return -1;
    }
    if (drop) posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ssize_t got;
    while ((got = read(fd, buf, sizeof buf)) > 0) *bytes += (double)got;
    close(fd);
  }
  return kqsvd_now() - t0;
}

int main(int argc, char **argv) {
  if (argc >= 3 && !strcmp(argv[1], "dgemm")) return dgemm_rate(atoi(argv[2]));
  if (argc >= 3 && !strcmp(argv[1], "read")) {
    double bytes = 0;
    if (read_all(argc - 2, argv + 2, 0, &bytes) < 0) return 1; /* into the page cache */
    const double warm = read_all(argc - 2, argv + 2, 0, &bytes);
    const double cold = read_all(argc - 2, argv + 2, 1, &bytes);
    read_all(argc - 2, argv + 2, 0, &bytes); /* leave them cached for the runs that follow */
    printf("read_bytes=%.0f read_warm_bps=%.4g read_cold_bps=%.4g\n", bytes, bytes / warm,
           bytes / cold);
    return 0;
  }
  fprintf(stderr, "usage: kqsvd_bench_machine dgemm THREADS | read FILE...\n");
  return 2;
}
