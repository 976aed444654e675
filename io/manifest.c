/* The manifest reader: the file, its lines in turn (manifest_line.c) and
 * the checks across lines. */
#include "kqsvd_manifest.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "manifest_reader.h"

/* Beyond this many, bad lines are only counted: a wrong file given as the
 * manifest would otherwise print one line per line of it. */
enum { MAX_REPORTED = 1000 };

static const char *const ROLE_NAME[] = {[ROLE_OUTPUT] = "already the output",
                                        [ROLE_MODEL] = "the MODEL_H5",
                                        [ROLE_SHARD] = "a SHARD_GLOB file",
                                        [ROLE_VALID] = "a VALID_GLOB file",
                                        [ROLE_MANIFEST] = "the manifest itself",
                                        [ROLE_HF_MODEL] = "the MODEL",
                                        [ROLE_TEXT] = "the TEXT",
                                        [ROLE_VALID_TEXT] = "the VALID_TEXT"};

kqsvd_status_t manifest_note(manifest_reader_t *r, int line, const char *fmt, ...) {
  kqsvd_status_t st = KQSVD_OK;
  char why[3 * PATH_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  if (r->nbad == MAX_REPORTED) {
    r->dropped++;
    return KQSVD_ERR_INPUT;
  }
  GROW(r->bad, r->nbad, r->capbad);
  char path[4 * PATH_MAX];
  manifest_shown(r->m->path, path, sizeof path);
  const size_t len = strlen(path) + strlen(why) + 16;
  char *text = malloc(len);
  KQSVD_CHECK(text, KQSVD_ERR_NOMEM, "cannot record the manifest's errors");
  snprintf(text, len, "%s:%d: %s", path, line, why);
  r->bad[r->nbad] = (manifest_bad_t){line, r->nbad, text};
  r->nbad++;
  st = KQSVD_ERR_INPUT;
done:
  return st;
}

typedef struct keyed {
  const char *key;
  int entry;
} keyed_t;

static int by_key(const void *a, const void *b) {
  const keyed_t *x = a, *y = b;
  const int c = strcmp(x->key, y->key);
  return c ? c : (x->entry > y->entry) - (x->entry < y->entry);
}

/* A NAME, or an OUTPUT_H5 spelled the same, on two lines: sorting makes
 * that n log n (thousands of lines are checked in milliseconds). */
static kqsvd_status_t duplicates(manifest_reader_t *r, int outputs) {
  kqsvd_status_t st = KQSVD_OK;
  const kqsvd_manifest_t *m = r->m;
  keyed_t *k = NULL;
  int nk = 0;
  KQSVD_MALLOC(k, m->n, "the manifest's names");
  for (int i = 0; i < m->n; i++) {
    const char *key = outputs ? m->e[i].output : m->e[i].name;
    if (key) k[nk++] = (keyed_t){key, i};
  }
  if (nk > 1) qsort(k, (size_t)nk, sizeof *k, by_key);
  for (int i = 1, first = 0; i < nk; i++) {
    if (strcmp(k[i].key, k[first].key) != 0) {
      first = i;
      continue;
    }
    const int e = k[i].entry, line = m->e[e].line, other = m->e[k[first].entry].line;
    if (r->flag[e]) continue;
    r->flag[e] = 1;
    if (outputs)
      st = manifest_note(r, line, "OUTPUT_H5 %s is already the output of line %d", k[i].key, other);
    else
      st = manifest_note(r, line, "NAME '%s' is already used on line %d", k[i].key, other);
    if (st != KQSVD_ERR_INPUT) KQSVD_CALL(st);
    st = KQSVD_OK;
  }
done:
  free(k);
  return st;
}

static int by_ident(const void *a, const void *b) {
  const manifest_ident_t *x = a, *y = b;
  if (x->dev != y->dev) return x->dev < y->dev ? -1 : 1;
  if (x->ino != y->ino) return x->ino < y->ino ? -1 : 1;
  if (x->entry != y->entry) return x->entry < y->entry ? -1 : 1;
  return (x->role > y->role) - (x->role < y->role);
}

/* An existing output that is the same file as any input of any line, or as
 * an earlier line's output: among the files sorted by identity, a group of
 * one file names every role it has. */
static kqsvd_status_t outputs_vs_inputs(manifest_reader_t *r) {
  kqsvd_status_t st = KQSVD_OK;
  const kqsvd_manifest_t *m = r->m;
  if (r->nid > 1) qsort(r->id, r->nid, sizeof *r->id, by_ident);
  for (size_t a = 0, b; a < r->nid; a = b) {
    for (b = a + 1; b < r->nid && r->id[b].dev == r->id[a].dev && r->id[b].ino == r->id[a].ino;)
      b++;
    for (size_t o = a; o < b; o++) {
      const manifest_ident_t *out = &r->id[o];
      if (out->role != ROLE_OUTPUT || r->flag[out->entry]) continue;
      for (size_t x = a; x < b; x++) {
        const manifest_ident_t *in = &r->id[x];
        /* A later line's output is reported on that line. */
        if (x == o || (in->role == ROLE_OUTPUT && in->entry > out->entry)) continue;
        const kqsvd_manifest_entry_t *e = &m->e[out->entry];
        char who[32] = "";
        if (in->entry == out->entry)
          snprintf(who, sizeof who, " of this line");
        else if (in->entry >= 0)
          snprintf(who, sizeof who, " of line %d", m->e[in->entry].line);
        r->flag[out->entry] = 1;
        st = manifest_note(r, e->line, "OUTPUT_H5 %s is %s%s", e->output, ROLE_NAME[in->role], who);
        if (st != KQSVD_ERR_INPUT) KQSVD_CALL(st);
        st = KQSVD_OK;
        break;
      }
    }
  }
done:
  return st;
}

static int by_line(const void *a, const void *b) {
  const manifest_bad_t *x = a, *y = b;
  if (x->line != y->line) return x->line < y->line ? -1 : 1;
  return (x->seq > y->seq) - (x->seq < y->seq);
}

/* Fails with every recorded reason, in line order.  The error record is
 * bounded (src/core/error.c): a list that does not fit goes to `report`
 * first, or only its first line is kept, with a count of the rest. */
static kqsvd_status_t fail_with_all(manifest_reader_t *r, FILE *report) {
  kqsvd_status_t st = KQSVD_OK;
  const char *path = r->m->path;
  const int total = r->nbad + r->dropped;
  char *all = NULL, more[64] = "";
  qsort(r->bad, (size_t)r->nbad, sizeof *r->bad, by_line);
  if (total == 1) KQSVD_FAIL(KQSVD_ERR_INPUT, "%s", r->bad[0].why);
  if (r->dropped) snprintf(more, sizeof more, "\n... and %d more", r->dropped);
  size_t len = strlen(more) + 1;
  for (int i = 0; i < r->nbad; i++) len += strlen(r->bad[i].why) + 1;
  KQSVD_MALLOC(all, len, "the manifest's errors");
  for (int i = 0, w = 0; i < r->nbad; i++)
    w += sprintf(all + w, "%s%s%s", i ? "\n" : "", r->bad[i].why, i == r->nbad - 1 ? more : "");
  const int head = snprintf(NULL, 0, "%s: %d bad lines:\n", path, total);
  st = kqsvd_error_set(KQSVD_ERR_INPUT, __FILE__, __LINE__, __func__, "%s: %d bad lines:\n%s", path,
                       total, all);
  if (strlen(kqsvd_error_message()) == (size_t)head + strlen(all)) goto done;
  kqsvd_error_clear();
  if (report) {
    fprintf(report, "%s\n", all);
    fflush(report);
    KQSVD_FAIL(KQSVD_ERR_INPUT, "%s: %d bad lines (listed above)", path, total);
  }
  KQSVD_FAIL(KQSVD_ERR_INPUT,
             "%s: %d bad lines, the first:\n%s\n... `kqsvd manifest %s` lists "
             "them all",
             path, total, r->bad[0].why, path);
done:
  free(all);
  return st;
}

/* A FIFO would block the open and a device would never end: only a
 * regular file of a sensible size is read, and what is opened is checked
 * again, the open not waiting for a writer. */
static kqsvd_status_t open_manifest(const char *path, FILE **f, struct stat *sb) {
  kqsvd_status_t st = KQSVD_OK;
  int fd = -1;
  KQSVD_CHECK(stat(path, sb) == 0, KQSVD_ERR_INPUT, "manifest %s: %s", path, strerror(errno));
  KQSVD_CHECK(S_ISREG(sb->st_mode), KQSVD_ERR_INPUT, "manifest %s is not a regular file", path);
  fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  KQSVD_CHECK(fd >= 0, KQSVD_ERR_INPUT, "manifest %s: %s", path, strerror(errno));
  KQSVD_CHECK(fstat(fd, sb) == 0, KQSVD_ERR_IO, "manifest %s: %s", path, strerror(errno));
  KQSVD_CHECK(S_ISREG(sb->st_mode), KQSVD_ERR_INPUT, "manifest %s is not a regular file", path);
  KQSVD_CHECK(sb->st_size <= KQSVD_MANIFEST_MAX_BYTES, KQSVD_ERR_INPUT,
              "manifest %s: %lld bytes, more than the %d a manifest may hold", path,
              (long long)sb->st_size, KQSVD_MANIFEST_MAX_BYTES);
  *f = fdopen(fd, "r");
  KQSVD_CHECK(*f, KQSVD_ERR_IO, "manifest %s: %s", path, strerror(errno));
  fd = -1;
done:
  if (fd >= 0) close(fd);
  return st;
}

/* One line without its newline into buf (KQSVD_MANIFEST_MAX_LINE + 1
 * bytes), NUL bytes included in the length; -1 at the end; a longer line
 * is read to its end and reported as one byte too long.  `total` counts
 * the bytes, for a file that grows while it is read. */
static long read_line(FILE *f, char *buf, size_t *total) {
  long n = 0;
  int c = EOF;
  while ((c = getc(f)) != EOF) {
    ++*total;
    if (c == '\n' || *total > KQSVD_MANIFEST_MAX_BYTES) break;
    if (n < KQSVD_MANIFEST_MAX_LINE) buf[n] = (char)c;
    if (n <= KQSVD_MANIFEST_MAX_LINE) n++;
  }
  if (c == EOF && n == 0) return -1;
  buf[n < KQSVD_MANIFEST_MAX_LINE ? n : KQSVD_MANIFEST_MAX_LINE] = '\0';
  return n;
}

kqsvd_status_t kqsvd_manifest_read_report(const char *path, FILE *report, kqsvd_manifest_t *m) {
  kqsvd_status_t st = KQSVD_OK;
  manifest_reader_t r;
  FILE *f = NULL;
  char *buf = NULL, real[PATH_MAX];
  struct stat sb;
  size_t total = 0;
  memset(&r, 0, sizeof r);
  memset(m, 0, sizeof *m);
  r.m = m;
  m->path = strdup(path);
  KQSVD_CHECK(m->path, KQSVD_ERR_NOMEM, "cannot allocate the manifest");
  KQSVD_CALL(open_manifest(path, &f, &sb));
  KQSVD_CHECK(realpath(path, real), KQSVD_ERR_INPUT, "manifest %s: %s", path, strerror(errno));
  char *slash = strrchr(real, '/');
  if (slash == real)
    slash[1] = '\0';
  else
    *slash = '\0';
  snprintf(r.dir, sizeof r.dir, "%s", real);
  KQSVD_CALL(manifest_add_ident(&r, &sb, -1, ROLE_MANIFEST));
  KQSVD_MALLOC(buf, KQSVD_MANIFEST_MAX_LINE + 1, "a manifest line");
  long len;
  for (int no = 1; (len = read_line(f, buf, &total)) >= 0; no++) {
    KQSVD_CHECK(total <= KQSVD_MANIFEST_MAX_BYTES, KQSVD_ERR_INPUT,
                "manifest %s: more than the %d bytes a manifest may hold", path,
                KQSVD_MANIFEST_MAX_BYTES);
    if (len > KQSVD_MANIFEST_MAX_LINE)
      st = manifest_note(&r, no, "line longer than %d bytes", KQSVD_MANIFEST_MAX_LINE);
    else
      st = manifest_parse_line(&r, no, buf, (size_t)len);
    /* A bad line's reason is in r; the error record only traced its way
     * up.  The next lines are still checked. */
    if (st != KQSVD_ERR_INPUT) KQSVD_CALL(st);
    kqsvd_error_clear();
    st = KQSVD_OK;
  }
  KQSVD_CHECK(!ferror(f), KQSVD_ERR_IO, "manifest %s: read error", path);
  KQSVD_CHECK(m->n > 0 || r.nbad > 0, KQSVD_ERR_INPUT, "manifest %s names no model", path);
  KQSVD_CALL(duplicates(&r, 0));
  KQSVD_CALL(duplicates(&r, 1));
  KQSVD_CALL(outputs_vs_inputs(&r));
  if (r.nbad + r.dropped > 0) KQSVD_CALL(fail_with_all(&r, report));
done:
  for (int i = 0; i < r.nbad; i++) free(r.bad[i].why);
  free(r.bad);
  free(r.flag);
  free(r.id);
  free(buf);
  if (f) fclose(f);
  if (st != KQSVD_OK) kqsvd_manifest_free(m);
  return st;
}

kqsvd_status_t kqsvd_manifest_read(const char *path, kqsvd_manifest_t *m) {
  return kqsvd_manifest_read_report(path, NULL, m);
}

static void free_list(char **list, int n) {
  for (int k = 0; list && k < n; k++) free(list[k]);
  free(list);
}

void kqsvd_manifest_free(kqsvd_manifest_t *m) {
  for (int i = 0; i < m->n; i++) {
    kqsvd_manifest_entry_t *e = &m->e[i];
    free(e->name);
    free(e->model);
    free(e->output);
    free(e->shard_glob);
    free(e->valid_glob);
    free(e->text);
    free(e->valid_text);
    free_list(e->shards, e->nshards);
    free_list(e->valid, e->nvalid);
  }
  free(m->e);
  free(m->path);
  memset(m, 0, sizeof *m);
}
