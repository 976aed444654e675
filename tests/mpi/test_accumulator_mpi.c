/* The public accumulator (include/kqsvd/kqsvd.h), under mpiexec with any
 * rank count.  Each rank absorbs its share of the rows of a common random
 * model (keys, every query head and values, as strided bf16, f32 and f64
 * rows in uneven calls); after kqsvd_acc_reduce the root's factors equal
 * LAPACK dgeqrf's R of all rows up to row signs, within a multiple of
 * eps * sqrt(d) * ||X||.  Then save and load give the same factors bit for
 * bit, finish and write make a proj.h5 whose kqsvd projection reproduces
 * K Q^T's best rank-r error, and bad calls fail with a message and the
 * error handler. */
#include <float.h>
#include <lapacke.h>
#include <mpi.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "../unit/check.h"
#include "kqsvd/kqsvd.h"
#include "kqsvd_acc.h"
#include "kqsvd_convert.h"
#include "kqsvd_error.h"
#include "kqsvd_linalg.h"
#include "mpi_check.h"

enum { L = 2, H = 2, G = 3, D = 8, HID = 20, T = 701 };

/* Element j of row i of a head's matrix: deterministic, so any rank can make
 * any row; decaying columns make the spectra realistic. */
static double value(int tensor, int64_t layer, int64_t head, int64_t i, int j) {
  unsigned long long s = 2654435761ULL * (unsigned long long)(i + 1) +
                         40503ULL * (unsigned long long)(tensor * 97 + layer * 13 + head) +
                         (unsigned long long)j * 7ULL;
  double x = test_normal(&s);
  (void)test_normal(&s);
  return x * pow(10.0, -2.0 * j / D) * (1.0 + 0.5 * head);
}

/* The R factor of a head's T rows by LAPACK, column-major with a
 * non-negative diagonal. */
static void lapack_r(int tensor, int64_t layer, int64_t head, double *R) {
  double *A = malloc(sizeof(double) * T * D), tau[D];
  for (int64_t i = 0; i < T; i++)
    for (int j = 0; j < D; j++) A[(size_t)j * T + i] = value(tensor, layer, head, i, j);
  LAPACKE_dgeqrf(LAPACK_COL_MAJOR, T, D, A, T, tau);
  for (int j = 0; j < D; j++)
    for (int i = 0; i < D; i++) R[j * D + i] = i <= j ? A[(size_t)j * T + i] : 0.0;
  kqsvd_r_fix_signs(D, R);
  free(A);
}

/* Rows [r0, r1) of one head as `type`, each `stride` elements apart. */
static void *make_rows(int tensor, int64_t layer, int64_t head, int64_t r0, int64_t r1,
                       kqsvd_dtype_t type, int64_t stride) {
  const size_t esz = kqsvd_dtype_size(type);
  char *buf = calloc((size_t)((r1 - r0) * stride), esz);
  for (int64_t i = r0; i < r1; i++) {
    double x[D];
    for (int j = 0; j < D; j++) x[j] = value(tensor, layer, head, i, j);
    kqsvd_convert_from_f64(type, x, D, buf + (size_t)((i - r0) * stride) * esz);
  }
  return buf;
}

/* Head groups: the H KV heads of each layer as one group (head_groups = H).
 * Keys come as rows of both heads side by side, queries per head; after the
 * reduction the joint factor equals dgeqrf's R of [K_0 K_1] up to row signs,
 * and the queries' factor stays exactly block-diagonal. */
