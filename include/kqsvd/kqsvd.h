/* kqsvd: low-rank KV-cache projections (KQ-SVD, K-SVD, Eigen) from
 * calibration activations, by streaming TSQR.  The one header to include:
 *
 *     #include <kqsvd/kqsvd.h>
 *
 * and link kqsvd::kqsvd (CMake: find_package(kqsvd)) or `pkg-config
 * --cflags --libs kqsvd`.  The library is C11 and uses MPI (only for
 * kqsvd_acc_reduce: a single process needs no MPI_Init) and HDF5.  A
 * program that only decodes or reads a result includes kqsvd/decode.h,
 * kqsvd/result.h and kqsvd/error.h instead, which need no MPI headers. */
#ifndef KQSVD_PUBLIC_KQSVD_H
#define KQSVD_PUBLIC_KQSVD_H

#include "kqsvd/accumulator.h"
#include "kqsvd/decode.h"
#include "kqsvd/error.h"
#include "kqsvd/result.h"
#include "kqsvd/types.h"
#include "kqsvd/version.h"

#endif
