/* One manifest line: its fields, their syntax and the files they name. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "manifest_reader.h"

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

static kqsvd_status_t parse_policy(manifest_reader_t *r, kqsvd_manifest_entry_t *e,
                                   const char *tok) {
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
static kqsvd_status_t check_bytes(manifest_reader_t *r, int line, const char *text, size_t len) {
  kqsvd_status_t st = KQSVD_OK;
  for (size_t k = 0; k < len; k++) {
    const unsigned char c = (unsigned char)text[k];
    if (c == '\0') BAD(r, line, "NUL byte at column %zu: a manifest is text", k + 1);
    if (manifest_is_ctl(c) && c != '\t' && !(c == '\r' && k + 1 == len))
      BAD(r, line,
          "control character 0x%02x at column %zu: fields may not hold control "
          "characters",
          c, k + 1);
  }
done:
  return st;
}

static kqsvd_status_t add_entry(manifest_reader_t *r, int line, const char *name) {
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

/* FIELD `tok`, an input that must exist: resolved into *out and recorded
 * by identity as `role`; a regular file, or with `folder_ok` a folder (a
 * model's). */
static kqsvd_status_t input(manifest_reader_t *r, int entry, const char *field, const char *tok,
                            int role, int folder_ok, char **out) {
  kqsvd_status_t st = KQSVD_OK;
  const int line = r->m->e[entry].line;
  char esc[4 * PATH_MAX];
  struct stat sb;
  KQSVD_CALL(manifest_resolve(r, line, field, tok, 0, out));
  if (stat(*out, &sb) != 0) {
    const int err = errno;
    BAD(r, line, "%s %s: %s", field, manifest_shown(*out, esc, sizeof esc), strerror(err));
  }
  if (!S_ISREG(sb.st_mode) && !(folder_ok && S_ISDIR(sb.st_mode)))
    BAD(r, line, "%s %s is not a regular file%s", field, *out, folder_ok ? " or a folder" : "");
  KQSVD_CALL(manifest_add_ident(r, &sb, entry, role));
done:
  return st;
}

/* SEQ_LEN and NUM_SEQS: whole numbers from 1 to 2^24, so their product
 * (the tokens) cannot overflow anywhere downstream. */
static kqsvd_status_t count(manifest_reader_t *r, int line, const char *field, const char *tok,
                            int64_t *v) {
  kqsvd_status_t st = KQSVD_OK;
  char *end = NULL;
  errno = 0;
  const long long x = strtoll(tok, &end, 10);
  if (end == tok || *end || errno || x < 1 || x > (1 << 24))
    BAD(r, line, "%s '%.32s' must be a whole number from 1 to %d", field, tok, 1 << 24);
  *v = x;
done:
  return st;
}

#define CACHE_FIELDS "NAME MODEL_H5 OUTPUT_H5 SHARD_GLOB [EPS [VALID_GLOB]]"
#define INSITU_FIELDS "NAME hf:MODEL OUTPUT_H5 TEXT SEQ_LEN NUM_SEQS [EPS [VALID_TEXT]]"

/* A line naming cache shards: the model file, the shards, the validation
 * shards. */
static kqsvd_status_t cache_line(manifest_reader_t *r, int entry, char **tok, int n) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_manifest_entry_t *e = &r->m->e[entry];
  if (n < 4 || n > 6) BAD(r, e->line, "%d field%s, expected " CACHE_FIELDS, n, n == 1 ? "" : "s");
  KQSVD_CALL(input(r, entry, "MODEL_H5", tok[1], ROLE_MODEL, 0, &e->model));
  KQSVD_CALL(manifest_resolve(r, e->line, "SHARD_GLOB", tok[3], 1, &e->shard_glob));
  KQSVD_CALL(
      manifest_expand(r, entry, "SHARD_GLOB", e->shard_glob, ROLE_SHARD, &e->shards, &e->nshards));
  if (n > 4) KQSVD_CALL(parse_policy(r, e, tok[4]));
  if (n > 5) {
    KQSVD_CALL(manifest_resolve(r, e->line, "VALID_GLOB", tok[5], 1, &e->valid_glob));
    KQSVD_CALL(
        manifest_expand(r, entry, "VALID_GLOB", e->valid_glob, ROLE_VALID, &e->valid, &e->nvalid));
  }
