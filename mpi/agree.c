#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "kqsvd_mpi.h"

kqsvd_status_t kqsvd_mpi_check_(int rc, const char *call, const char *file, int line,
                                const char *func) {
  if (rc == MPI_SUCCESS) return KQSVD_OK;
  char msg[MPI_MAX_ERROR_STRING] = "";
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) snprintf(msg, sizeof msg, "code %d", rc);
  return kqsvd_error_set(KQSVD_ERR_MPI, file, line, func, "MPI call failed: %s: %s", call, msg);
}

kqsvd_status_t kqsvd_mpi_agree(MPI_Comm comm, kqsvd_status_t local) {
  kqsvd_status_t st = KQSVD_OK;
  int rank = 0, size = 1;
  /* One process without MPI (kqsvd manifest, ranks, help): it agrees alone. */
  if (comm == MPI_COMM_NULL) {
    if (local != KQSVD_OK) kqsvd_error_mark_collective(true);
    return local;
  }
  KQSVD_MPI(MPI_Comm_rank(comm, &rank));
  KQSVD_MPI(MPI_Comm_size(comm, &size));
  /* A rank that only stopped because another failed is not an origin. */
  const int origin = local != KQSVD_OK && local != KQSVD_ERR_REMOTE;
  int mine[2] = {origin ? rank : size, local != KQSVD_OK ? -1 : 0}, all[2];
  KQSVD_MPI(MPI_Allreduce(mine, all, 2, MPI_INT, MPI_MIN, comm));
  if (all[1] == 0) return KQSVD_OK;
  const int first = all[0];
  /* Every rank exits with the reporting rank's code (2 for usage, 75 for
   * an interruption), not with its own "another rank failed". */
  int code = rank == first ? (int)local : 0, agreed = 0;
  KQSVD_MPI(MPI_Allreduce(&code, &agreed, 1, MPI_INT, MPI_MAX, comm));
  if (!origin) {
    kqsvd_error_clear();
    st = kqsvd_error_set(KQSVD_ERR_REMOTE, __FILE__, __LINE__, __func__,
                         "rank %d failed (see its message)", first);
  } else {
    st = local;
  }
  /* If no rank recorded an origin, rank 0 at least says the run stopped. */
  kqsvd_error_mark_collective(first < size ? rank == first : rank == 0);
  if (agreed != 0) kqsvd_error_set_origin((kqsvd_status_t)agreed);
done:
  return st;
}

void kqsvd_mpi_rmdir_made(MPI_Comm comm, kqsvd_made_dirs_t *made) {
  int rank = 0;
  if (comm == MPI_COMM_NULL) {
    kqsvd_rmdir_made(made);
    return;
  }
  /* The shallowest component any rank made: all below it were made by
   * this run, by one rank or another (the path is the same on each). */
  int mine = made->n > 0 ? (int)made->end[0] : INT_MAX, shallowest = INT_MAX;
  if (MPI_Comm_rank(comm, &rank) != MPI_SUCCESS ||
      MPI_Allreduce(&mine, &shallowest, 1, MPI_INT, MPI_MIN, comm) != MPI_SUCCESS) {
    made->n = 0;
    return;
  }
  if (rank == 0 && shallowest != INT_MAX) {
    kqsvd_made_dirs_t all = {.n = 0};
    memcpy(all.path, made->path, sizeof all.path);
    const size_t len = strlen(all.path);
    for (size_t i = (size_t)shallowest; i <= len; i++)
      if (i == len || all.path[i] == '/') all.end[all.n++] = (unsigned short)i;
    kqsvd_rmdir_made(&all);
  }
  made->n = 0;
}
