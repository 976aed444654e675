#include "kqsvd_eval.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kqsvd_linalg.h"

const char *kqsvd_metric_name(int metric) {
  static const char *const names[KQSVD_NMETRICS] = {"err_k", "err_q", "err_v", "err_kq", "err_out"};
  return metric >= 0 && metric < KQSVD_NMETRICS ? names[metric] : "?";
}

void kqsvd_eval_sums_add(kqsvd_eval_sums_t *a, const kqsvd_eval_sums_t *b) {
  for (int k = 0; k < KQSVD_NMETRICS; k++) {
    a->den[k] += b->den[k];
    for (int m = 0; m < KQSVD_NMETHODS; m++) a->num[m][k] += b->num[m][k];
  }
}

double kqsvd_eval_ratio(const kqsvd_eval_sums_t *s, int method, int metric) {
  const double num = s->num[method][metric], den = s->den[metric];
  if (den > 0.0) return num / den;
  return num > 0.0 ? 1.0 : 0.0;
}

struct kqsvd_eval_ws {
  int heads, d, hidden;
  int64_t max_T, max_rows;
  kqsvd_qr_ws_t *qr;
  double *R;                  /* R factor of the group's K, column-major */
  double *S;                  /* max_rows x max_T scores, then probabilities */
  double *KA, *VA;            /* max_T x d: compressed keys and values */
  double *QB, *E, *X, *Y;     /* max_rows x d */
  double *Z;                  /* max_rows x heads*d: exact head outputs */
  double *Dm[KQSVD_NMETHODS]; /* the same minus each method's */
  double *O;                  /* max_rows x hidden */
  /* the current block */
  const kqsvd_eval_layer_t *L;
  int64_t T, row0, nrows, nk;
};

double kqsvd_eval_ws_bytes(int heads, int d, int hidden, int64_t max_T, int64_t block_rows) {
  const double b = (double)block_rows, T = (double)max_T, dd = (double)d;
  const double doubles = b * T + 2.0 * T * dd + 4.0 * b * dd +
                         (1.0 + KQSVD_NMETHODS) * b * heads * dd + b * hidden + dd * dd;
  /* The QR workspace holds a block of rows and a few d x d matrices. */
  return 8.0 * (doubles + (KQSVD_QR_BLOCK_DEFAULT + 3.0 * dd) * dd);
}

kqsvd_status_t kqsvd_eval_ws_init(int heads, int d, int hidden, int64_t max_T, int64_t block_rows,
                                  kqsvd_eval_ws_t **out) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_eval_ws_t *ws = calloc(1, sizeof *ws);
  *out = NULL;
  KQSVD_CHECK(ws, KQSVD_ERR_NOMEM, "cannot allocate the evaluation workspace");
  KQSVD_CHECK(heads >= 1 && d >= 1 && hidden >= 1 && max_T >= 1 && block_rows >= 1, KQSVD_ERR_USAGE,
              "evaluation workspace: sizes must be positive");
  ws->heads = heads, ws->d = d, ws->hidden = hidden;
  ws->max_T = max_T, ws->max_rows = block_rows;
  const size_t b = (size_t)block_rows, T = (size_t)max_T, D = (size_t)d;
  KQSVD_CALL(kqsvd_qr_ws_init(d, KQSVD_QR_BLOCK_DEFAULT, &ws->qr));
  KQSVD_MALLOC(ws->R, D * D, "evaluation workspace");
  KQSVD_MALLOC(ws->S, b * T, "attention scores of one head");
  KQSVD_MALLOC(ws->KA, T * D, "compressed keys");
  KQSVD_MALLOC(ws->VA, T * D, "compressed values");
  KQSVD_MALLOC(ws->QB, b * D, "evaluation workspace");
  KQSVD_MALLOC(ws->E, b * D, "evaluation workspace");
  KQSVD_MALLOC(ws->X, b * D, "evaluation workspace");
  KQSVD_MALLOC(ws->Y, b * D, "evaluation workspace");
  KQSVD_MALLOC(ws->Z, b * (size_t)heads * D, "head outputs");
  for (int m = 0; m < KQSVD_NMETHODS; m++)
    KQSVD_MALLOC(ws->Dm[m], b * (size_t)heads * D, "head output errors");
  KQSVD_MALLOC(ws->O, b * (size_t)hidden, "layer outputs");
  *out = ws;
  ws = NULL;
done:
  kqsvd_eval_ws_free(&ws);
  return st;
}

void kqsvd_eval_ws_free(kqsvd_eval_ws_t **wsp) {
  kqsvd_eval_ws_t *ws = *wsp;
  if (!ws) return;
  kqsvd_qr_ws_free(&ws->qr);
  free(ws->R);
  free(ws->S);
  free(ws->KA);
  free(ws->VA);
  free(ws->QB);
  free(ws->E);
  free(ws->X);
  free(ws->Y);
  free(ws->Z);
  for (int m = 0; m < KQSVD_NMETHODS; m++) free(ws->Dm[m]);
  free(ws->O);
  free(ws);
  *wsp = NULL;
}

