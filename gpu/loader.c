/* Loads the CUDA module on demand, so that a kqsvd built with CUDA costs a
 * CPU-only run nothing: the driver is asked for devices through libcuda
 * (small), and cuSOLVER comes in with the module only when one is there. */
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kqsvd_gpu.h"

int kqsvd_gpu_driver_devices(void) {
  static int cached = -1;
  if (cached >= 0) return cached;
  cached = 0;
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!cuda) return cached;
  int (*init)(unsigned) = NULL;
  int (*count)(int *) = NULL;
  void *a = dlsym(cuda, "cuInit"), *b = dlsym(cuda, "cuDeviceGetCount");
  /* POSIX dlsym returns object pointers: copied, not cast (-Wpedantic). */
  memcpy(&init, &a, sizeof init);
  memcpy(&count, &b, sizeof count);
  int n = 0;
  if (init && count && init(0) == 0 && count(&n) == 0) cached = n;
  /* Kept open: the module's runtime will want the driver anyway. */
  return cached;
}

const char *kqsvd_gpu_module_path(void) {
  static char path[PATH_MAX + 32];
  const char *env = getenv("KQSVD_GPU_MODULE");
  if (env && *env) return env;
  char exe[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) return "libkqsvd_gpu.so";
  exe[n] = '\0';
  char *slash = strrchr(exe, '/');
  if (slash) *slash = '\0';
  snprintf(path, sizeof path, "%s/libkqsvd_gpu.so", exe);
  return path;
}

kqsvd_status_t kqsvd_gpu_open(const kqsvd_gpu_api_t **out) {
  kqsvd_status_t st = KQSVD_OK;
  static kqsvd_gpu_api_t api;
  static int loaded = 0;
  const char *path = kqsvd_gpu_module_path();
  *out = NULL;
  if (!loaded) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    KQSVD_CHECK(h, KQSVD_ERR_CUDA, "cannot load the CUDA module %s: %s (is this kqsvd built "
                "with -DKQSVD_CUDA=ON?)", path, dlerror());
    /* Function pointers copied from dlsym's object pointers, as above. */
    struct {
      const char *name;
      void *slot;
      size_t size;
    } syms[] = {{"kqsvd_gpu_device_count", &api.device_count, sizeof api.device_count},
                {"kqsvd_gpu_describe", &api.describe, sizeof api.describe},
                {"kqsvd_gpu_fold_init", &api.fold_init, sizeof api.fold_init},
                {"kqsvd_gpu_fold_free", &api.fold_free, sizeof api.fold_free},
                {"kqsvd_gpu_fold_load", &api.fold_load, sizeof api.fold_load},
                {"kqsvd_gpu_fold_rows", &api.fold_rows, sizeof api.fold_rows},
                {"kqsvd_gpu_fold_sync", &api.fold_sync, sizeof api.fold_sync},
                {"kqsvd_gpu_last_error", &api.last_error, sizeof api.last_error},
                {"kqsvd_gpu_h2d_bandwidth", &api.h2d_bandwidth, sizeof api.h2d_bandwidth}};
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
      void *f = dlsym(h, syms[i].name);
      KQSVD_CHECK(f, KQSVD_ERR_CUDA, "the CUDA module %s lacks %s", path, syms[i].name);
      memcpy(syms[i].slot, &f, syms[i].size);
    }
    loaded = 1;
  }
  *out = &api;
done:
  return st;
}
