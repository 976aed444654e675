/* Host-to-device bandwidth of each visible GPU (pinned memory, 256 MiB
 * copies), for docs/benchmarks.md.  Exit 77 without a GPU. */
#include <stdio.h>

#include "kqsvd_gpu.h"

int main(void) {
  const kqsvd_gpu_api_t *api = NULL;
  const int n = kqsvd_gpu_driver_devices();
  if (n == 0) {
    printf("gpu_h2d: no GPU visible\n");
    return 77;
  }
  if (kqsvd_gpu_open(&api) != KQSVD_OK) {
    fprintf(stderr, "gpu_h2d: %s\n", kqsvd_error_message());
    return 1;
  }
  for (int dev = 0; dev < n; dev++) {
    double gbps = 0.0;
    char line[256] = "";
    api->describe(dev, line, sizeof line);
    if (api->h2d_bandwidth(dev, (size_t)256 << 20, 20, &gbps) != KQSVD_OK) {
      fprintf(stderr, "gpu_h2d: %s\n", api->last_error());
      return 1;
    }
    printf("%s: host-to-device %.1f GB/s (pinned, 256 MiB copies)\n", line, gbps);
  }
  return 0;
}
