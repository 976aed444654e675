/* kqsvd evaluate: options, input validation, ranks, the work plan, and the
 * table and report; the work itself lives in eval_run.c. */
#include "evaluate.h"

#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kqsvd_linalg.h"
#include "kqsvd_report.h"
#include "kqsvd_util.h"

static void evaluate_help(void) {
  printf(
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
      "  -h, --help          this text\n");
}

static kqsvd_status_t parse(evaluation_t *e, int argc, char **argv) {
  kqsvd_status_t st = KQSVD_OK;
  enum { O_MODEL = 256, O_PROJ, O_JSON, O_RANKS, O_BLOCK, O_ALLOW };
  static const struct option longopts[] = {{"model", required_argument, NULL, O_MODEL},
                                           {"proj", required_argument, NULL, O_PROJ},
                                           {"json", required_argument, NULL, O_JSON},
                                           {"ranks", required_argument, NULL, O_RANKS},
                                           {"block-rows", required_argument, NULL, O_BLOCK},
                                           {"allow-model-mismatch", no_argument, NULL, O_ALLOW},
                                           KQSVD_RUN_LONGOPTS,
                                           {"help", no_argument, NULL, 'h'},
                                           {NULL, 0, NULL, 0}};
  int handled = 0;
  e->block_rows = 256;
  kqsvd_run_opts_default(&e->run);
  optind = 1;
  for (;;) {
    int o;
    KQSVD_CALL(kqsvd_getopt(argc, argv, ":hv", longopts, &o));
    if (o == -1) break;
    switch (o) {
    case O_MODEL: e->model_path = optarg; break;
    case O_PROJ: e->proj_path = optarg; break;
    case O_JSON: e->json_path = optarg; break;
    case O_RANKS:
      KQSVD_CALL(kqsvd_rank_policy_parse("--ranks", optarg, &e->ranks));
      e->ranks_set = 1;
      break;
    case O_ALLOW: e->allow_mismatch = 1; break;
    case O_BLOCK:
      KQSVD_CALL(kqsvd_opt_int("--block-rows", optarg, 1, 1 << 20, &e->block_rows));
      e->block_set = 1;
      break;
    case 'h':
      if (e->cli->rank == 0) evaluate_help();
      e->help = 1;
      return KQSVD_OK;
    default:
      KQSVD_CALL(kqsvd_run_option(e->cli, o, optarg, &e->run, &handled));
      KQSVD_CHECK(handled, KQSVD_ERR_BUG, "unhandled option %d", o);
    }
  }
  KQSVD_CHECK(e->model_path, KQSVD_ERR_USAGE, "--model is required");
  KQSVD_CHECK(e->proj_path, KQSVD_ERR_USAGE, "--proj is required");
  e->nshards = argc - optind;
  e->shards = argv + optind;
  KQSVD_CHECK(e->nshards > 0, KQSVD_ERR_USAGE, "no validation cache shards given");
  {
    const char *named[] = {e->model_path, e->proj_path}, *opts[] = {"--model", "--proj"};
    KQSVD_CALL(kqsvd_check_file_args("--json", e->json_path, 2, named, opts, e->shards,
                                     e->nshards));
  }
  /* A report is quick to remake: it is replaced without --force. */
  if (e->json_path) KQSVD_CALL(kqsvd_check_output("--json", e->json_path, 1));
done:
  return st;
}

/* Every rank opens the model and the projections (small); the shard
 * headers are read once, round robin, and their sequences shared. */
static kqsvd_status_t validate_inputs(evaluation_t *e) {
  kqsvd_status_t st = KQSVD_OK, local = KQSVD_OK;
  kqsvd_shard_set_t set;
  memset(&set, 0, sizeof set);
  local = kqsvd_model_open(e->model_path, &e->model);
  if (local == KQSVD_OK) local = kqsvd_proj_open(e->proj_path, &e->proj);
  if (local == KQSVD_OK) {
    e->dims = *kqsvd_model_dims(e->model);
    kqsvd_dims_t pd = *kqsvd_proj_dims(e->proj);
    pd.causal = e->dims.causal; /* not part of a projections file */
    local = kqsvd_dims_match(&pd, e->proj_path, &e->dims, e->model_path);
    /* Projections of another model with the same shapes give numbers that
     * look fine and mean nothing. */
    if (local == KQSVD_OK && strcmp(pd.model, e->dims.model) != 0) {
      if (!e->allow_mismatch)
        local = kqsvd_error_set(KQSVD_ERR_INPUT, __FILE__, __LINE__, __func__,
                                "%s: attribute 'model' is \"%s\", but %s says \"%s\"; give "
                                "--allow-model-mismatch to evaluate them anyway",
                                e->proj_path, pd.model, e->model_path, e->dims.model);
      else if (e->cli->rank == 0)
        fprintf(stderr, "kqsvd evaluate: warning: %s is from model \"%s\", %s says \"%s\"\n",
                e->proj_path, pd.model, e->model_path, e->dims.model);
    }
  }
  KQSVD_CALL(kqsvd_mpi_agree(e->cli->comm, local));
  e->d = e->dims.head_dim;
  e->group = e->dims.heads / e->dims.kv_heads;
  KQSVD_CALL(kqsvd_scan_shards(e->cli, "evaluate", e->shards, e->nshards, &e->dims,
                               e->model_path, kqsvd_dtype_size(kqsvd_model_dtype(e->model)), 1,
                               &set));
  e->nseq = set.sequences;
  e->tokens = set.tokens;
  e->elem_max = set.elem_max;
  /* Failures before the next collective must be agreed, or others wait. */
  e->seq_shard = malloc((size_t)e->nseq * sizeof *e->seq_shard);
  e->seq_off = malloc((size_t)e->nseq * sizeof *e->seq_off);
  local = e->seq_shard && e->seq_off
              ? KQSVD_OK
              : kqsvd_error_set(KQSVD_ERR_NOMEM, __FILE__, __LINE__, __func__,
                                "cannot allocate the table of %lld sequences", (long long)e->nseq);
  KQSVD_CALL(kqsvd_mpi_agree(e->cli->comm, local));
  e->seq_len = set.seq_lens;
  set.seq_lens = NULL;
  e->max_T = 0;
  for (int64_t s = 0, q = 0; s < e->nshards; s++)
    for (int64_t k = 0, off = 0; k < set.seqs[s]; k++, q++) {
      e->seq_shard[q] = s;
      e->seq_off[q] = off;
      off += e->seq_len[q];
      e->max_T = e->seq_len[q] > e->max_T ? e->seq_len[q] : e->max_T;
    }
done:
  kqsvd_shard_set_free(&set);
  return st;
}

