/* The accumulator: kqsvd's calibration in process.
 *
 * Everything the three methods need is in d x d R factors: per (layer, KV
 * head), those of K, of the group's stacked queries Q, of V, and of W^T
 * (W = the group's o_proj blocks side by side).  An accumulator keeps them
 * in float64 and folds rows into them as they come (Householder QR of
 * [R; rows], `block_rows` rows at a time), so a caller can feed a model's
 * activations while the model runs, without writing caches.  Several
 * processes each absorb their rows, kqsvd_acc_reduce merges their factors
 * (TSQR, in rank order), and kqsvd_acc_finish solves the d x d problems.
 * `kqsvd calibrate` runs the same steps on cache shards.
 *
 *     kqsvd_acc_t *acc;
 *     kqsvd_shape_t shape = {.layers = L, .kv_heads = Hkv, .group = Hq / Hkv,
 *                            .head_dim = d, .hidden = D};
 *     kqsvd_acc_init(&shape, NULL, &acc);
 *     // for each batch of T tokens, layer l, KV head g, query head q of g:
 *     kqsvd_acc_absorb(acc, KQSVD_KEYS, l, g, 0, k_rows, KQSVD_BF16, T, stride);
 *     kqsvd_acc_absorb(acc, KQSVD_QUERIES, l, g, q, q_rows, KQSVD_BF16, T, stride);
 *     kqsvd_acc_absorb(acc, KQSVD_VALUES, l, g, 0, v_rows, KQSVD_BF16, T, stride);
 *     // once per layer: o_proj's weight, [D, Hq d] row-major
 *     kqsvd_acc_absorb_oproj(acc, l, o_proj, KQSVD_F32, D, Hq * d);
 *     kqsvd_acc_reduce(acc, MPI_COMM_WORLD, 0);         // with several processes
 *     kqsvd_result_t *res;
 *     kqsvd_acc_finish(acc, NULL, &res);                // on the root
 *     kqsvd_result_write(res, "proj.h5", NULL);
 *
 * Threads: handles are independent; one handle must not be used by two
 * threads at once.  Save, load and write go through HDF5 one at a time
 * (a library-wide lock: the HDF5 of MPI builds is not thread-safe).
 * Errors are recorded per thread (kqsvd/error.h), and each fallible call
 * starts by clearing the thread's record, so it reports its own failure.
 * The library turns HDF5's own error printing off around its calls. */
#ifndef KQSVD_PUBLIC_ACCUMULATOR_H
#define KQSVD_PUBLIC_ACCUMULATOR_H

/* The C API only: Open MPI's and MPICH's C++ bindings would need their own
 * libraries in a C++ consumer. */
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>
#include <stdint.h>

#include "kqsvd/result.h"
#include "kqsvd/types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kqsvd_acc kqsvd_acc_t;

/* How rows become R factors.  TSQR (Householder QR, merged as triangles) is
 * the default and the accurate one; GRAM accumulates X^T X and takes its
 * Cholesky factor at the end (faster, loses digits for ill-conditioned
 * data: a peer for benchmarks). */
typedef enum kqsvd_qr { KQSVD_QR_TSQR = 0, KQSVD_QR_GRAM = 1 } kqsvd_qr_t;

typedef struct kqsvd_acc_options {
  int64_t block_rows;   /* rows per Householder update [256]; results depend on
                           it by round-off only, and checkpoints record it */
  double mem_limit_mib; /* refuse an accumulator whose factors and buffers
                           exceed this many MiB; 0 = no limit [0] */
  kqsvd_qr_t qr;        /* [KQSVD_QR_TSQR] */
  /* Head-group latents [1]: G > 1 (dividing kv_heads) solves each group of
   * G consecutive KV heads as one, G d wide: keys K_G = [K_1 .. K_G] side by
   * side against Q_bd = blockdiag(Q_1 .. Q_G), values likewise against
   * blockdiag(W_1 .. W_G), so that one latent of rank R serves the group
   * (docs/formats.md, head-group projections).  Memory and time grow as
   * (G d)^2 per group.  1 is the per-head form. */
  int64_t head_groups;
} kqsvd_acc_options_t;

