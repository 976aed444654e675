/* The final stage of kqsvd calibrate: TSQR reduction of the R factors onto
 * the ranks that own each (layer, KV group), the d x d solves, ranks, and a
 * parallel write of the projections under a temporary name. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "calib.h"
#include "kqsvd_gram.h"
#include "kqsvd_linalg.h"
#include "kqsvd_proj.h"
#include "kqsvd_rank.h"
#include "kqsvd_signal.h"
#include "kqsvd_util.h"

/* Spectra the rank policies need, per item: each method's sigma_k and
 * sigma_v, then those of K and V. */
enum { SIG_K = 2 * KQSVD_NMETHODS, SIG_V, SIG_N };

/* Solves and writes the owned items, keeping their spectra in sig
 * ([SIG_N][nitems][d], zero for items owned elsewhere). */
static kqsvd_status_t solve_owned(calib_t *c, kqsvd_proj_writer_t *w, double *sig) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_solution_t sol;
  double *R = NULL;
  const int d = (int)c->d;
  const size_t tri = kqsvd_tri_size(d), dd = (size_t)d * (size_t)d;
  const size_t plane = (size_t)(c->nitems * c->d), vec = (size_t)d * sizeof(double);
  memset(&sol, 0, sizeof sol);
  KQSVD_CALL(kqsvd_solution_init(d, &sol));
  KQSVD_MALLOC(R, (CAL_NR + 1) * dd, "R factors of one item");
  for (int64_t i = c->own0; i < c->own1; i++) {
    for (int k = 0; k < CAL_NR; k++)
      kqsvd_tri_unpack(d, c->state + ((size_t)i * CAL_NR + k) * tri, R + k * dd);
    kqsvd_tri_unpack(d, kqsvd_acc_wstate(c->acc) + (size_t)i * tri, R + CAL_NR * dd);
    KQSVD_CALL(kqsvd_solve(d, R + CAL_RK * dd, R + CAL_RQ * dd, R + CAL_RV * dd, R + CAL_NR * dd,
                           c->cfg.beta, &sol));
    KQSVD_CALL(kqsvd_proj_write_item(w, i / c->dims.kv_heads, i % c->dims.kv_heads, &sol));
    double *at = sig + (size_t)i * (size_t)d;
    for (int m = 0; m < KQSVD_NMETHODS; m++) {
      memcpy(at + (2 * m) * plane, sol.method[m].sigma_k, vec);
      memcpy(at + (2 * m + 1) * plane, sol.method[m].sigma_v, vec);
    }
    memcpy(at + SIG_K * plane, sol.spec_K, vec);
    memcpy(at + SIG_V * plane, sol.spec_V, vec);
  }
done:
  kqsvd_solution_free(&sol);
  free(R);
  return st;
}

/* Rank 0: the rank policy over all items' spectra. */
static kqsvd_status_t choose_ranks(calib_t *c, const double *sig) {
  kqsvd_status_t st = KQSVD_OK;
  const int64_t L = c->dims.layers;
  const size_t plane = (size_t)(c->nitems * c->d);
  const double *sk[KQSVD_NMETHODS], *sv[KQSVD_NMETHODS];
  for (int m = 0; m < KQSVD_NMETHODS; m++) sk[m] = sig + 2 * m * plane, sv[m] = sk[m] + plane;
  KQSVD_MALLOC(c->rank_k, (size_t)(KQSVD_NMETHODS * L), "ranks");
  KQSVD_MALLOC(c->rank_v, (size_t)(KQSVD_NMETHODS * L), "ranks");
  KQSVD_CALL(kqsvd_rank_choose(&c->cfg.ranks, (int)L, (int)c->dims.kv_heads, (int)c->d, sk, sv,
                               sig + SIG_K * plane, sig + SIG_V * plane, c->rank_k, c->rank_v));
done:
  return st;
}

/* Leaves the global R factors of each item on its owner rank. */
static kqsvd_status_t reduce(calib_t *c) {
  kqsvd_status_t st = KQSVD_OK;
  const int d = (int)c->d;
  const size_t tri = kqsvd_tri_size(d);
  double *G = NULL;
  switch (c->cfg.qr) {
  case KQSVD_CALIB_QR_TSQR:
    KQSVD_CALL(kqsvd_tsqr_reduce(c->ctx.comm, d, CAL_NR, c->nitems, c->state));
    break;
  case KQSVD_CALIB_QR_GRAM:
    KQSVD_CALL(kqsvd_sum_reduce(c->ctx.comm, CAL_NR * tri, c->nitems, c->state));
    KQSVD_MALLOC(G, (size_t)d * (size_t)d, "Gram matrix");
    for (int64_t i = c->own0; i < c->own1; i++)
      for (int k = 0; k < CAL_NR; k++) {
        double *P = c->state + ((size_t)i * CAL_NR + (size_t)k) * tri;
        kqsvd_tri_unpack(d, P, G);
        KQSVD_CALL(kqsvd_gram_to_r(d, G));
        kqsvd_tri_pack(d, G, P);
      }
    break;
  case KQSVD_CALIB_QR_SCALAPACK: break; /* pdgeqrf left every factor on every rank */
  }
done:
  free(G);
  return st;
}

