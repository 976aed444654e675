/* Publishing an output (src/core/kqsvd_util.h): kqsvd_publish_new never
 * replaces a file that appeared at the output while the run worked (issue
 * 61: two runs of one command, the later rename silently replacing the
 * earlier file), kqsvd_publish (--force) does, and so do the writers of
 * evaluate's --json report and calibrate's output; kqsvd_tmp_claim learns of
 * a full disk before HDF5 writes, leaving nothing; kqsvd_missing_top and
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
  char dir[] = "/tmp/kqsvd-publish-XXXXXX", out[256], tmp[300], top[256], deep[300];
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

  /* Folders: only those made go, and only while empty. */
  snprintf(deep, sizeof deep, "%s/a/b/c", dir);
  kqsvd_missing_top(deep, top, sizeof top);
  char want[300];
  snprintf(want, sizeof want, "%s/a", dir);
  CHECK(strcmp(top, want) == 0, "top %s, expected %s", top, want);
  CHECK(kqsvd_mkdir_p(deep) == 0, "mkdir -p %s", deep);
  kqsvd_rmdir_made(deep, top);
  CHECK(access(want, F_OK) != 0, "%s stayed", want);
  kqsvd_missing_top(dir, top, sizeof top);
  CHECK(top[0] == '\0', "%s exists, yet top %s", dir, top);
  kqsvd_rmdir_made(dir, top);
  CHECK(access(out, F_OK) == 0, "a folder that existed was touched");

  remove(out);
  rmdir(dir);
  return check_exit("publish");
}
