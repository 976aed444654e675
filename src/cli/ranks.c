/* kqsvd ranks: the per-layer ranks a rank policy gives for a projections
 * file (chosen by kqsvd_proj_choose_ranks, as `evaluate --ranks` does). */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kqsvd_cli.h"
#include "kqsvd_mpi.h"
#include "kqsvd_report.h"

typedef struct ranks_cmd {
  const char *proj_path;
  kqsvd_rank_policy_t policy;
  int policy_set, json, help;
} ranks_cmd_t;

static void ranks_help(void) {
  printf(
      "usage: kqsvd ranks --proj PROJ.h5 [--ranks POLICY] [--json]\n"
      "\n"
      "Prints the key and value rank of each layer for the kqsvd, ksvd and eigen\n"
      "projections of PROJ.h5, and the fraction of the full KV cache each method\n"
      "keeps, sum over layers of (rank_k + rank_v) / (2 d L).  Without --ranks: the\n"
      "ranks stored in PROJ.h5 and the policy that chose them.  With --ranks: those\n"
      "POLICY chooses from the stored spectra, exactly as 'kqsvd calibrate --ranks\n"
      "POLICY' and 'kqsvd evaluate --ranks POLICY' do.  Runs without mpirun.\n"
      "\n"
      "  --proj FILE         projections from kqsvd calibrate (required)\n"
      "  --ranks POLICY      ranks to compute [those stored in PROJ.h5]:\n"
      "                        eps:E     the paper's rule with tolerance E\n"
      "                        fixed:R   rank R everywhere, 1 <= R <= d\n"
      "                        budget:F  a fraction F of the full cache, spread over layers\n"
      "                                  by each method's own spectra\n"
      "  --json              print one JSON object instead of the table: proj, policy,\n"
      "                      num_layers, num_kv_heads, head_dim, methods.M.rank_k and\n"
      "                      .rank_v (one entry per layer) and cache_kept.M, for M in\n"
      "                      kqsvd, ksvd, eigen\n"
      "  -v, --verbose       print a trace with errors\n"
      "  -h, --help          this text\n");
}

static kqsvd_status_t parse(kqsvd_cli_t *cli, ranks_cmd_t *r, int argc, char **argv) {
  kqsvd_status_t st = KQSVD_OK;
  enum { O_PROJ = 256, O_RANKS, O_JSON };
  static const struct option longopts[] = {{"proj", required_argument, NULL, O_PROJ},
                                           {"ranks", required_argument, NULL, O_RANKS},
                                           {"json", no_argument, NULL, O_JSON},
                                           {"verbose", no_argument, NULL, 'v'},
                                           {"help", no_argument, NULL, 'h'},
                                           {NULL, 0, NULL, 0}};
  optind = 1;
  for (;;) {
    int o;
    KQSVD_CALL(kqsvd_getopt(argc, argv, ":hv", longopts, &o));
    if (o == -1) break;
    switch (o) {
    case O_PROJ: r->proj_path = optarg; break;
    case O_RANKS:
      KQSVD_CALL(kqsvd_rank_policy_parse("--ranks", optarg, &r->policy));
      r->policy_set = 1;
      break;
    case O_JSON: r->json = 1; break;
    case 'v': cli->verbose = 1; break;
    case 'h':
      if (cli->rank == 0) ranks_help();
      r->help = 1;
      return KQSVD_OK;
    default: KQSVD_FAIL(KQSVD_ERR_BUG, "unhandled option %d", o);
    }
  }
  KQSVD_CHECK(optind == argc, KQSVD_ERR_USAGE, "unexpected argument '%s'%s", argv[optind],
              r->json ? " (--json prints to stdout and takes no file)" : "");
  KQSVD_CHECK(r->proj_path, KQSVD_ERR_USAGE, "--proj is required");
done:
  return st;
}

/* sum_l (rank_k[l] + rank_v[l]) / (2 d L) of one method's [L] ranks. */
static double cache_kept(const int32_t *rk, const int32_t *rv, int L, int64_t d) {
  int64_t sum = 0;
  for (int l = 0; l < L; l++) sum += (int64_t)rk[l] + rv[l];
  return (double)sum / (double)(2 * d * L);
}

static void json_ints(const char *key, const int32_t *v, int L) {
  printf("\"%s\": [", key);
  for (int l = 0; l < L; l++) printf("%s%d", l ? ", " : "", v[l]);
  putchar(']');
}

static void print_json(const ranks_cmd_t *r, const kqsvd_dims_t *dims, const char *policy,
                       const int32_t *rank_k, const int32_t *rank_v) {
  const int L = (int)dims->layers;
  printf("{\"proj\": ");
  kqsvd_json_put_string(stdout, r->proj_path);
  printf(", \"policy\": ");
  kqsvd_json_put_string(stdout, policy);
  printf(", \"num_layers\": %d, \"num_kv_heads\": %lld, \"head_dim\": %lld,\n \"methods\": {", L,
         (long long)dims->kv_heads, (long long)dims->head_dim);
  for (int m = 0; m < KQSVD_NMETHODS; m++) {
    printf("%s\n  \"%s\": {", m ? "," : "", kqsvd_method_name((kqsvd_method_t)m));
    json_ints("rank_k", rank_k + m * L, L);
    printf(", ");
    json_ints("rank_v", rank_v + m * L, L);
    putchar('}');
  }
  printf("},\n \"cache_kept\": {");
  for (int m = 0; m < KQSVD_NMETHODS; m++)
    printf("%s\"%s\": %.17g", m ? ", " : "", kqsvd_method_name((kqsvd_method_t)m),
           cache_kept(rank_k + m * L, rank_v + m * L, L, dims->head_dim));
  printf("}}\n");
}

