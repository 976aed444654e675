/* The accumulator (include/kqsvd/accumulator.h): R factors of K, Q, V and
 * W^T per (layer, KV head), folded as rows arrive, merged across processes
 * and solved.  Its state is calibrate's: per item, the packed triangles of
 * K, Q and V in that order, so checkpoints and results are the same. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kqsvd/accumulator.h"
#include "kqsvd_acc.h"
#include "kqsvd_checkpoint.h"
#include "kqsvd_gram.h"
#include "kqsvd_h5guard.h"
#include "kqsvd_linalg.h"
#include "kqsvd_mpi.h"
#include "kqsvd_pipeline.h"
#include "kqsvd_util.h"

enum { ACC_K = 0, ACC_Q = 1, ACC_V = 2, ACC_NR = 3 };

struct kqsvd_acc {
  kqsvd_shape_t shape; /* the model's */
  /* What the items are: with head_groups G, one per (layer, group of G KV
   * heads), G d wide, its queries (G group of them) padded to that width;
   * the model's shape when G = 1. */
  kqsvd_shape_t view;
  kqsvd_acc_options_t opt;
  int d;  /* an item's width: head_dim x head_groups */
  int hd; /* head_dim */
  int64_t nitems;
  size_t tri;
  double *state;      /* nitems x ACC_NR packed triangles (Gram matrices under GRAM) */
  double *wstate;     /* nitems packed triangles of W^T */
  double *R, *backup; /* d x d: scratch for W's factors; a K/Q/V factor as it was */
  double *sub;        /* hd x hd: one KV head's diagonal block of a grouped item */
  /* The K, Q and V factors of one item, unpacked while rows of that item
   * arrive (calibrate feeds an item's rows block after block), packed back
   * when another item comes or the state is read. */
  double *cur[ACC_NR];
  int64_t cur_item;
  int64_t bad_row;             /* the last call's NaN or Inf row, else -1 */
  char *gather;                /* block_rows x d elements of the widest type, for strided rows */
  double *gram_buf;            /* block_rows x d doubles */
  char *wbuf;                  /* block_rows x group x d elements: o_proj rows of one group */
  kqsvd_qr_ws_t *ws, *ws_head; /* for d-wide rows; for hd-wide ones (when G > 1) */
  int64_t tokens;
  int64_t *w_rows; /* [layers]: o_proj rows absorbed, D when complete */
};

void kqsvd_acc_options_default(kqsvd_acc_options_t *opt) {
  opt->block_rows = KQSVD_QR_BLOCK_DEFAULT;
  opt->mem_limit_mib = 0.0;
  opt->qr = KQSVD_QR_TSQR;
  opt->head_groups = 1;
}

int64_t kqsvd_acc_state_doubles(const kqsvd_acc_t *acc) {
  return acc->nitems * ACC_NR * (int64_t)acc->tri;
}

/* Packs the unpacked item back into the state. */
static void flush(kqsvd_acc_t *a) {
  if (a->cur_item < 0) return;
  for (int k = 0; k < ACC_NR; k++)
    kqsvd_tri_pack(a->d, a->cur[k], a->state + ((size_t)a->cur_item * ACC_NR + (size_t)k) * a->tri);
  a->cur_item = -1;
}

double *kqsvd_acc_state(kqsvd_acc_t *acc) {
  flush(acc);
  return acc->state;
}
void kqsvd_acc_discard(kqsvd_acc_t *acc) { acc->cur_item = -1; }
int64_t kqsvd_acc_bad_row(const kqsvd_acc_t *acc) { return acc->bad_row; }
const double *kqsvd_acc_wstate(const kqsvd_acc_t *acc) { return acc->wstate; }
const kqsvd_shape_t *kqsvd_acc_shape(const kqsvd_acc_t *acc) { return &acc->view; }
int64_t kqsvd_acc_head_groups(const kqsvd_acc_t *acc) { return acc->opt.head_groups; }
const kqsvd_acc_options_t *kqsvd_acc_options(const kqsvd_acc_t *acc) { return &acc->opt; }
int64_t kqsvd_acc_oproj_rows(const kqsvd_acc_t *acc, int64_t layer) { return acc->w_rows[layer]; }
int64_t kqsvd_acc_tokens(const kqsvd_acc_t *acc) { return acc ? acc->tokens : 0; }