done:
  return st;
}

/* A line naming a model (in-situ calibration, python -m kqsvd.calibrate_hf):
 * its folder or GGUF file, the calibration text and the windows cut from
 * it, the validation text. */
static kqsvd_status_t insitu_line(manifest_reader_t *r, int entry, char **tok, int n) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_manifest_entry_t *e = &r->m->e[entry];
  e->insitu = 1;
  if (n < 6 || n > 8) BAD(r, e->line, "%d field%s, expected " INSITU_FIELDS, n, n == 1 ? "" : "s");
  if (!tok[1][3]) BAD(r, e->line, "MODEL 'hf:' names no model: hf:FOLDER or hf:FILE.gguf");
  KQSVD_CALL(input(r, entry, "MODEL", tok[1] + 3, ROLE_HF_MODEL, 1, &e->model));
  KQSVD_CALL(input(r, entry, "TEXT", tok[3], ROLE_TEXT, 0, &e->text));
  KQSVD_CALL(count(r, e->line, "SEQ_LEN", tok[4], &e->seq_len));
  KQSVD_CALL(count(r, e->line, "NUM_SEQS", tok[5], &e->num_seqs));
  if (n > 6) KQSVD_CALL(parse_policy(r, e, tok[6]));
  if (n > 7) KQSVD_CALL(input(r, entry, "VALID_TEXT", tok[7], ROLE_VALID_TEXT, 0, &e->valid_text));
done:
  return st;
}

/* One line's own checks; what lines share is checked by duplicates and
 * outputs_vs_inputs.  A MODEL field starting "hf:" makes an in-situ line
 * (./hf:x names a file called hf:x). */
kqsvd_status_t manifest_parse_line(manifest_reader_t *r, int line, char *text, size_t len) {
  kqsvd_status_t st = KQSVD_OK;
  char *tok[8];
  int n = 0, entry = -1;
  struct stat sb;
  KQSVD_CALL(check_bytes(r, line, text, len));
  char *hash = strchr(text, '#');
  if (hash) *hash = '\0';
  for (char *save = NULL, *t = strtok_r(text, " \t\r", &save); t;
       t = strtok_r(NULL, " \t\r", &save)) {
    if (n == 8)
      BAD(r, line, "too many fields: expected %s",
          strncmp(tok[1], "hf:", 3) == 0 ? INSITU_FIELDS : CACHE_FIELDS);
    tok[n++] = t;
  }
  if (n == 0) goto done;
  const int insitu = n > 1 && strncmp(tok[1], "hf:", 3) == 0;
  if (n < 3)
    BAD(r, line, "%d field%s, expected %s", n, n == 1 ? "" : "s",
        insitu ? INSITU_FIELDS : CACHE_FIELDS);
  if (!valid_name(tok[0]))
    BAD(r, line,
        "NAME '%.64s%s' must be 1 to %d letters, digits, '.', '_' or '-', not starting "
        "with '.' or '-'",
        tok[0], strlen(tok[0]) > 64 ? "..." : "", KQSVD_MANIFEST_MAX_NAME);
  KQSVD_CALL(add_entry(r, line, tok[0]));
  entry = r->m->n - 1;
  kqsvd_manifest_entry_t *e = &r->m->e[entry];

  const char *base = strrchr(tok[2], '/');
  base = base ? base + 1 : tok[2];
  if (!*base || strcmp(base, ".") == 0 || strcmp(base, "..") == 0)
    BAD(r, line, "OUTPUT_H5 %s names a folder, not a file", tok[2]);
  KQSVD_CALL(manifest_resolve(r, line, "OUTPUT_H5", tok[2], 0, &e->output));
  if (insitu)
    KQSVD_CALL(insitu_line(r, entry, tok, n));
  else
    KQSVD_CALL(cache_line(r, entry, tok, n));
  /* Last, so that only a line whose inputs are known has its output
   * compared with them. */
  if (stat(e->output, &sb) == 0) {
    if (!S_ISREG(sb.st_mode))
      BAD(r, line, "OUTPUT_H5 %s exists and is not a regular file", e->output);
    KQSVD_CALL(manifest_add_ident(r, &sb, entry, ROLE_OUTPUT));
  }
done:
  if (st == KQSVD_ERR_INPUT && entry >= 0) r->flag[entry] = 1;
  return st;
}
