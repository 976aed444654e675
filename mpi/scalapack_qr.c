/* pdgeqrf on a P x 1 row-block distribution: the peer that TSQR is
 * benchmarked against.  Built with ScaLAPACK when CMake finds it; otherwise
 * every entry point says so. */
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
void pdgeqrf_(const int *m, const int *n, double *a, const int *ia, const int *ja,
              const int *desca, double *tau, double *work, const int *lwork, int *info);
#endif

/* Column block of the descriptor, the width of pdgeqrf's panels: 32 was
 * the fastest of 16, 32, 64 and 128 at d = 128 here (bench/). */
#define PQR_NB 32

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
  KQSVD_TO_INT(mb, &q->mb, "rows per rank for ScaLAPACK");
  KQSVD_TO_INT((int64_t)q->size * mb, &M, "rows of the ScaLAPACK matrix");
  q->handle = Csys2blacs_handle(comm);
  q->ctxt = q->handle;
  Cblacs_gridinit(&q->ctxt, "Row", q->size, 1);
  const int nb = d < PQR_NB ? d : PQR_NB, zero = 0, lld = q->mb;
  descinit_(q->desc, &M, &d, &q->mb, &nb, &zero, &zero, &q->ctxt, &lld, &info);
  KQSVD_LAPACK("descinit", info);
  KQSVD_MALLOC(q->A, (size_t)q->mb * (size_t)d, "ScaLAPACK row block");
  KQSVD_MALLOC(q->tau, (size_t)d, "ScaLAPACK scalars");
  double query = 0;
  const int one = 1, minus1 = -1;
  pdgeqrf_(&M, &d, q->A, &one, &one, q->desc, q->tau, &query, &minus1, &info);
  KQSVD_LAPACK("pdgeqrf (workspace query)", info);
  q->lwork = (int)query + 1;
  KQSVD_MALLOC(q->work, (size_t)q->lwork, "ScaLAPACK workspace");
  *out = q;
  q = NULL;
#else
  (void)comm, (void)d, (void)max_local_rows;
  KQSVD_FAIL(KQSVD_ERR_USAGE, "--qr scalapack: this kqsvd was built without ScaLAPACK "
             "(Debian: apt-get install libscalapack-openmpi-dev, then rebuild)");
#endif
done:
  kqsvd_pqr_free(&q);
  return st;
}

double *kqsvd_pqr_local(kqsvd_pqr_t *q) { return q->A; }
int64_t kqsvd_pqr_ld(const kqsvd_pqr_t *q) { return q->mb; }

kqsvd_status_t kqsvd_pqr_factor(kqsvd_pqr_t *q, int64_t local_rows, double *R) {
  kqsvd_status_t st = KQSVD_OK;
#ifdef KQSVD_HAVE_SCALAPACK
  const int d = q->d, one = 1;
  int M = q->size * q->mb, info = 0, count = 0;
  KQSVD_CHECK(local_rows >= 0 && local_rows <= q->mb, KQSVD_ERR_BUG,
              "%lld local rows for a block of %d", (long long)local_rows, q->mb);
  for (int j = 0; j < d; j++)
    memset(q->A + (size_t)j * q->mb + local_rows, 0,
           (size_t)(q->mb - local_rows) * sizeof(double));
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
