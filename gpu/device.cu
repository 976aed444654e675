/* The module's device queries (count, description, bandwidth) and its
 * function table, the one symbol it exports (kqsvd_gpu.h). */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>
#include <stdio.h>
#include <string.h>

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
  kqsvd_error_clear();
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

kqsvd_status_t kqsvd_gpu_h2d_bandwidth(int device, size_t bytes, int reps, double *gbps) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_error_clear();
  void *host = NULL, *dev = NULL;
  cudaEvent_t t0 = NULL, t1 = NULL;
  float ms = 0.0f;
  KQSVD_CUDA_CALL(cudaSetDevice(device));
  KQSVD_CUDA_CALL(cudaMallocHost(&host, bytes));
  KQSVD_CUDA_CALL(cudaMalloc(&dev, bytes));
  memset(host, 1, bytes);
  KQSVD_CUDA_CALL(cudaEventCreate(&t0));
  KQSVD_CUDA_CALL(cudaEventCreate(&t1));
  KQSVD_CUDA_CALL(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice)); /* warm-up */
  KQSVD_CUDA_CALL(cudaEventRecord(t0));
  for (int r = 0; r < reps; r++)
    KQSVD_CUDA_CALL(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice));
  KQSVD_CUDA_CALL(cudaEventRecord(t1));
  KQSVD_CUDA_CALL(cudaEventSynchronize(t1));
  KQSVD_CUDA_CALL(cudaEventElapsedTime(&ms, t0, t1));
  *gbps = (double)bytes * reps / (ms * 1e-3) / 1e9;
done:
  if (t0) cudaEventDestroy(t0);
  if (t1) cudaEventDestroy(t1);
  cudaFree(dev);
  cudaFreeHost(host);
  return st;
}

/* The module's one exported symbol (the link keeps every other symbol
 * local: gpu/CMakeLists.txt).  Positional, as C++17 has no designated
 * initializers; every function has its own signature, so a slip in the
 * order does not compile. */
extern "C" const kqsvd_gpu_api_t *kqsvd_gpu_module_table(void) {
  static const kqsvd_gpu_api_t table = {
      KQSVD_GPU_ABI_VERSION, kqsvd_gpu_device_count, kqsvd_gpu_describe,      kqsvd_gpu_fold_init,
      kqsvd_gpu_fold_free,   kqsvd_gpu_fold_load,    kqsvd_gpu_fold_stage,    kqsvd_gpu_fold_item,
      kqsvd_gpu_fold_sync,   kqsvd_gpu_last_error,   kqsvd_gpu_h2d_bandwidth, kqsvd_gpu_fold_rate};
  return &table;
}
