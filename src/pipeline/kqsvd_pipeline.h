/* The pipeline: `kqsvd calibrate` (one model, or every model of a
 * manifest) and `kqsvd evaluate` as library calls, from a plain config
 * struct, a run context and an observer (kqsvd_observer.h) instead of argv
 * and printf.  src/cli parses options into these structs, calls them and
 * prints what the observer and the results hand back. */
#ifndef KQSVD_PIPELINE_H
#define KQSVD_PIPELINE_H

#include <stdint.h>

#include "kqsvd_cache.h"
#include "kqsvd_error.h"
#include "kqsvd_mpi.h"
#include "kqsvd_observer.h"
#include "kqsvd_proj.h"
#include "kqsvd_rank.h"
#include "kqsvd_report.h"
#include "kqsvd_util.h"

/* Where a run happens: a communicator and this process's place in it.
 * comm MPI_COMM_NULL (size 1) for the steps that run without MPI. */
typedef struct kqsvd_ctx {
  MPI_Comm comm;
  int rank, size;
} kqsvd_ctx_t;

/* How cache rows become R factors.  TSQR (streaming Householder, tree
 * merge) is the default; the others are benchmark peers. */
typedef enum kqsvd_calib_qr {
  KQSVD_CALIB_QR_TSQR = 0,
  KQSVD_CALIB_QR_GRAM,
  KQSVD_CALIB_QR_SCALAPACK
} kqsvd_calib_qr_t;

/* Where the streaming QR runs: a GPU when one is usable (auto), or as said. */
typedef enum kqsvd_device {
  KQSVD_DEVICE_AUTO = 0,
  KQSVD_DEVICE_CPU,
  KQSVD_DEVICE_CUDA
} kqsvd_device_t;

/* The --qr and --device spellings ("tsqr", "gram", "scalapack"; "auto",
 * "cpu", "cuda"), both ways.  Not collective; parse errors are
 * KQSVD_ERR_USAGE naming `opt`. */
const char *kqsvd_calib_qr_name(kqsvd_calib_qr_t q);
kqsvd_status_t kqsvd_calib_qr_parse(const char *opt, const char *s, kqsvd_calib_qr_t *q);
kqsvd_status_t kqsvd_device_parse(const char *opt, const char *s, kqsvd_device_t *d);

/* Everything a calibration needs to know, as `kqsvd calibrate`'s options
 * (kqsvd help calibrate) say.  Either manifest_path, or model_path,
 * out_path and the shards.  The strings and the shard list are borrowed
 * for the run. */
typedef struct kqsvd_calib_config {
  const char *model_path, *out_path, *manifest_path;
  char **shards;
  int nshards;
  const char *ckpt_dir;        /* NULL: no checkpoints */
  double ckpt_every;           /* seconds between checkpoints within a shard */
  kqsvd_rank_policy_t ranks;   /* how rank_k and rank_v are chosen */
  double beta;                 /* eigen's key/query unbalance */
  int64_t qr_block, read_rows; /* read_rows 0: as --mem-limit allows */
  int64_t head_groups;         /* G KV heads solved as one, G d wide [1: per head] */
  int64_t mem_mib;
  kqsvd_calib_qr_t qr;
  kqsvd_device_t device;
  int skip_done, force, timings;
} kqsvd_calib_config_t;

/* The defaults of `kqsvd calibrate`: eps:0.1, beta 1, checkpoints every
 * 60 s, --qr-block 256, 1024 MiB, tsqr, device auto; no paths. */
void kqsvd_calib_config_default(kqsvd_calib_config_t *cfg);

/* Checks a config before any work: the options agree with each other and
 * the files can be made (kqsvd_check_output, kqsvd_check_file_args,
 * kqsvd_check_checkpoint_dir).  Not collective, but reads the file system:
 * callers on several ranks agree on the outcome.  Into `made` (may be
 * NULL): the --checkpoint folders it made.  Errors: KQSVD_ERR_USAGE naming
 * the option. */
kqsvd_status_t kqsvd_calib_config_check(const kqsvd_calib_config_t *cfg, kqsvd_made_dirs_t *made);

