#define _GNU_SOURCE /* GLOB_ALTDIRFUNC: globs that read folders on a budget */
/* Paths of a manifest line: resolved against the manifest's folder,
 * globs expanded on a budget, files recorded by identity. */
#include <dirent.h>
#include <errno.h>
#include <glob.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "manifest_reader.h"

const char *manifest_first_ctl(const char *s) {
  for (; *s; s++)
    if (manifest_is_ctl((unsigned char)*s)) return s;
  return NULL;
}

/* `s` with control characters escaped, so that a message stays one line. */
const char *manifest_shown(const char *s, char *buf, size_t cap) {
  size_t w = 0;
  for (; *s && w + 5 < cap; s++) {
    const unsigned char c = (unsigned char)*s;
    if (c == '\t')
      w += (size_t)snprintf(buf + w, cap - w, "\\t");
    else if (c == '\n')
      w += (size_t)snprintf(buf + w, cap - w, "\\n");
    else if (manifest_is_ctl(c))
      w += (size_t)snprintf(buf + w, cap - w, "\\x%02x", c);
    else
      buf[w++] = (char)c;
  }
  buf[w] = '\0';
  return buf;
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
kqsvd_status_t manifest_resolve(manifest_reader_t *r, int line, const char *field, const char *tok,
                                int is_glob, char **out) {
  kqsvd_status_t st = KQSVD_OK;
  char real[PATH_MAX], esc[4 * PATH_MAX];
  char *joined = malloc(strlen(r->dir) + strlen(tok) + 2);
  *out = NULL;
  KQSVD_CHECK(joined, KQSVD_ERR_NOMEM, "cannot allocate the manifest");
  if (tok[0] == '/')
    strcpy(joined, tok);
  else
    sprintf(joined, "%s/%s", r->dir, tok);
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
    BAD(r, line, "%s %s: folder %s: %s", field, tok, manifest_shown(folder, esc, sizeof esc),
        strerror(err));
  }
  *out = malloc(strlen(real) + strlen(split + 1) + 2);
  KQSVD_CHECK(*out, KQSVD_ERR_NOMEM, "cannot allocate the manifest");
  sprintf(*out, "%s/%s", real, split + 1);
  normalise(*out);
  if (manifest_first_ctl(*out))
    BAD(r, line, "%s %s resolves to '%s', which holds a control character", field, tok,
        manifest_shown(*out, esc, sizeof esc));
done:
  free(joined);
  if (st != KQSVD_OK) {
    free(*out);
    *out = NULL;
  }
  return st;
}

kqsvd_status_t manifest_add_ident(manifest_reader_t *r, const struct stat *sb, int entry,
                                  int role) {
  kqsvd_status_t st = KQSVD_OK;
  GROW(r->id, r->nid, r->capid);
  r->id[r->nid++] = (manifest_ident_t){sb->st_dev, sb->st_ino, entry, role};
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
kqsvd_status_t manifest_expand(manifest_reader_t *r, int entry, const char *field,
                               const char *pattern, int role, char ***files, int *n) {
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
    if (manifest_first_ctl(f))
      BAD(r, line, "%s %s matches '%s', whose name holds a control character", field, pattern,
          manifest_shown(f, esc, sizeof esc));
    if (stat(f, &sb) != 0 || !S_ISREG(sb.st_mode))
      BAD(r, line, "%s %s matches %s, which is not a regular file", field, pattern,
          manifest_shown(f, esc2, sizeof esc2));
    KQSVD_CALL(manifest_add_ident(r, &sb, entry, role));
    (*files)[*n] = strdup(f);
    KQSVD_CHECK((*files)[*n], KQSVD_ERR_NOMEM, "cannot allocate the manifest");
    (*n)++;
  }
done:
  globfree(&g);
  return st;
}