/* Sizes out of range, or whose factors' byte count would overflow, are
 * refused as usage. */
static kqsvd_status_t check_shape(const kqsvd_shape_t *s, const kqsvd_acc_options_t *o) {
  kqsvd_status_t st = KQSVD_OK;
  const struct {
    const char *name;
    int64_t v, max;
  } f[] = {{"layers", s->layers, 1 << 20}, {"kv_heads", s->kv_heads, 1 << 20},
           {"group", s->group, 1 << 16},   {"head_dim", s->head_dim, 1 << 14},
           {"hidden", s->hidden, 1 << 26}, {"block_rows", o->block_rows, 1 << 20}};
  for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
    KQSVD_CHECK(f[i].v >= 1 && f[i].v <= f[i].max, KQSVD_ERR_USAGE,
                "accumulator: %s = %lld is outside 1..%lld", f[i].name, (long long)f[i].v,
                (long long)f[i].max);
  const int64_t G = o->head_groups;
  KQSVD_CHECK(G >= 1 && G <= s->kv_heads && s->kv_heads % G == 0, KQSVD_ERR_USAGE,
              "accumulator: head_groups = %lld must divide kv_heads = %lld", (long long)G,
              (long long)s->kv_heads);
  KQSVD_CHECK(G * s->head_dim <= 1 << 15, KQSVD_ERR_USAGE,
              "accumulator: head_groups x head_dim = %lld is above %d",
              (long long)(G * s->head_dim), 1 << 15);
  /* The factors' bytes must fit a size_t (and a double's exact range). */
  const double w = (double)(G * s->head_dim);
  const double bytes =
      (double)s->layers * (double)(s->kv_heads / G) * (ACC_NR + 1) * (w * (w + 1.0) / 2.0) * 8.0;
  KQSVD_CHECK(bytes < 0x1p52, KQSVD_ERR_USAGE,
              "accumulator: %lld layers x %lld KV heads at d = %lld need %.3g bytes of factors, "
              "more than this library can address",
              (long long)s->layers, (long long)s->kv_heads, (long long)s->head_dim, bytes);
  KQSVD_CHECK(o->qr == KQSVD_QR_TSQR || o->qr == KQSVD_QR_GRAM, KQSVD_ERR_USAGE,
              "accumulator: unknown qr method %d", (int)o->qr);
  KQSVD_CHECK(o->mem_limit_mib >= 0.0 && isfinite(o->mem_limit_mib), KQSVD_ERR_USAGE,
              "accumulator: mem_limit_mib = %g must be finite and >= 0", o->mem_limit_mib);
done:
  return st;
}