static void grouped(int rank, int size, const char *ckpt_of_ungrouped) {
  enum { W = H * D };
  kqsvd_shape_t shape = {L, H, G, D, HID};
  kqsvd_acc_options_t opt;
  kqsvd_acc_options_default(&opt);
  opt.block_rows = 64;
  opt.head_groups = H;
  kqsvd_acc_t *acc = NULL, *back = NULL;
  CHECK_OK(kqsvd_acc_init(&shape, &opt, &acc));
  const int64_t r0 = T * rank / size, r1 = T * (rank + 1) / size;
  double *rows = malloc(sizeof(double) * (size_t)(T * (W + 5)));
  for (int64_t l = 0; l < L; l++) {
    for (int64_t i = r0; i < r1; i++)
      for (int h = 0; h < H; h++)
        for (int j = 0; j < D; j++)
          rows[(i - r0) * (W + 5) + h * D + j] = value(KQSVD_KEYS, l, h, i, j);
    CHECK_OK(kqsvd_acc_absorb(acc, KQSVD_KEYS, l, 0, 0, rows, KQSVD_F64, r1 - r0, W + 5));
    for (int64_t q = 0; q < H * G; q++) {
      double *qr = make_rows(KQSVD_QUERIES, l, q, r0, r1, KQSVD_F64, D);
      CHECK_OK(kqsvd_acc_absorb(acc, KQSVD_QUERIES, l, q / G, q % G, qr, KQSVD_F64, r1 - r0, D));
      free(qr);
    }
  }
  CHECK(kqsvd_acc_absorb(acc, KQSVD_KEYS, 0, 1, 0, rows, KQSVD_F64, 1, W) == KQSVD_ERR_USAGE &&
            strstr(kqsvd_last_error(), "first head"),
        "a group's second head: %s", kqsvd_last_error());
  kqsvd_clear_error();
  CHECK_OK(kqsvd_acc_reduce(acc, MPI_COMM_WORLD, 0));
  if (rank == 0) {
    double *A = malloc(sizeof(double) * T * W), tau[W], ref[W * W], got[W * W], worst = 0.0;
    for (int64_t l = 0; l < L; l++) {
      for (int64_t i = 0; i < T; i++)
        for (int j = 0; j < W; j++) A[(size_t)j * T + i] = value(KQSVD_KEYS, l, j / D, i, j % D);
      LAPACKE_dgeqrf(LAPACK_COL_MAJOR, T, W, A, T, tau);
      for (int j = 0; j < W; j++)
        for (int i = 0; i < W; i++) ref[j * W + i] = i <= j ? A[(size_t)j * T + i] : 0.0;
      kqsvd_r_fix_signs(W, ref);
      CHECK_OK(kqsvd_acc_factor(acc, KQSVD_KEYS, l, 1, got)); /* row-major */
      double nrm = 0.0;
      for (int i = 0; i < W * W; i++) nrm = fmax(nrm, fabs(ref[i]));
      for (int i = 0; i < W; i++) {
        const double sg = got[i * W + i] < 0 ? -1.0 : 1.0;
        for (int j = 0; j < W; j++)
          worst = fmax(worst, fabs(sg * got[i * W + j] - ref[j * W + i]) / nrm);
      }
      const size_t tri = kqsvd_tri_size(W);
      kqsvd_tri_unpack(W, kqsvd_acc_state(acc) + ((size_t)l * 3 + 1) * tri, got);
      for (int j = D; j < W; j++)
        for (int i = 0; i < D; i++) CHECK(got[j * W + i] == 0.0, "Q off the diagonal blocks");
    }
    free(A);
    CHECK(worst <= 64.0 * DBL_EPSILON * sqrt((double)W), "joint R vs dgeqrf: %.3e", worst);
    printf("head groups on %d ranks: joint R vs LAPACK dgeqrf %.2e\n", size, worst);
  }
  free(rows);
  /* Checkpoints: the grouped state round-trips; a per-head one is refused. */
  char path[220];
  snprintf(path, sizeof path, "%s.grouped.h5", ckpt_of_ungrouped);
  CHECK_OK(kqsvd_acc_save(acc, path, 0));
  CHECK_OK(kqsvd_acc_init(&shape, &opt, &back));
  CHECK_OK(kqsvd_acc_load(back, path));
  CHECK(memcmp(kqsvd_acc_state(acc), kqsvd_acc_state(back),
               sizeof(double) * (size_t)kqsvd_acc_state_doubles(acc)) == 0,
        "grouped state loaded");
  CHECK(kqsvd_acc_load(back, ckpt_of_ungrouped) == KQSVD_ERR_INPUT, "per-head checkpoint refused");
  kqsvd_clear_error();
  remove(path);
  kqsvd_acc_free(&back);
  kqsvd_acc_free(&acc);
}

static int g_handled;
static void handler(kqsvd_status_t st, const char *msg, void *ctx) {
  (void)ctx;
  g_handled += st != KQSVD_OK && msg[0] != '\0';
}

