/* Test tool: calibrate and evaluate as library calls (kqsvd_pipeline.h),
 * in process, under mpiexec with any number of ranks.  It records what the
 * observer hears in PREFIX.observed (rank 0, one fact per line) so that the
 * e2e scenario `pipeline` can hold it against the files and against the
 * command line's output for the same options:
 *
 *   1. kqsvd_calibrate, --ranks budget:0.4 (ranks that differ by method)
 *      with a recording observer, into PREFIX.proj.h5;
 *   2. the same at fixed:4 with no observer, into PREFIX.quiet.h5: the
 *      pipeline prints nothing of its own;
 *   3. kqsvd_evaluate of PREFIX.proj.h5 on the shards, the report written
 *      by kqsvd_report_write to PREFIX.eval.json;
 *   4. a plan that cannot fit 16 MiB: a usage error that every rank
 *      returns, reported by rank 0 alone, and no output.
 *
 *     pipeline_run PREFIX MODEL.h5 SHARD...                              */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kqsvd_pipeline.h"

typedef struct recorder {
  FILE *f; /* rank 0's record, NULL elsewhere */
  int logs[KQSVD_LOG_DETAIL + 1];
} recorder_t;

static void rec_log(void *ctx, kqsvd_log_kind_t kind, const char *text) {
  recorder_t *r = ctx;
  r->logs[kind]++;
  if (r->f && text[strlen(text) - 1] != '\n') fprintf(r->f, "unterminated %d\n", (int)kind);
}

static void rec_begin(void *ctx, const char *stage, int64_t tokens, int64_t base,
                      kqsvd_progress_fn *fn, void **fn_ctx, double *interval) {
  recorder_t *r = ctx;
  if (r->f) fprintf(r->f, "begin %s %lld %lld\n", stage, (long long)tokens, (long long)base);
}

static void rec_calibrated(void *ctx, const kqsvd_calib_report_t *rep) {
  recorder_t *r = ctx;
  if (!r->f) return;
  fprintf(r->f, "calibrated %s %s per_method=%d layers=%lld d=%lld\n", rep->out_path, rep->policy,
          rep->per_method, (long long)rep->layers, (long long)rep->head_dim);
  for (int m = 0; m < KQSVD_NMETHODS; m++) {
    fprintf(r->f, "ranks %s", kqsvd_method_name((kqsvd_method_t)m));
    for (int64_t l = 0; l < rep->layers; l++)
      fprintf(r->f, " %d/%d", rep->rank_k[m * rep->layers + l], rep->rank_v[m * rep->layers + l]);
    fprintf(r->f, "\n");
  }
}

static void rec_counts(recorder_t *r, const char *what) {
  if (r->f)
    fprintf(r->f, "logs %s note=%d warning=%d result=%d info=%d detail=%d\n", what,
            r->logs[KQSVD_LOG_NOTE], r->logs[KQSVD_LOG_WARNING], r->logs[KQSVD_LOG_RESULT],
            r->logs[KQSVD_LOG_INFO], r->logs[KQSVD_LOG_DETAIL]);
  memset(r->logs, 0, sizeof r->logs);
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: pipeline_run PREFIX MODEL.h5 SHARD...\n");
    return 2;
  }
  MPI_Init(&argc, &argv);
  kqsvd_ctx_t ctx = {MPI_COMM_WORLD, 0, 1};
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(ctx.comm, &ctx.rank);
  MPI_Comm_size(ctx.comm, &ctx.size);
  char path[4][4096], rec_path[4096];
  const char *suffix[] = {"proj.h5", "quiet.h5", "eval.json", "tight.h5"};
  for (int i = 0; i < 4; i++) snprintf(path[i], sizeof path[i], "%s.%s", argv[1], suffix[i]);
  snprintf(rec_path, sizeof rec_path, "%s.observed", argv[1]);
  recorder_t rec = {ctx.rank == 0 ? fopen(rec_path, "w") : NULL, {0}};
  const kqsvd_observer_t obs = {rec_log, rec_begin, rec_calibrated, &rec};
  int failed = 0;

  kqsvd_calib_config_t cfg;
  kqsvd_calib_config_default(&cfg);
  cfg.model_path = argv[2];
  cfg.shards = argv + 3;
  cfg.nshards = argc - 3;
  cfg.device = KQSVD_DEVICE_CPU;
  cfg.out_path = path[0];
  cfg.ranks = (kqsvd_rank_policy_t){KQSVD_RANKS_BUDGET, 0.4};
  kqsvd_status_t st = kqsvd_calib_config_check(&cfg, NULL);
  if (st == KQSVD_OK) st = kqsvd_calibrate(&ctx, &cfg, &obs);
  if (rec.f) fprintf(rec.f, "calibrate %d\n", (int)st);
  rec_counts(&rec, "calibrate");
  failed |= st != KQSVD_OK;

  cfg.out_path = path[1];
  cfg.ranks = (kqsvd_rank_policy_t){KQSVD_RANKS_FIXED, 4};
  st = kqsvd_calibrate(&ctx, &cfg, NULL);
  if (rec.f) fprintf(rec.f, "quiet %d\n", (int)st);
  failed |= st != KQSVD_OK;

  kqsvd_eval_config_t ecfg;
  kqsvd_eval_config_default(&ecfg);
  ecfg.model_path = argv[2];
  ecfg.proj_path = path[0];
  ecfg.shards = argv + 3;
  ecfg.nshards = argc - 3;
  kqsvd_eval_result_t res;
  st = kqsvd_evaluate(&ctx, &ecfg, &obs, &res);
  if (st == KQSVD_OK && ctx.rank == 0) st = kqsvd_report_write(path[2], &res.report, 1);
  if (rec.f) fprintf(rec.f, "evaluate %d d=%lld\n", (int)st, (long long)res.head_dim);
  rec_counts(&rec, "evaluate");
  kqsvd_eval_result_free(&res);
  failed |= st != KQSVD_OK;

  cfg.out_path = path[3];
  cfg.mem_mib = 16;
  kqsvd_error_clear();
  st = kqsvd_calibrate(&ctx, &cfg, &obs);
  /* Every rank's verdict, gathered: all must say usage, one must speak. */
  int mine[2] = {(int)st, kqsvd_error_report_here() ? 1 : 0}, *all = NULL;
  if (ctx.rank == 0) all = malloc(sizeof(int) * 2 * (size_t)ctx.size);
  MPI_Gather(mine, 2, MPI_INT, all, 2, MPI_INT, 0, ctx.comm);
  if (rec.f) {
    int usage = 0, speakers = 0;
    for (int p = 0; p < ctx.size; p++)
      usage += all[2 * p] == KQSVD_ERR_USAGE, speakers += all[2 * p + 1];
    fprintf(rec.f, "tight usage=%d of %d speakers=%d rank0_speaks=%d tight_exists=%d\n", usage,
            ctx.size, speakers, all[1], access(path[3], F_OK) == 0);
    fprintf(rec.f, "tight message %s\n", kqsvd_error_message());
  }
  free(all);
  if (rec.f) fclose(rec.f);
  MPI_Finalize();
  return failed;
}
