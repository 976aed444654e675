#include "kqsvd_manifest.h"

#include <errno.h>
#include <glob.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* "MANIFEST:LINE: reason" */
#define BAD(m, line, ...)                                                           \
  do {                                                                              \
    char why_[3 * PATH_MAX];                                                                \
    snprintf(why_, sizeof why_, __VA_ARGS__);                                       \
    KQSVD_FAIL(KQSVD_ERR_INPUT, "%s:%d: %s", (m)->path, (line), why_);              \
  } while (0)

static char *dup_str(const char *s) {
  char *d = malloc(strlen(s) + 1);
  if (d) strcpy(d, s);
  return d;
}

/* `p` against the manifest's folder unless it is absolute. */
static char *resolve(const char *dir, const char *p) {
  if (p[0] == '/') return dup_str(p);
  char *out = malloc(strlen(dir) + strlen(p) + 2);
  if (out) sprintf(out, "%s/%s", dir, p);
  return out;
}

static int valid_name(const char *s) {
  for (const char *c = s; *c; c++)
    if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
          *c == '.' || *c == '_' || *c == '-'))
      return 0;
  return *s != '\0' && *s != '.';
}

static int same_file(const char *a, const char *b) {
  struct stat x, y;
  return stat(a, &x) == 0 && stat(b, &y) == 0 && x.st_dev == y.st_dev && x.st_ino == y.st_ino;
}

static kqsvd_status_t parse_policy(kqsvd_manifest_t *m, kqsvd_manifest_entry_t *e,
                                   const char *tok) {
  kqsvd_status_t st = KQSVD_OK;
  char *end = NULL;
  errno = 0;
  const double v = strtod(tok, &end);
  if (end != tok && *end == '\0' && errno == 0) {
    if (!(v > 0 && v < 1)) BAD(m, e->line, "EPS '%s' must lie in (0, 1)", tok);
    e->policy = (kqsvd_rank_policy_t){KQSVD_RANKS_EPS, v};
  } else if (kqsvd_rank_policy_parse("EPS", tok, &e->policy) != KQSVD_OK) {
    char why[512];
    snprintf(why, sizeof why, "%s", kqsvd_error_message());
    kqsvd_error_clear();
    BAD(m, e->line, "%s", why);
  }
  e->has_policy = 1;
done:
  return st;
}

static kqsvd_status_t parse_line(kqsvd_manifest_t *m, const char *dir, int line, char *text) {
  kqsvd_status_t st = KQSVD_OK;
  char *tok[8];
  int n = 0;
  char *hash = strchr(text, '#');
  if (hash) *hash = '\0';
  for (char *save = NULL, *t = strtok_r(text, " \t\r\n", &save); t;
       t = strtok_r(NULL, " \t\r\n", &save)) {
    if (n == 6) BAD(m, line, "too many fields: expected NAME MODEL_H5 OUTPUT_H5 SHARD_GLOB "
                             "[EPS [VALID_GLOB]]");
    tok[n++] = t;
  }
  if (n == 0) return KQSVD_OK;
  if (n < 4)
    BAD(m, line, "%d field%s, expected NAME MODEL_H5 OUTPUT_H5 SHARD_GLOB [EPS [VALID_GLOB]]",
        n, n == 1 ? "" : "s");
  if (!valid_name(tok[0]))
    BAD(m, line, "NAME '%s' may hold only letters, digits, '.', '_' and '-' (not first)", tok[0]);
  kqsvd_manifest_entry_t *grown = realloc(m->e, (size_t)(m->n + 1) * sizeof *m->e);
  KQSVD_CHECK(grown, KQSVD_ERR_NOMEM, "cannot grow the manifest");
  m->e = grown;
  kqsvd_manifest_entry_t *e = &m->e[m->n++];
  memset(e, 0, sizeof *e);
  e->line = line;
  e->name = dup_str(tok[0]);
  e->model = resolve(dir, tok[1]);
  e->output = resolve(dir, tok[2]);
  e->shard_glob = resolve(dir, tok[3]);
  e->valid_glob = n > 5 ? resolve(dir, tok[5]) : NULL;
  KQSVD_CHECK(e->name && e->model && e->output && e->shard_glob && (n < 6 || e->valid_glob),
              KQSVD_ERR_NOMEM, "cannot allocate the manifest");
  /* One spelling per output file: its folder's real path and its name. */
  {
    char folder[PATH_MAX], real[PATH_MAX];
    snprintf(folder, sizeof folder, "%s", e->output);
    char *slash = strrchr(folder, '/');
    const char *base = slash + 1;
    if (slash == folder) folder[1] = '\0';
    else *slash = '\0';
    if (!realpath(folder, real)) BAD(m, line, "OUTPUT_H5 %s: folder %s: %s", tok[2], folder, strerror(errno));
    if (!*base) BAD(m, line, "OUTPUT_H5 %s names a folder, not a file", tok[2]);
    char *canon = malloc(strlen(real) + strlen(base) + 2);
    KQSVD_CHECK(canon, KQSVD_ERR_NOMEM, "cannot allocate the manifest");
    sprintf(canon, "%s/%s", strcmp(real, "/") ? real : "", base);
    free(e->output);
    e->output = canon;
  }
  if (same_file(e->output, m->path)) BAD(m, line, "OUTPUT_H5 %s is the manifest itself", tok[2]);
  if (n > 4) KQSVD_CALL(parse_policy(m, e, tok[4]));
  for (int k = 0; k < m->n - 1; k++) {
    if (strcmp(m->e[k].name, e->name) == 0)
      BAD(m, line, "NAME '%s' is already used on line %d", e->name, m->e[k].line);
    if (strcmp(m->e[k].output, e->output) == 0 || same_file(m->e[k].output, e->output))
      BAD(m, line, "OUTPUT_H5 %s is already the output of line %d", tok[2], m->e[k].line);
  }
  struct stat sb;
  if (stat(e->model, &sb) != 0) BAD(m, line, "MODEL_H5 %s: %s", e->model, strerror(errno));
  glob_t g;
  const int rc = glob(e->shard_glob, 0, NULL, &g);
  if (rc != 0) {
    globfree(&g);
    BAD(m, line, "SHARD_GLOB %s matches no file", e->shard_glob);
  }
  e->shards = calloc(g.gl_pathc, sizeof *e->shards);
  for (size_t k = 0; e->shards && k < g.gl_pathc; k++) e->shards[e->nshards++] = dup_str(g.gl_pathv[k]);
  globfree(&g);
  if (e->valid_glob) {
    glob_t v;
    const int vrc = glob(e->valid_glob, 0, NULL, &v);
    globfree(&v);
    if (vrc != 0) BAD(m, line, "VALID_GLOB %s matches no file", e->valid_glob);
  }
  KQSVD_CHECK(e->shards && e->shards[e->nshards - 1], KQSVD_ERR_NOMEM, "cannot allocate the manifest");
  if (same_file(e->output, e->model)) BAD(m, line, "OUTPUT_H5 %s is the model file", tok[2]);
  for (int k = 0; k < e->nshards; k++)
    if (same_file(e->output, e->shards[k])) BAD(m, line, "OUTPUT_H5 %s is one of the shards", tok[2]);
done:
  return st;
}

