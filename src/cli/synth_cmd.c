/* kqsvd synth: a deterministic synthetic cache set in the contract format.
 * Ranks write shards round-robin; rank 0 also writes the model file. */
#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kqsvd_cli.h"
#include "kqsvd_mpi.h"
#include "kqsvd_pipeline.h"
#include "kqsvd_synth.h"
#include "kqsvd_util.h"
#include "kqsvd_writer.h"

typedef struct {
  const char *out, *name;
  kqsvd_synth_config_t cfg;
  int64_t seqs, shards, causal, skip, seed;
  kqsvd_dtype_t dtype;
  int uneven, force;
} synth_opts_t;

static const char help[] =
    "usage: [mpirun -np N] kqsvd synth --out DIR [OPTIONS]\n"
    "\n"
    "Writes DIR/model.h5 and DIR/shard-NNNN.h5: caches of a synthetic decoder with the\n"
    "structure of real ones (decaying spectrum, outlier channels, RoPE, GQA).  The same\n"
    "options give the same numbers, however many shards or ranks.\n"
    "\n"
    "  --layers L [4]  --heads Hq [8]  --kv-heads Hkv [2]  --head-dim d [64]\n"
    "  --hidden D [Hq*d]  --seqs S [32]  --seq-len T [512]\n"
    "  --min-seq-len M [T/2+1] (lengths vary uniformly in [M, T]; M = T fixes them)\n"
    "  --shards N [4]   --uneven (shard i gets a share proportional to i+1)\n"
    "  --dtype f16|bf16|f32|f64 [bf16]  --beta B [1] (keys x B, queries / B)\n"
    "  --causal 0|1 [1]  --seed N [0]  --model-name NAME  --progress MODE [auto]\n"
    "  --force (replace the set DIR holds: its model.h5 and every shard-NNNN.h5)\n"
    "  --skip-seqs N [0] (start N sequences into the stream: with the same\n"
    "                    options otherwise, a validation set disjoint from the\n"
    "                    calibration set made with --seqs N; the offset follows\n"
    "                    from --seq-len and --min-seq-len, so keep them equal)\n";

enum {
  O_OUT = 256,
  O_LAYERS,
  O_HEADS,
  O_KV,
  O_HD,
  O_HIDDEN,
  O_SEQS,
  O_SEQLEN,
  O_SHARDS,
  O_DTYPE,
  O_BETA,
  O_CAUSAL,
  O_SEED,
  O_UNEVEN,
  O_NAME,
  O_MINLEN,
  O_SKIP,
  O_FORCE
};

static const struct option longopts[] = {{"out", required_argument, NULL, O_OUT},
                                         {"layers", required_argument, NULL, O_LAYERS},
                                         {"heads", required_argument, NULL, O_HEADS},
                                         {"kv-heads", required_argument, NULL, O_KV},
                                         {"head-dim", required_argument, NULL, O_HD},
                                         {"hidden", required_argument, NULL, O_HIDDEN},
                                         {"seqs", required_argument, NULL, O_SEQS},
                                         {"seq-len", required_argument, NULL, O_SEQLEN},
                                         {"shards", required_argument, NULL, O_SHARDS},
                                         {"dtype", required_argument, NULL, O_DTYPE},
                                         {"beta", required_argument, NULL, O_BETA},
                                         {"causal", required_argument, NULL, O_CAUSAL},
                                         {"seed", required_argument, NULL, O_SEED},
                                         {"uneven", no_argument, NULL, O_UNEVEN},
                                         {"model-name", required_argument, NULL, O_NAME},
                                         {"min-seq-len", required_argument, NULL, O_MINLEN},
                                         {"skip-seqs", required_argument, NULL, O_SKIP},
                                         {"progress", required_argument, NULL, KQSVD_OPT_PROGRESS},
                                         {"force", no_argument, NULL, O_FORCE},
                                         KQSVD_LONGOPTS_END};

static void defaults(void *state) {
  synth_opts_t *o = state;
  kqsvd_synth_config_t *c = &o->cfg;
  c->layers = 4, c->heads = 8, c->kv_heads = 2, c->head_dim = 64, c->hidden = 0;
  c->max_seq_len = 512, c->beta = 1.0, c->rope_theta = 10000.0;
  o->seqs = 32, o->shards = 4, o->causal = 1, o->dtype = KQSVD_BF16;
}

