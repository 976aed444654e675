/* Distribution: MPI error checking, agreement on failures, the split of
 * rows and (layer, head) items over ranks, and the TSQR tree reduction. */
#ifndef KQSVD_MPI_H
#define KQSVD_MPI_H

#include <mpi.h>
#include <stdint.h>

#include "kqsvd_error.h"
#include "kqsvd_util.h"

/* MPI return-code checker (communicators must use MPI_ERRORS_RETURN). */
kqsvd_status_t kqsvd_mpi_check_(int rc, const char *call, const char *file, int line,
                                const char *func);
#define KQSVD_MPI(call) KQSVD_CALL(kqsvd_mpi_check_((call), #call, __FILE__, __LINE__, __func__))

/* Collective.  Agrees on the outcome of a phase: returns KQSVD_OK when every
 * rank passed `local` == KQSVD_OK.  Otherwise every rank returns an error
 * marked collective; the lowest failing rank keeps its message and is the
 * one to print it, the others return their own status or KQSVD_ERR_REMOTE.
 * comm == MPI_COMM_NULL (a command run without MPI): returns `local`, an
 * error marked collective and reported here; no MPI call.
 * Errors: KQSVD_ERR_MPI (not collective: main() then aborts). */
kqsvd_status_t kqsvd_mpi_agree(MPI_Comm comm, kqsvd_status_t local);

/* Collective.  kqsvd_rmdir_made for a folder every rank asked kqsvd_mkdir_made
 * for (the same path on each): once every rank is past its mkdir, rank 0
 * removes, deepest first, each component that some rank made and that is
 * empty.  Each rank removing only its own would race: the parent one rank
 * made is not yet empty while another still holds the child it made.
 * comm == MPI_COMM_NULL: kqsvd_rmdir_made.  Errors: none reported (an MPI
 * failure leaves the folders, as a non-empty one is left). */
void kqsvd_mpi_rmdir_made(MPI_Comm comm, kqsvd_made_dirs_t *made);

/* A contiguous row range [row0, row1) of one shard. */
typedef struct kqsvd_segment {
  int64_t shard, row0, row1;
} kqsvd_segment_t;

/* Not collective (deterministic, so every rank computes the same split).
 * Splits the rows of `nshards` shards (rows[s] each, in order) into `nranks`
 * contiguous, balanced parts.  A part boundary moves to the nearest shard
 * boundary when that costs at most `snap` of a part's size (0.1 = 10%), so
 * whole shards go to ranks when there are enough of them and large shards
 * are cut into row ranges otherwise.  On return segs[first[p] ..
 * first[p+1]) are rank p's segments in order; free both with free().
 * Errors: KQSVD_ERR_NOMEM. */
kqsvd_status_t kqsvd_partition_rows(int64_t nshards, const int64_t *rows, int nranks, double snap,
                                    kqsvd_segment_t **segs, int64_t **first);

/* Not collective.  The ranks that read part of shard `shard` under the
 * split above (segs/first of kqsvd_partition_rows), in increasing order,
 * into ranks[] (room for nranks); returns how many.  A rank may own no row
 * at all (fewer rows than ranks), so these need not be a contiguous range:
 * only they take part in opening the shard together. */
int kqsvd_partition_readers(const kqsvd_segment_t *segs, const int64_t *first, int nranks,
                            int64_t shard, int *ranks);

/* Not collective.  Block split of `n` items: rank p owns [first, last). */
void kqsvd_partition_items(int64_t n, int nranks, int p, int64_t *first, int64_t *last);

/* Collective.  TSQR reduction of `nitems` items of `per_item` packed d x d
 * upper triangles each (kqsvd_tri_size(d) doubles per triangle, item-major)
 * held by every rank: items of rank p (kqsvd_partition_items) end on rank p
 * as the R factors of the ranks' factors stacked in rank order.  Uses a
 * non-commutative MPI_Op, so MPI picks the tree and any rank count works.
 * Other items' contents are left unspecified.  Errors: KQSVD_ERR_MPI,
 * _LAPACK, _NOMEM (not collective). */
kqsvd_status_t kqsvd_tsqr_reduce(MPI_Comm comm, int d, int per_item, int64_t nitems,
                                 double *packed);
