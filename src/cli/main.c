/* kqsvd: low-rank KV-cache projections by streaming TSQR over MPI.
 * main() is the only place that calls MPI_Abort: subcommands return errors
 * that every rank agreed on, and only an error that some rank could not
 * share (an MPI or HDF5 failure inside a collective) ends in an abort.
 *
 * Only the commands that need MPI start it: help, --version, `manifest` and
 * `ranks` (one process reading small files) run without touching MPI, so
 * that they work on login nodes that forbid it and where Open MPI's runtime
 * cannot start (no mpirun or ssh on PATH). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kqsvd_cli.h"
#include "kqsvd_gpu.h"
#include "kqsvd_h5.h"
#include "kqsvd_signal.h"

/* In the order `kqsvd --help` lists them. */
static const kqsvd_command_t *const g_commands[] = {
    &kqsvd_command_calibrate, &kqsvd_command_evaluate, &kqsvd_command_manifest,
    &kqsvd_command_ranks,     &kqsvd_command_synth,
};
#define NCOMMANDS (sizeof g_commands / sizeof g_commands[0])

static void usage(FILE *out) {
  fprintf(out, "usage: [mpirun -np N] kqsvd COMMAND [OPTIONS]\n\n"
               "Low-rank KV-cache projections (KQ-SVD, K-SVD, Eigen) from calibration caches,\n"
               "streamed once in bounded memory and reduced across MPI ranks by TSQR.\n\n"
               "commands:\n");
  for (size_t i = 0; i < NCOMMANDS; i++)
    fprintf(out, "  %-10s %s\n", g_commands[i]->name, g_commands[i]->about);
  fprintf(out, "\n'kqsvd help COMMAND' (or 'kqsvd COMMAND --help') describes each command;\n"
               "'kqsvd --version' (-V, version) the build and the GPUs it sees.\n"
               "help, --version, manifest and ranks run without MPI.\n"
               "Files follow the kqsvd data contract (docs/formats.md).\n");
}

/* This process's rank as the launcher tells it, without MPI: under
 * `mpirun -np N kqsvd manifest` (or srun) every process runs alone, and
 * only the first prints, as rank 0 did when these commands started MPI. */
static int launcher_rank(void) {
  static const char *const vars[] = {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK",
                                     "SLURM_PROCID"};
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
    const char *v = getenv(vars[i]);
    if (v && *v) return atoi(v);
  }
  return 0;
}

/* -h or --help among a command's arguments (before a "--"): the command
 * prints its help, which needs no MPI.  An option value spelled -h or
 * --help is taken for the request too. */
static int asks_help(int argc, char **argv) {
  for (int i = 2; i < argc && strcmp(argv[i], "--") != 0; i++)
    if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) return 1;
  return 0;
}

static void version(void) {
  printf("kqsvd %s (data contract version 1)\n", KQSVD_VERSION);
  const int ndev = kqsvd_gpu_driver_devices();
  const char *path = kqsvd_gpu_module_path();
  if (access(path, R_OK) != 0) {
    printf("CUDA module: not built (configure with -DKQSVD_CUDA=ON); %d GPU%s visible\n", ndev,
           ndev == 1 ? "" : "s");
    return;
  }
  /* bench/gpu_calibrate.sh reads the GPU count from this line. */
  printf("CUDA module: %s; %d GPU%s visible\n", path, ndev, ndev == 1 ? "" : "s");
  if (ndev == 0) return; /* the module is loaded only when a GPU is there */
  const kqsvd_gpu_api_t *api = NULL;
  if (kqsvd_gpu_open(&api) != KQSVD_OK) {
    printf("  not usable: %s\n", kqsvd_error_message());
    kqsvd_error_clear();
    return;
  }
  printf("  ABI version %u\n", (unsigned)api->abi_version);
  for (int dev = 0; dev < ndev; dev++) {
    char line[256];
    if (api->describe(dev, line, sizeof line) == KQSVD_OK) printf("  %s\n", line);
  }
}

