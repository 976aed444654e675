/* The start every MPI test shares: MPI up, errors returned rather than
 * fatal (a failing call must reach the checks), this process's rank and
 * the count. */
#ifndef KQSVD_TEST_MPI_CHECK_H
#define KQSVD_TEST_MPI_CHECK_H

#include <mpi.h>

static inline void test_mpi_init(int *argc, char ***argv, int *rank, int *size) {
  MPI_Init(argc, argv);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, rank);
  MPI_Comm_size(MPI_COMM_WORLD, size);
}

#endif
