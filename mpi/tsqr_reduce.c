#include <math.h>
#include <stdlib.h>

#include "kqsvd_linalg.h"
#include "kqsvd_mpi.h"

/* A contiguous type of `count` elements of `inner`, and its count and
 * inner type back: the merge reads its sizes from the datatype it is given,
 * since MPI user functions take no context.  The inner type returned by
 * MPI_Type_get_contents is a new handle to free when it is derived. */
static int contiguous_parts(MPI_Datatype t, MPI_Datatype *inner) {
  int ni = 0, na = 0, nd = 0, combiner = 0, count = 0;
  *inner = MPI_DATATYPE_NULL;
  if (MPI_Type_get_envelope(t, &ni, &na, &nd, &combiner) != MPI_SUCCESS ||
      combiner != MPI_COMBINER_CONTIGUOUS || ni != 1 || nd != 1)
    return -1;
  if (MPI_Type_get_contents(t, 1, 0, 1, &count, NULL, inner) != MPI_SUCCESS) return -1;
  return count;
}

static void free_if_derived(MPI_Datatype *t) {
  int ni = 0, na = 0, nd = 0, combiner = 0;
  if (*t != MPI_DATATYPE_NULL &&
      MPI_Type_get_envelope(*t, &ni, &na, &nd, &combiner) == MPI_SUCCESS &&
      combiner != MPI_COMBINER_NAMED)
    MPI_Type_free(t);
  *t = MPI_DATATYPE_NULL;
}

/* inout[i] <- R factor of [in[i]; inout[i]]: `in` holds the lower ranks.
 * The type is `per_item` triangles of tri(d) doubles (see item_type).  A
 * merge that cannot run (no memory, a LAPACK failure) leaves NaN in the
 * result, which the receiving rank reports: an MPI operation cannot return
 * an error. */
static void merge_op(void *in, void *inout, int *len, MPI_Datatype *type) {
  MPI_Datatype tri_type = MPI_DATATYPE_NULL, dbl = MPI_DATATYPE_NULL;
  const int per_item = contiguous_parts(*type, &tri_type);
  const int tri = per_item > 0 ? contiguous_parts(tri_type, &dbl) : -1;
  free_if_derived(&dbl);
  free_if_derived(&tri_type);
  int d = 0;
  while (tri > 0 && (size_t)d * (size_t)(d + 1) / 2 < (size_t)tri) d++;
  const size_t n = (size_t)*len * (size_t)(per_item > 0 ? per_item : 0);
  kqsvd_qr_ws_t *ws = NULL;
  double *top = NULL, *bottom = NULL;
  kqsvd_status_t st = tri > 0 && kqsvd_tri_size(d) == (size_t)tri ? KQSVD_OK : KQSVD_ERR_BUG;
  if (st == KQSVD_OK) st = kqsvd_qr_ws_init(d, d, &ws); /* d rows: the fast merge */
  if (st == KQSVD_OK) {
    top = malloc((size_t)d * (size_t)d * sizeof *top);
    bottom = malloc((size_t)d * (size_t)d * sizeof *bottom);
    if (!top || !bottom) st = KQSVD_ERR_NOMEM;
  }
  for (size_t i = 0; i < n && st == KQSVD_OK; i++) {
    double *a = (double *)in + i * (size_t)tri, *b = (double *)inout + i * (size_t)tri;
    kqsvd_tri_unpack(d, a, top);
    kqsvd_tri_unpack(d, b, bottom);
    st = kqsvd_qr_merge(ws, top, bottom);
    kqsvd_tri_pack(d, top, b);
  }
  if (st != KQSVD_OK) { /* every double of the message, whatever its layout */
    int bytes = 0;
    MPI_Type_size(*type, &bytes);
    for (size_t k = 0; k < (size_t)*len * ((size_t)bytes / sizeof(double)); k++)
      ((double *)inout)[k] = NAN;
  }
  kqsvd_qr_ws_free(&ws);
  free(top);
  free(bottom);
}

/* Messages of at most this many bytes bound MPI's temporary buffers. */
#define REDUCE_CHUNK_BYTES ((size_t)64 << 20)

/* Reduces each rank's items (kqsvd_partition_items) onto it with `op`, or
 * all items onto `root` when root >= 0, in messages of at most
 * REDUCE_CHUNK_BYTES.  Predefined operations (MPI_SUM) only apply to basic
 * types, so with them items travel as plain doubles; the merge's items are
 * `per_item` triangles of `tri` doubles, a type it can take apart. */
