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
  int policy_set, json;
} ranks_cmd_t;

static const char help[] =
    "usage: kqsvd ranks --proj PROJ.h5 [--ranks POLICY] [--json]\n"
    "\n"
    "Prints the key and value rank of each layer for the kqsvd, ksvd and eigen\n"
    "projections of PROJ.h5, and the fraction of the full KV cache each method\n"
    "keeps, sum over layers of (rank_k + rank_v) / (2 d L).  Without --ranks: the\n"
    "ranks stored in PROJ.h5 and the policy that chose them.  With --ranks: those\n"
    "POLICY chooses from the stored spectra, exactly as 'kqsvd calibrate --ranks\n"
    "POLICY' and 'kqsvd evaluate --ranks POLICY' do.  Where PROJ.h5 stores ranks\n"
    "per KV head (rank_k_heads, rank_v_heads) and --ranks is not given, those are\n"
    "listed too, and kept is the sum over layers and KV heads of (rank_k +\n"
    "rank_v) / (2 d L Hkv).  Runs without mpirun.\n"
    "\n"
    "  --proj FILE         projections from kqsvd calibrate (required)\n"
    "  --ranks POLICY      ranks to compute [those stored in PROJ.h5]:\n"
    "                        eps:E     the paper's rule with tolerance E\n"
    "                        fixed:R   rank R everywhere, 1 <= R <= d\n"
    "                        budget:F  a fraction F of the full cache, spread over layers\n"
    "                                  by each method's own spectra\n"
    "  --json              print one JSON object instead of the table: proj, policy,\n"
    "                      num_layers, num_kv_heads, head_dim, methods.M.rank_k and\n"
    "                      .rank_v (one entry per layer; .rank_k_heads and\n"
    "                      .rank_v_heads, [layer][KV head], where stored) and\n"
    "                      cache_kept.M, for M in kqsvd, ksvd, eigen\n"
    "  -v, --verbose       print a trace with errors\n"
    "  -h, --help          this text\n";

enum { O_PROJ = 256, O_RANKS, O_JSON };

static const struct option longopts[] = {{"proj", required_argument, NULL, O_PROJ},
                                         {"ranks", required_argument, NULL, O_RANKS},
                                         {"json", no_argument, NULL, O_JSON},
                                         {"verbose", no_argument, NULL, 'v'},
                                         KQSVD_LONGOPTS_END};

static kqsvd_status_t option(void *state, int o, const char *arg) {
  kqsvd_status_t st = KQSVD_OK;
  ranks_cmd_t *r = state;
  switch (o) {
  case O_PROJ: r->proj_path = arg; break;
  case O_RANKS:
    KQSVD_CALL(kqsvd_rank_policy_parse("--ranks", arg, &r->policy));
    r->policy_set = 1;
    break;
  case O_JSON: r->json = 1; break;
  default: KQSVD_FAIL(KQSVD_ERR_BUG, "unhandled option %d", o);
  }
done:
  return st;
}

static kqsvd_status_t operands(void *state, const kqsvd_run_opts_t *opts, int n, char **args) {
  kqsvd_status_t st = KQSVD_OK;
  const ranks_cmd_t *r = state;
  (void)opts;
  KQSVD_CHECK(n == 0, KQSVD_ERR_USAGE, "unexpected argument '%s'%s", args[0],
              r->json ? " (--json prints to stdout and takes no file)" : "");
  KQSVD_CHECK(r->proj_path, KQSVD_ERR_USAGE, "--proj is required");
done:
  return st;
}

/* What is printed: the per-layer ranks [KQSVD_NMETHODS][L], and the stored
 * per-head ranks [KQSVD_NMETHODS][L][Hkv] of the methods with has[m]
 * (head_k and head_v NULL when none has them, and under --ranks). */
typedef struct ranks_out {
  int32_t *rank_k, *rank_v, *head_k, *head_v;
  int has[KQSVD_NMETHODS];
  char policy[96];
  int64_t head_groups; /* > 1: the file's dims are the model's group view */
} ranks_out_t;

static int per_head(const ranks_out_t *o, int m) { return o->head_k && o->has[m]; }

/* The fraction of the full cache method m keeps: sum over layers of
 * (rank_k + rank_v) / (2 d L), or with per-head ranks sum over layers and
 * KV heads of (rank_k + rank_v) / (2 d L Hkv). */
