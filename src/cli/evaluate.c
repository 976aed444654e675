/* kqsvd evaluate: options, the table and the JSON report; the evaluation
 * is the pipeline's (src/pipeline/evaluate.c). */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kqsvd_cli.h"
#include "kqsvd_linalg.h"
#include "kqsvd_report.h"
#include "kqsvd_util.h"

typedef struct evaluate_cmd {
  kqsvd_eval_config_t cfg;
  kqsvd_rank_policy_t ranks; /* cfg.ranks points here when --ranks is given */
  const char *json_path;
  int force;
} evaluate_cmd_t;

static const char help[] =
    "usage: [mpirun -np N] kqsvd evaluate --model MODEL.h5 --proj PROJ.h5 [OPTIONS] SHARD...\n"
    "\n"
    "Measures how well the kqsvd, ksvd and eigen projections of PROJ.h5 reproduce\n"
    "attention on validation caches: err_k, err_q, err_v, err_kq and err_out, the\n"
    "relative squared Frobenius errors of K, Q, V, Q K^T and the attention layer's\n"
    "output, per sequence over all heads of a layer, averaged over sequences.\n"
    "\n"
    "  --model FILE        model file with o_proj (required)\n"
    "  --proj FILE         projections from kqsvd calibrate (required)\n"
    "  --json FILE         also write the report as JSON (docs/formats.md)\n"
    "  --force             replace an existing --json FILE\n"
    "  --ranks POLICY      ranks to evaluate at [those stored in PROJ.h5]:\n"
    "                        eps:E     the paper's rule with tolerance E\n"
    "                        fixed:R   rank R everywhere\n"
    "                        budget:F  a fraction F of the full cache, spread over layers\n"
    "                                  by each method's own spectra\n"
    "  --block-rows N      query rows per unit of work; memory grows with N x T\n"
    "                      [256, fewer if --mem-limit requires]\n"
    "  --mem-limit MIB     memory bound per rank [1024]\n"
    "  --allow-model-mismatch\n"
    "                      evaluate projections whose 'model' attribute differs from\n"
    "                      MODEL's (an error otherwise)\n"
    "  --threads N         BLAS threads per rank [1]; use MPI ranks for cores\n"
    "  --progress MODE     auto, bar, lines or off [auto]\n"
    "  -v, --verbose       print a trace with errors\n"
    "  -h, --help          this text\n";

enum { O_MODEL = 256, O_PROJ, O_JSON, O_FORCE, O_RANKS, O_BLOCK, O_ALLOW };

static const struct option longopts[] = {{"model", required_argument, NULL, O_MODEL},
                                         {"proj", required_argument, NULL, O_PROJ},
                                         {"json", required_argument, NULL, O_JSON},
                                         {"force", no_argument, NULL, O_FORCE},
                                         {"ranks", required_argument, NULL, O_RANKS},
                                         {"block-rows", required_argument, NULL, O_BLOCK},
                                         {"allow-model-mismatch", no_argument, NULL, O_ALLOW},
                                         KQSVD_RUN_LONGOPTS,
                                         KQSVD_LONGOPTS_END};

static void defaults(void *state) {
  evaluate_cmd_t *e = state;
  kqsvd_eval_config_default(&e->cfg);
}

static kqsvd_status_t option(void *state, int o, const char *arg) {
  kqsvd_status_t st = KQSVD_OK;
  evaluate_cmd_t *e = state;
  switch (o) {
  case O_MODEL: e->cfg.model_path = arg; break;
  case O_PROJ: e->cfg.proj_path = arg; break;
  case O_JSON: e->json_path = arg; break;
  case O_FORCE: e->force = 1; break;
  case O_RANKS:
    KQSVD_CALL(kqsvd_rank_policy_parse("--ranks", arg, &e->ranks));
    e->cfg.ranks = &e->ranks;
    break;
  case O_ALLOW: e->cfg.allow_mismatch = 1; break;
  case O_BLOCK:
    KQSVD_CALL(kqsvd_opt_int("--block-rows", arg, 1, 1 << 20, &e->cfg.block_rows));
    e->cfg.block_set = 1;
    break;
  default: KQSVD_FAIL(KQSVD_ERR_BUG, "unhandled option %d", o);
  }
done:
  return st;
}

static kqsvd_status_t operands(void *state, const kqsvd_run_opts_t *opts, int n, char **args) {
  kqsvd_status_t st = KQSVD_OK;
  evaluate_cmd_t *e = state;
  KQSVD_CHECK(e->cfg.model_path, KQSVD_ERR_USAGE, "--model is required");
  KQSVD_CHECK(e->cfg.proj_path, KQSVD_ERR_USAGE, "--proj is required");
  e->cfg.nshards = n;
  e->cfg.shards = args;
  KQSVD_CHECK(e->cfg.nshards > 0, KQSVD_ERR_USAGE, "no validation cache shards given");
  {
    const char *named[] = {e->cfg.model_path, e->cfg.proj_path}, *roles[] = {"--model", "--proj"};
    KQSVD_CALL(kqsvd_check_file_args("--json", e->json_path, 2, named, roles, e->cfg.shards,
                                     e->cfg.nshards));
  }
  /* Quick to remake, but an output is never replaced unasked. */
  if (e->json_path) KQSVD_CALL(kqsvd_check_output("--json", e->json_path, e->force));
  e->cfg.mem_mib = opts->mem_mib;
done:
  return st;
}