kqsvd_status_t kqsvd_manifest_read(const char *path, kqsvd_manifest_t *m) {
  kqsvd_status_t st = KQSVD_OK;
  FILE *f = NULL;
  char *line = NULL, real[PATH_MAX];
  size_t cap = 0;
  memset(m, 0, sizeof *m);
  m->path = dup_str(path);
  KQSVD_CHECK(m->path, KQSVD_ERR_NOMEM, "cannot allocate the manifest");
  f = fopen(path, "r");
  KQSVD_CHECK(f && realpath(path, real), KQSVD_ERR_INPUT, "manifest %s: %s", path, strerror(errno));
  char *slash = strrchr(real, '/');
  if (slash == real) slash[1] = '\0';
  else *slash = '\0';
  int no = 0;
  while (getline(&line, &cap, f) >= 0) KQSVD_CALL(parse_line(m, real, ++no, line));
  KQSVD_CHECK(!ferror(f), KQSVD_ERR_INPUT, "manifest %s: read error", path);
  KQSVD_CHECK(m->n > 0, KQSVD_ERR_INPUT, "manifest %s names no model", path);
  /* An output must not be another line's input either. */
  for (int i = 0; i < m->n; i++)
    for (int j = 0; j < m->n; j++) {
      if (i == j) continue;
      if (same_file(m->e[i].output, m->e[j].model))
        BAD(m, m->e[i].line, "OUTPUT_H5 is the model file of line %d", m->e[j].line);
      for (int k = 0; k < m->e[j].nshards; k++)
        if (same_file(m->e[i].output, m->e[j].shards[k]))
          BAD(m, m->e[i].line, "OUTPUT_H5 is a shard of line %d", m->e[j].line);
    }
done:
  free(line);
  if (f) fclose(f);
  if (st != KQSVD_OK) kqsvd_manifest_free(m);
  return st;
}

void kqsvd_manifest_free(kqsvd_manifest_t *m) {
  for (int i = 0; i < m->n; i++) {
    kqsvd_manifest_entry_t *e = &m->e[i];
    free(e->name);
    free(e->model);
    free(e->output);
    free(e->shard_glob);
    free(e->valid_glob);
    for (int k = 0; k < e->nshards; k++) free(e->shards[k]);
    free(e->shards);
  }
  free(m->e);
  free(m->path);
  memset(m, 0, sizeof *m);
}
