/* Stand-ins for the CUDA module, for the loader's checks (e2e_gpu_abi):
 * built as libkqsvd_fake_gpu_abi.so, whose table has the next ABI version
 * and no functions (the loader must refuse it before touching them), and,
 * with KQSVD_FAKE_NO_TABLE, as libkqsvd_fake_gpu_empty.so, which exports no
 * table at all (a module from before the table, or another library). */
#include "kqsvd_gpu.h"

#ifdef KQSVD_FAKE_NO_TABLE
/* A shared library must hold something. */
int kqsvd_fake_gpu_module_marker(void);
int kqsvd_fake_gpu_module_marker(void) { return 1; }
#else
const kqsvd_gpu_api_t *kqsvd_gpu_module_table(void) {
  static const kqsvd_gpu_api_t table = {.abi_version = KQSVD_GPU_ABI_VERSION + 1u};
  return &table;
}
#endif
