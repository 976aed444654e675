/* The one parse of every subcommand, from its record (kqsvd_command_t):
 * getopt_long over the record's options, the options all long-running
 * subcommands share, the operands, then the run. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>

#include "kqsvd_cli.h"
#include "kqsvd_mpi.h"

/* getopt_long, with a message for an unknown option or a missing value:
 * the option's code in *o, -1 at the end. */
static kqsvd_status_t next_option(int argc, char **argv, const kqsvd_command_t *c, int *o) {
  kqsvd_status_t st = KQSVD_OK;
  opterr = 0;
  *o = getopt_long(argc, argv, c->shortopts, c->longopts, NULL);
  if (*o == '?') {
    const char *arg = argv[optind - 1];
    if (optopt) KQSVD_FAIL(KQSVD_ERR_USAGE, "unknown option '-%c'", optopt);
    KQSVD_FAIL(KQSVD_ERR_USAGE, "unknown option '%s'", arg);
  }
  if (*o == ':') KQSVD_FAIL(KQSVD_ERR_USAGE, "option '%s' needs a value", argv[optind - 1]);
done:
  return st;
}

/* Takes option `o` when it is one of KQSVD_RUN_LONGOPTS (*taken = 1); a
 * subcommand whose table lacks one never sees it. */
static kqsvd_status_t run_option(kqsvd_cli_t *cli, int o, const char *arg, kqsvd_run_opts_t *r,
                                 int *taken) {
  kqsvd_status_t st = KQSVD_OK;
  *taken = 1;
  switch (o) {
  case KQSVD_OPT_MEM:
    KQSVD_CALL(kqsvd_opt_int("--mem-limit", arg, 16, INT64_C(1) << 30, &r->mem_mib));
    break;
  case KQSVD_OPT_THREADS: KQSVD_CALL(kqsvd_opt_int("--threads", arg, 1, 1024, &r->threads)); break;
  case KQSVD_OPT_PROGRESS: KQSVD_CALL(kqsvd_progress_parse(arg, &r->progress)); break;
  case 'v': cli->verbose = 1; break;
  default: *taken = 0;
  }
done:
  return st;
}

/* The options in order, then the operands; *help = 1 at -h or --help
 * (spelled within other options: main() takes the plain ones). */
static kqsvd_status_t parse(kqsvd_cli_t *cli, const kqsvd_command_t *c, void *state,
                            kqsvd_run_opts_t *run, int argc, char **argv, int *help) {
  kqsvd_status_t st = KQSVD_OK;
  *run = (kqsvd_run_opts_t){1024, 1, KQSVD_PROGRESS_AUTO};
  if (c->defaults) c->defaults(state);
  optind = 1;
  while (c->shortopts) {
    int o, taken = 0;
    KQSVD_CALL(next_option(argc, argv, c, &o));
    if (o == -1) break;
    if (o == 'h') {
      *help = 1;
      goto done;
    }
    KQSVD_CALL(run_option(cli, o, optarg, run, &taken));
    if (!taken) KQSVD_CALL(c->option(state, o, optarg));
  }
  KQSVD_CALL(c->operands(state, run, argc - optind, argv + optind));
done:
  return st;
}

kqsvd_status_t kqsvd_command_main(kqsvd_cli_t *cli, const kqsvd_command_t *c, int argc, char **argv,
                                  int help) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_run_opts_t run;
  void *state = calloc(1, c->size);
  KQSVD_CHECK(state, KQSVD_ERR_NOMEM, "cannot allocate the options of kqsvd %s", c->name);
  if (!help) {
    /* Options are checked against the file system too, which may look
     * different from another node: agree rather than assume. */
    const kqsvd_status_t parsed = parse(cli, c, state, &run, argc, argv, &help);
    if (parsed == KQSVD_ERR_USAGE) kqsvd_usage_error(cli, c->name, parsed);
    KQSVD_CALL(kqsvd_mpi_agree(cli->comm, parsed));
  }
  if (help) {
    for (size_t i = 0; cli->rank == 0 && i < sizeof c->help / sizeof c->help[0]; i++)
      if (c->help[i]) fputs(c->help[i], stdout);
    goto done;
  }
  KQSVD_CALL(c->run(cli, state, &run));
done:
  if (state && c->end) c->end(cli, state, st);
  free(state);
  return st;
}