static kqsvd_status_t option(void *state, int ch, const char *arg) {
  kqsvd_status_t st = KQSVD_OK;
  synth_opts_t *o = state;
  kqsvd_synth_config_t *c = &o->cfg;
  const int64_t big = INT64_C(1) << 40;
  switch (ch) {
  case O_OUT: o->out = arg; break;
  case O_LAYERS: KQSVD_CALL(kqsvd_opt_int("--layers", arg, 1, 100000, &c->layers)); break;
  case O_HEADS: KQSVD_CALL(kqsvd_opt_int("--heads", arg, 1, 100000, &c->heads)); break;
  case O_KV: KQSVD_CALL(kqsvd_opt_int("--kv-heads", arg, 1, 100000, &c->kv_heads)); break;
  case O_HD: KQSVD_CALL(kqsvd_opt_int("--head-dim", arg, 2, 4096, &c->head_dim)); break;
  case O_HIDDEN: KQSVD_CALL(kqsvd_opt_int("--hidden", arg, 1, 1 << 20, &c->hidden)); break;
  case O_SEQS: KQSVD_CALL(kqsvd_opt_int("--seqs", arg, 1, big, &o->seqs)); break;
  case O_SEQLEN: KQSVD_CALL(kqsvd_opt_int("--seq-len", arg, 1, 1 << 24, &c->max_seq_len)); break;
  case O_SHARDS: KQSVD_CALL(kqsvd_opt_int("--shards", arg, 1, 1000000, &o->shards)); break;
  case O_DTYPE: KQSVD_CALL(kqsvd_dtype_parse(arg, &o->dtype)); break;
  case O_BETA: KQSVD_CALL(kqsvd_opt_double("--beta", arg, 0, 1e30, 1, 0, &c->beta)); break;
  case O_CAUSAL: KQSVD_CALL(kqsvd_opt_int("--causal", arg, 0, 1, &o->causal)); break;
  case O_SEED: KQSVD_CALL(kqsvd_opt_int("--seed", arg, 0, INT64_MAX, &o->seed)); break;
  case O_UNEVEN: o->uneven = 1; break;
  case O_FORCE: o->force = 1; break;
  case O_NAME: o->name = arg; break;
  case O_MINLEN:
    KQSVD_CALL(kqsvd_opt_int("--min-seq-len", arg, 1, 1 << 24, &c->min_seq_len));
    break;
  case O_SKIP: KQSVD_CALL(kqsvd_opt_int("--skip-seqs", arg, 0, big, &o->skip)); break;
  default: KQSVD_FAIL(KQSVD_ERR_BUG, "unhandled option %d", ch);
  }
done:
  return st;
}

static kqsvd_status_t operands(void *state, const kqsvd_run_opts_t *opts, int n, char **args) {
  kqsvd_status_t st = KQSVD_OK;
  synth_opts_t *o = state;
  kqsvd_synth_config_t *c = &o->cfg;
  (void)opts;
  KQSVD_CHECK(n == 0, KQSVD_ERR_USAGE, "unexpected argument '%s'", args[0]);
  KQSVD_CHECK(o->out, KQSVD_ERR_USAGE, "--out is required");
  KQSVD_CHECK(o->shards <= o->seqs, KQSVD_ERR_USAGE,
              "--shards (%lld) must not exceed --seqs (%lld): shards hold whole sequences",
              (long long)o->shards, (long long)o->seqs);
  if (c->hidden == 0) c->hidden = c->heads * c->head_dim;
  if (c->min_seq_len == 0) c->min_seq_len = c->max_seq_len / 2 + 1;
  c->seed = (uint64_t)o->seed;
done:
  return st;
}

/* Whether `name` is a file of a set, model.h5 or shard-NNNN.h5 (1), or
 * the temporary file of one that a crash left, NAME.tmp-... (2); else 0. */
static int of_a_set(const char *name) {
  int n = -1;
  const char *tail = NULL;
  if (strncmp(name, "model.h5", 8) == 0)
    tail = name + 8;
  else if (strncmp(name, "shard-", 6) == 0 && sscanf(name + 6, "%*[0-9].h5%n", &n) == 0 && n > 0)
    tail = name + 6 + n;
  if (!tail) return 0;
  return *tail == '\0' ? 1 : strncmp(tail, ".tmp-", 5) == 0 ? 2 : 0;
}

/* The set --out already holds, checked before any work (rank 0): none, or
 * with --force regular files that a second call (remove_it) deletes with
 * the temporary files of a crashed run, so that no
 * shard of an older set, of another shape perhaps, stays beside the new
 * one.  Without --force an existing set is kept. */