/* Collective over ctx->comm: calibrates one model, or every model of
 * cfg->manifest_path in turn, writing each projections file (under a
 * temporary name, renamed when complete), resuming from and removing
 * cfg->ckpt_dir's checkpoints.  Reports through `obs` (may be NULL).
 * Errors, agreed by every rank: KQSVD_ERR_USAGE (an impossible plan, such
 * as a --mem-limit too small, reported by rank 0), _INPUT and _DATA naming
 * the file and field, _IO, _NOMEM, _INTERRUPTED (checkpoints kept). */
kqsvd_status_t kqsvd_calibrate(const kqsvd_ctx_t *ctx, const kqsvd_calib_config_t *cfg,
                               const kqsvd_observer_t *obs);

/* What `kqsvd evaluate` is given (kqsvd help evaluate). */
typedef struct kqsvd_eval_config {
  const char *model_path, *proj_path;
  char **shards;
  int nshards;
  const kqsvd_rank_policy_t *ranks; /* NULL: the ranks stored in the file */
  int64_t block_rows;               /* query rows per unit of work */
  int block_set;                    /* block_rows is the user's: never shrunk */
  int64_t mem_mib;
  int allow_mismatch; /* projections of another model's name: a warning */
} kqsvd_eval_config_t;

/* block_rows 256 (shrunk to fit), 1024 MiB; no paths. */
void kqsvd_eval_config_default(kqsvd_eval_config_t *cfg);

/* An evaluation's outcome on rank 0: the report (docs/formats.md section
 * 4; report.proj is cfg->proj_path, borrowed) and head_dim for tables. */
typedef struct kqsvd_eval_result {
  kqsvd_report_t report;
  int64_t head_dim;
} kqsvd_eval_result_t;

/* Collective over ctx->comm: the errors of every method's projections on
 * the validation shards, reported through `obs` (may be NULL).  On rank 0
 * *res holds the results, owned by it: free with kqsvd_eval_result_free
 * (on every rank).  Errors, agreed: KQSVD_ERR_INPUT and _DATA naming the
 * file and field (projections of another model's name unless
 * allow_mismatch), _NOMEM, _INTERRUPTED, and KQSVD_ERR_USAGE when the rank
 * policy or mem_mib cannot be met (rank 0 reports). */
kqsvd_status_t kqsvd_evaluate(const kqsvd_ctx_t *ctx, const kqsvd_eval_config_t *cfg,
                              const kqsvd_observer_t *obs, kqsvd_eval_result_t *res);
void kqsvd_eval_result_free(kqsvd_eval_result_t *res);

/* The per-layer ranks of all three methods for the projections `proj`
 * (`evaluate` and `ranks` both use it).  policy == NULL: those stored in
 * the file, and its policy string (the rank_policy attribute, else "eps:E"
 * from a finite eps, else "stored").  Otherwise those the policy chooses
 * from the stored spectra (sigma_k, sigma_v of each method, spectra/K and
 * spectra/V) by kqsvd_rank_choose, exactly as calibrate chooses them, and
 * the policy as kqsvd_rank_policy_format writes it.  rank_k, rank_v:
 * [KQSVD_NMETHODS][L]; policy_buf: n bytes.  Not collective.  Errors:
 * KQSVD_ERR_USAGE naming --ranks when the policy cannot be met at this
 * head_dim; those of kqsvd_proj_read_ranks and kqsvd_proj_read
 * (KQSVD_ERR_INPUT, _DATA naming the file), _NOMEM. */
kqsvd_status_t kqsvd_proj_choose_ranks(kqsvd_proj_reader_t *proj, const kqsvd_rank_policy_t *policy,
                                       int32_t *rank_k, int32_t *rank_v, char *policy_buf,
                                       size_t n);

/* The stored per-(layer, KV head) ranks (docs/formats.md 5.3) that
 * `evaluate` and `ranks` use without --ranks.  has[m] (KQSVD_NMETHODS
 * entries) says which methods hold them.  When one does, *head_k and
 * *head_v are new [KQSVD_NMETHODS][L][Hkv] arrays (rows of methods without
 * them are zero; free them); when none does, both are NULL.  Not
 * collective.  Errors: those of kqsvd_proj_read_head_ranks (KQSVD_ERR_INPUT
 * naming the file and dataset), _NOMEM. */
kqsvd_status_t kqsvd_proj_choose_head_ranks(kqsvd_proj_reader_t *proj, int32_t **head_k,
                                            int32_t **head_v, int *has);