int main(int argc, char **argv) {
  int rank, size;
  test_mpi_init(&argc, &argv, &rank, &size);
  kqsvd_acc_t *acc = NULL, *back = NULL;
  kqsvd_result_t *res = NULL;
  kqsvd_shape_t shape = {L, H, G, D, HID};
  kqsvd_acc_options_t opt;
  kqsvd_acc_options_default(&opt);
  opt.block_rows = 64;
  CHECK_OK(kqsvd_acc_init(&shape, &opt, &acc));
  /* Rows are exact in every type: they go in as f64 here, since LAPACK's
   * reference sees the f64 values; bf16 and f32 are checked by the CLI's
   * tests.  Strides and uneven call sizes exercise the gather path. */
  const int64_t r0 = T * rank / size, r1 = T * (rank + 1) / size;
  for (int64_t l = 0; l < L; l++)
    for (int64_t g = 0; g < H; g++)
      for (int t = 0; t < 2 + G; t++) {
        const kqsvd_tensor_t ten = t == 0 ? KQSVD_KEYS : t == 1 ? KQSVD_VALUES : KQSVD_QUERIES;
        const int64_t head = ten == KQSVD_QUERIES ? g * G + (t - 2) : g;
        const int64_t stride = t % 2 ? D : D + 3;
        for (int64_t a = r0; a < r1;) {
          const int64_t b = a + 37 + (a % 90) < r1 ? a + 37 + (a % 90) : r1;
          void *rows = make_rows((int)ten, l, head, a, b, KQSVD_F64, stride);
          CHECK_OK(kqsvd_acc_absorb(acc, ten, l, g, ten == KQSVD_QUERIES ? t - 2 : 0, rows,
                                    KQSVD_F64, b - a, stride));
          free(rows);
          a = b;
        }
      }
  CHECK(kqsvd_acc_tokens(acc) == r1 - r0, "tokens %lld", (long long)kqsvd_acc_tokens(acc));
  CHECK_OK(kqsvd_acc_reduce(acc, MPI_COMM_WORLD, size - 1));
  if (rank == size - 1) {
    CHECK(kqsvd_acc_tokens(acc) == T, "reduced tokens %lld", (long long)kqsvd_acc_tokens(acc));
    const size_t tri = kqsvd_tri_size(D);
    double ref[D * D], got[D * D], worst = 0.0;
    for (int64_t l = 0; l < L; l++)
      for (int64_t g = 0; g < H; g++)
        for (int k = 0; k < 3; k++) {
          /* Q's factor is of the group's stacked heads: compare its Gram. */
          kqsvd_tri_unpack(D, kqsvd_acc_state(acc) + ((size_t)(l * H + g) * 3 + (size_t)k) * tri,
                           got);
          kqsvd_r_fix_signs(D, got);
          if (k == 1) continue;
          lapack_r(k == 0 ? KQSVD_KEYS : KQSVD_VALUES, l, g, ref);
          double nrm = 0.0;
          for (int i = 0; i < D * D; i++) nrm = fmax(nrm, fabs(ref[i]));
          for (int i = 0; i < D * D; i++) worst = fmax(worst, fabs(got[i] - ref[i]) / nrm);
        }
    /* Round-off of O(T) Householder updates and log2(ranks) merges, each
     * about eps * sqrt(d) relative: 64 eps sqrt(d) leaves room. */
    CHECK(worst <= 64.0 * DBL_EPSILON * sqrt((double)D), "R vs dgeqrf: %.3e", worst);
    printf("accumulator on %d ranks: R vs LAPACK dgeqrf %.2e (%.1f eps sqrt(d))\n", size, worst,
           worst / (DBL_EPSILON * sqrt((double)D)));
  }

  /* o_proj: a [HID, L*... ] weight per layer, rows given in two calls. */
  double *W = malloc(sizeof(double) * HID * H * G * D);
  unsigned long long seed = 99;
  for (int64_t l = 0; l < L; l++) {
    for (int i = 0; i < HID * H * G * D; i++) W[i] = test_normal(&seed);
    CHECK_OK(kqsvd_acc_absorb_oproj(acc, l, W, KQSVD_F64, 7, H * G * D));
    CHECK_OK(kqsvd_acc_absorb_oproj(acc, l, W + 7 * H * G * D, KQSVD_F64, HID - 7, H * G * D));
  }
  free(W);

  /* Save and load: the same factors bit for bit. */
  char path[200], proj[256];
  snprintf(path, sizeof path, "%s/kqsvd-acc-%d-%d.h5", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp",
           (int)getpid(), rank);
  snprintf(proj, sizeof proj, "%s.proj.h5", path);
  CHECK_OK(kqsvd_acc_save(acc, path, 0));
  CHECK_OK(kqsvd_acc_init(&shape, &opt, &back));
  CHECK_OK(kqsvd_acc_load(back, path));
  CHECK(memcmp(kqsvd_acc_state(acc), kqsvd_acc_state(back),
               sizeof(double) * (size_t)kqsvd_acc_state_doubles(acc)) == 0,
        "loaded state");
  CHECK(kqsvd_acc_tokens(back) == kqsvd_acc_tokens(acc), "loaded tokens");

  grouped(rank, size, path);

  /* Finish on the root: kqsvd's key projection reaches the best rank-r
   * error of K Q^T, the tail of sigma(K Q^T). */
  if (rank == size - 1) {
    kqsvd_finish_options_t fo;
    kqsvd_finish_options_default(&fo);
    fo.ranks = "fixed:3";
    CHECK_OK(kqsvd_acc_finish(acc, &fo, &res));
    CHECK(res && kqsvd_result_rank_k(res, KQSVD_METHOD_KQSVD)[1] == 3, "fixed:3 ranks");
    const double *A = kqsvd_result_matrix(res, KQSVD_METHOD_KQSVD, KQSVD_KEY_DOWN, 1, 1);
    const double *B = kqsvd_result_matrix(res, KQSVD_METHOD_KQSVD, KQSVD_QUERY_DOWN, 1, 1);
    const double *s = kqsvd_result_sigma(res, KQSVD_METHOD_KQSVD, 0, 1, 1);
    CHECK(A && B && s && !kqsvd_result_matrix(res, KQSVD_METHOD_KQSVD, KQSVD_KEY_DOWN, L, 0),
          "matrix accessors");
    /* ||K A_r B_r^T Q^T - K Q^T||^2 over all queries of the group equals
     * the tail energy sum_{r >= 3} sigma_r^2 of K Q^T (Theorem 1). */
    double *K = malloc(sizeof(double) * T * D), *Q = malloc(sizeof(double) * G * T * D);
    for (int64_t i = 0; i < T; i++)
      for (int j = 0; j < D; j++) {
        K[i * D + j] = value(KQSVD_KEYS, 1, 1, i, j);
        for (int q = 0; q < G; q++) Q[(q * T + i) * D + j] = value(KQSVD_QUERIES, 1, G + q, i, j);
      }
    double err = 0.0, tail = 0.0, total = 0.0;
    for (int r = 0; r < D; r++) total += s[r] * s[r], tail += r >= 3 ? s[r] * s[r] : 0.0;
    for (int64_t i = 0; i < T; i++) {
      double kp[D] = {0}, c3[3] = {0};
      for (int c = 0; c < 3; c++)
        for (int j = 0; j < D; j++) c3[c] += K[i * D + j] * A[j * D + c];
      for (int a = 0; a < D; a++)
        for (int c = 0; c < 3; c++) kp[a] += c3[c] * B[a * D + c];
      for (int64_t u = 0; u < G * T; u++) {
        double dot = 0.0;
        for (int j = 0; j < D; j++) dot += (kp[j] - K[i * D + j]) * Q[u * D + j];
        err += dot * dot;
      }
    }
    free(K);
    free(Q);
    CHECK(fabs(err - tail) <= 1e-10 * total, "kqsvd error %.12e vs tail %.12e (total %.3e)", err,
          tail, total);
    CHECK_OK(kqsvd_result_write(res, proj, NULL));
    CHECK(access(proj, F_OK) == 0, "proj.h5 written");
    kqsvd_write_options_t wo;
    kqsvd_write_options_default(&wo);
    CHECK(kqsvd_result_write(res, proj, &wo) == KQSVD_ERR_USAGE, "existing file refused");
    kqsvd_clear_error();
    wo.force = 1;
    CHECK_OK(kqsvd_result_write(res, proj, &wo));
  }

  /* Errors: a message, the handler, and no change. */
  kqsvd_set_error_handler(handler, NULL);
  double nan_rows[2 * D];
  for (int i = 0; i < 2 * D; i++) nan_rows[i] = i == D + 3 ? NAN : 1.0;
  memcpy(kqsvd_acc_state(back), kqsvd_acc_state(acc), 0);
  CHECK(kqsvd_acc_absorb(back, KQSVD_KEYS, 0, 0, 0, nan_rows, KQSVD_F64, 2, D) == KQSVD_ERR_DATA,
        "NaN refused");
  CHECK(strstr(kqsvd_last_error(), "keys: NaN or Inf at layer 0, head 0, row 1") != NULL, "%s",
        kqsvd_last_error());
  CHECK(memcmp(kqsvd_acc_state(acc), kqsvd_acc_state(back),
               sizeof(double) * (size_t)kqsvd_acc_state_doubles(acc)) == 0,
        "a refused call leaves the factors unchanged");
  kqsvd_clear_error();
  CHECK(kqsvd_acc_absorb(back, KQSVD_QUERIES, 0, 0, G, nan_rows, KQSVD_F64, 1, D) ==
            KQSVD_ERR_USAGE,
        "query index");
  kqsvd_clear_error();
  kqsvd_shape_t other = {L + 1, H, G, D, HID};
  kqsvd_acc_t *wrong = NULL;
  CHECK_OK(kqsvd_acc_init(&other, &opt, &wrong));
  CHECK(kqsvd_acc_load(wrong, path) == KQSVD_ERR_INPUT && strstr(kqsvd_last_error(), path),
        "another shape's checkpoint: %s", kqsvd_last_error());
  kqsvd_clear_error();
  CHECK(g_handled == 3, "handler called %d times", g_handled);
  kqsvd_set_error_handler(NULL, NULL);
  remove(path);
  remove(proj);
  kqsvd_acc_free(&wrong);
  kqsvd_acc_free(&back);
  kqsvd_acc_free(&acc);
  kqsvd_result_free(&res);
  int failures = g_failures, total = 0;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) check_exit("test_accumulator_mpi");
  MPI_Finalize();
  return total ? 1 : 0;
}
