/* kqsvd: low-rank KV-cache projections by streaming TSQR over MPI.
 * main() is the only place that calls MPI_Abort: subcommands return errors
 * that every rank agreed on, and only an error that some rank could not
 * share (an MPI or HDF5 failure inside a collective) ends in an abort. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kqsvd_cli.h"
#include "kqsvd_h5.h"
#include "kqsvd_gpu.h"
#include "kqsvd_signal.h"

typedef kqsvd_status_t (*command_fn)(kqsvd_cli_t *, int, char **);

static const struct {
  const char *name;
  command_fn fn;
  const char *about;
} g_commands[] = {
    {"calibrate", kqsvd_cmd_calibrate, "compute kqsvd, ksvd and eigen projections from caches"},
    {"evaluate", kqsvd_cmd_evaluate, "measure attention fidelity of projections on validation caches"},
    {"manifest", kqsvd_cmd_manifest, "check a manifest of models and print it resolved"},
    {"ranks", kqsvd_cmd_ranks, "print the per-layer ranks a rank policy gives for projections"},
    {"synth", kqsvd_cmd_synth, "write a synthetic cache set and model file"},
};
#define NCOMMANDS (sizeof g_commands / sizeof g_commands[0])

static void usage(FILE *out) {
  fprintf(out,
          "usage: [mpirun -np N] kqsvd COMMAND [OPTIONS]\n\n"
          "Low-rank KV-cache projections (KQ-SVD, K-SVD, Eigen) from calibration caches,\n"
          "streamed once in bounded memory and reduced across MPI ranks by TSQR.\n\n"
          "commands:\n");
  for (size_t i = 0; i < NCOMMANDS; i++)
    fprintf(out, "  %-10s %s\n", g_commands[i].name, g_commands[i].about);
  fprintf(out, "\n'kqsvd help COMMAND' (or 'kqsvd COMMAND --help') describes each command;\n"
               "'kqsvd --version' (-V, version) the build and the GPUs it sees.\n"
               "Files follow the kqsvd data contract (docs/formats.md).\n");
}

int main(int argc, char **argv) {
  kqsvd_cli_t cli = {MPI_COMM_WORLD, 0, 1, 0};
  kqsvd_status_t st = KQSVD_OK;
  int code = 0;
  if (MPI_Init(&argc, &argv) != MPI_SUCCESS) {
    fprintf(stderr, "kqsvd: error: MPI_Init failed\n");
    return 1;
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(cli.comm, &cli.rank);
  MPI_Comm_size(cli.comm, &cli.size);
  kqsvd_h5_init();
  kqsvd_signal_install();

  const char *cmd = argc > 1 ? argv[1] : NULL;
  command_fn fn = NULL;
  /* `kqsvd help CMD` is `kqsvd CMD --help`. */
  char help_opt[] = "--help";
  char *help_argv[] = {argv[0], argc > 2 ? argv[2] : NULL, help_opt, NULL};
  if (cmd && strcmp(cmd, "help") == 0 && argc == 3) {
    cmd = argv[2];
    argv = help_argv;
  }
  for (size_t i = 0; cmd && i < NCOMMANDS; i++)
    if (strcmp(cmd, g_commands[i].name) == 0) fn = g_commands[i].fn;
  if (!cmd || strcmp(cmd, "-h") == 0 || strcmp(cmd, "--help") == 0 || strcmp(cmd, "help") == 0) {
    if (cli.rank == 0) usage(cmd ? stdout : stderr);
    code = cmd ? 0 : 2;
    goto finalize;
  }
  if (strcmp(cmd, "--version") == 0 || strcmp(cmd, "-V") == 0 || strcmp(cmd, "version") == 0) {
    if (cli.rank == 0) {
      printf("kqsvd %s (data contract version 1)\n", KQSVD_VERSION);
      const int ndev = kqsvd_gpu_driver_devices();
      const kqsvd_gpu_api_t *api = NULL;
      if (access(kqsvd_gpu_module_path(), R_OK) != 0)
        printf("CUDA module: not built (configure with -DKQSVD_CUDA=ON); %d GPU%s visible\n", ndev,
               ndev == 1 ? "" : "s");
      else
        printf("CUDA module: %s; %d GPU%s visible\n", kqsvd_gpu_module_path(), ndev,
               ndev == 1 ? "" : "s");
      for (int dev = 0; dev < ndev && kqsvd_gpu_open(&api) == KQSVD_OK; dev++) {
        char line[256];
        if (api->describe(dev, line, sizeof line) == KQSVD_OK) printf("  %s\n", line);
      }
    }
    goto finalize;
  }
  if (!fn) {
    if (cli.rank == 0) {
      fprintf(stderr, "kqsvd: error: unknown command '%s'\n\n", cmd);
      usage(stderr);
    }
    code = 2;
    goto finalize;
  }

  st = fn(&cli, argc - 1, argv + 1);
  if (st != KQSVD_OK) {
    const kqsvd_status_t why = kqsvd_error_origin();
    code = why == KQSVD_ERR_USAGE ? 2 : why == KQSVD_ERR_INTERRUPTED ? KQSVD_EXIT_INTERRUPTED : 1;
    if (kqsvd_error_report_here() && st != KQSVD_ERR_REMOTE) {
      if (cli.size > 1 && !kqsvd_error_is_collective())
        fprintf(stderr, "kqsvd %s: error (rank %d): %s\n", cmd, cli.rank, kqsvd_error_message());
      else
        fprintf(stderr, "kqsvd %s: error: %s\n", cmd, kqsvd_error_message());
      if (cli.verbose || getenv("KQSVD_TRACE")) fputs(kqsvd_error_trace_text(), stderr);
    }
    fflush(stderr);
    if (!kqsvd_error_is_collective() || kqsvd_error_is_fatal()) MPI_Abort(MPI_COMM_WORLD, code);
  }
finalize:
  MPI_Finalize();
  return code;
}
