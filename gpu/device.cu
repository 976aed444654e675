#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>
#include <stdio.h>

#include "kqsvd_gpu.h"

/* Checkers: CUDA runtime errors carry their own strings; cuSOLVER and
 * cuBLAS statuses are numbers, reported with the call that returned them. */
static kqsvd_status_t cuda_fail(cudaError_t e, const char *call, const char *file, int line) {
  return kqsvd_error_set(KQSVD_ERR_CUDA, file, line, "cuda", "CUDA: %s: %s", call,
                         cudaGetErrorString(e));
}
#define KQSVD_CUDA_CALL(call)                                                  \
  do {                                                                         \
    cudaError_t e_ = (call);                                                   \
    if (e_ != cudaSuccess) {                                                   \
      st = cuda_fail(e_, #call, __FILE__, __LINE__);                           \
      goto done;                                                               \
    }                                                                          \
  } while (0)
#define KQSVD_CUSOLVER_CALL(call)                                              \
  do {                                                                         \
    cusolverStatus_t s_ = (call);                                              \
    if (s_ != CUSOLVER_STATUS_SUCCESS)                                         \
      KQSVD_FAIL(KQSVD_ERR_CUDA, "cuSOLVER: %s returned status %d", #call, (int)s_); \
  } while (0)

int kqsvd_gpu_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError(); /* no driver or no device: report zero devices */
    return 0;
  }
  return n;
}

kqsvd_status_t kqsvd_gpu_describe(int dev, char *buf, int n) {
  kqsvd_status_t st = KQSVD_OK;
  cudaDeviceProp prop;
  int major = 0, minor = 0, patch = 0;
  KQSVD_CUDA_CALL(cudaGetDeviceProperties(&prop, dev));
  KQSVD_CUSOLVER_CALL(cusolverGetProperty(MAJOR_VERSION, &major));
  KQSVD_CUSOLVER_CALL(cusolverGetProperty(MINOR_VERSION, &minor));
  KQSVD_CUSOLVER_CALL(cusolverGetProperty(PATCH_LEVEL, &patch));
  snprintf(buf, (size_t)n, "device %d: %s, %.1f GiB, compute %d.%d; cuSOLVER %d.%d.%d", dev,
           prop.name, (double)prop.totalGlobalMem / 1073741824.0, prop.major, prop.minor, major,
           minor, patch);
done:
  return st;
}