/* Squared Frobenius norm of a rows x cols block with leading dimension ld. */
static double frob2(const double *A, int64_t rows, int64_t cols, int64_t ld) {
  double s = 0.0;
  for (int64_t i = 0; i < rows; i++)
    for (int64_t j = 0; j < cols; j++) s += A[i * ld + j] * A[i * ld + j];
  return s;
}

/* ||A - B||_F^2 of two rows x cols blocks with leading dimension ld. */
static double diff2(const double *A, const double *B, int64_t rows, int64_t cols, int64_t ld) {
  double s = 0.0;
  for (int64_t i = 0; i < rows; i++)
    for (int64_t j = 0; j < cols; j++) {
      const double e = A[i * ld + j] - B[i * ld + j];
      s += e * e;
    }
  return s;
}

static void gemm(CBLAS_TRANSPOSE tb, int64_t m, int64_t n, int64_t k, double alpha, const double *A,
                 int64_t lda, const double *B, int64_t ldb, double beta, double *C, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, CblasNoTrans, tb, (int)m, (int)n, (int)k, alpha, A, (int)lda, B,
              (int)ldb, beta, C, (int)ldc);
}

/* Row-wise softmax of the nrows x nk scores in place.  Under the causal
 * mask, block row i (sequence row row0 + i) sees keys 0 .. row0 + i; the
 * masked entries become exact zeros so that the product with V may run
 * over all nk keys. */
