#define _GNU_SOURCE /* GLOB_ALTDIRFUNC: globs that read folders on a budget */
#include "kqsvd_manifest.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Beyond this many, bad lines are only counted: a wrong file given as the
 * manifest would otherwise print one line per line of it. */
enum { MAX_REPORTED = 1000 };

/* The files a line names, by identity: how outputs are told apart from
 * inputs whatever their spelling (links, symlinked folders). */
enum role { ROLE_OUTPUT, ROLE_MODEL, ROLE_SHARD, ROLE_VALID, ROLE_MANIFEST };
static const char *const ROLE_NAME[] = {"already the output", "the MODEL_H5", "a SHARD_GLOB file",
                                        "a VALID_GLOB file", "the manifest itself"};

typedef struct ident {
  dev_t dev;
  ino_t ino;
  int entry; /* -1 for the manifest */
  int role;
} ident_t;

typedef struct bad {
  int line, seq;
  char *why; /* "MANIFEST:LINE: reason" */
} bad_t;

typedef struct reader {
  kqsvd_manifest_t *m;
  char dir[PATH_MAX]; /* the manifest's real folder */
  char *flag;         /* per entry: a reason is already recorded for its line */
  size_t cape, capflag;
  bad_t *bad;
  int nbad, dropped;
  size_t capbad;
  ident_t *id;
  size_t nid, capid;
} reader_t;

/* Room for element `n` of the growing array `arr` of capacity `cap`. */
#define GROW(arr, n, cap)                                                      \
  do {                                                                         \
    if ((size_t)(n) >= (cap)) {                                                \
      const size_t c_ = (cap) ? 2 * (cap) : 16;                                \
      void *g_ = realloc((arr), c_ * sizeof *(arr));                           \
      KQSVD_CHECK(g_, KQSVD_ERR_NOMEM, "cannot allocate the manifest");        \
      (arr) = g_;                                                              \
      (cap) = c_;                                                              \
    }                                                                          \
  } while (0)

static int is_ctl(unsigned char c) { return c < 0x20 || c == 0x7f; }

static const char *first_ctl(const char *s) {
  for (; *s; s++)
    if (is_ctl((unsigned char)*s)) return s;
  return NULL;
}

/* `s` with control characters escaped, so that a message stays one line. */
static const char *shown(const char *s, char *buf, size_t cap) {
  size_t w = 0;
  for (; *s && w + 5 < cap; s++) {
    const unsigned char c = (unsigned char)*s;
    if (c == '\t') w += (size_t)snprintf(buf + w, cap - w, "\\t");
    else if (c == '\n') w += (size_t)snprintf(buf + w, cap - w, "\\n");
    else if (is_ctl(c)) w += (size_t)snprintf(buf + w, cap - w, "\\x%02x", c);
    else buf[w++] = (char)c;
  }
  buf[w] = '\0';
  return buf;
}

/* Records the reason in the reader (the error record holds one message,
 * a manifest may have many bad lines) and returns KQSVD_ERR_INPUT, which
 * the line loop takes as "this line is bad, go on with the next". */
#define BAD(r, line, ...)                                                      \
  do {                                                                         \
    st = note((r), (line), __VA_ARGS__);                                       \
    goto done;                                                                 \
  } while (0)

