/* A calibration's result: the three methods' projections, spectra and
 * ranks (kqsvd_acc_finish makes one), read in memory or written as a
 * projections file.  No MPI here: a program that only reads results, or
 * only decodes (kqsvd/decode.h), includes this without MPI's headers. */
#ifndef KQSVD_PUBLIC_RESULT_H
#define KQSVD_PUBLIC_RESULT_H

#include <stdint.h>

#include "kqsvd/types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kqsvd_result kqsvd_result_t;

/* What proj.h5 stores, as in docs/formats.md section 3. */
typedef enum kqsvd_matrix {
  KQSVD_KEY_DOWN = 0, /* A: compressed keys K A */
  KQSVD_QUERY_DOWN,   /* B: queries q B, scores (q B)(K A)^T ~ q K^T */
  KQSVD_VALUE_DOWN,   /* A_v: compressed values V A_v */
  KQSVD_VALUE_UP      /* B_v: B_v^T W^O_h replaces each head's W^O_h */
} kqsvd_matrix_t;

/* A method's d x d matrix of (layer, kv_head), row-major, columns most
 * important first (any rank r is the first r columns); NULL for an index
 * out of range.  Valid until kqsvd_result_free.  Not collective. */
KQSVD_API const double *kqsvd_result_matrix(const kqsvd_result_t *res, kqsvd_method_t method,
                                            kqsvd_matrix_t which, int64_t layer, int64_t kv_head);
/* The d singular values ordering a method's key (values == 0) or value
 * (values == 1) columns; NULL for an index out of range. */
KQSVD_API const double *kqsvd_result_sigma(const kqsvd_result_t *res, kqsvd_method_t method,
                                           int values, int64_t layer, int64_t kv_head);
/* The chosen ranks of a method: [layers] each, or NULL. */
KQSVD_API const int32_t *kqsvd_result_rank_k(const kqsvd_result_t *res, kqsvd_method_t method);
KQSVD_API const int32_t *kqsvd_result_rank_v(const kqsvd_result_t *res, kqsvd_method_t method);
/* The shape of the result's items: the model's, or its group view under
 * head_groups (kqsvd_acc_finish).  Not collective. */
KQSVD_API kqsvd_shape_t kqsvd_result_shape(const kqsvd_result_t *res);
/* The head_groups the result was made with (1: per head).  Not collective. */
KQSVD_API int64_t kqsvd_result_head_groups(const kqsvd_result_t *res);

typedef struct kqsvd_write_options {
  const char *model; /* the root attribute `model` [""] */
  int64_t tokens;    /* the root attribute `tokens`; 0: kqsvd_acc_tokens [0] */
  int causal;        /* the attribute `causal`: 1 for decoders, 0 for encoders [1] */
  int force;         /* replace an existing regular file [0: refuse] */
  /* The root attribute `inputs_hash` (at most 63 characters): what the
   * caller made the result from, so that a later run can tell the file is
   * up to date and skip it (calibrate_hf --skip-done) [NULL: none]. */
  const char *inputs_hash;
  /* The root attribute `rope` (docs/formats.md 5.3): "pre" when the folded
   * keys and queries were taken before RoPE, "post" after it [NULL: none,
   * which readers take as "post"]. */
  const char *rope;
  /* The root attribute `seq_len` (docs/formats.md 5.3): the length in tokens
   * of the longest sequence folded, the context the projections were
   * calibrated for [0: unknown, no attribute]. */
  int64_t seq_len;
} kqsvd_write_options_t;

/* Fills *opt with the defaults above.  Not collective; cannot fail. */
KQSVD_API void kqsvd_write_options_default(kqsvd_write_options_t *opt);

/* Writes `res` as a projections file (docs/formats.md, section 3), under a
 * temporary name renamed when complete.  opt NULL: the defaults.  Not
 * collective (serial HDF5; MPI need not be initialised).  Errors:
 * KQSVD_ERR_USAGE for an existing file without force, for a path that is a
 * folder, a device, a FIFO or a socket (links followed; force or not), and
 * for a folder no file can be created in or with no write bit (mode a-w,
 * read-only for root too), and for a negative seq_len; KQSVD_ERR_IO (also
 * when the path has become a device, FIFO, socket or folder by the final
 * rename, which then leaves it as it is), KQSVD_ERR_HDF5. */
KQSVD_API kqsvd_status_t kqsvd_result_write(const kqsvd_result_t *res, const char *path,
                                            const kqsvd_write_options_t *opt);
KQSVD_API void kqsvd_result_free(kqsvd_result_t **res);

#ifdef __cplusplus
}
#endif

#endif
