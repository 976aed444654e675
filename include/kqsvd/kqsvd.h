/* kqsvd: low-rank KV-cache projections (KQ-SVD, K-SVD, Eigen) from
 * calibration activations, by streaming TSQR.  The one header to include:
 *
 *     #include <kqsvd/kqsvd.h>
 *
 * The library is C11 and uses MPI and HDF5. */
#ifndef KQSVD_PUBLIC_KQSVD_H
#define KQSVD_PUBLIC_KQSVD_H

#include "kqsvd/version.h"
#include "kqsvd/types.h"
#include "kqsvd/error.h"

#endif