static kqsvd_status_t note(reader_t *r, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static kqsvd_status_t note(reader_t *r, int line, const char *fmt, ...) {
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
  shown(r->m->path, path, sizeof path);
  const size_t len = strlen(path) + strlen(why) + 16;
  char *text = malloc(len);
  KQSVD_CHECK(text, KQSVD_ERR_NOMEM, "cannot record the manifest's errors");
  snprintf(text, len, "%s:%d: %s", path, line, why);
  r->bad[r->nbad] = (bad_t){line, r->nbad, text};
  r->nbad++;
  st = KQSVD_ERR_INPUT;
done:
  return st;
}

/* Drops "." and empty components of an absolute path and lets ".." take
 * the previous one away, in place (the result is never longer). */
static void normalise(char *p) {
  size_t w = 0;
  const char *in = p;
  while (*in) {
    while (*in == '/') in++;
    const char *c = in;
    while (*in && *in != '/') in++;
    const size_t len = (size_t)(in - c);
    if (len == 0 || (len == 1 && c[0] == '.')) continue;
    if (len == 2 && c[0] == '.' && c[1] == '.') {
      while (w > 0 && p[w - 1] != '/') w--;
      if (w > 0) w--;
      continue;
    }
    p[w++] = '/';
    memmove(p + w, c, len);
    w += len;
  }
  if (w == 0) p[w++] = '/';
  p[w] = '\0';
}

/* FIELD's `tok` as an absolute path: the folders before the last
 * component (in a glob, before the first component holding a wildcard)
 * through realpath, which must find them, so that "link/.." means what the
 * kernel means; the rest normalised lexically. */
static kqsvd_status_t resolve(reader_t *r, int line, const char *field, const char *tok,
                              int is_glob, char **out) {
  kqsvd_status_t st = KQSVD_OK;
  char real[PATH_MAX], esc[4 * PATH_MAX];
  char *joined = malloc(strlen(r->dir) + strlen(tok) + 2);
  *out = NULL;
  KQSVD_CHECK(joined, KQSVD_ERR_NOMEM, "cannot allocate the manifest");
  if (tok[0] == '/') strcpy(joined, tok);
  else sprintf(joined, "%s/%s", r->dir, tok);
  char *split = strrchr(joined, '/');
  /* Only the field's own wildcards: the manifest's folder is taken as is. */
  char *wild = is_glob ? strpbrk(joined + (tok[0] == '/' ? 0 : strlen(r->dir)), "*?[\\") : NULL;
  if (wild) {
    while (*wild != '/') wild--;
    if (wild < split) split = wild;
  }
  *split = '\0';
  const char *folder = split == joined ? "/" : joined;
  if (!realpath(folder, real)) {
    const int err = errno;
    BAD(r, line, "%s %s: folder %s: %s", field, tok, shown(folder, esc, sizeof esc), strerror(err));
  }
  *out = malloc(strlen(real) + strlen(split + 1) + 2);
  KQSVD_CHECK(*out, KQSVD_ERR_NOMEM, "cannot allocate the manifest");
  sprintf(*out, "%s/%s", real, split + 1);
  normalise(*out);
  if (first_ctl(*out))
    BAD(r, line, "%s %s resolves to '%s', which holds a control character", field, tok,
        shown(*out, esc, sizeof esc));
done:
  free(joined);
  if (st != KQSVD_OK) {
    free(*out);
    *out = NULL;
  }
  return st;
}

static kqsvd_status_t add_ident(reader_t *r, const struct stat *sb, int entry, int role) {
  kqsvd_status_t st = KQSVD_OK;
  GROW(r->id, r->nid, r->capid);
  r->id[r->nid++] = (ident_t){sb->st_dev, sb->st_ino, entry, role};
done:
  return st;
}

/* Folder entries one glob may read: a million, thousands of shards in each
 * of hundreds of folders, while "/" and forty levels of "*" (looping
 * through /proc) stop within seconds.  glob's callbacks take no argument,
 * hence a static: manifests are read by one thread. */
enum { GLOB_BUDGET = 1 << 20 };
static long glob_left;

static void *budget_opendir(const char *p) { return glob_left > 0 ? opendir(p) : NULL; }
static void budget_closedir(void *d) { closedir(d); }
static struct dirent *budget_readdir(void *d) { return glob_left-- > 0 ? readdir(d) : NULL; }

/* The files `pattern` matches, sorted, each a regular file with a
 * printable name. */
static kqsvd_status_t expand(reader_t *r, int entry, const char *field, const char *pattern,
                             int role, char ***files, int *n) {
  kqsvd_status_t st = KQSVD_OK;
  const int line = r->m->e[entry].line;
  char esc[4 * PATH_MAX], esc2[4 * PATH_MAX];
  glob_t g;
  memset(&g, 0, sizeof g);
  g.gl_opendir = budget_opendir;
  g.gl_readdir = budget_readdir;
  g.gl_closedir = budget_closedir;
  g.gl_lstat = lstat;
  g.gl_stat = stat;
  glob_left = GLOB_BUDGET;
  const int rc = glob(pattern, GLOB_ALTDIRFUNC, NULL, &g);
  KQSVD_CHECK(rc != GLOB_NOSPACE, KQSVD_ERR_NOMEM, "cannot expand %s", pattern);
  if (glob_left < 0)
    BAD(r, line, "%s %s reads more than %d folder entries: name the files more narrowly", field,
        pattern, GLOB_BUDGET);
  if (rc != 0 || g.gl_pathc == 0) BAD(r, line, "%s %s matches no file", field, pattern);
  if (g.gl_pathc >= INT_MAX) BAD(r, line, "%s %s matches too many files", field, pattern);
  *files = calloc(g.gl_pathc, sizeof **files);
  KQSVD_CHECK(*files, KQSVD_ERR_NOMEM, "cannot allocate the manifest");
  for (size_t k = 0; k < g.gl_pathc; k++) {
    const char *f = g.gl_pathv[k];
    struct stat sb;
    if (first_ctl(f))
      BAD(r, line, "%s %s matches '%s', whose name holds a control character", field, pattern,
          shown(f, esc, sizeof esc));
    if (stat(f, &sb) != 0 || !S_ISREG(sb.st_mode))
      BAD(r, line, "%s %s matches %s, which is not a regular file", field, pattern,
          shown(f, esc2, sizeof esc2));
    KQSVD_CALL(add_ident(r, &sb, entry, role));
    (*files)[*n] = strdup(f);
    KQSVD_CHECK((*files)[*n], KQSVD_ERR_NOMEM, "cannot allocate the manifest");
    (*n)++;
  }
done:
  globfree(&g);
  return st;
}

/* A NAME names files (NAME.calibrate.log, NAME.shards, the checkpoint
 * folder) and is a word in job scripts: no hidden files, no options. */
static int valid_name(const char *s) {
  if (!*s || *s == '.' || *s == '-' || strlen(s) > KQSVD_MANIFEST_MAX_NAME) return 0;
  for (const char *c = s; *c; c++)
    if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
          *c == '.' || *c == '_' || *c == '-'))
      return 0;
  return 1;
}