/* Checks file arguments before any work: no input given twice (its rows
 * would count twice) and no output that is one of the inputs (the final
 * rename would replace it).  The inputs are `named` (named_opts[i] gives
 * the option of named[i]) and shard arguments ("shard N" in messages);
 * `out` may be NULL; files that do not exist are left for the readers to
 * report.  Not collective.  Errors: KQSVD_ERR_USAGE naming the options
 * that collide. */
kqsvd_status_t kqsvd_check_file_args(const char *out_opt, const char *out, int nnamed,
                                     const char *const *named, const char *const *named_opts,
                                     char **shards, int nshards);

/* Checks that output `path` (given as option `opt`, NULL for none) can be
 * made in place: if it exists, it is a regular file once links are
 * followed (force or not: a device or FIFO is never replaced); its folder
 * exists, has a write bit (root included) and a file can be created in it.
 * Not collective.  Errors: KQSVD_ERR_USAGE naming `opt` and `path`. */
kqsvd_status_t kqsvd_check_output_place(const char *opt, const char *path);

/* Checks before any work that output `path` (given as option `opt`; NULL
 * for a library call, whose messages then name the path and `force`) can
 * be made: its name leaves room for the temporary suffix, it holds no
 * control character, kqsvd_check_output_place, and it does not exist
 * unless `force`.  Not collective.  Errors: KQSVD_ERR_USAGE. */
kqsvd_status_t kqsvd_check_output(const char *opt, const char *path, int force);

/* Checks before any work that folder output `dir` (given as option `opt`)
 * can be filled: if it exists it is a folder once links are followed (not
 * a file, device, FIFO or socket); otherwise the nearest folder above it
 * that exists is one; and the folder that exists takes a new file (as
 * kqsvd_check_output_place).  Creates nothing.  Not collective.  Errors:
 * KQSVD_ERR_USAGE naming `opt` and `dir`. */
kqsvd_status_t kqsvd_check_folder_output(const char *opt, const char *dir);

/* Checks a --checkpoint folder before any work: not the output's path, not
 * a file, creatable and writable (as kqsvd_check_output_place), and
 * not holding `out` (may be NULL), whose neighbours are deleted at the end.
 * Creates the folder, noting in `made` (may be NULL) the folders this call
 * made (kqsvd_mkdir_made).  Not collective.  Errors: KQSVD_ERR_USAGE. */
kqsvd_status_t kqsvd_check_checkpoint_dir(const char *dir, const char *out,
                                          kqsvd_made_dirs_t *made);

/* What kqsvd_scan_shards learns of a set of cache shards. */
typedef struct kqsvd_shard_set {
  int64_t *rows, *seqs; /* [n]: T and S of each shard */
  int64_t *seq_lens;    /* every sequence's length, shard after shard */
  int64_t tokens, sequences;
  int64_t seq_max; /* the longest sequence: the calibration's window length */
  size_t elem_max; /* widest element size of the shards and elem_min */
} kqsvd_shard_set_t;

/* Collective.  Reads each shard's header once, round robin over the ranks:
 * checks it against `dims` (read from `model_path`), warns through `obs`
 * (on the rank that read it) when its model name differs, and shares the
 * sizes with every rank (and every sequence length when want_lens).  `rope`
 * is the model file's attribute (kqsvd_model_rope): a shard whose keys
 * were taken on the other side of RoPE is refused (no attribute counts as
 * "post").  Errors, agreed by all ranks: KQSVD_ERR_INPUT naming the file
 * and field, or a set without tokens. */
kqsvd_status_t kqsvd_scan_shards(const kqsvd_ctx_t *ctx, const kqsvd_observer_t *obs,
                                 const char *cmd, char **paths, int n, const kqsvd_dims_t *dims,
                                 const char *model_path, const char *rope, size_t elem_min,
                                 int want_lens, kqsvd_shard_set_t *set);
void kqsvd_shard_set_free(kqsvd_shard_set_t *set);

/* Marks a usage error that every rank of ctx found alike (from the same
 * options and files) as collective, reported by rank 0.  Returns st. */
kqsvd_status_t kqsvd_agreed_usage(const kqsvd_ctx_t *ctx, kqsvd_status_t st);

#endif
