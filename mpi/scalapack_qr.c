/* pdgeqrf on a P x 1 row-block distribution: the peer that TSQR is
 * benchmarked against.  Built with ScaLAPACK when CMake finds it; otherwise
 * every entry point says so. */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "kqsvd_linalg.h"
#include "kqsvd_mpi.h"

#ifdef KQSVD_HAVE_SCALAPACK
/* The BLACS C interface and the Fortran ScaLAPACK routines have no header
 * in Debian's package. */
int Csys2blacs_handle(MPI_Comm comm);
void Cfree_blacs_system_handle(int handle);
void Cblacs_gridinit(int *ctxt, const char *order, int nprow, int npcol);
void Cblacs_gridexit(int ctxt);
void descinit_(int *desc, const int *m, const int *n, const int *mb, const int *nb,
               const int *irsrc, const int *icsrc, const int *ctxt, const int *lld, int *info);
void pdgeqrf_(const int *m, const int *n, double *a, const int *ia, const int *ja, const int *desca,
              double *tau, double *work, const int *lwork, int *info);
#endif

/* Column block of the descriptor, the width of pdgeqrf's panels.  At d =
 * 128 on 2 ranks (32 k tokens, 4 layers, GQA) pdgeqrf's stage took 4.0,
 * 3.9, 4.7, 7.1 and 10.3 s with 8, 16, 32, 64 and 128: its panels stream
 * the whole tall block once per column, so narrow panels win. */
#ifndef PQR_NB
#define PQR_NB 16
#endif

struct kqsvd_pqr {
  MPI_Comm comm;
  int rank, size, d, mb, ctxt, handle;
  int desc[9];
  double *A, *tau, *work;
  int lwork;
};

int kqsvd_pqr_available(void) {
#ifdef KQSVD_HAVE_SCALAPACK
  return 1;
#else
  return 0;
#endif
}

/* BLACS and ScaLAPACK index with int: counts beyond it get a clear refusal. */
static kqsvd_status_t to_int(int64_t v, int *out) {
  kqsvd_status_t st = KQSVD_OK;
  KQSVD_CHECK(v >= 0 && v <= INT_MAX, KQSVD_ERR_USAGE,
              "--qr scalapack: %lld rows exceed ScaLAPACK's 32-bit indices; use --qr tsqr or "
              "more ranks",
              (long long)v);
  *out = (int)v;
done:
  return st;
}

#ifdef KQSVD_HAVE_SCALAPACK
/* Descriptor of the P x d matrix of row blocks of mb rows (mb >= d, so the
 * whole R lands in rank 0's block); local blocks have leading dimension ld. */
static kqsvd_status_t describe(kqsvd_pqr_t *q, int mb, int *M) {
  kqsvd_status_t st = KQSVD_OK;
  const int nb = q->d < PQR_NB ? q->d : PQR_NB, zero = 0;
  int info = 0;
  KQSVD_CALL(to_int((int64_t)q->size * mb, M));
  descinit_(q->desc, M, &q->d, &mb, &nb, &zero, &zero, &q->ctxt, &q->mb, &info);
  KQSVD_LAPACK("descinit", info);
done:
  return st;
}
#endif

kqsvd_status_t kqsvd_pqr_init(MPI_Comm comm, int d, int64_t max_local_rows, kqsvd_pqr_t **out) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_pqr_t *q = NULL;
  *out = NULL;