/* The stored ranks, or those of --ranks from the stored spectra
 * (kqsvd_proj_choose_ranks, shared with `kqsvd ranks`).  Every rank
 * computes the same (deterministic, from the same file). */
static kqsvd_status_t choose_ranks(evaluation_t *e) {
  kqsvd_status_t st = KQSVD_OK;
  const size_t n = (size_t)KQSVD_NMETHODS * (size_t)e->dims.layers;
  KQSVD_MALLOC(e->rank_k, n, "ranks");
  KQSVD_MALLOC(e->rank_v, n, "ranks");
  KQSVD_CALL(kqsvd_proj_choose_ranks(e->proj, e->ranks_set ? &e->ranks : NULL, e->rank_k,
                                     e->rank_v, e->policy, sizeof e->policy));
done:
  return st;
}

/* Memory under --mem-limit (shrinking the row blocks when they were not
 * given), and this rank's contiguous share of the units by cost. */
static kqsvd_status_t plan(evaluation_t *e) {
  kqsvd_status_t st = KQSVD_OK;
  const double mib = 1048576.0, d = (double)e->d, hd = (double)(e->dims.heads * e->d);
  const double fixed = 8.0 * ((double)e->dims.hidden * hd + 12.0 * (double)e->dims.kv_heads * d * d +
                              2.0 * (double)e->max_T * d) +
                       64.0 * mib; /* libraries */
  if (e->block_rows > e->max_T) e->block_rows = e->max_T;
  for (;;) {
    const double b = (double)e->block_rows;
    const double raw = (double)e->elem_max * fmax(fmax((double)e->max_T * d, (double)e->group * b * d), hd);
    e->mem_need = fixed + raw + 8.0 * (double)e->group * b * d +
                  kqsvd_eval_ws_bytes((int)e->dims.heads, (int)e->d, (int)e->dims.hidden, e->max_T,
                                      e->block_rows);
    if (e->mem_need <= (double)e->run.mem_mib * mib || e->block_set || e->block_rows <= 16) break;
    e->block_rows /= 2;
  }
  KQSVD_CHECK(e->mem_need <= (double)e->run.mem_mib * mib, KQSVD_ERR_USAGE,
              "--mem-limit %lld MiB is too small: sequences of %lld tokens with --block-rows %lld "
              "need %.0f MiB per rank (%s)",
              (long long)e->run.mem_mib, (long long)e->max_T, (long long)e->block_rows,
              e->mem_need / mib + 1,
              e->block_set ? "lower --block-rows or raise --mem-limit" : "raise --mem-limit");

  double total = 0.0;
  e->nunits = 0;
  for (int64_t q = 0; q < e->nseq; q++)
    for (int64_t k = 0; k < eval_blocks(e, e->seq_len[q]); k++) {
      total += eval_unit_cost(e, e->seq_len[q], k);
      e->nunits++;
    }
  e->layer_cost = total;
  total *= (double)e->dims.layers;
  e->nunits *= e->dims.layers;
  /* A unit goes to the rank whose share of the total cost holds its middle. */
  const int P = e->cli->size, me = e->cli->rank;
  double cum = 0.0;
  int64_t u = 0;
  e->u0 = e->u1 = 0;
  int found = 0;
  for (int64_t l = 0; l < e->dims.layers; l++)
    for (int64_t q = 0; q < e->nseq; q++)
      for (int64_t k = 0; k < eval_blocks(e, e->seq_len[q]); k++, u++) {
        const double c = eval_unit_cost(e, e->seq_len[q], k);
        int p = (int)((cum + 0.5 * c) / total * P);
        p = p >= P ? P - 1 : p;
        cum += c;
        if (p == me && !found) e->u0 = u, found = 1;
        if (p == me) e->u1 = u + 1;
      }
done:
  return st;
}

