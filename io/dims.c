#include <string.h>

#include "kqsvd_h5.h"

kqsvd_status_t kqsvd_h5_read_dims(hid_t file, const char *path, const char *format, int want_causal,
                                  kqsvd_dims_t *d) {
  kqsvd_status_t st = KQSVD_OK;
  char fmt[64] = "";
  int64_t version = 0;
  memset(d, 0, sizeof *d);
  KQSVD_CALL(kqsvd_h5_attr_str(file, path, "kqsvd_format", fmt, sizeof fmt));
  KQSVD_CHECK(strcmp(fmt, format) == 0, KQSVD_ERR_INPUT,
              "%s: attribute 'kqsvd_format' is \"%s\", expected \"%s\"", path, fmt, format);
  KQSVD_CALL(kqsvd_h5_attr_int(file, path, "kqsvd_format_version", &version));
  KQSVD_CHECK(version == 1, KQSVD_ERR_INPUT,
              "%s: attribute 'kqsvd_format_version' is %lld; this kqsvd reads version 1", path,
              (long long)version);
  KQSVD_CALL(kqsvd_h5_attr_str(file, path, "model", d->model, sizeof d->model));
  struct {
    const char *name;
    int64_t *v;
  } f[] = {{"num_layers", &d->layers},
           {"num_heads", &d->heads},
           {"num_kv_heads", &d->kv_heads},
           {"head_dim", &d->head_dim},
           {"hidden_size", &d->hidden}};
  for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
    KQSVD_CALL(kqsvd_h5_attr_int(file, path, f[i].name, f[i].v));
    KQSVD_CHECK(*f[i].v >= 1, KQSVD_ERR_INPUT, "%s: attribute '%s' is %lld, must be >= 1", path,
                f[i].name, (long long)*f[i].v);
  }
  KQSVD_CHECK(d->heads % d->kv_heads == 0, KQSVD_ERR_INPUT,
              "%s: num_heads (%lld) is not a multiple of num_kv_heads (%lld)", path,
              (long long)d->heads, (long long)d->kv_heads);
  if (want_causal) {
    KQSVD_CALL(kqsvd_h5_attr_int(file, path, "causal", &d->causal));
    KQSVD_CHECK(d->causal == 0 || d->causal == 1, KQSVD_ERR_INPUT,
                "%s: attribute 'causal' is %lld, must be 0 or 1", path, (long long)d->causal);
  }
done:
  return st;
}

kqsvd_status_t kqsvd_h5_write_dims(hid_t file, const char *format, const kqsvd_dims_t *d,
                                   int with_causal) {
  kqsvd_status_t st = KQSVD_OK;
  KQSVD_CALL(kqsvd_h5_put_str(file, "kqsvd_format", format));
  KQSVD_CALL(kqsvd_h5_put_int(file, "kqsvd_format_version", H5T_STD_I64LE, 1));
  KQSVD_CALL(kqsvd_h5_put_str(file, "model", d->model));
  KQSVD_CALL(kqsvd_h5_put_int(file, "num_layers", H5T_STD_I64LE, d->layers));
  KQSVD_CALL(kqsvd_h5_put_int(file, "num_heads", H5T_STD_I64LE, d->heads));
  KQSVD_CALL(kqsvd_h5_put_int(file, "num_kv_heads", H5T_STD_I64LE, d->kv_heads));
  KQSVD_CALL(kqsvd_h5_put_int(file, "head_dim", H5T_STD_I64LE, d->head_dim));
  KQSVD_CALL(kqsvd_h5_put_int(file, "hidden_size", H5T_STD_I64LE, d->hidden));
  if (with_causal) KQSVD_CALL(kqsvd_h5_put_int(file, "causal", H5T_STD_I64LE, d->causal));
done:
  return st;
}

kqsvd_status_t kqsvd_dims_match(const kqsvd_dims_t *a, const char *path_a, const kqsvd_dims_t *b,
                                const char *path_b) {
  kqsvd_status_t st = KQSVD_OK;
  struct {
    const char *name;
    int64_t va, vb;
  } f[] = {{"num_layers", a->layers, b->layers},       {"num_heads", a->heads, b->heads},
           {"num_kv_heads", a->kv_heads, b->kv_heads}, {"head_dim", a->head_dim, b->head_dim},
           {"hidden_size", a->hidden, b->hidden},      {"causal", a->causal, b->causal}};
  for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
    KQSVD_CHECK(f[i].va == f[i].vb, KQSVD_ERR_INPUT, "%s: %s = %lld, but %s has %lld", path_a,
                f[i].name, (long long)f[i].va, path_b, (long long)f[i].vb);
done:
  return st;
}
