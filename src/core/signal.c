#include "kqsvd_signal.h"

#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

enum { NTRACK = 8 };

/* The handler reads these while the main flow may be changing them: a slot
 * is published by setting its flag last and retired by clearing it first. */
static char g_paths[NTRACK][PATH_MAX + 64];
static volatile sig_atomic_t g_used[NTRACK];
static volatile sig_atomic_t g_defer, g_pending;
/* A forked child (kqsvd_h5_isolate) inherits the handler but owns none of
 * the files. */
static pid_t g_owner;

static const int g_signals[] = {SIGTERM, SIGINT, SIGUSR1};
static char g_context[PATH_MAX];
static volatile sig_atomic_t g_have_context;

/* Ends the process as `sig` would, without the temporary files. */
static void remove_and_reraise(int sig) {
  if (getpid() == g_owner)
    for (int k = 0; k < NTRACK; k++)
      if (g_used[k]) unlink(g_paths[k]);
  signal(sig, SIG_DFL);
  raise(sig);
}

static void handler(int sig) {
  if (getpid() == g_owner && g_defer && !g_pending) {
    g_pending = sig;
    return;
  }
  remove_and_reraise(sig);
}

/* Sanitizer builds keep their own, more telling, crash reports. */
#if !defined(__SANITIZE_ADDRESS__)
static const int g_fatal[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};

static void say(const char *s) {
  ssize_t left = (ssize_t)strlen(s);
  while (left > 0) {
    const ssize_t w = write(STDERR_FILENO, s, (size_t)left);
    if (w <= 0) return;
    s += w, left -= w;
  }
}

static void fatal(int sig) {
  if (getpid() == g_owner) {
    say("kqsvd: fatal signal ");
    say(sig == SIGSEGV  ? "SIGSEGV"
        : sig == SIGBUS ? "SIGBUS"
        : sig == SIGFPE ? "SIGFPE"
        : sig == SIGILL ? "SIGILL"
                        : "SIGABRT");
    if (g_have_context) {
      say("; the last file opened or read was ");
      say(g_context);
      say(" (damaged?)");
    }
    say("\n");
  }
  remove_and_reraise(sig);
}
#endif

void kqsvd_signal_install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = handler;
  sigemptyset(&sa.sa_mask);
  /* Reads and MPI polls go on after a recorded signal. */
  sa.sa_flags = SA_RESTART;
  g_owner = getpid();
  for (size_t i = 0; i < sizeof g_signals / sizeof g_signals[0]; i++)
    sigaction(g_signals[i], &sa, NULL);
#if !defined(__SANITIZE_ADDRESS__)
  sa.sa_handler = fatal;
  sa.sa_flags = SA_RESETHAND;
  for (size_t i = 0; i < sizeof g_fatal / sizeof g_fatal[0]; i++) sigaction(g_fatal[i], &sa, NULL);
#endif
}

void kqsvd_signal_context(const char *path) {
  g_have_context = 0;
  snprintf(g_context, sizeof g_context, "%s", path);
  g_have_context = 1;
}

void kqsvd_signal_defer(int on) { g_defer = on; }

int kqsvd_signal_pending(void) { return g_pending; }

void kqsvd_signal_track(const char *path) {
  for (int k = 0; k < NTRACK; k++)
    if (!g_used[k]) {
      snprintf(g_paths[k], sizeof g_paths[k], "%s", path);
      g_used[k] = 1;
      return;
    }
}

void kqsvd_signal_untrack(const char *path) {
  for (int k = 0; k < NTRACK; k++)
    if (g_used[k] && strcmp(g_paths[k], path) == 0) g_used[k] = 0;
}
