/* Linked into every executable of a -DKQSVD_SANITIZE=ON build only (see
 * KqsvdSanitize.cmake): a dlclose that keeps the library loaded.
 *
 * Open MPI unloads its components in MPI_Finalize, before LeakSanitizer
 * looks at what is still allocated.  The allocations those components made
 * then point into unmapped code, so LeakSanitizer rereads /proc/self/maps for
 * every such frame (about a second per process) and cannot match them with
 * the library names of tests/lsan.supp.  Keeping every library mapped costs
 * nothing in a short-lived test process.  The executable exports this
 * definition (--export-dynamic-symbol), so it takes precedence over libc's
 * and the sanitizer's for every library. */
int dlclose(void *handle);

int dlclose(void *handle) {
  (void)handle;
  return 0;
}