/* The same with every item merged onto `root` (the accumulator's reduce).
 * Collective.  Errors as kqsvd_tsqr_reduce. */
kqsvd_status_t kqsvd_tsqr_reduce_root(MPI_Comm comm, int d, int per_item, int64_t nitems,
                                      double *packed, int root);

/* Collective.  Like kqsvd_tsqr_reduce, but items of `item_doubles` doubles
 * are summed (Gram matrices of `calibrate --qr gram`).  Errors: _MPI;
 * _USAGE when one item or chunk exceeds MPI's int count. */
kqsvd_status_t kqsvd_sum_reduce(MPI_Comm comm, size_t item_doubles, int64_t nitems, double *packed);

/* ScaLAPACK pdgeqrf on a P x 1 row-block grid (`calibrate --qr scalapack`):
 * the classic distributed Householder QR that TSQR is compared with.  Each
 * rank holds a block of rows of the whole matrix in memory. */
typedef struct kqsvd_pqr kqsvd_pqr_t;

/* Whether this kqsvd was built with ScaLAPACK. */
int kqsvd_pqr_available(void);

/* Collective.  A BLACS grid over `comm` (rank p is process row p) and a
 * local block of mb x d doubles, mb = the largest `max_local_rows` of all
 * ranks (at least d, so that R lands on rank 0).  Failures are agreed on
 * before any ScaLAPACK call, so no rank is left in one.  Errors: _USAGE
 * without ScaLAPACK or when P * mb exceeds ScaLAPACK's int, _NOMEM, _MPI,
 * _LAPACK. */
kqsvd_status_t kqsvd_pqr_init(MPI_Comm comm, int d, int64_t max_local_rows, kqsvd_pqr_t **pqr);

/* Not collective.  This rank's block (column-major, leading dimension
 * kqsvd_pqr_ld): fill its first rows with this rank's rows. */
double *kqsvd_pqr_local(kqsvd_pqr_t *pqr);
int64_t kqsvd_pqr_ld(const kqsvd_pqr_t *pqr);

/* Collective.  R (d x d upper triangular, column-major, non-negative
 * diagonal, on every rank) of all ranks' first `local_rows` rows stacked in
 * rank order.  The matrix factored has blocks as tall as the largest
 * `local_rows` (at least d); shorter ranks are padded with zero rows, which
 * leave R unchanged.  The local block is destroyed.  Errors: _LAPACK, _BUG,
 * _MPI. */
kqsvd_status_t kqsvd_pqr_factor(kqsvd_pqr_t *pqr, int64_t local_rows, double *R);

/* Collective (releases the grid). */
void kqsvd_pqr_free(kqsvd_pqr_t **pqr);

/* Progress reporting to rank 0 and cooperative cancellation. */
typedef struct kqsvd_monitor kqsvd_monitor_t;

/* Called on rank 0 only, with the summed work of all ranks; `final` is 1 on
 * the last call. */
typedef void (*kqsvd_progress_fn)(void *ctx, int64_t done, int64_t total, int final);

/* Collective.  `total` is the global amount of work; `fn` (may be NULL) is
 * called on rank 0 at most every `interval` seconds.  Errors: _MPI, _NOMEM. */
kqsvd_status_t kqsvd_monitor_init(MPI_Comm comm, int64_t total, kqsvd_progress_fn fn, void *ctx,
                                  double interval, kqsvd_monitor_t **mon);

/* Not collective.  Records this rank's work done so far, exchanges messages
 * when due, and sets *stop once another rank has raised a failure. */
kqsvd_status_t kqsvd_monitor_update(kqsvd_monitor_t *mon, int64_t local_done, int *stop);

/* Not collective.  Tells every other rank to stop at its next update. */
kqsvd_status_t kqsvd_monitor_raise(kqsvd_monitor_t *mon);

/* Collective.  Drains all messages in flight, shows the final progress and
 * agrees on the outcome like kqsvd_mpi_agree. */
kqsvd_status_t kqsvd_monitor_finish(kqsvd_monitor_t *mon, int64_t local_done, kqsvd_status_t local);

/* Not collective; call after finish. */
void kqsvd_monitor_free(kqsvd_monitor_t **mon);

#endif
