#include <stdlib.h>

#include "kqsvd_linalg.h"
#include "kqsvd_mpi.h"

/* MPI user functions cannot take context or return errors, so the merge
 * reads its shape from, and reports into, this state, which is only live
 * during kqsvd_tsqr_reduce (kqsvd calls MPI from one thread). */
static struct {
  int d, per_item;
  kqsvd_qr_ws_t *ws;
  double *top, *bottom;
  kqsvd_status_t st;
} g_merge;

/* inout[i] <- R factor of [in[i]; inout[i]]: `in` holds the lower ranks. */
static void merge_op(void *in, void *inout, int *len, MPI_Datatype *type) {
  (void)type;
  const int d = g_merge.d;
  const size_t tri = kqsvd_tri_size(d);
  const int n = *len * g_merge.per_item;
  for (int i = 0; i < n && g_merge.st == KQSVD_OK; i++) {
    double *a = (double *)in + (size_t)i * tri, *b = (double *)inout + (size_t)i * tri;
    kqsvd_tri_unpack(d, a, g_merge.top);
    kqsvd_tri_unpack(d, b, g_merge.bottom);
    g_merge.st = kqsvd_qr_merge(g_merge.ws, g_merge.top, g_merge.bottom);
    kqsvd_tri_pack(d, g_merge.top, b);
  }
}

/* Messages of at most this many bytes bound MPI's temporary buffers. */
#define REDUCE_CHUNK_BYTES ((size_t)64 << 20)

/* Reduces each rank's items (kqsvd_partition_items) onto it with `op`, in
 * messages of at most REDUCE_CHUNK_BYTES.  Predefined operations (MPI_SUM)
 * only apply to basic types, so with them items travel as plain doubles. */
static kqsvd_status_t reduce_to_owners(MPI_Comm comm, size_t item_doubles, int64_t nitems,
                                       double *packed, MPI_Op op, const kqsvd_status_t *op_st) {
  kqsvd_status_t st = KQSVD_OK;
  MPI_Datatype item_type = MPI_DATATYPE_NULL;
  int rank = 0, size = 1, item_int = 0;
  KQSVD_MPI(MPI_Comm_rank(comm, &rank));
  KQSVD_MPI(MPI_Comm_size(comm, &size));
  const int basic = op == MPI_SUM;
  KQSVD_TO_INT(item_doubles, &item_int, "reduction item size");
  if (!basic) {
    KQSVD_MPI(MPI_Type_contiguous(item_int, MPI_DOUBLE, &item_type));
    KQSVD_MPI(MPI_Type_commit(&item_type));
  }
  const int64_t chunk = (int64_t)(REDUCE_CHUNK_BYTES / (item_doubles * sizeof(double))) + 1;
  for (int p = 0; p < size; p++) {
    int64_t i0, i1;
    kqsvd_partition_items(nitems, size, p, &i0, &i1);
    for (int64_t c0 = i0; c0 < i1; c0 += chunk) {
      int count = 0;
      const int64_t n = c0 + chunk < i1 ? chunk : i1 - c0;
      KQSVD_TO_INT(basic ? n * (int64_t)item_doubles : n, &count, "reduction chunk");
      double *buf = packed + (size_t)c0 * item_doubles;
      KQSVD_MPI(MPI_Reduce(rank == p ? MPI_IN_PLACE : buf, rank == p ? buf : NULL, count,
                           basic ? MPI_DOUBLE : item_type, op, p, comm));
      if (op_st) KQSVD_CALL(*op_st);
    }
  }
done:
  if (item_type != MPI_DATATYPE_NULL) MPI_Type_free(&item_type);
  return st;
}

kqsvd_status_t kqsvd_tsqr_reduce(MPI_Comm comm, int d, int per_item, int64_t nitems,
                                 double *packed) {
  kqsvd_status_t st = KQSVD_OK;
  MPI_Op op = MPI_OP_NULL;
  int size = 1;
  g_merge.per_item = per_item;
  g_merge.ws = NULL;
  g_merge.top = g_merge.bottom = NULL;
  g_merge.st = KQSVD_OK;
  g_merge.d = d;
  KQSVD_MPI(MPI_Comm_size(comm, &size));
  if (size == 1) return KQSVD_OK;
  KQSVD_CALL(kqsvd_qr_ws_init(d, d, &g_merge.ws)); /* d rows: the fast merge */
  KQSVD_MALLOC(g_merge.top, (size_t)d * d, "TSQR merge buffer");
  KQSVD_MALLOC(g_merge.bottom, (size_t)d * d, "TSQR merge buffer");
  KQSVD_MPI(MPI_Op_create(merge_op, 0 /* not commutative: rank order is kept */, &op));
  KQSVD_CALL(reduce_to_owners(comm, kqsvd_tri_size(d) * (size_t)per_item, nitems, packed, op,
                              &g_merge.st));
done:
  if (op != MPI_OP_NULL) MPI_Op_free(&op);
  kqsvd_qr_ws_free(&g_merge.ws);
  free(g_merge.top);
  free(g_merge.bottom);
  g_merge.top = g_merge.bottom = NULL;
  return st;
}

kqsvd_status_t kqsvd_sum_reduce(MPI_Comm comm, size_t item_doubles, int64_t nitems,
                                double *packed) {
  kqsvd_status_t st = KQSVD_OK;
  int size = 1;
  KQSVD_MPI(MPI_Comm_size(comm, &size));
  if (size > 1) KQSVD_CALL(reduce_to_owners(comm, item_doubles, nitems, packed, MPI_SUM, NULL));
done:
  return st;
}
