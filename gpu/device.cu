#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>
#include <stdio.h>

#include "gpu_check.h"
#include "kqsvd_gpu.h"

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

extern "C" const char *kqsvd_gpu_last_error(void) { return kqsvd_error_message(); }