static double cache_kept(const ranks_out_t *o, int m, const kqsvd_dims_t *dims) {
  const int64_t L = dims->layers, H = dims->kv_heads, d = dims->head_dim;
  int64_t sum = 0;
  if (per_head(o, m)) {
    const int32_t *k = o->head_k + m * L * H, *v = o->head_v + m * L * H;
    for (int64_t i = 0; i < L * H; i++) sum += (int64_t)k[i] + v[i];
    return (double)sum / (double)(2 * d * L * H);
  }
  const int32_t *k = o->rank_k + m * L, *v = o->rank_v + m * L;
  for (int64_t l = 0; l < L; l++) sum += (int64_t)k[l] + v[l];
  return (double)sum / (double)(2 * d * L);
}

/* "[a, b, ...]" of n ints. */
static void json_list(const int32_t *v, int64_t n) {
  putchar('[');
  for (int64_t k = 0; k < n; k++) printf("%s%d", k ? ", " : "", v[k]);
  putchar(']');
}

/* "key": [[...], ...], L rows of H ints. */
static void json_rows(const char *key, const int32_t *v, int64_t L, int64_t H) {
  printf("\"%s\": [", key);
  for (int64_t l = 0; l < L; l++) {
    printf("%s", l ? ", " : "");
    json_list(v + l * H, H);
  }
  putchar(']');
}

static void print_json(const ranks_cmd_t *r, const kqsvd_dims_t *dims, const ranks_out_t *o) {
  const int L = (int)dims->layers;
  const int64_t H = dims->kv_heads;
  printf("{\"proj\": ");
  kqsvd_json_put_string(stdout, r->proj_path);
  printf(", \"policy\": ");
  kqsvd_json_put_string(stdout, o->policy);
  if (o->head_groups > 1) printf(", \"head_groups\": %lld", (long long)o->head_groups);
  printf(", \"num_layers\": %d, \"num_kv_heads\": %lld, \"head_dim\": %lld,\n \"methods\": {", L,
         (long long)dims->kv_heads, (long long)dims->head_dim);
  for (int m = 0; m < KQSVD_NMETHODS; m++) {
    printf("%s\n  \"%s\": {\"rank_k\": ", m ? "," : "", kqsvd_method_name((kqsvd_method_t)m));
    json_list(o->rank_k + m * L, L);
    printf(", \"rank_v\": ");
    json_list(o->rank_v + m * L, L);
    if (per_head(o, m)) {
      printf(", ");
      json_rows("rank_k_heads", o->head_k + m * L * H, L, H);
      printf(", ");
      json_rows("rank_v_heads", o->head_v + m * L * H, L, H);
    }
    putchar('}');
  }
  printf("},\n \"cache_kept\": {");
  for (int m = 0; m < KQSVD_NMETHODS; m++)
    printf("%s\"%s\": %.17g", m ? ", " : "", kqsvd_method_name((kqsvd_method_t)m),
           cache_kept(o, m, dims));
  printf("}}\n");
}

/* One layer's ranks, "24,31,17" over its KV heads (n of them); returns
 * the characters printed. */
static int put_heads(const int32_t *v, int64_t n) {
  int w = 0;
  for (int64_t k = 0; k < n; k++) w += printf("%s%d", k ? "," : "", v[k]);
  return w;
}

/* The table of a file with per-head ranks: a block per method, a row per
 * layer with every KV head's ranks (the per-layer ones for a method
 * without them). */
static void print_head_table(const kqsvd_dims_t *dims, const ranks_out_t *o) {
  const int64_t L = dims->layers, H = dims->kv_heads;
  /* Wide enough for H ranks of up to d's digits and their commas. */
  int width = (int)snprintf(NULL, 0, "%lld", (long long)dims->head_dim);
  width = (int)H * (width + 1) - 1;
  width = width < 6 ? 6 : width;
  for (int m = 0; m < KQSVD_NMETHODS; m++) {
    const int heads = per_head(o, m);
    printf("%s: %s, kept %.4f\nlayer  %-*s  rank_v\n", kqsvd_method_name((kqsvd_method_t)m),
           heads ? "per KV head" : "per layer", cache_kept(o, m, dims), width, "rank_k");
    for (int64_t l = 0; l < L; l++) {
      printf("%5lld  ", (long long)l);
      const int w =
          heads ? put_heads(o->head_k + (m * L + l) * H, H) : printf("%d", o->rank_k[m * L + l]);
      printf("%*s  ", width - w, "");
      if (heads)
        put_heads(o->head_v + (m * L + l) * H, H);
      else
        printf("%d", o->rank_v[m * L + l]);
      printf("\n");
    }
  }
  printf("kept: the fraction of the full KV cache, sum over layers and KV heads of\n"
         "rank_k + rank_v over 2 d L Hkv\n");
}