kqsvd_status_t kqsvd_acc_init(const kqsvd_shape_t *shape, const kqsvd_acc_options_t *opt,
                              kqsvd_acc_t **out) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_error_clear(); /* a call reports its own failure, not an earlier one */
  kqsvd_acc_t *a = NULL;
  KQSVD_CHECK(shape && out, KQSVD_ERR_USAGE, "kqsvd_acc_init: shape and acc must not be NULL");
  *out = NULL;
  KQSVD_MALLOC(a, 1, "accumulator");
  memset(a, 0, sizeof *a);
  a->shape = *shape;
  if (opt)
    a->opt = *opt;
  else
    kqsvd_acc_options_default(&a->opt);
  KQSVD_CALL(check_shape(&a->shape, &a->opt));
  const int64_t G = a->opt.head_groups;
  a->view = *shape;
  a->view.kv_heads = shape->kv_heads / G;
  a->view.group = shape->group * G;
  a->view.head_dim = shape->head_dim * G;
  a->hd = (int)shape->head_dim;
  a->d = (int)a->view.head_dim;
  a->nitems = shape->layers * a->view.kv_heads;
  a->tri = kqsvd_tri_size(a->d);
  /* Everything init allocates: the factors, five d x d buffers (R, the
   * backup, the item's K, Q and V), the row, Gram and o_proj buffers, the
   * QR workspace. */
  const double dd = (double)a->d * a->d, rows = (double)a->opt.block_rows * a->d;
  const double need =
      ((double)a->nitems * (ACC_NR + 1) * (double)a->tri + 5.0 * dd +
       (2.0 + (double)shape->group) * rows + (double)shape->layers + (double)a->hd * a->hd) *
          8.0 +
      kqsvd_qr_ws_bytes(a->d, (int)a->opt.block_rows) +
      (G > 1 ? kqsvd_qr_ws_bytes(a->hd, (int)a->opt.block_rows) : 0.0);
  KQSVD_CHECK(a->opt.mem_limit_mib == 0.0 || need <= a->opt.mem_limit_mib * 1048576.0,
              KQSVD_ERR_NOMEM,
              "accumulator: the factors of %lld layers x %lld KV heads at d = %d "
              "need %.1f MiB, above the limit of %g MiB",
              (long long)shape->layers, (long long)shape->kv_heads, a->d, need / 1048576.0,
              a->opt.mem_limit_mib);
  KQSVD_MALLOC(a->state, (size_t)kqsvd_acc_state_doubles(a), "accumulator factors");
  KQSVD_MALLOC(a->wstate, (size_t)a->nitems * a->tri, "accumulator W factors");
  memset(a->state, 0, (size_t)kqsvd_acc_state_doubles(a) * sizeof(double));
  memset(a->wstate, 0, (size_t)a->nitems * a->tri * sizeof(double));
  KQSVD_MALLOC(a->w_rows, (size_t)shape->layers, "accumulator row counts");
  memset(a->w_rows, 0, (size_t)shape->layers * sizeof *a->w_rows);
  KQSVD_MALLOC(a->R, (size_t)a->d * (size_t)a->d, "accumulator work");
  KQSVD_MALLOC(a->cur[0], (size_t)ACC_NR * (size_t)a->d * (size_t)a->d, "accumulator work");
  for (int k = 1; k < ACC_NR; k++) a->cur[k] = a->cur[0] + (size_t)k * (size_t)a->d * (size_t)a->d;
  a->cur_item = -1;
  KQSVD_MALLOC(a->backup, (size_t)a->d * (size_t)a->d, "accumulator work");
  KQSVD_MALLOC(a->gather, (size_t)a->opt.block_rows * (size_t)a->d * sizeof(double),
               "accumulator row buffer");
  KQSVD_MALLOC(a->gram_buf, (size_t)a->opt.block_rows * (size_t)a->d, "accumulator Gram buffer");
  KQSVD_MALLOC(a->wbuf, (size_t)(a->opt.block_rows * shape->group * a->hd) * sizeof(double),
               "accumulator o_proj buffer");
  KQSVD_MALLOC(a->sub, (size_t)a->hd * (size_t)a->hd, "accumulator work");
  KQSVD_CALL(kqsvd_qr_ws_init(a->d, (int)a->opt.block_rows, &a->ws));
  if (G > 1) KQSVD_CALL(kqsvd_qr_ws_init(a->hd, (int)a->opt.block_rows, &a->ws_head));
  *out = a;
  a = NULL;
done:
  kqsvd_acc_free(&a);
  return kqsvd_api_return(st);
}

void kqsvd_acc_free(kqsvd_acc_t **acc) {
  if (!acc || !*acc) return;
  kqsvd_acc_t *a = *acc;
  kqsvd_qr_ws_free(&a->ws);
  kqsvd_qr_ws_free(&a->ws_head);
  free(a->sub);
  free(a->state);
  free(a->wstate);
  free(a->w_rows);
  free(a->R);
  free(a->cur[0]);
  free(a->backup);
  free(a->gather);
  free(a->gram_buf);
  free(a->wbuf);
  free(a);
  *acc = NULL;
}

/* Folds n contiguous rows of `width` elements into the width x width R
 * (ws: a workspace of that width); *bad the row of a NaN or Inf, else -1.
 * Both kernels check a block before folding it, so R holds the blocks
 * before the bad one. */
static kqsvd_status_t fold(kqsvd_acc_t *a, int width, kqsvd_qr_ws_t *ws, double *R,
                           const void *rows, kqsvd_dtype_t type, int64_t n, int gram,
                           int64_t *bad) {
  kqsvd_status_t st = KQSVD_OK;
  if (gram)
    kqsvd_gram_absorb(width, R, rows, type, n, a->gram_buf, (int)a->opt.block_rows, bad);
  else
    KQSVD_CALL(kqsvd_qr_absorb(ws, R, rows, type, n, bad));
done:
  return st;
}

