/* Under mpiexec with any rank count: each rank folds its row range of two
 * matrices; the TSQR reduction leaves every item on its owner equal to
 * LAPACK dgeqrf's R of the whole matrix up to row signs (1e-12).  Then the
 * monitor's cancellation: one rank fails, all ranks stop and agree without
 * hanging. */
#include <lapacke.h>
#include <mpi.h>
#include <string.h>

#include "../unit/check.h"
#include "kqsvd_linalg.h"
#include "kqsvd_mpi.h"
#include "mpi_check.h"

enum { N = 2503, D = 16, ITEMS = 5, PER = 2 };

/* Row i of matrix `which`: deterministic, so any rank can make any row. */
static void row(int which, int64_t i, double *x) {
  unsigned long long s = 1000003ULL * (unsigned long long)i + 7919ULL * (unsigned long long)which;
  for (int j = 0; j < D; j++) x[j] = test_normal(&s) * pow(10.0, -3.0 * j / D) * (1 + which);
}

int main(int argc, char **argv) {
  int rank, size;
  test_mpi_init(&argc, &argv, &rank, &size);
  const size_t tri = kqsvd_tri_size(D);
  double *state = calloc(ITEMS * PER * tri, sizeof(double)), R[D * D];
  double *X = malloc(sizeof(double) * N * D);
  kqsvd_segment_t *segs = NULL;
  int64_t *first = NULL, rows = N, bad;
  kqsvd_qr_ws_t *ws = NULL;
  CHECK_OK(kqsvd_qr_ws_init(D, 100, &ws));
  CHECK_OK(kqsvd_partition_rows(1, &rows, size, 0.1, &segs, &first));
  for (int it = 0; it < ITEMS; it++)
    for (int w = 0; w < PER; w++) {
      memset(R, 0, sizeof R);
      for (int64_t k = first[rank]; k < first[rank + 1]; k++) {
        const int64_t n = segs[k].row1 - segs[k].row0;
        for (int64_t i = 0; i < n; i++) row(it * PER + w, segs[k].row0 + i, X + i * D);
        CHECK_OK(kqsvd_qr_absorb(ws, R, X, KQSVD_F64, n, &bad));
      }
      kqsvd_tri_pack(D, R, state + (size_t)(it * PER + w) * tri);
    }
  CHECK_OK(kqsvd_tsqr_reduce(MPI_COMM_WORLD, D, PER, ITEMS, state));
  int64_t own0, own1;
  kqsvd_partition_items(ITEMS, size, rank, &own0, &own1);
  for (int64_t it = own0; it < own1; it++)
    for (int w = 0; w < PER; w++) {
      double *A = malloc(sizeof(double) * N * D), tau[D], ref[D * D], got[D * D], num = 0, den = 0;
      for (int64_t i = 0; i < N; i++) {
        double x[D];
        row((int)it * PER + w, i, x);
        for (int j = 0; j < D; j++) A[(size_t)j * N + i] = x[j];
      }
      LAPACKE_dgeqrf(LAPACK_COL_MAJOR, N, D, A, N, tau);
      for (int j = 0; j < D; j++)
        for (int i = 0; i < D; i++) ref[j * D + i] = i <= j ? A[(size_t)j * N + i] : 0.0;
      kqsvd_tri_unpack(D, state + (size_t)(it * PER + w) * tri, got);
      kqsvd_r_fix_signs(D, ref);
      kqsvd_r_fix_signs(D, got);
      for (int k = 0; k < D * D; k++)
        num = fmax(num, fabs(got[k] - ref[k])), den = fmax(den, fabs(ref[k]));
      CHECK(num <= 1e-12 * den, "np=%d item %lld/%d: TSQR R differs from dgeqrf by %.3g", size,
            (long long)it, w, num / den);
      free(A);
    }

  /* Cooperative cancellation: the last rank fails; everyone stops. */
  kqsvd_monitor_t *mon = NULL;
  CHECK_OK(kqsvd_monitor_init(MPI_COMM_WORLD, 1000, NULL, NULL, 1.0, &mon));
  kqsvd_status_t local = KQSVD_OK;
  int stop = 0;
  if (rank == size - 1) {
    local = kqsvd_error_set(KQSVD_ERR_DATA, __FILE__, __LINE__, __func__, "injected failure");
    CHECK_OK(kqsvd_monitor_raise(mon));
  } else {
    for (int spins = 0; !stop && spins < 2000000; spins++)
      CHECK_OK(kqsvd_monitor_update(mon, spins, &stop));
    CHECK(stop || size == 1, "rank %d never saw the cancellation", rank);
    if (stop) local = KQSVD_ERR_REMOTE;
  }
  const kqsvd_status_t st = kqsvd_monitor_finish(mon, 1, local);
  CHECK(st != KQSVD_OK, "the failure must reach every rank");
  CHECK(kqsvd_error_is_collective(), "agreed failures are collective");
  CHECK(kqsvd_error_report_here() == (rank == size - 1), "only the failing rank reports");
  kqsvd_error_clear();
  kqsvd_monitor_free(&mon);
  CHECK(kqsvd_mpi_agree(MPI_COMM_WORLD, KQSVD_OK) == KQSVD_OK, "all OK agrees on OK");

  /* A merge that fails (NaN in one rank's factors) on the owner of the
   * first items, with a state of more than one 64 MiB message: every rank
   * gets an error, and none waits for the others in a later message. */
  if (size > 1) {
    enum { BIG_D = 128, BIG_ITEMS = 400, BIG_PER = 3 };
    const size_t big_tri = kqsvd_tri_size(BIG_D);
    double *big = calloc((size_t)BIG_ITEMS * BIG_PER * big_tri, sizeof(double));
    if (rank == size - 1) big[5 * BIG_PER * big_tri] = NAN;
    kqsvd_status_t got = kqsvd_tsqr_reduce(MPI_COMM_WORLD, BIG_D, BIG_PER, BIG_ITEMS, big);
    got = kqsvd_mpi_agree(MPI_COMM_WORLD, got);
    CHECK(got != KQSVD_OK, "a failed merge must fail on every rank");
    CHECK(rank != 0 || strstr(kqsvd_error_message(), "TSQR merge") != NULL, "message: %s",
          kqsvd_error_message());
    kqsvd_error_clear();
    free(big);
  }

  kqsvd_qr_ws_free(&ws);
  free(state);
  free(X);
  free(segs);
  free(first);
  int failed = g_failures, any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) printf("test_tsqr_mpi np=%d: %d failures over all ranks\n", size, any);
  MPI_Finalize();
  return any ? 1 : 0;
}
