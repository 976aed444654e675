/* Around every HDF5 call of a public function (save, load, write): a
 * library-wide lock, and HDF5's automatic error printing off (restored on
 * leave).  Not collective. */
#ifndef KQSVD_H5GUARD_H
#define KQSVD_H5GUARD_H

#include <hdf5.h>

typedef struct kqsvd_h5guard {
  H5E_auto2_t func;
  void *data;
} kqsvd_h5guard_t;

void kqsvd_h5guard_enter(kqsvd_h5guard_t *g);
void kqsvd_h5guard_leave(kqsvd_h5guard_t *g);

#endif
