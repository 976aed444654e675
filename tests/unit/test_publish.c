/* Publishing an output (src/core/kqsvd_util.h): kqsvd_publish_new never
 * replaces a file that appeared at the output while the run worked (issue
 * 61: two runs of one command, the later rename silently replacing the
 * earlier file), kqsvd_publish (--force) does, and so do the writers of
 * evaluate's --json report and calibrate's output; kqsvd_tmp_claim learns of
 * a full disk before HDF5 writes, leaving nothing; kqsvd_mkdir_made and
 * kqsvd_rmdir_made take away only the folders a run made. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "kqsvd_error.h"
#include "kqsvd_report.h"
#include "kqsvd_util.h"

static void put(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  CHECK(f, "%s: %s", path, strerror(errno));
  if (f) {
    fputs(text, f);
    fclose(f);
  }
}

/* The file's first line, "" when it cannot be read. */
static const char *text_of(const char *path) {
  static char buf[64];
  FILE *f = fopen(path, "r");
  buf[0] = '\0';
  if (f) {
    if (!fgets(buf, sizeof buf, f)) buf[0] = '\0';
    fclose(f);
  }
  return buf;
}

int main(void) {
  char dir[] = "/tmp/kqsvd-publish-XXXXXX", out[256], tmp[300], deep[300];
  CHECK(mkdtemp(dir) != NULL, "mkdtemp: %s", strerror(errno));
  snprintf(out, sizeof out, "%s/proj.h5", dir);
  snprintf(tmp, sizeof tmp, "%s.tmp-1-0", out);

  /* Nothing there: published, the temporary name gone. */
  put(tmp, "ours");
  CHECK_OK(kqsvd_publish_new(tmp, out));
  CHECK(strcmp(text_of(out), "ours") == 0 && access(tmp, F_OK) != 0, "not published");

  /* A file there now: kept, one message naming it, tmp left to the caller. */
  put(out, "theirs");
  put(tmp, "ours");
  CHECK(kqsvd_publish_new(tmp, out) == KQSVD_ERR_IO, "replaced %s", out);
  CHECK(strstr(kqsvd_error_message(), out) &&
            strstr(kqsvd_error_message(), "appeared while the run"),
        "message '%s'", kqsvd_error_message());
  kqsvd_error_clear();
  CHECK(strcmp(text_of(out), "theirs") == 0, "%s changed", out);
  CHECK(access(tmp, F_OK) == 0, "the temporary file went");

  /* --force: replaced. */
  CHECK_OK(kqsvd_publish(tmp, out));
  CHECK(strcmp(text_of(out), "ours") == 0 && access(tmp, F_OK) != 0, "not replaced");

  /* evaluate --json: the report is published so too, replacing only with
   * force (its --force). */
  kqsvd_report_t rep;
  memset(&rep, 0, sizeof rep);
  rep.model = "m";
  put(out, "theirs");
  CHECK(kqsvd_report_write(out, &rep, 0) == KQSVD_ERR_IO, "report replaced %s", out);
  CHECK(strstr(kqsvd_error_message(), "appeared while the run"), "message '%s'",
        kqsvd_error_message());
  kqsvd_error_clear();
  CHECK(strcmp(text_of(out), "theirs") == 0, "%s changed", out);
  CHECK_OK(kqsvd_report_write(out, &rep, 1));
  CHECK(text_of(out)[0] == '{', "the report is not there: '%s'", text_of(out));

  /* A claim that fits leaves an empty temporary file; one that cannot
   * fit leaves nothing and says so, naming the output. */
  char claimed[300];
  CHECK_OK(kqsvd_tmp_claim(out, claimed, sizeof claimed, 4096));
  struct stat sb;
  CHECK(claimed[0] && stat(claimed, &sb) == 0 && sb.st_size == 0, "claim left %s", claimed);
  remove(claimed);
  CHECK(kqsvd_tmp_claim(out, claimed, sizeof claimed, (int64_t)1 << 60) == KQSVD_ERR_IO,
        "an exabyte fitted");
  CHECK(claimed[0] == '\0' && strstr(kqsvd_error_message(), out), "claim: '%s', message '%s'",
        claimed, kqsvd_error_message());
  kqsvd_error_clear();

  /* Folders: only those this process's mkdir made go, and only while empty. */
  kqsvd_made_dirs_t made;
  char want[300];
  snprintf(deep, sizeof deep, "%s/a/b/c//", dir);
  CHECK(kqsvd_mkdir_made(deep, &made) == 0, "mkdir -p %s", deep);
  snprintf(want, sizeof want, "%s/a/b/c", dir);
  CHECK(made.n == 3 && strcmp(made.path, want) == 0, "made %d in %s", made.n, made.path);
  kqsvd_rmdir_made(&made);
  snprintf(want, sizeof want, "%s/a", dir);
  CHECK(access(want, F_OK) != 0, "%s stayed", want);
  CHECK(kqsvd_mkdir_made(dir, &made) == 0 && made.n == 0, "%s exists, yet made %d", dir, made.n);
  kqsvd_rmdir_made(&made);
  CHECK(access(out, F_OK) == 0, "a folder that existed was touched");
  /* One that was there (another's, or one a ".." leads back to) stays. */
  snprintf(want, sizeof want, "%s/y", dir);
  CHECK(mkdir(want, 0777) == 0, "mkdir %s", want);
  snprintf(deep, sizeof deep, "%s/x/../y", dir);
  CHECK(kqsvd_mkdir_made(deep, &made) == 0 && made.n == 1, "%s: made %d", deep, made.n);
  kqsvd_rmdir_made(&made);
  CHECK(access(want, F_OK) == 0, "%s, there before, was removed", want);
  snprintf(deep, sizeof deep, "%s/x", dir);
  CHECK(access(deep, F_OK) != 0, "%s, made, stayed", deep);
  snprintf(deep, sizeof deep, "%s/y/z", dir);
  CHECK(kqsvd_mkdir_made(deep, &made) == 0 && made.n == 1, "%s: made %d", deep, made.n);
  kqsvd_rmdir_made(&made);
  CHECK(access(deep, F_OK) != 0 && access(want, F_OK) == 0, "%s: the wrong folders went", deep);
  rmdir(want);

  remove(out);
  rmdir(dir);
  return check_exit("publish");
}