#ifdef KQSVD_HAVE_SCALAPACK
  int64_t mb = 0;
  int M = 0, info = 0;
  q = calloc(1, sizeof *q);
  KQSVD_CHECK(q, KQSVD_ERR_NOMEM, "cannot allocate the ScaLAPACK state");
  q->comm = comm;
  q->ctxt = q->handle = -1;
  q->d = d;
  KQSVD_MPI(MPI_Comm_rank(comm, &q->rank));
  KQSVD_MPI(MPI_Comm_size(comm, &q->size));
  KQSVD_MPI(MPI_Allreduce(&max_local_rows, &mb, 1, MPI_INT64_T, MPI_MAX, comm));
  mb = mb < d ? d : mb;
  /* Everything that can fail on one rank alone happens before the grid
   * exists and is agreed on: ScaLAPACK's calls are collective over it. */
  kqsvd_status_t local = to_int(mb, &q->mb);
  if (local == KQSVD_OK) local = to_int((int64_t)q->size * mb, &M);
  if (local == KQSVD_OK) {
    q->A = malloc((size_t)mb * (size_t)d * sizeof(double));
    q->tau = malloc((size_t)d * sizeof(double));
    if (!q->A || !q->tau)
      local = kqsvd_error_set(KQSVD_ERR_NOMEM, __FILE__, __LINE__, __func__,
                              "cannot allocate the ScaLAPACK row block (%lld x %d doubles)",
                              (long long)mb, d);
  }
  KQSVD_CALL(kqsvd_mpi_agree(comm, local));
  q->handle = Csys2blacs_handle(comm);
  q->ctxt = q->handle;
  Cblacs_gridinit(&q->ctxt, "Row", q->size, 1);
  KQSVD_CALL(describe(q, q->mb, &M));
  double query = 0;
  const int one = 1, minus1 = -1;
  /* The workspace of the tallest matrix serves the shorter ones. */
  pdgeqrf_(&M, &d, q->A, &one, &one, q->desc, q->tau, &query, &minus1, &info);
  KQSVD_LAPACK("pdgeqrf (workspace query)", info);
  local = to_int((int64_t)query + 1, &q->lwork);
  if (local == KQSVD_OK && !(q->work = malloc((size_t)q->lwork * sizeof(double))))
    local = kqsvd_error_set(KQSVD_ERR_NOMEM, __FILE__, __LINE__, __func__,
                            "cannot allocate the ScaLAPACK workspace (%d doubles)", q->lwork);
  KQSVD_CALL(kqsvd_mpi_agree(comm, local));
  *out = q;
  q = NULL;
#else
  (void)comm, (void)d, (void)max_local_rows, (void)to_int;
  KQSVD_FAIL(KQSVD_ERR_USAGE, "--qr scalapack: this kqsvd was built without ScaLAPACK "
                              "(Debian: apt-get install libscalapack-openmpi-dev, then rebuild)");
#endif
done:
  /* Every failure above is agreed, so every rank releases the grid. */
  kqsvd_pqr_free(&q);
  return st;
}

double *kqsvd_pqr_local(kqsvd_pqr_t *q) { return q->A; }
int64_t kqsvd_pqr_ld(const kqsvd_pqr_t *q) { return q->mb; }

kqsvd_status_t kqsvd_pqr_factor(kqsvd_pqr_t *q, int64_t local_rows, double *R) {
  kqsvd_status_t st = KQSVD_OK;
#ifdef KQSVD_HAVE_SCALAPACK
  const int d = q->d, one = 1;
  int M = 0, info = 0, count = 0, mb = 0;
  int64_t most = 0;
  KQSVD_CHECK(local_rows >= 0 && local_rows <= q->mb, KQSVD_ERR_BUG,
              "%lld local rows for a block of %d", (long long)local_rows, q->mb);
  /* Blocks as tall as this matrix's longest rank, not the allocation:
   * pdgeqrf does not skip zero rows. */
  KQSVD_MPI(MPI_Allreduce(&local_rows, &most, 1, MPI_INT64_T, MPI_MAX, q->comm));
  mb = (int)(most < d ? d : most);
  KQSVD_CALL(describe(q, mb, &M));
  for (int j = 0; j < d; j++)
    memset(q->A + (size_t)j * q->mb + local_rows, 0, (size_t)(mb - local_rows) * sizeof(double));
  pdgeqrf_(&M, &d, q->A, &one, &one, q->desc, q->tau, q->work, &q->lwork, &info);
  KQSVD_LAPACK("pdgeqrf", info);
  /* mb >= d: the whole R lies in rank 0's block. */
  if (q->rank == 0)
    for (int j = 0; j < d; j++)
      for (int i = 0; i < d; i++) R[(size_t)j * d + i] = i <= j ? q->A[(size_t)j * q->mb + i] : 0.0;
  KQSVD_TO_INT((int64_t)d * d, &count, "R factor size");
  KQSVD_MPI(MPI_Bcast(R, count, MPI_DOUBLE, 0, q->comm));
  kqsvd_r_fix_signs(d, R);
#else
  (void)q, (void)local_rows, (void)R;
  KQSVD_FAIL(KQSVD_ERR_BUG, "ScaLAPACK is not built in");
#endif
done:
  return st;
}

void kqsvd_pqr_free(kqsvd_pqr_t **pq) {
  if (!pq || !*pq) return;
  kqsvd_pqr_t *q = *pq;
#ifdef KQSVD_HAVE_SCALAPACK
  if (q->ctxt >= 0) Cblacs_gridexit(q->ctxt);
  if (q->handle >= 0) Cfree_blacs_system_handle(q->handle);
#endif
  free(q->A);
  free(q->tau);
  free(q->work);
  free(q);
  *pq = NULL;
}
