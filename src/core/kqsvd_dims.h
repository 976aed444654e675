/* A model's sizes as every kqsvd file records them (docs/formats.md,
 * sections 1 to 3): the header shared by caches, model files and
 * projections, and by the stages that plan work from it.  Plain data; the
 * HDF5 readers and writers are in io/kqsvd_h5.h. */
#ifndef KQSVD_DIMS_H
#define KQSVD_DIMS_H

#include <stdint.h>

typedef struct kqsvd_dims {
  char model[256];
  int64_t layers, heads, kv_heads, head_dim, hidden, causal;
} kqsvd_dims_t;

#endif