static kqsvd_status_t parse_policy(reader_t *r, kqsvd_manifest_entry_t *e, const char *tok) {
  kqsvd_status_t st = KQSVD_OK;
  char *end = NULL;
  errno = 0;
  const double v = strtod(tok, &end);
  if (end != tok && *end == '\0' && errno == 0) {
    if (!(v > 0 && v < 1)) BAD(r, e->line, "EPS '%s' must lie in (0, 1)", tok);
    e->policy = (kqsvd_rank_policy_t){KQSVD_RANKS_EPS, v};
  } else if (kqsvd_rank_policy_parse("EPS", tok, &e->policy) != KQSVD_OK) {
    char why[512];
    snprintf(why, sizeof why, "%s", kqsvd_error_message());
    kqsvd_error_clear();
    BAD(r, e->line, "%s", why);
  }
  e->has_policy = 1;
done:
  return st;
}

/* Blanks and tabs separate fields and a CR may end a line (a file saved on
 * Windows); any other control character, a NUL above all, would cut or
 * shift the fields that `kqsvd manifest` hands to the job scripts. */
static kqsvd_status_t check_bytes(reader_t *r, int line, const char *text, size_t len) {
  kqsvd_status_t st = KQSVD_OK;
  for (size_t k = 0; k < len; k++) {
    const unsigned char c = (unsigned char)text[k];
    if (c == '\0') BAD(r, line, "NUL byte at column %zu: a manifest is text", k + 1);
    if (is_ctl(c) && c != '\t' && !(c == '\r' && k + 1 == len))
      BAD(r, line, "control character 0x%02x at column %zu: fields may not hold control "
                   "characters", c, k + 1);
  }
done:
  return st;
}

static kqsvd_status_t add_entry(reader_t *r, int line, const char *name) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_manifest_t *m = r->m;
  GROW(m->e, m->n, r->cape);
  GROW(r->flag, m->n, r->capflag);
  memset(&m->e[m->n], 0, sizeof *m->e);
  m->e[m->n].line = line;
  r->flag[m->n] = 0;
  m->n++;
  m->e[m->n - 1].name = strdup(name);
  KQSVD_CHECK(m->e[m->n - 1].name, KQSVD_ERR_NOMEM, "cannot allocate the manifest");
done:
  return st;
}

