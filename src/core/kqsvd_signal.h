/* Stopping on SIGTERM, SIGINT and SIGUSR1 without leaving anything behind.
 *
 * SLURM sends SIGTERM (or, as the job templates ask, SIGUSR1 through the
 * batch shell and mpirun) before it kills a job at its time limit or on
 * preemption.  While the streaming stage runs, a signal is only recorded,
 * so that every rank stops at a safe point, saves a checkpoint and exits
 * with KQSVD_EXIT_INTERRUPTED.  Anywhere else a signal removes the
 * temporary files registered here and ends the process as the signal
 * would.  None of these functions is collective. */
#ifndef KQSVD_SIGNAL_H
#define KQSVD_SIGNAL_H

#ifdef __cplusplus
extern "C" {
#endif

/* Exit status of a run stopped by a signal at a safe point (EX_TEMPFAIL:
 * the same command, run again, goes on from its checkpoint). */
#define KQSVD_EXIT_INTERRUPTED 75

/* Installs the handlers (once, after MPI_Init, which may install its own). */
void kqsvd_signal_install(void);

/* While `on`, signals are only recorded; a second one still ends the
 * process.  Turning it off leaves a recorded signal pending. */
void kqsvd_signal_defer(int on);

/* The signal recorded while deferred (0: none). */
int kqsvd_signal_pending(void);

/* Names the file being read, for the one line printed if the process
 * crashes (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT: e.g. inside libhdf5 on
 * a damaged file) before it ends as the signal would; the launcher then
 * ends the other ranks.  Not async-signal-safe: main flow only. */
void kqsvd_signal_context(const char *path);

/* Registers a temporary file to remove when a signal ends the process, and
 * forgets it again (after its rename or removal).  Up to 8 at a time;
 * further ones are not tracked.  Not async-signal-safe: call from the main
 * flow only. */
void kqsvd_signal_track(const char *path);
void kqsvd_signal_untrack(const char *path);

#ifdef __cplusplus
}
#endif

#endif
