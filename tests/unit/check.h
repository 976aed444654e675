/* Minimal assertions for the C tests: failures are counted and printed with
 * their position; a test's main() returns check_exit(). */
#ifndef KQSVD_TEST_CHECK_H
#define KQSVD_TEST_CHECK_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static int g_failures = 0, g_checks = 0;

#define CHECK(cond, ...)                                                       \
  do {                                                                         \
    g_checks++;                                                                \
    if (!(cond)) {                                                             \
      g_failures++;                                                            \
      fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                            \
      fputc('\n', stderr);                                                     \
    }                                                                          \
  } while (0)

/* |a - b| <= tol * scale, reporting both values. */
#define CHECK_CLOSE(a, b, tol, scale)                                                       \
  CHECK(fabs((double)(a) - (double)(b)) <= (tol) * (scale), "%.17g vs %.17g (tol %g x %g)", \
        (double)(a), (double)(b), (double)(tol), (double)(scale))

#define CHECK_OK(expr)                                  \
  do {                                                  \
    kqsvd_status_t s_ = (expr);                         \
    CHECK(s_ == KQSVD_OK, "%s", kqsvd_error_message()); \
    if (s_ != KQSVD_OK) kqsvd_error_clear();            \
  } while (0)

static inline int check_exit(const char *name) {
  printf("%s: %d checks, %d failed\n", name, g_checks, g_failures);
  return g_failures ? 1 : 0;
}

/* Deterministic standard normals for test matrices. */
static inline double test_normal(unsigned long long *state) {
  double u1, u2;
  *state = *state * 6364136223846793005ULL + 1442695040888963407ULL;
  u1 = ((double)(*state >> 11) + 0.5) * 0x1.0p-53;
  *state = *state * 6364136223846793005ULL + 1442695040888963407ULL;
  u2 = ((double)(*state >> 11) + 0.5) * 0x1.0p-53;
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

#endif