/* Fills *opt with the defaults above.  Not collective; cannot fail. */
KQSVD_API void kqsvd_acc_options_default(kqsvd_acc_options_t *opt);

/* Creates an accumulator for `shape`, its factors zero (no rows yet).
 * opt NULL means the defaults.  Not collective.  Errors: KQSVD_ERR_USAGE for
 * a size < 1 or a block_rows outside 1..2^20, KQSVD_ERR_NOMEM (also when the
 * memory limit is too small, saying how much is needed). */
KQSVD_API kqsvd_status_t kqsvd_acc_init(const kqsvd_shape_t *shape, const kqsvd_acc_options_t *opt,
                                        kqsvd_acc_t **acc);
/* Frees *acc and sets it to NULL; NULL is a no-op.  Not collective. */
KQSVD_API void kqsvd_acc_free(kqsvd_acc_t **acc);

/* Folds `nrows` rows of one head into its factor.  tensor: KQSVD_KEYS or
 * KQSVD_VALUES of KV head `kv_head` (query must be 0), or KQSVD_QUERIES of
 * query head kv_head * group + query (0 <= query < group).  Row i holds
 * head_dim elements of `type` at rows + i * row_stride elements
 * (row_stride >= head_dim: e.g. Hq d for the output of q_proj).  With
 * head_groups G > 1, keys and values come a group at a time: kv_head is
 * the group's first KV head (a multiple of G) and a row holds the G heads'
 * head_dim elements side by side (G d: the columns of k_proj's output for
 * those heads); queries are given per head as above.  The
 * group's query heads share one factor (of their rows stacked), so their
 * calls may come in any order (`kqsvd calibrate` gives block_rows rows of
 * each head in turn).  The result depends on the rows, their order and how they are split into
 * calls only through round-off; bit for bit it depends on the calls'
 * boundaries modulo block_rows.  Not collective.  Errors: KQSVD_ERR_USAGE
 * for an index, count or stride out of range; KQSVD_ERR_DATA for a NaN or
 * Inf, naming the tensor, layer, head and row; the factor is then left as it
 * was before the call. */
KQSVD_API kqsvd_status_t kqsvd_acc_absorb(kqsvd_acc_t *acc, kqsvd_tensor_t tensor, int64_t layer,
                                          int64_t kv_head, int64_t query, const void *rows,
                                          kqsvd_dtype_t type, int64_t nrows, int64_t row_stride);

/* Folds rows of layer `layer`'s output projection into the W factors of
 * all its KV groups: o_proj holds `nrows` rows (of the D rows of Hugging
 * Face's o_proj.weight, [D, Hq d]) of Hq d elements each, row_stride
 * elements apart.  Give all D rows of every layer, in one call or in
 * several in row order.  W is the model's, the same everywhere: it is not
 * merged by kqsvd_acc_reduce, so give it to the accumulator that finishes.
 * Not collective.  Errors: as kqsvd_acc_absorb (the layer's W factors are
 * left as they were). */
KQSVD_API kqsvd_status_t kqsvd_acc_absorb_oproj(kqsvd_acc_t *acc, int64_t layer, const void *o_proj,
                                                kqsvd_dtype_t type, int64_t nrows,
                                                int64_t row_stride);

/* Copies the current R factor of one head's rows into R (d x d, row-major,
 * upper triangular, zeros below): tensor and indices as kqsvd_acc_absorb
 * (queries: the group's stacked heads, any `query`).  With head_groups G,
 * keys and values give the (G d) x (G d) factor of the group holding
 * kv_head; queries stay d x d.  Unique up to the sign
 * of each row; under KQSVD_QR_GRAM, the Cholesky factor of the Gram matrix.
 * Not collective.  Errors: KQSVD_ERR_USAGE for an index out of range,
 * KQSVD_ERR_LAPACK. */
