/* CUDA backend (built with -DKQSVD_CUDA=ON).  This first part only finds
 * devices and checks CUDA/cuBLAS/cuSOLVER calls; the device QR stage of
 * `calibrate` builds on it.  Nothing here is collective. */
#ifndef KQSVD_GPU_H
#define KQSVD_GPU_H

#include "kqsvd_error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Number of CUDA devices visible to this process (0 when the driver or a
 * device is missing: not an error).  Errors: none. */
int kqsvd_gpu_device_count(void);

/* One line describing device `dev` (name, memory, compute capability) and
 * the cuSOLVER version linked.  Errors: KQSVD_ERR_CUDA naming the call. */
kqsvd_status_t kqsvd_gpu_describe(int dev, char *buf, int n);

#ifdef __cplusplus
}
#endif

#endif