kqsvd_status_t calib_finish(calib_t *c) {
  kqsvd_status_t st = KQSVD_OK, local = KQSVD_OK;
  MPI_Comm comm = c->ctx.comm;
  const int root = c->ctx.rank == 0;
  kqsvd_proj_writer_t *w = NULL;
  double *sig = NULL;
  char tmp[PATH_MAX + 32] = "", policy[64];
  int nsig_int = 0;

  if (root)
    kqsvd_observe(c->obs, KQSVD_LOG_INFO,
                  "kqsvd calibrate: reducing the R factors and solving %lld (layer, KV head) "
                  "items on %d rank%s\n",
                  (long long)c->nitems, c->ctx.size, c->ctx.size == 1 ? "" : "s");
  /* Without it the reduction's time would include waiting for the slowest
   * rank's stream. */
  if (c->cfg.timings) KQSVD_MPI(MPI_Barrier(comm));
  double t0 = kqsvd_now();
  KQSVD_CALL(kqsvd_mpi_agree(comm, reduce(c)));
  c->t_reduce = kqsvd_now() - t0;
  t0 = kqsvd_now();

  /* One temporary name for all ranks, unique to this run. */
  if (root) kqsvd_tmp_path(c->cfg.out_path, tmp, sizeof tmp); /* fits: checked with --out */
  KQSVD_MPI(MPI_Bcast(tmp, (int)sizeof tmp, MPI_CHAR, 0, comm));
  kqsvd_signal_track(tmp);
  /* Test hook: a signal while the output is being written. */
  const char *sig_at = getenv("KQSVD_TEST_SIGNAL_WRITING");
  kqsvd_rank_policy_format(&c->cfg.ranks, policy, sizeof policy);
  const double eps = c->cfg.ranks.kind == KQSVD_RANKS_EPS ? c->cfg.ranks.value : NAN;
  kqsvd_proj_meta_t meta = {c->dims,
                            eps,
                            c->cfg.beta,
                            c->tokens,
                            c->cfg.nshards,
                            c->cfg.qr_block,
                            policy,
                            c->inputs_hash,
                            c->rope[0] ? c->rope : NULL,
                            c->G,
                            c->seq_max};
  local = root ? kqsvd_check_space(c->cfg.out_path, kqsvd_proj_size_estimate(&c->dims)) : KQSVD_OK;
  KQSVD_CALL(kqsvd_mpi_agree(comm, local));
  local = kqsvd_proj_create(tmp, comm, &meta, &w);
  KQSVD_CALL(kqsvd_mpi_agree(comm, local));
  /* Every byte is claimed now, while a failure can still be agreed on. */
  KQSVD_CALL(kqsvd_mpi_agree(comm, root ? kqsvd_proj_reserve(w, c->cfg.out_path) : KQSVD_OK));
  if (sig_at && root) raise(atoi(sig_at));

  const size_t nsig = (size_t)(SIG_N * c->nitems * c->d);
  KQSVD_MALLOC(sig, nsig, "spectra");
  for (size_t k = 0; k < nsig; k++) sig[k] = 0.0;
  KQSVD_CALL(kqsvd_mpi_agree(comm, solve_owned(c, w, sig)));
  KQSVD_TO_INT(nsig, &nsig_int, "spectra size");
  KQSVD_MPI(MPI_Reduce(root ? MPI_IN_PLACE : sig, sig, nsig_int, MPI_DOUBLE, MPI_SUM, 0, comm));
  local = KQSVD_OK;
  if (root) {
    local = choose_ranks(c, sig);
    if (local == KQSVD_OK) local = kqsvd_proj_write_ranks(w, c->rank_k, c->rank_v);
  }
  KQSVD_CALL(kqsvd_mpi_agree(comm, local));
  KQSVD_CALL(kqsvd_mpi_agree(comm, kqsvd_proj_close(&w)));
  local = root ? kqsvd_proj_trim(tmp) : KQSVD_OK;
  if (local == KQSVD_OK && root)
    /* --skip-done and a manifest remake an output whose inputs changed:
     * replacing it is what they ask for, as --force does. */
    local = c->cfg.force || c->cfg.skip_done || c->cfg.manifest_path
                ? kqsvd_publish(tmp, c->cfg.out_path)
                : kqsvd_publish_new(tmp, c->cfg.out_path);
  KQSVD_CALL(kqsvd_mpi_agree(comm, local));
  c->t_solve = kqsvd_now() - t0;
done:
  /* The close is collective: only safe when every rank knows of the
   * failure (otherwise main() aborts).  The partial file goes. */
  if (w && (st == KQSVD_OK || kqsvd_error_is_collective())) kqsvd_proj_close(&w);
  if (st != KQSVD_OK && root && tmp[0]) remove(tmp);
  if (tmp[0]) kqsvd_signal_untrack(tmp);
  free(sig);
  return st;
}