/* Folds n rows (stride elements apart) into an unpacked factor: the whole
 * item's R (block < 0), or the diagonal block `block` of one KV head (hd
 * wide: a grouped item's queries and W^T, whose padded rows are zero
 * elsewhere, so that the item's factor stays block-diagonal).  Strided rows
 * are gathered block_rows at a time; the kernels block from each call's
 * first row, so this equals one call on contiguous rows.  On a NaN or Inf,
 * *bad is its row (else -1) and R is as it was: a call of more than one
 * block keeps a copy to restore.  gram: R is a Gram matrix (KQSVD_QR_GRAM's
 * K, Q and V; W's factor is always an R factor, since it is never reduced
 * and the solver takes it as is). */
static kqsvd_status_t absorb_rows(kqsvd_acc_t *a, double *R, int block, const void *rows,
                                  kqsvd_dtype_t type, int64_t n, int64_t stride, int gram,
                                  int64_t *bad) {
  kqsvd_status_t st = KQSVD_OK;
  const int w = block < 0 ? a->d : a->hd;
  kqsvd_qr_ws_t *ws = block < 0 || !a->ws_head ? a->ws : a->ws_head;
  double *F = R;
  const size_t esz = kqsvd_dtype_size(type), row_bytes = (size_t)w * esz;
  const size_t bytes = (size_t)w * (size_t)w * sizeof(double);
  const size_t off = block < 0 ? 0 : (size_t)block * (size_t)a->hd * ((size_t)a->d + 1);
  const int copy = n > a->opt.block_rows;
  *bad = -1;
  if (block >= 0 && a->d != a->hd) { /* the block, into its own hd x hd matrix */
    F = a->sub;
    for (int j = 0; j < w; j++)
      memcpy(F + (size_t)j * w, R + off + (size_t)j * a->d, (size_t)w * sizeof(double));
  }
  if (copy) memcpy(a->backup, F, bytes);
  if (stride == w) {
    KQSVD_CALL(fold(a, w, ws, F, rows, type, n, gram, bad));
  } else {
    for (int64_t r0 = 0; r0 < n && *bad < 0; r0 += a->opt.block_rows) {
      const int64_t m = n - r0 < a->opt.block_rows ? n - r0 : a->opt.block_rows;
      for (int64_t i = 0; i < m; i++)
        memcpy(a->gather + (size_t)i * row_bytes,
               (const char *)rows + (size_t)(r0 + i) * (size_t)stride * esz, row_bytes);
      KQSVD_CALL(fold(a, w, ws, F, a->gather, type, m, gram, bad));
      if (*bad >= 0) *bad += r0;
    }
  }
  if (*bad >= 0 && copy) memcpy(F, a->backup, bytes);
  if (F != R)
    for (int j = 0; j < w; j++)
      memcpy(R + off + (size_t)j * a->d, F + (size_t)j * w, (size_t)w * sizeof(double));
done:
  return st;
}

static kqsvd_status_t check_rows(const void *rows, kqsvd_dtype_t type, int64_t nrows,
                                 int64_t stride, int64_t width) {
  kqsvd_status_t st = KQSVD_OK;
  KQSVD_CHECK(type >= KQSVD_F16 && type <= KQSVD_F64, KQSVD_ERR_USAGE,
              "accumulator: unknown element type %d", (int)type);
  KQSVD_CHECK(nrows >= 0, KQSVD_ERR_USAGE, "accumulator: nrows = %lld is negative",
              (long long)nrows);
  KQSVD_CHECK(stride >= width, KQSVD_ERR_USAGE,
              "accumulator: row_stride = %lld is below the row's %lld elements", (long long)stride,
              (long long)width);
  KQSVD_CHECK(rows || nrows == 0, KQSVD_ERR_USAGE, "accumulator: rows is NULL");
done:
  return st;
}

