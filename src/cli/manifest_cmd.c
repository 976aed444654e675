/* kqsvd manifest: checks a manifest and prints it resolved, one model per
 * line, for scripts (slurm/kqsvd-submit) that must refuse a bad manifest
 * before submitting anything.  It runs as one process without MPI (main()
 * passes cli->comm = MPI_COMM_NULL), so that it works on a login node
 * where MPI cannot start; the reader (io/manifest.c) makes no MPI call. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "kqsvd_cli.h"
#include "kqsvd_manifest.h"
#include "kqsvd_util.h"

/* DIR/NAME.KIND: the paths, each ended by a NUL byte, in the order
 * calibrate --manifest uses.  NUL is the one byte no path can hold, so no
 * file name can shift the list a job script reads back (mapfile -d ''). */
static kqsvd_status_t write_list(const char *dir, const char *name, const char *kind, char **paths,
                                 int n) {
  kqsvd_status_t st = KQSVD_OK;
  char file[PATH_MAX], tmp[PATH_MAX + 32] = "";
  FILE *f = NULL;
  KQSVD_CHECK(snprintf(file, sizeof file, "%s/%s.%s", dir, name, kind) < (int)sizeof file,
              KQSVD_ERR_USAGE, "--lists %s: path too long", dir);
  /* Renamed when complete, and never over a device or FIFO of that name. */
  f = kqsvd_tmp_open(file, tmp, sizeof tmp);
  KQSVD_CHECK(f, KQSVD_ERR_IO, "cannot write %s: %s", file, strerror(errno));
  for (int k = 0; k < n; k++) {
    fputs(paths[k], f);
    fputc('\0', f);
  }
  const int failed = ferror(f);
  const int closed = fclose(f);
  f = NULL;
  KQSVD_CHECK(!failed && closed == 0, KQSVD_ERR_IO, "cannot write %s: %s", file, strerror(errno));
  KQSVD_CALL(kqsvd_publish(tmp, file));
  tmp[0] = '\0';
done:
  if (f) fclose(f);
  if (tmp[0]) remove(tmp);
  return st;
}

typedef struct manifest_cmd {
  const char *path, *lists;
} manifest_cmd_t;

static const char help[] =
    "usage: kqsvd manifest MANIFEST [--lists DIR]\n\n"
    "Checks MANIFEST ('#' comments, paths relative to its folder), whose lines\n"
    "name cache shards or, with hf:, a model to calibrate in situ:\n"
    "  NAME MODEL_H5 OUTPUT_H5 SHARD_GLOB [EPS [VALID_GLOB]]\n"
    "  NAME hf:MODEL OUTPUT_H5 TEXT SEQ_LEN NUM_SEQS [EPS [VALID_TEXT]]\n"
    "and prints one line per model, 8 fields separated by tabs, with absolute,\n"
    "normalised paths:\n"
    "  NAME MODEL_H5 OUTPUT_H5 POLICY SHARDS SHARD_GLOB VALID_GLOB -\n"
    "  NAME hf:MODEL OUTPUT_H5 POLICY NUM_SEQS TEXT VALID_TEXT SEQ_LEN\n"
    "where POLICY and VALID_* are '-' when not given and SHARDS counts the\n"
    "shards.  Every bad line is reported, as MANIFEST:LINE: reason; paths\n"
    "holding control characters (tabs, newlines) are refused, so the fields\n"
    "cannot shift.\n"
    "--lists DIR also writes DIR/NAME.shards and DIR/NAME.valid for each cache\n"
    "line, the matching files in the order calibrate uses, each path followed\n"
    "by a NUL byte (bash: mapfile -d '' files < DIR/NAME.shards).\n";

/* MANIFEST [--lists DIR], in this order: no options otherwise. */
static kqsvd_status_t operands(void *state, const kqsvd_run_opts_t *opts, int n, char **args) {
  kqsvd_status_t st = KQSVD_OK;
  manifest_cmd_t *m = state;
  (void)opts;
  if (n == 3 && strcmp(args[1], "--lists") == 0) {
    m->lists = args[2];
    n = 1;
  }
  KQSVD_CHECK(n == 1, KQSVD_ERR_USAGE, "expected MANIFEST [--lists DIR]");
  m->path = args[0];
done:
  return st;
}

static kqsvd_status_t run(kqsvd_cli_t *cli, void *state, const kqsvd_run_opts_t *opts) {
  kqsvd_status_t st = KQSVD_OK;
  const manifest_cmd_t *c = state;
  const char *lists = c->lists;
  kqsvd_manifest_t m;
  (void)opts;
  memset(&m, 0, sizeof m);
  /* Under a launcher every process reads alone; the first one reports. */
  KQSVD_CALL(kqsvd_manifest_read_report(c->path, cli->rank == 0 ? stderr : NULL, &m));
  /* The lists first: a table on stdout means every list was written. */
  for (int i = 0; lists && cli->rank == 0 && i < m.n; i++) {
    const kqsvd_manifest_entry_t *e = &m.e[i];
    if (e->insitu) continue;
    KQSVD_CALL(write_list(lists, e->name, "shards", e->shards, e->nshards));
    if (e->valid_glob) KQSVD_CALL(write_list(lists, e->name, "valid", e->valid, e->nvalid));
  }
  for (int i = 0; cli->rank == 0 && i < m.n; i++) {
    const kqsvd_manifest_entry_t *e = &m.e[i];
    char policy[64] = "-";
    if (e->has_policy) kqsvd_rank_policy_format(&e->policy, policy, sizeof policy);
    if (e->insitu)
      printf("%s\thf:%s\t%s\t%s\t%lld\t%s\t%s\t%lld\n", e->name, e->model, e->output, policy,
             (long long)e->num_seqs, e->text, e->valid_text ? e->valid_text : "-",
             (long long)e->seq_len);
    else
      printf("%s\t%s\t%s\t%s\t%d\t%s\t%s\t-\n", e->name, e->model, e->output, policy, e->nshards,
             e->shard_glob, e->valid_glob ? e->valid_glob : "-");
  }
done:
  kqsvd_manifest_free(&m);
  return st;
}

const kqsvd_command_t kqsvd_command_manifest = {
    .name = "manifest",
    .about = "check a manifest of models and print it resolved",
    .mpi = 0,
    .h5 = 0,
    .help = {help},
    .size = sizeof(manifest_cmd_t),
    .operands = operands,
    .run = run,
};