static void softmax_rows(double *S, int64_t nrows, int64_t nk, int64_t row0, int causal) {
  for (int64_t i = 0; i < nrows; i++) {
    double *s = S + i * nk;
    const int64_t n = causal ? row0 + i + 1 : nk;
    double mx = s[0], sum = 0.0;
    for (int64_t j = 1; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    for (int64_t j = 0; j < n; j++) {
      s[j] = exp(s[j] - mx);
      sum += s[j];
    }
    const double inv = 1.0 / sum;
    for (int64_t j = 0; j < n; j++) s[j] *= inv;
    for (int64_t j = n; j < nk; j++) s[j] = 0.0;
  }
}

kqsvd_status_t kqsvd_eval_begin(kqsvd_eval_ws_t *ws, const kqsvd_eval_layer_t *layer, int64_t T,
                                int64_t row0, int64_t nrows) {
  kqsvd_status_t st = KQSVD_OK;
  KQSVD_CHECK(layer->heads == ws->heads && layer->d == ws->d && layer->hidden == ws->hidden &&
                  T >= 1 && T <= ws->max_T && nrows >= 1 && nrows <= ws->max_rows && row0 >= 0 &&
                  row0 + nrows <= T,
              KQSVD_ERR_USAGE, "evaluation block [%lld, %lld) of %lld rows exceeds the workspace",
              (long long)row0, (long long)(row0 + nrows), (long long)T);
  ws->L = layer;
  ws->T = T, ws->row0 = row0, ws->nrows = nrows;
  /* Causal rows of this block never look past its last row. */
  ws->nk = layer->causal ? row0 + nrows : T;
done:
  return st;
}

kqsvd_status_t kqsvd_eval_group(kqsvd_eval_ws_t *ws, int g, const double *K, const double *V,
                                const double *Q, kqsvd_eval_sums_t *sums) {
  kqsvd_status_t st = KQSVD_OK;
  const kqsvd_eval_layer_t *L = ws->L;
  const int64_t d = ws->d, b = ws->nrows, nk = ws->nk, r0 = ws->row0, m = L->heads / L->kv_heads;
  const int64_t hd = (int64_t)L->heads * d;
  const double scale = 1.0 / sqrt((double)(L->scale_dim > 0 ? L->scale_dim : d));
  const double *Kb = K + r0 * d, *Vb = V + r0 * d;

  /* ||Q K^T - Q B A^T K^T||_F = ||(Q - Q B A^T) R_K^T||_F for K = Qk R_K with
   * orthonormal Qk: err_kq over all T keys at O(T d^2) instead of O(T^2 d),
   * and without squaring K's condition number.  The column-major R is R^T
   * when read row-major, which is the right operand here. */
  int64_t bad = -1;
  memset(ws->R, 0, (size_t)(d * d) * sizeof(double));
  KQSVD_CALL(kqsvd_qr_absorb(ws->qr, ws->R, K, KQSVD_F64, ws->T, &bad));
  KQSVD_CHECK(bad < 0, KQSVD_ERR_DATA, "keys row %lld is not finite", (long long)bad);
  const double *Rt = ws->R;

  sums->den[KQSVD_ERR_K] += frob2(Kb, b, d, d);
  sums->den[KQSVD_ERR_V] += frob2(Vb, b, d, d);
  for (int64_t i = 0; i < m; i++) {
    const double *Qh = Q + i * b * d;
    double *Zh = ws->Z + (g * m + i) * d;
    sums->den[KQSVD_ERR_Q] += frob2(Qh, b, d, d);
    gemm(CblasNoTrans, b, d, d, 1.0, Qh, d, Rt, d, 0.0, ws->X, d);
    sums->den[KQSVD_ERR_KQ] += frob2(ws->X, b, d, d);
    gemm(CblasTrans, b, nk, d, scale, Qh, d, K, d, 0.0, ws->S, nk);
    softmax_rows(ws->S, b, nk, r0, L->causal);
    gemm(CblasNoTrans, b, d, nk, 1.0, ws->S, nk, V, d, 0.0, Zh, hd);
  }

  for (int meth = 0; meth < KQSVD_NMETHODS; meth++) {
    const double *A = L->proj[meth][0] + g * d * d, *B = L->proj[meth][1] + g * d * d;
    const double *Av = L->proj[meth][2] + g * d * d, *Bv = L->proj[meth][3] + g * d * d;
    const int64_t rk = L->rank_k_heads[meth] ? L->rank_k_heads[meth][g] : L->rank_k[meth];
    const int64_t rv = L->rank_v_heads[meth] ? L->rank_v_heads[meth][g] : L->rank_v[meth];
    double *num = sums->num[meth];
    /* Only the first nk keys and values are ever looked at. */
    gemm(CblasNoTrans, nk, rk, d, 1.0, K, d, A, d, 0.0, ws->KA, rk);
    gemm(CblasNoTrans, nk, rv, d, 1.0, V, d, Av, d, 0.0, ws->VA, rv);
    gemm(CblasTrans, b, d, rk, 1.0, ws->KA + r0 * rk, rk, B, d, 0.0, ws->X, d);
    num[KQSVD_ERR_K] += diff2(Kb, ws->X, b, d, d);
    gemm(CblasTrans, b, d, rv, 1.0, ws->VA + r0 * rv, rv, Bv, d, 0.0, ws->X, d);
    num[KQSVD_ERR_V] += diff2(Vb, ws->X, b, d, d);
    for (int64_t i = 0; i < m; i++) {
      const double *Qh = Q + i * b * d;
      const int64_t h = g * m + i;
      gemm(CblasNoTrans, b, rk, d, 1.0, Qh, d, B, d, 0.0, ws->QB, rk);
      memcpy(ws->E, Qh, (size_t)(b * d) * sizeof(double));
      gemm(CblasTrans, b, d, rk, -1.0, ws->QB, rk, A, d, 1.0, ws->E, d);
      num[KQSVD_ERR_Q] += frob2(ws->E, b, d, d);
      gemm(CblasNoTrans, b, d, d, 1.0, ws->E, d, Rt, d, 0.0, ws->X, d);
      num[KQSVD_ERR_KQ] += frob2(ws->X, b, d, d);

      gemm(CblasTrans, b, nk, rk, scale, ws->QB, rk, ws->KA, rk, 0.0, ws->S, nk);
      softmax_rows(ws->S, b, nk, r0, L->causal);
      gemm(CblasNoTrans, b, rv, nk, 1.0, ws->S, nk, ws->VA, rv, 0.0, ws->Y, rv);
      /* Delta_h = Z_h - (P~ V A_v) B_v^T, the head's error before W^O. */
      double *Dh = ws->Dm[meth] + h * d;
      const double *Zh = ws->Z + h * d;
      for (int64_t r = 0; r < b; r++) memcpy(Dh + r * hd, Zh + r * hd, (size_t)d * sizeof(double));
      gemm(CblasTrans, b, d, rv, -1.0, ws->Y, rv, Bv, d, 1.0, Dh, hd);
    }
  }
done:
  return st;
}

void kqsvd_eval_end(kqsvd_eval_ws_t *ws, kqsvd_eval_sums_t *sums) {
  const kqsvd_eval_layer_t *L = ws->L;
  const int64_t b = ws->nrows, D = L->hidden, hd = (int64_t)L->heads * L->d;
  /* O = sum_h Z_h W^O_h = Z o_proj^T, and likewise for the errors: the
   * difference is taken before W^O so that small errors keep their digits. */
  gemm(CblasTrans, b, D, hd, 1.0, ws->Z, hd, L->o_proj, hd, 0.0, ws->O, D);
  sums->den[KQSVD_ERR_OUT] += frob2(ws->O, b, D, D);
  for (int m = 0; m < KQSVD_NMETHODS; m++) {
    gemm(CblasTrans, b, D, hd, 1.0, ws->Dm[m], hd, L->o_proj, hd, 0.0, ws->O, D);
    sums->num[m][KQSVD_ERR_OUT] += frob2(ws->O, b, D, D);
  }
}
