/* The kqsvd command line: subcommands, option parsing and progress display. */
#ifndef KQSVD_CLI_H
#define KQSVD_CLI_H

#include <mpi.h>
#include <stdint.h>
#include <stdio.h>

#include "kqsvd_error.h"
#include "kqsvd_h5.h"
#include "kqsvd_observer.h"
#include "kqsvd_pipeline.h"
#include "kqsvd_proj.h"
#include "kqsvd_rank.h"

/* What every subcommand gets from main(). */
typedef struct kqsvd_cli {
  MPI_Comm comm;
  int rank, size;
  int verbose; /* set by -v: print error traces */
} kqsvd_cli_t;

/* Option values, parsed strictly: the whole string must be a number in
 * [lo, hi].  KQSVD_ERR_USAGE naming the option otherwise. */
kqsvd_status_t kqsvd_opt_int(const char *opt, const char *s, int64_t lo, int64_t hi, int64_t *v);
kqsvd_status_t kqsvd_opt_double(const char *opt, const char *s, double lo, double hi, int open_lo,
                                int open_hi, double *v);

/* Turns a usage error found identically on every rank into a collective
 * one that rank 0 prints, with a pointer to --help. */
kqsvd_status_t kqsvd_usage_error(kqsvd_cli_t *cli, const char *cmd, kqsvd_status_t st);

/* After a pipeline call: a usage error this rank reports (an impossible
 * plan) gets the pointer to `kqsvd CMD --help` too; anything else is left
 * as it is. */
void kqsvd_usage_hint(const char *cmd);

/* Progress of a long run on rank 0's stderr: a live bar on a terminal,
 * a line every `line_interval` seconds otherwise, or nothing. */
typedef enum kqsvd_progress_mode {
  KQSVD_PROGRESS_AUTO = 0,
  KQSVD_PROGRESS_BAR,
  KQSVD_PROGRESS_LINES,
  KQSVD_PROGRESS_OFF
} kqsvd_progress_mode_t;

typedef struct kqsvd_progress {
  kqsvd_progress_mode_t mode;
  const char *label;
  int64_t tokens;    /* what `total` work units amount to */
  int64_t work_base; /* work already done before this run (resumed) */
  double t0;
} kqsvd_progress_t;

kqsvd_status_t kqsvd_progress_parse(const char *s, kqsvd_progress_mode_t *mode);
/* Resolves AUTO against whether stderr is a terminal. */
void kqsvd_progress_init(kqsvd_progress_t *p, kqsvd_progress_mode_t mode, const char *label,
                         int64_t tokens, int64_t work_base);
/* Seconds between updates that suit the mode. */
double kqsvd_progress_interval(const kqsvd_progress_t *p);
/* A kqsvd_progress_fn: ctx is a kqsvd_progress_t. */
void kqsvd_progress_show(void *ctx, int64_t done, int64_t total, int final);

/* The command line's observer (kqsvd_observer.h) of a pipeline run: notes
 * and warnings to stderr (commentary silenced by --progress off, details
 * shown with -v), results and tables to stdout, the progress bar or lines
 * of `mode`.  The observer is o->obs; o must outlive the run. */
typedef struct kqsvd_cli_observer {
  kqsvd_observer_t obs;
  kqsvd_progress_mode_t mode;
  int verbose;
  kqsvd_progress_t prog;
} kqsvd_cli_observer_t;
void kqsvd_cli_observer_init(kqsvd_cli_observer_t *o, kqsvd_progress_mode_t mode, int verbose);

/* Options shared by the long-running subcommands (codes above any
 * subcommand's own), for their getopt_long tables. */
enum { KQSVD_OPT_MEM = 1000, KQSVD_OPT_THREADS, KQSVD_OPT_PROGRESS };
#define KQSVD_RUN_LONGOPTS                                         \
  {"mem-limit", required_argument, NULL, KQSVD_OPT_MEM},           \
      {"threads", required_argument, NULL, KQSVD_OPT_THREADS},     \
      {"progress", required_argument, NULL, KQSVD_OPT_PROGRESS}, { \
    "verbose", no_argument, NULL, 'v'                              \
  }

/* -h/--help and the end, last in every subcommand's table. */
#define KQSVD_LONGOPTS_END \
  {"help", no_argument, NULL, 'h'}, { NULL, 0, NULL, 0 }

typedef struct kqsvd_run_opts {
  int64_t mem_mib, threads;
  kqsvd_progress_mode_t progress;
} kqsvd_run_opts_t;

/* One subcommand: main() lists these records, kqsvd_command_main() runs
 * one.  The parse is the same for every subcommand: getopt_long over
 * `longopts`; -h/--help, -v and the options of KQSVD_RUN_LONGOPTS are taken
 * by the parse itself, every other option goes to `option`, then the
 * operands, with the checks of the whole, to `operands`.  `state` is `size`
 * zeroed bytes, set by `defaults` first, that the parse fills and `run`
 * reads. */
struct option; /* <getopt.h> */
typedef struct kqsvd_command {
  const char *name;
  const char *about; /* its line in `kqsvd --help` */
  int mpi;           /* 0: runs as one process without MPI (cli->comm is MPI_COMM_NULL) */
  int h5;            /* reads HDF5 files (whose library, initialised, asks MPI_Initialized) */
  /* `kqsvd NAME --help`, in parts: C11 promises string literals of 4095
   * characters only. */
  const char *help[2];
  const char *shortopts; /* NULL: no options, every argument is an operand */
  const struct option *longopts;
  size_t size;
  void (*defaults)(void *state); /* NULL: all zero */
  /* These two fail with KQSVD_ERR_USAGE naming the option or operand. */
  kqsvd_status_t (*option)(void *state, int code, const char *arg);
  kqsvd_status_t (*operands)(void *state, const kqsvd_run_opts_t *opts, int n, char **args);
  kqsvd_status_t (*run)(kqsvd_cli_t *cli, void *state, const kqsvd_run_opts_t *opts);
  /* NULL, or called last with the outcome: after `run`, or after a parse
   * that failed (on every rank, which agreed on it). */
  void (*end)(kqsvd_cli_t *cli, void *state, kqsvd_status_t st);
} kqsvd_command_t;

extern const kqsvd_command_t kqsvd_command_calibrate, kqsvd_command_evaluate,
    kqsvd_command_manifest, kqsvd_command_ranks, kqsvd_command_synth;

/* Runs subcommand `c` on argv (argv[0] its name), or prints its help on
 * rank 0 when `help`; collective over cli->comm.  A usage error of the
 * parse gets the pointer to `kqsvd NAME --help`, and every rank agrees on
 * the parse before `run`.  On failure every rank returns an error; those
 * marked collective let main() finalize, others make it abort.  manifest,
 * ranks and every --help run without MPI: cli->comm is then MPI_COMM_NULL,
 * size 1, and they make no MPI call. */
kqsvd_status_t kqsvd_command_main(kqsvd_cli_t *cli, const kqsvd_command_t *c, int argc, char **argv,
                                  int help);

#endif