/* One line's own checks; what lines share is checked by duplicates and
 * outputs_vs_inputs. */
static kqsvd_status_t parse_line(reader_t *r, int line, char *text, size_t len) {
  kqsvd_status_t st = KQSVD_OK;
  char *tok[6], esc[4 * PATH_MAX];
  int n = 0, entry = -1;
  struct stat sb;
  KQSVD_CALL(check_bytes(r, line, text, len));
  char *hash = strchr(text, '#');
  if (hash) *hash = '\0';
  for (char *save = NULL, *t = strtok_r(text, " \t\r", &save); t;
       t = strtok_r(NULL, " \t\r", &save)) {
    if (n == 6) BAD(r, line, "too many fields: expected NAME MODEL_H5 OUTPUT_H5 SHARD_GLOB "
                             "[EPS [VALID_GLOB]]");
    tok[n++] = t;
  }
  if (n == 0) goto done;
  if (n < 4)
    BAD(r, line, "%d field%s, expected NAME MODEL_H5 OUTPUT_H5 SHARD_GLOB [EPS [VALID_GLOB]]",
        n, n == 1 ? "" : "s");
  if (!valid_name(tok[0]))
    BAD(r, line, "NAME '%.64s%s' must be 1 to %d letters, digits, '.', '_' or '-', not starting "
                 "with '.' or '-'", tok[0], strlen(tok[0]) > 64 ? "..." : "", KQSVD_MANIFEST_MAX_NAME);
  KQSVD_CALL(add_entry(r, line, tok[0]));
  entry = r->m->n - 1;
  kqsvd_manifest_entry_t *e = &r->m->e[entry];

  const char *base = strrchr(tok[2], '/');
  base = base ? base + 1 : tok[2];
  if (!*base || strcmp(base, ".") == 0 || strcmp(base, "..") == 0)
    BAD(r, line, "OUTPUT_H5 %s names a folder, not a file", tok[2]);
  KQSVD_CALL(resolve(r, line, "OUTPUT_H5", tok[2], 0, &e->output));

  KQSVD_CALL(resolve(r, line, "MODEL_H5", tok[1], 0, &e->model));
  if (stat(e->model, &sb) != 0) {
    const int err = errno;
    BAD(r, line, "MODEL_H5 %s: %s", shown(e->model, esc, sizeof esc), strerror(err));
  }
  if (!S_ISREG(sb.st_mode)) BAD(r, line, "MODEL_H5 %s is not a regular file", e->model);
  KQSVD_CALL(add_ident(r, &sb, entry, ROLE_MODEL));

  KQSVD_CALL(resolve(r, line, "SHARD_GLOB", tok[3], 1, &e->shard_glob));
  KQSVD_CALL(expand(r, entry, "SHARD_GLOB", e->shard_glob, ROLE_SHARD, &e->shards, &e->nshards));
  if (n > 4) KQSVD_CALL(parse_policy(r, e, tok[4]));
  if (n > 5) {
    KQSVD_CALL(resolve(r, line, "VALID_GLOB", tok[5], 1, &e->valid_glob));
    KQSVD_CALL(expand(r, entry, "VALID_GLOB", e->valid_glob, ROLE_VALID, &e->valid, &e->nvalid));
  }
  /* Last, so that only a line whose inputs are known has its output
   * compared with them. */
  if (stat(e->output, &sb) == 0) {
    if (!S_ISREG(sb.st_mode)) BAD(r, line, "OUTPUT_H5 %s exists and is not a regular file", e->output);
    KQSVD_CALL(add_ident(r, &sb, entry, ROLE_OUTPUT));
  }
done:
  if (st == KQSVD_ERR_INPUT && entry >= 0) r->flag[entry] = 1;
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
static kqsvd_status_t duplicates(reader_t *r, int outputs) {
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
    if (outputs) st = note(r, line, "OUTPUT_H5 %s is already the output of line %d", k[i].key, other);
    else st = note(r, line, "NAME '%s' is already used on line %d", k[i].key, other);
    if (st != KQSVD_ERR_INPUT) KQSVD_CALL(st);
    st = KQSVD_OK;
  }
done:
  free(k);
  return st;
}

