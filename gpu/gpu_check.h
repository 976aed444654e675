/* The CUDA, cuBLAS and cuSOLVER checkers of the gpu/ sources (private): a
 * failing call becomes KQSVD_ERR_CUDA naming it, with CUDA's own string or
 * the library's status number, and jumps to `done`. */
#ifndef KQSVD_GPU_CHECK_H
#define KQSVD_GPU_CHECK_H

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>

#include "kqsvd_error.h"

#define KQSVD_CUDA_CALL(call)                                                    \
  do {                                                                           \
    cudaError_t e_ = (call);                                                     \
    if (e_ != cudaSuccess)                                                       \
      KQSVD_FAIL(KQSVD_ERR_CUDA, "CUDA: %s: %s", #call, cudaGetErrorString(e_)); \
  } while (0)
#define KQSVD_CUSOLVER_CALL(call)                                                    \
  do {                                                                               \
    cusolverStatus_t s_ = (call);                                                    \
    if (s_ != CUSOLVER_STATUS_SUCCESS)                                               \
      KQSVD_FAIL(KQSVD_ERR_CUDA, "cuSOLVER: %s returned status %d", #call, (int)s_); \
  } while (0)
#define KQSVD_CUBLAS_CALL(call)                                                    \
  do {                                                                             \
    cublasStatus_t s_ = (call);                                                    \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                               \
      KQSVD_FAIL(KQSVD_ERR_CUDA, "cuBLAS: %s returned status %d", #call, (int)s_); \
  } while (0)

#endif