KQSVD_API kqsvd_status_t kqsvd_acc_factor(const kqsvd_acc_t *acc, kqsvd_tensor_t tensor,
                                          int64_t layer, int64_t kv_head, double *R);

/* Rows absorbed so far into the keys of (layer 0, KV head 0): the tokens
 * seen, when every head gets every token.  Not collective. */
KQSVD_API int64_t kqsvd_acc_tokens(const kqsvd_acc_t *acc);

/* Writes the factors to `path` in kqsvd's checkpoint format
 * (docs/formats.md, section 7), with a checksum, under a unique temporary
 * name in path's folder renamed when complete.  `path` is checked before
 * anything is written, as `kqsvd calibrate --out` is: never a folder, a
 * device, a FIFO or a socket (links followed), force or not; an existing
 * file is replaced only when `force` is non-zero; its folder must take a
 * new file.  The rename looks again, so a name that became a device
 * meanwhile is left as it is.  Not collective.  Errors: KQSVD_ERR_USAGE
 * for a path refused so (nothing written), KQSVD_ERR_IO, KQSVD_ERR_HDF5,
 * naming the path. */
KQSVD_API kqsvd_status_t kqsvd_acc_save(const kqsvd_acc_t *acc, const char *path, int force);
/* Replaces the factors with those saved in `path` by an accumulator of
 * the same shape and options.  Not collective.  Errors: KQSVD_ERR_INPUT
 * naming the file for another shape or options, a damaged file (checksum)
 * or a missing one; KQSVD_ERR_HDF5. */
KQSVD_API kqsvd_status_t kqsvd_acc_load(kqsvd_acc_t *acc, const char *path);

/* Collective over comm: merges every process's K, Q and V factors (the R
 * factor of all their rows stacked in rank order) onto `root`, whose
 * accumulator then holds them; the others' are left unchanged.  comm
 * MPI_COMM_NULL, or one process, does nothing (MPI need not be
 * initialised then); other communicators need MPI initialised.  Every
 * process must have the same shape and options.  After a failure the
 * root's factors are unspecified.  Errors (the same on every process): KQSVD_ERR_USAGE for a bad
 * root or shapes that differ, KQSVD_ERR_MPI, KQSVD_ERR_NOMEM. */
KQSVD_API kqsvd_status_t kqsvd_acc_reduce(kqsvd_acc_t *acc, MPI_Comm comm, int root);

typedef struct kqsvd_finish_options {
  double beta;       /* key/query unbalance of the eigen method, > 0 [1] */
  const char *ranks; /* rank policy: "eps:E", "fixed:R" or "budget:F" ["eps:0.1"] */
} kqsvd_finish_options_t;

KQSVD_API void kqsvd_finish_options_default(kqsvd_finish_options_t *opt);

/* Solves the d x d problems of every (layer, KV head) from this
 * accumulator's factors and chooses ranks: the three methods' projections,
 * spectra and ranks.  With head_groups G, the items are the (layer, group)
 * pairs and their problems G d wide: the result's shape
 * (kqsvd_result_shape) is the group view, kv_heads / G KV heads of
 * head_dim G d serving group G query heads each.  Call it after kqsvd_acc_reduce, on the root.  The
 * accumulator is unchanged.  Not collective.  Errors: KQSVD_ERR_USAGE for
 * an unknown policy or a rank above head_dim, KQSVD_ERR_LAPACK,
 * KQSVD_ERR_NOMEM. */
KQSVD_API kqsvd_status_t kqsvd_acc_finish(const kqsvd_acc_t *acc, const kqsvd_finish_options_t *opt,
                                          kqsvd_result_t **res);

#ifdef __cplusplus
}
#endif

#endif
