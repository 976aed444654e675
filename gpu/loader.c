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

/* The test hook of kqsvd_gpu.h: a module is opened and checked without a
 * GPU, and never used. */
static int test_hook(void) {
  const char *v = getenv("KQSVD_TEST_GPU_LOADER");
  return v && strcmp(v, "1") == 0;
}

int kqsvd_gpu_driver_devices(void) {
  static int cached = -1;
  if (cached >= 0) return cached;
  cached = 0;
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (cuda) {
    int (*init)(unsigned) = NULL;
    int (*count)(int *) = NULL;
    void *a = dlsym(cuda, "cuInit"), *b = dlsym(cuda, "cuDeviceGetCount");
    /* POSIX dlsym returns object pointers: copied, not cast (-Wpedantic). */
    memcpy(&init, &a, sizeof init);
    memcpy(&count, &b, sizeof count);
    int n = 0;
    if (init && count && init(0) == 0 && count(&n) == 0) cached = n;
    /* Kept open: the module's runtime will want the driver anyway. */
  }
  if (cached == 0 && test_hook()) cached = 1;
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

/* Every function of the table, by name, for the message when one is
 * missing (a module built from a damaged or edited tree). */
static const char *missing_function(const kqsvd_gpu_api_t *t) {
  const struct {
    const char *name;
    int set;
  } fns[] = {{"device_count", t->device_count != NULL}, {"describe", t->describe != NULL},
             {"fold_init", t->fold_init != NULL},       {"fold_free", t->fold_free != NULL},
             {"fold_load", t->fold_load != NULL},       {"fold_stage", t->fold_stage != NULL},
             {"fold_item", t->fold_item != NULL},       {"fold_sync", t->fold_sync != NULL},
             {"last_error", t->last_error != NULL},     {"h2d_bandwidth", t->h2d_bandwidth != NULL},
             {"fold_rate", t->fold_rate != NULL}};
  for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++)
    if (!fns[i].set) return fns[i].name;
  return NULL;
}

static kqsvd_status_t load(const char *path, const kqsvd_gpu_api_t **out) {
  kqsvd_status_t st = KQSVD_OK;
  /* A module that fails a check stays loaded: CUDA's libraries are not made
   * to be unloaded, and the process goes on without them or exits. */
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  KQSVD_CHECK(h, KQSVD_ERR_CUDA,
              "cannot load the CUDA module %s: %s (is this kqsvd built "
              "with -DKQSVD_CUDA=ON?)",
              path, dlerror());
  void *sym = dlsym(h, KQSVD_GPU_MODULE_ENTRY);
  KQSVD_CHECK(sym, KQSVD_ERR_CUDA,
              "the CUDA module %s exports no %s: it is not a kqsvd CUDA "
              "module, or one of ABI version 1 (older than this kqsvd's version %u); build the "
              "two together",
              path, KQSVD_GPU_MODULE_ENTRY, KQSVD_GPU_ABI_VERSION);
  const kqsvd_gpu_api_t *(*entry)(void) = NULL;
  memcpy(&entry, &sym, sizeof entry); /* object pointer to function pointer, as above */
  const kqsvd_gpu_api_t *t = entry();
  KQSVD_CHECK(t, KQSVD_ERR_CUDA, "the CUDA module %s returned no function table", path);
  /* The version first: nothing past it has a known layout until it matches. */
  KQSVD_CHECK(t->abi_version == KQSVD_GPU_ABI_VERSION, KQSVD_ERR_CUDA,
              "the CUDA module %s has ABI version %u, this kqsvd needs version %u: build the "
              "two together (or point KQSVD_GPU_MODULE at a matching module)",
              path, (unsigned)t->abi_version, KQSVD_GPU_ABI_VERSION);
  const char *missing = missing_function(t);
  KQSVD_CHECK(!missing, KQSVD_ERR_CUDA, "the CUDA module %s (ABI version %u) has no %s", path,
              (unsigned)t->abi_version, missing);
  KQSVD_CHECK(!test_hook(), KQSVD_ERR_CUDA,
              "KQSVD_TEST_GPU_LOADER=1: the CUDA module %s "
              "(ABI version %u) was checked and is not used",
              path, (unsigned)t->abi_version);
  *out = t;
done:
  return st;
}

kqsvd_status_t kqsvd_gpu_open(const kqsvd_gpu_api_t **out) {
  kqsvd_status_t st = KQSVD_OK;
  /* One attempt per process: the outcome, or the failure's message. */
  static const kqsvd_gpu_api_t *api = NULL;
  static char failed[1024] = "";
  *out = NULL;
  KQSVD_CHECK(!failed[0], KQSVD_ERR_CUDA, "%s", failed);
  if (!api) {
    st = load(kqsvd_gpu_module_path(), &api);
    if (st != KQSVD_OK) {
      snprintf(failed, sizeof failed, "%s", kqsvd_error_message());
      goto done;
    }
  }
  *out = api;
done:
  return st;
}