kqsvd_status_t kqsvd_acc_absorb(kqsvd_acc_t *a, kqsvd_tensor_t tensor, int64_t layer,
                                int64_t kv_head, int64_t query, const void *rows,
                                kqsvd_dtype_t type, int64_t nrows, int64_t row_stride) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_error_clear(); /* a call reports its own failure, not an earlier one */
  int64_t bad = -1;
  KQSVD_CHECK(a, KQSVD_ERR_USAGE, "kqsvd_acc_absorb: acc is NULL");
  const kqsvd_shape_t *s = &a->shape;
  KQSVD_CHECK(tensor == KQSVD_KEYS || tensor == KQSVD_VALUES || tensor == KQSVD_QUERIES,
              KQSVD_ERR_USAGE, "accumulator: unknown tensor %d", (int)tensor);
  KQSVD_CHECK(layer >= 0 && layer < s->layers, KQSVD_ERR_USAGE,
              "accumulator: layer %lld is outside 0..%lld", (long long)layer,
              (long long)s->layers - 1);
  KQSVD_CHECK(kv_head >= 0 && kv_head < s->kv_heads, KQSVD_ERR_USAGE,
              "accumulator: kv_head %lld is outside 0..%lld", (long long)kv_head,
              (long long)s->kv_heads - 1);
  KQSVD_CHECK(tensor == KQSVD_QUERIES ? query >= 0 && query < s->group : query == 0,
              KQSVD_ERR_USAGE, "accumulator: query %lld must be %s", (long long)query,
              tensor == KQSVD_QUERIES ? "in 0..group-1" : "0 for keys and values");
  const int64_t G = a->opt.head_groups, q = tensor == KQSVD_QUERIES;
  KQSVD_CHECK(q || kv_head % G == 0, KQSVD_ERR_USAGE,
              "accumulator: with head_groups = %lld, keys and values come a group at a time: "
              "kv_head %lld is not a group's first head",
              (long long)G, (long long)kv_head);
  KQSVD_CALL(check_rows(rows, type, nrows, row_stride, q ? a->hd : a->d));
  const int64_t item = layer * a->view.kv_heads + kv_head / G;
  const int k = tensor == KQSVD_KEYS ? ACC_K : q ? ACC_Q : ACC_V;
  if (item != a->cur_item) {
    flush(a);
    for (int f = 0; f < ACC_NR; f++)
      kqsvd_tri_unpack(a->d, a->state + ((size_t)item * ACC_NR + (size_t)f) * a->tri, a->cur[f]);
    a->cur_item = item;
  }
  /* A grouped item's queries: Q_bd = blockdiag(Q_1 .. Q_G), whose R factor
   * is blockdiag(R_Q1 .. R_QG); each KV head's fold into its block. */
  KQSVD_CALL(absorb_rows(a, a->cur[k], q ? (int)(kv_head % G) : -1, rows, type, nrows, row_stride,
                         a->opt.qr == KQSVD_QR_GRAM, &bad));
  a->bad_row = bad;
  if (!q && G > 1)
    KQSVD_CHECK(bad < 0, KQSVD_ERR_DATA, "%s: NaN or Inf at layer %lld, heads %lld..%lld, row %lld",
                kqsvd_tensor_name(tensor), (long long)layer, (long long)kv_head,
                (long long)(kv_head + G - 1), (long long)bad);
  KQSVD_CHECK(bad < 0, KQSVD_ERR_DATA, "%s: NaN or Inf at layer %lld, head %lld, row %lld",
              kqsvd_tensor_name(tensor), (long long)layer,
              (long long)(q ? kv_head * s->group + query : kv_head), (long long)bad);
  if (item == 0 && tensor == KQSVD_KEYS) a->tokens += nrows;
done:
  return kqsvd_api_return(st);
}

kqsvd_status_t kqsvd_acc_absorb_wt(kqsvd_acc_t *a, int64_t layer, int64_t g, const void *cols,
                                   kqsvd_dtype_t type, int64_t nrows, int64_t row_stride) {
  kqsvd_status_t st = KQSVD_OK;
  const int64_t m = a->shape.group, d = a->hd, G = a->opt.head_groups;
  const int block = (int)(g % G); /* a grouped item's W is blockdiag(W_1 .. W_G) */
  const size_t esz = kqsvd_dtype_size(type), width = (size_t)(m * d) * esz;
  double *P = a->wstate + (size_t)(layer * a->view.kv_heads + g / G) * a->tri;
  int64_t bad = -1;
  a->bad_row = -1;
  kqsvd_tri_unpack(a->d, P, a->R);
  if (row_stride == m * d) {
    KQSVD_CALL(absorb_rows(a, a->R, block, cols, type, nrows * m, d, 0, &bad));
  } else {
    /* Whole o_proj rows, block_rows of them per call: a multiple of
     * block_rows rows of W^T, so the blocking is that of one call. */
    for (int64_t r0 = 0; r0 < nrows && bad < 0; r0 += a->opt.block_rows) {
      const int64_t n = nrows - r0 < a->opt.block_rows ? nrows - r0 : a->opt.block_rows;
      for (int64_t r = 0; r < n; r++)
        memcpy(a->wbuf + (size_t)r * width,
               (const char *)cols + (size_t)(r0 + r) * (size_t)row_stride * esz, width);
      KQSVD_CALL(absorb_rows(a, a->R, block, a->wbuf, type, n * m, d, 0, &bad));
      if (bad >= 0) bad += r0 * m;
    }
  }
  a->bad_row = bad;
  if (bad < 0) kqsvd_tri_pack(a->d, a->R, P);
done:
  return st;
}

