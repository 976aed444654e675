/* kqsvd_calibrate: one model (calib_model.c) or every model of a manifest
 * (calib_manifest.c), from a config checked by kqsvd_calib_config_check. */
#include <string.h>

#include "calib.h"

kqsvd_status_t kqsvd_calibrate(const kqsvd_ctx_t *ctx, const kqsvd_calib_config_t *cfg,
                               const kqsvd_observer_t *obs) {
  kqsvd_status_t st = KQSVD_OK;
  calib_t c;
  memset(&c, 0, sizeof c);
  c.ctx = *ctx;
  c.obs = obs;
  c.cfg = *cfg;
  KQSVD_CALL(cfg->manifest_path ? calib_manifest(&c) : calib_model(&c));
done:
  return st;
}