static int by_ident(const void *a, const void *b) {
  const ident_t *x = a, *y = b;
  if (x->dev != y->dev) return x->dev < y->dev ? -1 : 1;
  if (x->ino != y->ino) return x->ino < y->ino ? -1 : 1;
  if (x->entry != y->entry) return x->entry < y->entry ? -1 : 1;
  return (x->role > y->role) - (x->role < y->role);
}

/* An existing output that is the same file as any input of any line, or as
 * an earlier line's output: among the files sorted by identity, a group of
 * one file names every role it has. */
static kqsvd_status_t outputs_vs_inputs(reader_t *r) {
  kqsvd_status_t st = KQSVD_OK;
  const kqsvd_manifest_t *m = r->m;
  if (r->nid > 1) qsort(r->id, r->nid, sizeof *r->id, by_ident);
  for (size_t a = 0, b; a < r->nid; a = b) {
    for (b = a + 1; b < r->nid && r->id[b].dev == r->id[a].dev && r->id[b].ino == r->id[a].ino;)
      b++;
    for (size_t o = a; o < b; o++) {
      const ident_t *out = &r->id[o];
      if (out->role != ROLE_OUTPUT || r->flag[out->entry]) continue;
      for (size_t x = a; x < b; x++) {
        const ident_t *in = &r->id[x];
        /* A later line's output is reported on that line. */
        if (x == o || (in->role == ROLE_OUTPUT && in->entry > out->entry)) continue;
        const kqsvd_manifest_entry_t *e = &m->e[out->entry];
        char who[32] = "";
        if (in->entry == out->entry) snprintf(who, sizeof who, " of this line");
        else if (in->entry >= 0) snprintf(who, sizeof who, " of line %d", m->e[in->entry].line);
        r->flag[out->entry] = 1;
        st = note(r, e->line, "OUTPUT_H5 %s is %s%s", e->output, ROLE_NAME[in->role], who);
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
  const bad_t *x = a, *y = b;
  if (x->line != y->line) return x->line < y->line ? -1 : 1;
  return (x->seq > y->seq) - (x->seq < y->seq);
}

/* Fails with every recorded reason, in line order.  The error record is
 * bounded (src/core/error.c): a list that does not fit goes to `report`
 * first, or only its first line is kept, with a count of the rest. */
static kqsvd_status_t fail_with_all(reader_t *r, FILE *report) {
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
  st = kqsvd_error_set(KQSVD_ERR_INPUT, __FILE__, __LINE__, __func__, "%s: %d bad lines:\n%s",
                       path, total, all);
  if (strlen(kqsvd_error_message()) == (size_t)head + strlen(all)) goto done;
  kqsvd_error_clear();
  if (report) {
    fprintf(report, "%s\n", all);
    fflush(report);
    KQSVD_FAIL(KQSVD_ERR_INPUT, "%s: %d bad lines (listed above)", path, total);
  }
  KQSVD_FAIL(KQSVD_ERR_INPUT, "%s: %d bad lines, the first:\n%s\n... `kqsvd manifest %s` lists "
             "them all", path, total, r->bad[0].why, path);
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
  reader_t r;
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
  if (slash == real) slash[1] = '\0';
  else *slash = '\0';
  snprintf(r.dir, sizeof r.dir, "%s", real);
  KQSVD_CALL(add_ident(&r, &sb, -1, ROLE_MANIFEST));
  KQSVD_MALLOC(buf, KQSVD_MANIFEST_MAX_LINE + 1, "a manifest line");
  long len;
  for (int no = 1; (len = read_line(f, buf, &total)) >= 0; no++) {
    KQSVD_CHECK(total <= KQSVD_MANIFEST_MAX_BYTES, KQSVD_ERR_INPUT,
                "manifest %s: more than the %d bytes a manifest may hold", path,
                KQSVD_MANIFEST_MAX_BYTES);
    if (len > KQSVD_MANIFEST_MAX_LINE) st = note(&r, no, "line longer than %d bytes",
                                                 KQSVD_MANIFEST_MAX_LINE);
    else st = parse_line(&r, no, buf, (size_t)len);
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
    free_list(e->shards, e->nshards);
    free_list(e->valid, e->nvalid);
  }
  free(m->e);
  free(m->path);
  memset(m, 0, sizeof *m);
}