kqsvd_status_t kqsvd_acc_absorb_oproj(kqsvd_acc_t *a, int64_t layer, const void *o_proj,
                                      kqsvd_dtype_t type, int64_t nrows, int64_t row_stride) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_error_clear();
  double *saved = NULL;
  KQSVD_CHECK(a, KQSVD_ERR_USAGE, "kqsvd_acc_absorb_oproj: acc is NULL");
  const kqsvd_shape_t *s = &a->shape;
  const int64_t d = a->hd, m = s->group, H = s->kv_heads, hq_d = H * m * d;
  const int64_t Hv = a->view.kv_heads; /* items per layer */
  KQSVD_CHECK(layer >= 0 && layer < s->layers, KQSVD_ERR_USAGE,
              "accumulator: layer %lld is outside 0..%lld", (long long)layer,
              (long long)s->layers - 1);
  KQSVD_CALL(check_rows(o_proj, type, nrows, row_stride, hq_d));
  KQSVD_CHECK(nrows <= s->hidden - a->w_rows[layer], KQSVD_ERR_USAGE,
              "accumulator: o_proj of layer %lld: %lld rows given, more than hidden = %lld",
              (long long)layer, (long long)(a->w_rows[layer] + nrows), (long long)s->hidden);
  /* A failure in a later group must leave the earlier ones as they were. */
  KQSVD_MALLOC(saved, (size_t)Hv * a->tri, "W factors");
  memcpy(saved, a->wstate + (size_t)(layer * Hv) * a->tri, (size_t)Hv * a->tri * sizeof(double));
  for (int64_t g = 0; g < H; g++) {
    const char *cols = (const char *)o_proj + (size_t)(g * m * d) * kqsvd_dtype_size(type);
    KQSVD_CALL(kqsvd_acc_absorb_wt(a, layer, g, cols, type, nrows, row_stride));
    if (a->bad_row >= 0) {
      memcpy(a->wstate + (size_t)(layer * Hv) * a->tri, saved,
             (size_t)Hv * a->tri * sizeof(double));
      KQSVD_FAIL(KQSVD_ERR_DATA, "o_proj: NaN or Inf at layer %lld, row %lld (head %lld's block)",
                 (long long)layer, (long long)(a->bad_row / m),
                 (long long)(g * m + a->bad_row % m));
    }
  }
  a->w_rows[layer] += nrows;
done:
  free(saved);
  return kqsvd_api_return(st);
}

kqsvd_status_t kqsvd_acc_factor(const kqsvd_acc_t *a, kqsvd_tensor_t tensor, int64_t layer,
                                int64_t kv_head, double *R) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_error_clear();
  double *C = NULL;
  KQSVD_CHECK(a && R, KQSVD_ERR_USAGE, "kqsvd_acc_factor: acc and R must not be NULL");
  KQSVD_CHECK(tensor == KQSVD_KEYS || tensor == KQSVD_VALUES || tensor == KQSVD_QUERIES,
              KQSVD_ERR_USAGE, "kqsvd_acc_factor: unknown tensor %d", (int)tensor);
  KQSVD_CHECK(layer >= 0 && layer < a->shape.layers && kv_head >= 0 && kv_head < a->shape.kv_heads,
              KQSVD_ERR_USAGE, "kqsvd_acc_factor: (layer %lld, kv_head %lld) is outside the shape",
              (long long)layer, (long long)kv_head);
  const int k = tensor == KQSVD_KEYS ? ACC_K : tensor == KQSVD_QUERIES ? ACC_Q : ACC_V;
  const int d = a->d, G = (int)a->opt.head_groups;
  KQSVD_MALLOC(C, (size_t)d * (size_t)d, "R factor");
  flush((kqsvd_acc_t *)a); /* the cache, not the factors, changes */
  kqsvd_tri_unpack(
      d,
      a->state + ((size_t)(layer * a->view.kv_heads + kv_head / G) * ACC_NR + (size_t)k) * a->tri,
      C);
  if (a->opt.qr == KQSVD_QR_GRAM) KQSVD_CALL(kqsvd_gram_to_r(d, C));
  /* A grouped item's queries: kv_head's own block. */
  const int w = k == ACC_Q ? a->hd : d;
  const size_t off = k == ACC_Q ? (size_t)(kv_head % G) * (size_t)a->hd * ((size_t)d + 1) : 0;
  for (int i = 0; i < w; i++) /* column-major inside, row-major out */
    for (int j = 0; j < w; j++) R[i * w + j] = C[off + (size_t)j * d + i];