static kqsvd_status_t check_set(const synth_opts_t *o, int remove_it) {
  kqsvd_status_t st = KQSVD_OK;
  DIR *d = opendir(o->out);
  int64_t n = 0, model = 0;
  char path[PATH_MAX];
  if (!d) { /* missing: made by the run (kqsvd_check_folder_output) */
    KQSVD_CHECK(errno == ENOENT, KQSVD_ERR_USAGE, "--out %s: cannot list it: %s", o->out,
                strerror(errno));
    return KQSVD_OK;
  }
  for (struct dirent *e; (e = readdir(d));) {
    const int kind = of_a_set(e->d_name);
    if (!kind) continue;
    struct stat sb;
    KQSVD_CHECK(snprintf(path, sizeof path, "%s/%s", o->out, e->d_name) < (int)sizeof path,
                KQSVD_ERR_USAGE, "--out %s: path too long", o->out);
    KQSVD_CHECK(lstat(path, &sb) == 0 && (S_ISREG(sb.st_mode) || S_ISLNK(sb.st_mode)),
                KQSVD_ERR_USAGE, "--out %s: %s is not a regular file; remove it first", o->out,
                path);
    KQSVD_CHECK(!remove_it || unlink(path) == 0, KQSVD_ERR_IO, "%s: cannot remove it: %s", path,
                strerror(errno));
    model += strcmp(e->d_name, "model.h5") == 0;
    n += kind == 1;
  }
  KQSVD_CHECK(n == 0 || o->force, KQSVD_ERR_USAGE,
              "--out %s already holds a cache set (%s%lld shard file%s); give --force to "
              "replace it",
              o->out, model ? "model.h5 and " : "", (long long)(n - model),
              n - model == 1 ? "" : "s");
done:
  if (d) closedir(d);
  return st;
}

/* First sequence of each shard: even counts, or weights 1, 2, 3, ... */
static void split_sequences(const synth_opts_t *o, int64_t *first) {
  const int64_t N = o->shards, S = o->seqs;
  const int64_t wsum = N * (N + 1) / 2;
  int64_t acc = 0;
  for (int64_t i = 0; i <= N; i++) {
    first[i] = o->uneven ? (int64_t)((double)S * (double)acc / (double)wsum) : S * i / N;
    acc += i + 1;
  }
  /* Every shard keeps at least one sequence. */
  for (int64_t i = 1; i <= N; i++)
    if (first[i] <= first[i - 1]) first[i] = first[i - 1] + 1;
  for (int64_t i = N - 1; i >= 0; i--)
    if (first[i] >= first[i + 1]) first[i] = first[i + 1] - 1;
  first[N] = S;
}

static kqsvd_status_t write_model(const synth_opts_t *o, const kqsvd_synth_t *gen,
                                  const kqsvd_dims_t *dims) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_writer_t *w = NULL;
  double *rows = NULL;
  char path[PATH_MAX];
  const int64_t D = dims->hidden, cols = dims->heads * dims->head_dim, chunk = 256;
  snprintf(path, sizeof path, "%s/model.h5", o->out);
  KQSVD_CALL(kqsvd_model_create(path, dims, o->dtype, &w));
  KQSVD_MALLOC(rows, (size_t)(chunk * cols), "o_proj rows");
  for (int64_t l = 0; l < dims->layers; l++)
    for (int64_t r0 = 0; r0 < D; r0 += chunk) {
      const int64_t n = D - r0 < chunk ? D - r0 : chunk;
      kqsvd_synth_oproj(gen, l, r0, n, rows);
      KQSVD_CALL(kqsvd_model_put_oproj(w, l, r0, n, rows));
    }
  KQSVD_CALL(kqsvd_writer_commit(&w));
done:
  kqsvd_writer_abort(&w);
  free(rows);
  return st;
}

#define SYNTH_BLOCK 2048

/* Writes this rank's shards, layer by layer so each layer's projections
 * are built once. */