static void print_table(const kqsvd_eval_result_t *res) {
  const kqsvd_report_t *r = &res->report;
  const int L = r->layers;
  int same = 1;
  for (int m = 1; m < KQSVD_NMETHODS; m++)
    for (int l = 0; l < L; l++)
      same &= r->rank_k[m * L + l] == r->rank_k[l] && r->rank_v[m * L + l] == r->rank_v[l];
  char tok[32];
  kqsvd_fmt_count((double)r->tokens, tok, sizeof tok);
  printf("%s: %s tokens in %lld sequence%s, %d layers, ranks %s of d = %lld%s\n", r->model, tok,
         (long long)r->sequences, r->sequences == 1 ? "" : "s", L, r->rank_policy,
         (long long)res->head_dim, r->causal ? ", causal" : "");
  if (r->head_groups > 1)
    printf("head groups of %lld KV heads: one latent of rank_k (rank_v) per group, d = %lld "
           "wide\n",
           (long long)r->head_groups, (long long)res->head_dim);
  int per_head = 0;
  for (int m = 0; m < KQSVD_NMETHODS; m++) per_head |= r->rank_k_heads && r->heads[m];
  if (per_head)
    printf("ranks per KV head: rank_k and rank_v below are each layer's largest; --json lists "
           "every head's\n");
  const char *rk = same ? "rank_k rank_v" : "rank_k/rank_v: kqsvd ksvd eigen";
  const int w = (int)strlen(rk);
  /* Each block of three columns is 27 wide after a 2-space gap. */
  printf("%5s %*s  %-27s  %-27s\n", "", w, "", "----- err_kq (scores) -----",
         "----- err_out (output) ----");
  printf("layer %s      kqsvd     ksvd    eigen      kqsvd     ksvd    eigen\n", rk);
  for (int l = 0; l <= L; l++) {
    char ranks[96] = "";
    if (l == L) {
      printf(" mean %*s", w, "");
    } else if (same) {
      snprintf(ranks, sizeof ranks, "%6d %6d", r->rank_k[l], r->rank_v[l]);
      printf("%5d %*s", l, w, ranks);
    } else {
      snprintf(ranks, sizeof ranks, "%d/%d %d/%d %d/%d", r->rank_k[l], r->rank_v[l],
               r->rank_k[L + l], r->rank_v[L + l], r->rank_k[2 * L + l], r->rank_v[2 * L + l]);
      printf("%5d %*s", l, w, ranks);
    }
    for (int k = KQSVD_ERR_KQ; k <= KQSVD_ERR_OUT; k++) {
      printf("  ");
      for (int m = 0; m < KQSVD_NMETHODS; m++) {
        const double v =
            l == L ? kqsvd_report_mean(r, m, k) : r->err[((size_t)m * L + l) * KQSVD_NMETRICS + k];
        printf(" %8.2e", v);
      }
    }
    printf("\n");
  }
  printf("\nmean over layers    err_k     err_q     err_v    err_kq   err_out\n");
  for (int m = 0; m < KQSVD_NMETHODS; m++) {
    printf("%-16s", kqsvd_method_name((kqsvd_method_t)m));
    for (int k = 0; k < KQSVD_NMETRICS; k++) printf(" %9.3e", kqsvd_report_mean(r, m, k));
    printf("\n");
  }
}

static kqsvd_status_t run(kqsvd_cli_t *cli, void *state, const kqsvd_run_opts_t *opts) {
  kqsvd_status_t st = KQSVD_OK, local = KQSVD_OK;
  const evaluate_cmd_t *e = state;
  kqsvd_eval_result_t res;
  const double t0 = kqsvd_now();
  memset(&res, 0, sizeof res);
  kqsvd_blas_set_threads((int)opts->threads);
  kqsvd_cli_observer_t obs;
  kqsvd_cli_observer_init(&obs, opts->progress, cli->verbose);
  const kqsvd_ctx_t ctx = {cli->comm, cli->rank, cli->size};
  st = kqsvd_evaluate(&ctx, &e->cfg, &obs.obs, &res);
  if (st != KQSVD_OK) kqsvd_usage_hint("evaluate");
  KQSVD_CALL(st);
  if (cli->rank == 0) {
    /* The table first: a report that cannot be written loses nothing else. */
    print_table(&res);
    fflush(stdout);
    if (e->json_path) local = kqsvd_report_write(e->json_path, &res.report, e->force);
    if (local == KQSVD_OK && e->json_path) printf("wrote %s; ", e->json_path);
    if (local == KQSVD_OK) printf("evaluated in %.2f s\n", kqsvd_now() - t0);
  }
  KQSVD_CALL(kqsvd_mpi_agree(cli->comm, local));
done:
  kqsvd_eval_result_free(&res);
  return st;
}

const kqsvd_command_t kqsvd_command_evaluate = {
    .name = "evaluate",
    .about = "measure attention fidelity of projections on validation caches",
    .mpi = 1,
    .h5 = 1,
    .help = {help},
    .shortopts = ":hv",
    .longopts = longopts,
    .size = sizeof(evaluate_cmd_t),
    .defaults = defaults,
    .option = option,
    .operands = operands,
    .run = run,
};