done:
  free(C);
  return kqsvd_api_return(st);
}

/* What a checkpoint of this accumulator must match: the shape, the
 * options that change the numbers, and the state's layout. */
static uint64_t fingerprint(const kqsvd_acc_t *a, char *about, size_t n) {
  const int64_t f[] = {a->shape.layers, a->shape.kv_heads, a->shape.group,     a->shape.head_dim,
                       a->shape.hidden, a->opt.block_rows, (int64_t)a->opt.qr, ACC_NR};
  snprintf(about, n,
           "accumulator: %lld layers, %lld KV heads x %lld queries, d = %lld, "
           "D = %lld, block_rows %lld, qr %s, head_groups %lld",
           (long long)f[0], (long long)f[1], (long long)f[2], (long long)f[3], (long long)f[4],
           (long long)f[5], a->opt.qr == KQSVD_QR_GRAM ? "gram" : "tsqr",
           (long long)a->opt.head_groups);
  const uint64_t h = kqsvd_fnv1a(kqsvd_fnv1a(KQSVD_FNV_INIT, "kqsvd-acc", 9), f, sizeof f);
  /* Per-head checkpoints of earlier versions stay valid. */
  return a->opt.head_groups == 1 ? h : kqsvd_fnv1a(h, &a->opt.head_groups, sizeof(int64_t));
}

/* The checkpoint's state: the K, Q, V factors, then W's, then the token
 * count and each layer's o_proj rows (counts are exact in a double up to
 * 2^53). */
static int64_t saved_doubles(const kqsvd_acc_t *a) {
  return kqsvd_acc_state_doubles(a) + a->nitems * (int64_t)a->tri + 1 + a->shape.layers;
}

kqsvd_status_t kqsvd_acc_save(const kqsvd_acc_t *a, const char *path, int force) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_error_clear();
  double *all = NULL;
  char about[256];
  KQSVD_CHECK(a && path, KQSVD_ERR_USAGE, "kqsvd_acc_save: acc and path must not be NULL");
  /* The rename at the end would replace whatever the name is: /dev/null
   * became a regular file so once. */
  KQSVD_CALL(kqsvd_check_output(NULL, path, force));
  const int64_t ns = kqsvd_acc_state_doubles(a), nw = a->nitems * (int64_t)a->tri;
  KQSVD_MALLOC(all, (size_t)saved_doubles(a), "accumulator checkpoint");
  flush((kqsvd_acc_t *)a); /* the cache, not the factors, changes */
  memcpy(all, a->state, (size_t)ns * sizeof(double));
  memcpy(all + ns, a->wstate, (size_t)nw * sizeof(double));
  all[ns + nw] = (double)a->tokens;
  for (int64_t l = 0; l < a->shape.layers; l++) all[ns + nw + 1 + l] = (double)a->w_rows[l];
  const uint64_t fp = fingerprint(a, about, sizeof about);
  kqsvd_h5guard_t guard;
  kqsvd_h5guard_enter(&guard);
  st = kqsvd_checkpoint_save_file(path, fp, about, (kqsvd_checkpoint_pos_t){0, 0}, saved_doubles(a),
                                  all);
  kqsvd_h5guard_leave(&guard);
  KQSVD_CALL(st);
done:
  free(all);
  return kqsvd_api_return(st);
}