static void print_table(const evaluation_t *e, const kqsvd_report_t *r) {
  const int L = (int)e->dims.layers;
  int same = 1;
  for (int m = 1; m < KQSVD_NMETHODS; m++)
    for (int l = 0; l < L; l++)
      same &= e->rank_k[m * L + l] == e->rank_k[l] && e->rank_v[m * L + l] == e->rank_v[l];
  char tok[32];
  kqsvd_fmt_count((double)e->tokens, tok, sizeof tok);
  printf("%s: %s tokens in %lld sequence%s, %d layers, ranks %s of d = %lld%s\n", e->dims.model,
         tok, (long long)e->nseq, e->nseq == 1 ? "" : "s", L, e->policy, (long long)e->d,
         e->dims.causal ? ", causal" : "");
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
      snprintf(ranks, sizeof ranks, "%6d %6d", e->rank_k[l], e->rank_v[l]);
      printf("%5d %*s", l, w, ranks);
    } else {
      snprintf(ranks, sizeof ranks, "%d/%d %d/%d %d/%d", e->rank_k[l], e->rank_v[l],
               e->rank_k[L + l], e->rank_v[L + l], e->rank_k[2 * L + l], e->rank_v[2 * L + l]);
      printf("%5d %*s", l, w, ranks);
    }
    for (int k = KQSVD_ERR_KQ; k <= KQSVD_ERR_OUT; k++) {
      printf("  ");
      for (int m = 0; m < KQSVD_NMETHODS; m++) {
        const double v = l == L ? kqsvd_report_mean(r, m, k)
                                : e->err[((size_t)m * L + l) * KQSVD_NMETRICS + k];
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

kqsvd_status_t kqsvd_cmd_evaluate(kqsvd_cli_t *cli, int argc, char **argv) {
  kqsvd_status_t st = KQSVD_OK, local = KQSVD_OK;
  evaluation_t e;
  const double t0 = kqsvd_now();
  memset(&e, 0, sizeof e);
  e.cli = cli;
  st = parse(&e, argc, argv);
  if (st == KQSVD_ERR_USAGE) kqsvd_usage_error(cli, "evaluate", st);
  KQSVD_CALL(kqsvd_mpi_agree(cli->comm, st));
  if (e.help) return KQSVD_OK;
  kqsvd_blas_set_threads((int)e.run.threads);

  KQSVD_CALL(validate_inputs(&e));
  /* Decided alike on every rank, from the same files. */
  st = choose_ranks(&e);
  if (st == KQSVD_OK) st = plan(&e);
  if (st == KQSVD_ERR_USAGE) {
    kqsvd_usage_error(cli, "evaluate", st);
    goto done;
  }
  KQSVD_CALL(kqsvd_mpi_agree(cli->comm, st));
  if (cli->rank == 0 && e.run.progress != KQSVD_PROGRESS_OFF) {
    char tok[32];
    kqsvd_fmt_count((double)e.tokens, tok, sizeof tok);
    fprintf(stderr,
            "kqsvd evaluate: %d shard%s, %s tokens in %lld sequence%s (longest %lld); %lld "
            "layers x %lld heads; %lld units of %lld query rows on %d rank%s, %.0f MiB each\n",
            e.nshards, e.nshards == 1 ? "" : "s", tok, (long long)e.nseq, e.nseq == 1 ? "" : "s",
            (long long)e.max_T,
            (long long)e.dims.layers, (long long)e.dims.heads, (long long)e.nunits,
            (long long)e.block_rows, cli->size, cli->size == 1 ? "" : "s",
            e.mem_need / 1048576.0);
  }
  KQSVD_CALL(eval_run(&e));

  local = KQSVD_OK;
  if (cli->rank == 0) {
    const kqsvd_report_t r = {e.dims.model, e.tokens, e.nseq, (int)e.dims.layers, e.rank_k,
                              e.rank_v, e.err, e.proj_path, e.policy, kqsvd_proj_beta(e.proj),
                              (int)e.dims.causal, kqsvd_proj_tokens(e.proj)};
    /* The table first: a report that cannot be written loses nothing else. */
    print_table(&e, &r);
    fflush(stdout);
    if (e.json_path) local = kqsvd_report_write(e.json_path, &r);
    if (local == KQSVD_OK && e.json_path) printf("wrote %s; ", e.json_path);
    if (local == KQSVD_OK) printf("evaluated in %.2f s\n", kqsvd_now() - t0);
  }
  KQSVD_CALL(kqsvd_mpi_agree(cli->comm, local));
done:
  kqsvd_model_close(&e.model);
  kqsvd_proj_reader_free(&e.proj);
  free(e.seq_shard);
  free(e.seq_off);
  free(e.seq_len);
  free(e.rank_k);
  free(e.rank_v);
  free(e.err);
  return st;
}