/* Runs a subcommand and turns its status into the exit code, printing the
 * error on the rank that reports it.  With MPI, an error that not every
 * rank knows of (or a fatal one) ends in MPI_Abort. */
static int run_command(kqsvd_cli_t *cli, const kqsvd_command_t *c, int mpi, int argc, char **argv,
                       int help) {
  const char *cmd = c->name;
  const kqsvd_status_t st = kqsvd_command_main(cli, c, argc, argv, help);
  if (st == KQSVD_OK) return 0;
  const kqsvd_status_t why = kqsvd_error_origin();
  const int code = why == KQSVD_ERR_USAGE         ? 2
                   : why == KQSVD_ERR_INTERRUPTED ? KQSVD_EXIT_INTERRUPTED
                                                  : 1;
  /* Without MPI each process is alone: the launcher's rank 0 speaks. */
  const int speak = mpi ? kqsvd_error_report_here() && st != KQSVD_ERR_REMOTE : cli->rank == 0;
  if (speak) {
    if (cli->size > 1 && !kqsvd_error_is_collective())
      fprintf(stderr, "kqsvd %s: error (rank %d): %s\n", cmd, cli->rank, kqsvd_error_message());
    else
      fprintf(stderr, "kqsvd %s: error: %s\n", cmd, kqsvd_error_message());
    if (cli->verbose || getenv("KQSVD_TRACE")) fputs(kqsvd_error_trace_text(), stderr);
  }
  fflush(stderr);
  if (mpi && (!kqsvd_error_is_collective() || kqsvd_error_is_fatal()))
    MPI_Abort(MPI_COMM_WORLD, code);
  return code;
}

int main(int argc, char **argv) {
  /* Until MPI starts (if it does): one process, no communicator. */
  kqsvd_cli_t cli = {MPI_COMM_NULL, launcher_rank(), 1, 0};
  const char *cmd = argc > 1 ? argv[1] : NULL;
  const int quiet = cli.rank != 0;
  if (!cmd || strcmp(cmd, "-h") == 0 || strcmp(cmd, "--help") == 0 ||
      (strcmp(cmd, "help") == 0 && argc != 3)) {
    if (!quiet) usage(cmd ? stdout : stderr);
    return cmd ? 0 : 2;
  }
  if (strcmp(cmd, "--version") == 0 || strcmp(cmd, "-V") == 0 || strcmp(cmd, "version") == 0) {
    if (!quiet) version();
    return 0;
  }
  /* `kqsvd help CMD` is `kqsvd CMD --help`. */
  int help = 0;
  if (strcmp(cmd, "help") == 0) cmd = argv[2], help = 1;
  size_t k = 0;
  while (k < NCOMMANDS && strcmp(cmd, g_commands[k]->name) != 0) k++;
  if (k == NCOMMANDS) {
    if (!quiet) {
      fprintf(stderr, "kqsvd: error: unknown command '%s'\n\n", cmd);
      usage(stderr);
    }
    return 2;
  }
  const kqsvd_command_t *c = g_commands[k];
  if (help || asks_help(argc, argv)) return run_command(&cli, c, 0, argc - 1, argv + 1, 1);
  if (!c->mpi) {
    if (c->h5) kqsvd_h5_init();
    kqsvd_signal_install();
    return run_command(&cli, c, 0, argc - 1, argv + 1, 0);
  }

  if (MPI_Init(&argc, &argv) != MPI_SUCCESS) {
    fprintf(stderr, "kqsvd: error: MPI_Init failed\n");
    return 1;
  }
  cli.comm = MPI_COMM_WORLD;
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(cli.comm, &cli.rank);
  MPI_Comm_size(cli.comm, &cli.size);
  /* After MPI_Init: parallel HDF5 then closes itself inside MPI_Finalize. */
  kqsvd_h5_init();
  kqsvd_signal_install();
  const int code = run_command(&cli, c, 1, argc - 1, argv + 1, 0);
  MPI_Finalize();
  return code;
}
