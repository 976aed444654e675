/* kqsvd manifest: checks a manifest and prints it resolved, one model per
 * line, for scripts (slurm/kqsvd-submit) that must refuse a bad manifest
 * before submitting anything. */
#include <stdio.h>
#include <string.h>

#include "kqsvd_cli.h"
#include "kqsvd_manifest.h"
#include "kqsvd_mpi.h"

kqsvd_status_t kqsvd_cmd_manifest(kqsvd_cli_t *cli, int argc, char **argv) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_manifest_t m;
  memset(&m, 0, sizeof m);
  if (argc == 2 && (strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0)) {
    if (cli->rank == 0)
      printf("usage: kqsvd manifest MANIFEST\n\n"
             "Checks MANIFEST (lines 'NAME MODEL_H5 OUTPUT_H5 SHARD_GLOB [EPS [VALID_GLOB]]',\n"
             "'#' comments, paths relative to its folder) and prints one line per model,\n"
             "fields separated by tabs: NAME, MODEL_H5, OUTPUT_H5, the rank policy ('-' for\n"
             "the default), the number of shards, SHARD_GLOB and VALID_GLOB ('-' if none),\n"
             "with absolute paths.  A bad line is reported as MANIFEST:LINE: reason.\n");
    return KQSVD_OK;
  }
  if (argc != 2) {
    KQSVD_CALL(kqsvd_usage_error(
        cli, "manifest",
        kqsvd_error_set(KQSVD_ERR_USAGE, __FILE__, __LINE__, __func__,
                        "expected one argument, the manifest")));
  }
  KQSVD_CALL(kqsvd_mpi_agree(cli->comm, kqsvd_manifest_read(argv[1], &m)));
  for (int i = 0; cli->rank == 0 && i < m.n; i++) {
    const kqsvd_manifest_entry_t *e = &m.e[i];
    char policy[64] = "-";
    if (e->has_policy) kqsvd_rank_policy_format(&e->policy, policy, sizeof policy);
    printf("%s\t%s\t%s\t%s\t%d\t%s\t%s\n", e->name, e->model, e->output, policy, e->nshards,
           e->shard_glob, e->valid_glob ? e->valid_glob : "-");
  }
done:
  kqsvd_manifest_free(&m);
  return st;
}