static kqsvd_status_t reduce_to_owners(MPI_Comm comm, int tri, int per_item, int64_t nitems,
                                       double *packed, MPI_Op op, int root) {
  kqsvd_status_t st = KQSVD_OK;
  MPI_Datatype tri_type = MPI_DATATYPE_NULL, item_type = MPI_DATATYPE_NULL;
  int rank = 0, size = 1, failed = 0;
  const size_t item_doubles = (size_t)tri * (size_t)per_item;
  KQSVD_MPI(MPI_Comm_rank(comm, &rank));
  KQSVD_MPI(MPI_Comm_size(comm, &size));
  const int basic = op == MPI_SUM;
  if (!basic) {
    KQSVD_MPI(MPI_Type_contiguous(tri, MPI_DOUBLE, &tri_type));
    KQSVD_MPI(MPI_Type_contiguous(per_item, tri_type, &item_type));
    KQSVD_MPI(MPI_Type_commit(&item_type));
  }
  const int64_t chunk = (int64_t)(REDUCE_CHUNK_BYTES / (item_doubles * sizeof(double))) + 1;
  for (int p = 0; p < size; p++) {
    int64_t i0 = 0, i1 = nitems;
    if (root >= 0 && p != root) continue;
    if (root < 0) kqsvd_partition_items(nitems, size, p, &i0, &i1);
    for (int64_t c0 = i0; c0 < i1; c0 += chunk) {
      int count = 0;
      const int64_t n = c0 + chunk < i1 ? chunk : i1 - c0;
      KQSVD_TO_INT(basic ? n * (int64_t)item_doubles : n, &count, "reduction chunk");
      double *buf = packed + (size_t)c0 * item_doubles;
      KQSVD_MPI(MPI_Reduce(rank == p ? MPI_IN_PLACE : buf, rank == p ? buf : NULL, count,
                           basic ? MPI_DOUBLE : item_type, op, p, comm));
      /* Noted, not reported yet: every rank must take part in every
       * remaining reduction, or the others wait for this one forever. */
      for (size_t k = 0; !basic && rank == p && k < (size_t)n * item_doubles && !failed; k++)
        failed = isnan(buf[k]);
    }
  }
  KQSVD_CHECK(!failed, KQSVD_ERR_NOMEM,
              "the TSQR merge of R factors failed on some rank (no memory for its workspace, "
              "a LAPACK failure, or NaN in the factors)");
done:
  if (item_type != MPI_DATATYPE_NULL) MPI_Type_free(&item_type);
  if (tri_type != MPI_DATATYPE_NULL) MPI_Type_free(&tri_type);
  return st;
}

kqsvd_status_t kqsvd_tsqr_reduce(MPI_Comm comm, int d, int per_item, int64_t nitems,
                                 double *packed) {
  return kqsvd_tsqr_reduce_root(comm, d, per_item, nitems, packed, -1);
}

kqsvd_status_t kqsvd_tsqr_reduce_root(MPI_Comm comm, int d, int per_item, int64_t nitems,
                                      double *packed, int root) {
  kqsvd_status_t st = KQSVD_OK;
  MPI_Op op = MPI_OP_NULL;
  int size = 1, tri = 0;
  KQSVD_MPI(MPI_Comm_size(comm, &size));
  if (size == 1) return KQSVD_OK;
  KQSVD_TO_INT(kqsvd_tri_size(d), &tri, "R factor size");
  KQSVD_MPI(MPI_Op_create(merge_op, 0 /* not commutative: rank order is kept */, &op));
  KQSVD_CALL(reduce_to_owners(comm, tri, per_item, nitems, packed, op, root));
done:
  if (op != MPI_OP_NULL) MPI_Op_free(&op);
  return st;
}

kqsvd_status_t kqsvd_sum_reduce(MPI_Comm comm, size_t item_doubles, int64_t nitems,
                                double *packed) {
  kqsvd_status_t st = KQSVD_OK;
  int size = 1;
  KQSVD_MPI(MPI_Comm_size(comm, &size));
  int n = 0;
  KQSVD_TO_INT(item_doubles, &n, "reduction item size");
  if (size > 1) KQSVD_CALL(reduce_to_owners(comm, n, 1, nitems, packed, MPI_SUM, -1));
done:
  return st;
}
