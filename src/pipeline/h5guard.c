/* The library's HDF5 calls from a host program: one at a time (Debian's
 * parallel HDF5 is not thread-safe, and several handles may be saved from
 * several threads), and without HDF5's own error printing, which is the
 * host's setting to keep: kqsvd reports through its own messages. */
#include <threads.h>

#include "kqsvd_h5guard.h"

static once_flag g_once = ONCE_FLAG_INIT;
static mtx_t g_lock;

static void init_lock(void) { mtx_init(&g_lock, mtx_plain); }

void kqsvd_h5guard_enter(kqsvd_h5guard_t *g) {
  call_once(&g_once, init_lock);
  mtx_lock(&g_lock);
  g->func = NULL;
  g->data = NULL;
  H5Eget_auto2(H5E_DEFAULT, &g->func, &g->data);
  H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
}

void kqsvd_h5guard_leave(kqsvd_h5guard_t *g) {
  H5Eset_auto2(H5E_DEFAULT, g->func, g->data);
  mtx_unlock(&g_lock);
}