kqsvd_status_t kqsvd_acc_load(kqsvd_acc_t *a, const char *path) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_error_clear();
  double *all = NULL;
  char about[256];
  kqsvd_checkpoint_pos_t pos;
  KQSVD_CHECK(a && path, KQSVD_ERR_USAGE, "kqsvd_acc_load: acc and path must not be NULL");
  const int64_t ns = kqsvd_acc_state_doubles(a), nw = a->nitems * (int64_t)a->tri;
  KQSVD_MALLOC(all, (size_t)saved_doubles(a), "accumulator checkpoint");
  kqsvd_h5guard_t guard;
  kqsvd_h5guard_enter(&guard);
  /* In process: a host program may have threads, and a child forked from
   * it to read the header could inherit a held lock. */
  st = kqsvd_checkpoint_load_file(path, fingerprint(a, about, sizeof about), saved_doubles(a), all,
                                  &pos, 0);
  kqsvd_h5guard_leave(&guard);
  KQSVD_CALL(st);
  a->cur_item = -1;
  memcpy(a->state, all, (size_t)ns * sizeof(double));
  memcpy(a->wstate, all + ns, (size_t)nw * sizeof(double));
  a->tokens = (int64_t)all[ns + nw];
  for (int64_t l = 0; l < a->shape.layers; l++) a->w_rows[l] = (int64_t)all[ns + nw + 1 + l];
done:
  free(all);
  return kqsvd_api_return(st);
}

kqsvd_status_t kqsvd_acc_reduce(kqsvd_acc_t *a, MPI_Comm comm, int root) {
  kqsvd_status_t st = KQSVD_OK, local = KQSVD_OK;
  kqsvd_error_clear();
  int size = 1, init = 0;
  KQSVD_CHECK(a, KQSVD_ERR_USAGE, "kqsvd_acc_reduce: acc is NULL");
  flush(a);
  if (comm == MPI_COMM_NULL) return kqsvd_api_return(KQSVD_OK);
  KQSVD_MPI(MPI_Initialized(&init));
  KQSVD_CHECK(init, KQSVD_ERR_USAGE,
              "kqsvd_acc_reduce: MPI is not initialised (pass "
              "MPI_COMM_NULL for a single process)");
  KQSVD_MPI(MPI_Comm_size(comm, &size));
  if (size == 1) return kqsvd_api_return(KQSVD_OK);
  /* Every process must agree on what is merged, or the reduction would mix
   * triangles of different sizes. */
  const int64_t f[] = {a->shape.layers,    a->shape.kv_heads, a->shape.group,
                       a->shape.head_dim,  a->shape.hidden,   a->opt.block_rows,
                       (int64_t)a->opt.qr, (int64_t)root,     a->opt.head_groups};
  int64_t lo[9], hi[9];
  KQSVD_MPI(MPI_Allreduce(f, lo, 9, MPI_INT64_T, MPI_MIN, comm));
  KQSVD_MPI(MPI_Allreduce(f, hi, 9, MPI_INT64_T, MPI_MAX, comm));
  KQSVD_CHECK(memcmp(lo, hi, sizeof lo) == 0, KQSVD_ERR_USAGE,
              "kqsvd_acc_reduce: the processes' accumulators differ in shape, options or root");
  KQSVD_CHECK(root >= 0 && root < size, KQSVD_ERR_USAGE,
              "kqsvd_acc_reduce: root %d is outside 0..%d", root, size - 1);
  int64_t tok = 0;
  KQSVD_MPI(MPI_Reduce(&a->tokens, &tok, 1, MPI_INT64_T, MPI_SUM, root, comm));
  if (a->opt.qr == KQSVD_QR_GRAM) {
    int rank = 0;
    const int64_t n = kqsvd_acc_state_doubles(a);
    KQSVD_MPI(MPI_Comm_rank(comm, &rank));
    for (int64_t c0 = 0; c0 < n; c0 += INT32_MAX / 2) {
      const int cnt = (int)(n - c0 < INT32_MAX / 2 ? n - c0 : INT32_MAX / 2);
      KQSVD_MPI(MPI_Reduce(rank == root ? MPI_IN_PLACE : a->state + c0,
                           rank == root ? a->state + c0 : NULL, cnt, MPI_DOUBLE, MPI_SUM, root,
                           comm));
    }
  } else {
    local = kqsvd_tsqr_reduce_root(comm, a->d, ACC_NR, a->nitems, a->state, root);
  }
  KQSVD_CALL(kqsvd_mpi_agree(comm, local));
  int rank = 0;
  KQSVD_MPI(MPI_Comm_rank(comm, &rank));
  if (rank == root) a->tokens = tok;
done:
  return kqsvd_api_return(st);
}