static void print_table(const ranks_cmd_t *r, const kqsvd_dims_t *dims, const ranks_out_t *o) {
  const int L = (int)dims->layers;
  const int32_t *rank_k = o->rank_k, *rank_v = o->rank_v;
  printf("%s: %d layers, %lld KV heads, d = %lld, ranks %s (%s%s)\n", r->proj_path, L,
         (long long)dims->kv_heads, (long long)dims->head_dim, o->policy,
         r->policy_set ? "chosen from the stored spectra" : "stored",
         o->head_k ? ", per KV head" : "");
  if (o->head_groups > 1)
    printf("head groups: each of these KV heads is a group of %lld of the model's, one latent "
           "d = %lld wide\n",
           (long long)o->head_groups, (long long)dims->head_dim);
  if (o->head_k) {
    print_head_table(dims, o);
    return;
  }
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
  for (int m = 0; m < KQSVD_NMETHODS; m++) printf("  %15.4f", cache_kept(o, m, dims));
  printf("\nkept: the fraction of the full KV cache, sum over layers of rank_k + rank_v\n"
         "over 2 d L\n");
}

/* The ranks of r->policy, or the stored ones with their per-head ranks,
 * into fresh arrays of *o. */
static kqsvd_status_t choose(const ranks_cmd_t *r, kqsvd_proj_reader_t *proj, ranks_out_t *o) {
  kqsvd_status_t st = KQSVD_OK;
  const size_t count = (size_t)KQSVD_NMETHODS * (size_t)kqsvd_proj_dims(proj)->layers;
  KQSVD_MALLOC(o->rank_k, count, "ranks");
  KQSVD_MALLOC(o->rank_v, count, "ranks");
  KQSVD_CALL(kqsvd_proj_choose_ranks(proj, r->policy_set ? &r->policy : NULL, o->rank_k, o->rank_v,
                                     o->policy, sizeof o->policy));
  if (!r->policy_set)
    KQSVD_CALL(kqsvd_proj_choose_head_ranks(proj, &o->head_k, &o->head_v, o->has));
done:
  return st;
}

static kqsvd_status_t run(kqsvd_cli_t *cli, void *state, const kqsvd_run_opts_t *opts) {
  kqsvd_status_t st = KQSVD_OK, local = KQSVD_OK;
  const ranks_cmd_t *r = state;
  kqsvd_proj_reader_t *proj = NULL;
  ranks_out_t out;
  (void)opts;
  memset(&out, 0, sizeof out);
  /* Every rank reads the (small) file alike, as evaluate does; rank 0 prints. */
  KQSVD_CALL(kqsvd_mpi_agree(cli->comm, kqsvd_proj_open(r->proj_path, &proj)));
  const kqsvd_dims_t dims = *kqsvd_proj_dims(proj);
  local = choose(r, proj, &out);
  out.head_groups = kqsvd_proj_head_groups(proj);
  if (local == KQSVD_ERR_USAGE) { /* found alike on every rank */
    st = kqsvd_usage_error(cli, "ranks", local);
    goto done;
  }
  KQSVD_CALL(kqsvd_mpi_agree(cli->comm, local));
  local = KQSVD_OK;
  if (cli->rank == 0) {
    if (r->json)
      print_json(r, &dims, &out);
    else
      print_table(r, &dims, &out);
    if (fflush(stdout) != 0 || ferror(stdout))
      local = kqsvd_error_set(KQSVD_ERR_IO, __FILE__, __LINE__, __func__,
                              "cannot write the ranks of %s to stdout", r->proj_path);
  }
  KQSVD_CALL(kqsvd_mpi_agree(cli->comm, local));
done:
  kqsvd_proj_reader_free(&proj);
  free(out.rank_k);
  free(out.rank_v);
  free(out.head_k);
  free(out.head_v);
  return st;
}

const kqsvd_command_t kqsvd_command_ranks = {
    .name = "ranks",
    .about = "print the per-layer ranks a rank policy gives for projections",
    .mpi = 0,
    .h5 = 1,
    .help = {help},
    .shortopts = ":hv",
    .longopts = longopts,
    .size = sizeof(ranks_cmd_t),
    .option = option,
    .operands = operands,
    .run = run,
};