static kqsvd_status_t write_shards(kqsvd_cli_t *cli, const synth_opts_t *o,
                                   const kqsvd_synth_t *gen, const kqsvd_dims_t *dims,
                                   const int64_t *lens, const int64_t *first, int64_t base,
                                   int64_t *done_rows, kqsvd_monitor_t *mon) {
  kqsvd_status_t st = KQSVD_OK;
  const int64_t N = o->shards, d = dims->head_dim;
  kqsvd_writer_t **w = NULL;
  kqsvd_synth_layer_t *lay = NULL;
  double *Z = NULL, *out = NULL;
  int64_t *pos = NULL, *start = NULL;
  int stop = 0;
  KQSVD_MALLOC(w, N, "shard writers");
  KQSVD_MALLOC(start, N + 1, "shard offsets");
  for (int64_t s = 0; s < N; s++) w[s] = NULL;
  start[0] = 0;
  for (int64_t s = 0; s < N; s++) {
    start[s + 1] = start[s];
    for (int64_t q = first[s]; q < first[s + 1]; q++) start[s + 1] += lens[q];
  }
  for (int64_t s = cli->rank; s < N; s += cli->size) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/shard-%04lld.h5", o->out, (long long)s);
    KQSVD_CALL(
        kqsvd_cache_create(path, dims, o->dtype, first[s + 1] - first[s], lens + first[s], &w[s]));
  }
  KQSVD_MALLOC(out, (size_t)(SYNTH_BLOCK * d), "synthetic rows");
  KQSVD_MALLOC(pos, SYNTH_BLOCK, "positions");
  for (int64_t l = 0; l < dims->layers && !stop; l++) {
    KQSVD_CALL(kqsvd_synth_layer_init(gen, l, &lay));
    if (!Z) KQSVD_MALLOC(Z, (size_t)(SYNTH_BLOCK * kqsvd_synth_latent_dim(lay)), "latents");
    for (int64_t s = cli->rank; s < N && !stop; s += cli->size) {
      const int64_t T = start[s + 1] - start[s];
      int64_t q = first[s], qpos = 0;
      for (int64_t r0 = 0; r0 < T; r0 += SYNTH_BLOCK) {
        const int64_t n = T - r0 < SYNTH_BLOCK ? T - r0 : SYNTH_BLOCK;
        /* Positions restart at every sequence start. */
        for (int64_t t = 0; t < n; t++) {
          if (qpos == lens[q]) q++, qpos = 0;
          pos[t] = qpos++;
        }
        kqsvd_synth_latent(lay, base + start[s] + r0, n, Z);
        for (int64_t h = 0; h < dims->heads; h++) {
          kqsvd_synth_project(lay, KQSVD_SYNTH_Q, h, Z, n, pos, out);
          KQSVD_CALL(kqsvd_cache_put(w[s], KQSVD_QUERIES, l, h, r0, n, out));
        }
        for (int64_t g = 0; g < dims->kv_heads; g++) {
          kqsvd_synth_project(lay, KQSVD_SYNTH_K, g, Z, n, pos, out);
          KQSVD_CALL(kqsvd_cache_put(w[s], KQSVD_KEYS, l, g, r0, n, out));
          kqsvd_synth_project(lay, KQSVD_SYNTH_V, g, Z, n, pos, out);
          KQSVD_CALL(kqsvd_cache_put(w[s], KQSVD_VALUES, l, g, r0, n, out));
        }
        *done_rows += n;
        KQSVD_CALL(kqsvd_monitor_update(mon, *done_rows, &stop));
      }
    }
    kqsvd_synth_layer_free(&lay);
  }
  if (stop) st = KQSVD_ERR_REMOTE;
  for (int64_t s = cli->rank; s < N && st == KQSVD_OK; s += cli->size)
    KQSVD_CALL(kqsvd_writer_commit(&w[s]));
done:
  for (int64_t s = 0; w && s < N; s++) kqsvd_writer_abort(&w[s]);
  kqsvd_synth_layer_free(&lay);
  free(w);
  free(start);
  free(Z);
  free(out);
  free(pos);
  return st;
}

/* The model's dimensions and name, as the files record them. */
static void set_dims(const synth_opts_t *o, kqsvd_dims_t *dims) {
  memset(dims, 0, sizeof *dims);
  if (o->name)
    snprintf(dims->model, sizeof dims->model, "%s", o->name);
  else
    snprintf(dims->model, sizeof dims->model, "kqsvd-synth(seed=%llu)",
             (unsigned long long)o->cfg.seed);
  dims->layers = o->cfg.layers, dims->heads = o->cfg.heads, dims->kv_heads = o->cfg.kv_heads;
  dims->head_dim = o->cfg.head_dim, dims->hidden = o->cfg.hidden, dims->causal = o->causal;
}

