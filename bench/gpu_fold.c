/* The device fold's rate (docs/benchmarks.md, bench/gpu_calibrate.sh): for
 * each shape and method, seconds per item block with the block already on
 * the device (the fold alone) and read from pinned host memory (the copy in
 * too), as GFLOP/s at 2 w^2 flops per row of width w, the count the CPU's
 * --timings uses, and as a share of the FP64 peak.
 *
 *   kqsvd_gpu_fold [--peak TFLOPS] [--rows N] [--reps R] [--chunks C,C,...]
 *
 * --peak: the device's FP64 peak [67, the H100 SXM's and H200's FP64 tensor
 * figure]; --rows: rows per head and block [65536, calibrate's largest GPU
 * read]; --chunks: the Gram method's chunk sizes to try [256,512,1024,2048].
 * Exit 77 without a GPU. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kqsvd_gpu.h"

typedef struct {
  const char *name;
  int hd, G, m;
} shape_t;

int main(int argc, char **argv) {
  const kqsvd_gpu_api_t *api = NULL;
  double peak = 67.0;
  long long rows = 65536;
  int reps = 24, chunks[8] = {256, 512, 1024, 2048}, nchunks = 4;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--peak"))
      peak = atof(argv[i + 1]);
    else if (!strcmp(argv[i], "--rows"))
      rows = atoll(argv[i + 1]);
    else if (!strcmp(argv[i], "--reps"))
      reps = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--chunks")) {
      char *s = argv[i + 1];
      for (nchunks = 0; nchunks < 8 && *s; nchunks++) {
        chunks[nchunks] = (int)strtol(s, &s, 10);
        if (*s == ',') s++;
      }
    } else {
      fprintf(stderr, "usage: kqsvd_gpu_fold [--peak TFLOPS] [--rows N] [--reps R] "
                      "[--chunks C,C,...]\n");
      return 2;
    }
  }
  if (kqsvd_gpu_driver_devices() == 0) {
    printf("gpu_fold: no GPU visible\n");
    return 77;
  }
  if (kqsvd_gpu_open(&api) != KQSVD_OK) {
    fprintf(stderr, "gpu_fold: %s\n", kqsvd_error_message());
    return 1;
  }
  char line[256] = "";
  api->describe(0, line, sizeof line);
  printf("%s; %lld rows per head and block, %d blocks timed\n\n", line, rows, reps);
  const shape_t shapes[] = {{"paper: d 128, 4 query heads per KV head", 128, 1, 4},
                            {"Llama-2-7B: d 128, MHA", 128, 1, 1},
                            {"head groups: G 2 x d 128, 4 query heads per KV head", 128, 2, 4}};
  printf("| shape | method | chunk | on device | GFLOP/s | share of %.0f TFLOP/s | "
         "from pinned host | GFLOP/s |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
         peak);
  for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
    const shape_t *sh = &shapes[k];
    const double w = (double)sh->hd * sh->G, hd = (double)sh->hd;
    const double flops = 2.0 * (double)rows * (2.0 * w * w + sh->G * sh->m * hd * hd);
    for (int c = -1; c < nchunks; c++) {
      const kqsvd_gpu_shape_t s = {sh->hd,
                                   sh->G,
                                   sh->m,
                                   4,
                                   rows,
                                   2,
                                   2,
                                   c < 0 ? 0 : chunks[c],
                                   c < 0 ? KQSVD_GPU_QR : KQSVD_GPU_GRAM};
      double dev = 0.0, host = 0.0;
      if (api->fold_rate(0, &s, rows, c < 0 ? 4 : reps, &dev, &host) != KQSVD_OK) {
        fprintf(stderr, "gpu_fold: %s\n", api->last_error());
        return 1;
      }
      printf("| %s | %s | %s | %.3f ms | %.0f | %.1f%% | %.3f ms | %.0f |\n", sh->name,
             c < 0 ? "qr" : "gram",
             c < 0 ? "-" : (snprintf(line, sizeof line, "%d", chunks[c]), line), dev * 1e3,
             flops / dev / 1e9, 100.0 * flops / dev / (peak * 1e12), host * 1e3,
             flops / host / 1e9);
      fflush(stdout);
    }
  }
  return 0;
}