static void print_table(const ranks_cmd_t *r, const kqsvd_dims_t *dims, const char *policy,
                        const int32_t *rank_k, const int32_t *rank_v) {
  const int L = (int)dims->layers;
  printf("%s: %d layers, %lld KV heads, d = %lld, ranks %s (%s)\n", r->proj_path, L,
         (long long)dims->kv_heads, (long long)dims->head_dim, policy,
         r->policy_set ? "chosen from the stored spectra" : "stored");
  /* Each method's block is 17 wide: a 2-space gap and 15 columns. */
  printf("     ");
  for (int m = 0; m < KQSVD_NMETHODS; m++) {
    const char *name = kqsvd_method_name((kqsvd_method_t)m);
    const int left = (13 - (int)strlen(name)) / 2, right = 13 - (int)strlen(name) - left;
    printf("  %.*s %s %.*s", left, "------", name, right, "------");
  }
  printf("\nlayer");
  for (int m = 0; m < KQSVD_NMETHODS; m++) printf("  rank_k   rank_v");
  printf("\n");
  for (int l = 0; l < L; l++) {
    printf("%5d", l);
    for (int m = 0; m < KQSVD_NMETHODS; m++)
      printf("  %6d   %6d", rank_k[m * L + l], rank_v[m * L + l]);
    printf("\n");
  }
  printf(" kept");
  for (int m = 0; m < KQSVD_NMETHODS; m++)
    printf("  %15.4f", cache_kept(rank_k + m * L, rank_v + m * L, L, dims->head_dim));
  printf("\nkept: the fraction of the full KV cache, sum over layers of rank_k + rank_v\n"
         "over 2 d L\n");
}

/* The ranks of r->policy (or the stored ones) into fresh [KQSVD_NMETHODS][L]
 * arrays. */
static kqsvd_status_t choose(const ranks_cmd_t *r, kqsvd_proj_reader_t *proj, int32_t **rank_k,
                             int32_t **rank_v, char *policy, size_t n) {
  kqsvd_status_t st = KQSVD_OK;
  const size_t count = (size_t)KQSVD_NMETHODS * (size_t)kqsvd_proj_dims(proj)->layers;
  KQSVD_MALLOC(*rank_k, count, "ranks");
  KQSVD_MALLOC(*rank_v, count, "ranks");
  KQSVD_CALL(kqsvd_proj_choose_ranks(proj, r->policy_set ? &r->policy : NULL, *rank_k, *rank_v,
                                     policy, n));
done:
  return st;
}

kqsvd_status_t kqsvd_cmd_ranks(kqsvd_cli_t *cli, int argc, char **argv) {
  kqsvd_status_t st = KQSVD_OK, local = KQSVD_OK;
  ranks_cmd_t r;
  kqsvd_proj_reader_t *proj = NULL;
  int32_t *rank_k = NULL, *rank_v = NULL;
  char policy[96];
  memset(&r, 0, sizeof r);
  st = parse(cli, &r, argc, argv);
  if (st == KQSVD_ERR_USAGE) kqsvd_usage_error(cli, "ranks", st);
  KQSVD_CALL(kqsvd_mpi_agree(cli->comm, st));
  if (r.help) return KQSVD_OK;

  /* Every rank reads the (small) file alike, as evaluate does; rank 0 prints. */
  KQSVD_CALL(kqsvd_mpi_agree(cli->comm, kqsvd_proj_open(r.proj_path, &proj)));
  const kqsvd_dims_t dims = *kqsvd_proj_dims(proj);
  local = choose(&r, proj, &rank_k, &rank_v, policy, sizeof policy);
  if (local == KQSVD_ERR_USAGE) { /* found alike on every rank */
    st = kqsvd_usage_error(cli, "ranks", local);
    goto done;
  }
  KQSVD_CALL(kqsvd_mpi_agree(cli->comm, local));
  local = KQSVD_OK;
  if (cli->rank == 0) {
    if (r.json)
      print_json(&r, &dims, policy, rank_k, rank_v);
    else
      print_table(&r, &dims, policy, rank_k, rank_v);
    if (fflush(stdout) != 0 || ferror(stdout))
      local = kqsvd_error_set(KQSVD_ERR_IO, __FILE__, __LINE__, __func__,
                              "cannot write the ranks of %s to stdout", r.proj_path);
  }
  KQSVD_CALL(kqsvd_mpi_agree(cli->comm, local));
done:
  kqsvd_proj_reader_free(&proj);
  free(rank_k);
  free(rank_v);
  return st;
}