static kqsvd_status_t run(kqsvd_cli_t *cli, void *state, const kqsvd_run_opts_t *opts) {
  kqsvd_status_t st = KQSVD_OK, local = KQSVD_OK;
  const synth_opts_t *o = state;
  kqsvd_synth_t *gen = NULL;
  kqsvd_monitor_t *mon = NULL;
  kqsvd_progress_t prog;
  int64_t *lens = NULL, *first = NULL, done_rows = 0;
  kqsvd_made_dirs_t made = {.n = 0}; /* the folders of --out rank 0 made */
  st = kqsvd_synth_init(&o->cfg, &gen);
  if (st != KQSVD_OK) return kqsvd_usage_error(cli, "synth", st);
  kqsvd_dims_t dims;
  set_dims(o, &dims);

  /* --out before any work, on rank 0: what is wrong with it, exit 2. */
  if (cli->rank == 0) local = kqsvd_check_folder_output("--out", o->out);
  if (cli->rank == 0 && local == KQSVD_OK) local = check_set(o, 0);
  KQSVD_CALL(kqsvd_mpi_agree(cli->comm, local));
  if (cli->rank == 0 && kqsvd_mkdir_made(o->out, &made) != 0)
    local = kqsvd_error_set(KQSVD_ERR_IO, __FILE__, __LINE__, __func__, "cannot create %s: %s",
                            o->out, strerror(errno));
  if (cli->rank == 0 && local == KQSVD_OK && o->force) local = check_set(o, 1);
  KQSVD_CALL(kqsvd_mpi_agree(cli->comm, local));
  /* Skipped sequences only move the start along the token stream, so the
   * set is disjoint from one made without skipping, from the same model. */
  KQSVD_MALLOC(lens, o->skip + o->seqs, "sequence lengths");
  KQSVD_MALLOC(first, o->shards + 1, "shard split");
  kqsvd_synth_seq_lens(gen, o->skip + o->seqs, lens);
  split_sequences(o, first);
  int64_t tokens = 0, base = 0;
  for (int64_t q = 0; q < o->skip; q++) base += lens[q];
  for (int64_t q = 0; q < o->seqs; q++) tokens += lens[o->skip + q];

  kqsvd_progress_init(&prog, opts->progress, "synth", tokens, 0);
  KQSVD_CALL(kqsvd_monitor_init(cli->comm, tokens * o->cfg.layers, kqsvd_progress_show, &prog,
                                kqsvd_progress_interval(&prog), &mon));
  local = write_shards(cli, o, gen, &dims, lens + o->skip, first, base, &done_rows, mon);
  if (local != KQSVD_OK && local != KQSVD_ERR_REMOTE) KQSVD_CALL(kqsvd_monitor_raise(mon));
  KQSVD_CALL(kqsvd_monitor_finish(mon, done_rows, local));
  /* Last, as the exporter does: a set with model.h5 is a whole one. */
  KQSVD_CALL(kqsvd_mpi_agree(cli->comm, cli->rank == 0 ? write_model(o, gen, &dims) : KQSVD_OK));
  if (cli->rank == 0) {
    char tok[32];
    printf("wrote %s/model.h5 and %lld %s shards (%s tokens in %lld sequences, %lld layers, "
           "%lld/%lld heads, d = %lld, beta = %g)\n",
           o->out, (long long)o->shards, kqsvd_dtype_name(o->dtype),
           kqsvd_fmt_count((double)tokens, tok, sizeof tok), (long long)o->seqs,
           (long long)dims.layers, (long long)dims.heads, (long long)dims.kv_heads,
           (long long)dims.head_dim, o->cfg.beta);
  }
done:
  /* A set not written leaves no folder it made; once every rank knows,
   * so that none is writing there still. */
  if (st != KQSVD_OK && (cli->size == 1 || kqsvd_error_is_collective())) kqsvd_rmdir_made(&made);
  kqsvd_monitor_free(&mon);
  kqsvd_synth_free(&gen);
  free(lens);
  free(first);
  return st;
}

const kqsvd_command_t kqsvd_command_synth = {
    .name = "synth",
    .about = "write a synthetic cache set and model file",
    .mpi = 1,
    .h5 = 1,
    .help = {help},
    .shortopts = ":h",
    .longopts = longopts,
    .size = sizeof(synth_opts_t),
    .defaults = defaults,
    .option = option,
    .operands = operands,
    .run = run,
};
