/* Internal to the manifest reader (manifest.c: the file and the checks
 * across lines; manifest_line.c: one line's fields; manifest_paths.c:
 * paths, globs and file identities).  Not collective; no MPI call. */
#ifndef KQSVD_MANIFEST_READER_H
#define KQSVD_MANIFEST_READER_H

#include <limits.h>
#include <stddef.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "kqsvd_manifest.h"

/* The files a line names, by identity: how outputs are told apart from
 * inputs whatever their spelling (links, symlinked folders). */
enum manifest_role {
  ROLE_OUTPUT,
  ROLE_MODEL,
  ROLE_SHARD,
  ROLE_VALID,
  ROLE_MANIFEST,
  ROLE_HF_MODEL,
  ROLE_TEXT,
  ROLE_VALID_TEXT
};

typedef struct manifest_ident {
  dev_t dev;
  ino_t ino;
  int entry; /* -1 for the manifest */
  int role;
} manifest_ident_t;

typedef struct manifest_bad {
  int line, seq;
  char *why; /* "MANIFEST:LINE: reason" */
} manifest_bad_t;

typedef struct manifest_reader {
  kqsvd_manifest_t *m;
  char dir[PATH_MAX]; /* the manifest's real folder */
  char *flag;         /* per entry: a reason is already recorded for its line */
  size_t cape, capflag;
  manifest_bad_t *bad;
  int nbad, dropped;
  size_t capbad;
  manifest_ident_t *id;
  size_t nid, capid;
} manifest_reader_t;

/* Room for element `n` of the growing array `arr` of capacity `cap`. */
#define GROW(arr, n, cap)                                               \
  do {                                                                  \
    if ((size_t)(n) >= (cap)) {                                         \
      const size_t c_ = (cap) ? 2 * (cap) : 16;                         \
      void *g_ = realloc((arr), c_ * sizeof *(arr));                    \
      KQSVD_CHECK(g_, KQSVD_ERR_NOMEM, "cannot allocate the manifest"); \
      (arr) = g_;                                                       \
      (cap) = c_;                                                       \
    }                                                                   \
  } while (0)

/* Records the reason in the reader (the error record holds one message,
 * a manifest may have many bad lines) and returns KQSVD_ERR_INPUT, which
 * the line loop takes as "this line is bad, go on with the next". */
#define BAD(r, line, ...)                         \
  do {                                            \
    st = manifest_note((r), (line), __VA_ARGS__); \
    goto done;                                    \
  } while (0)

/* Records "MANIFEST:LINE: reason"; KQSVD_ERR_INPUT, or KQSVD_ERR_NOMEM. */
kqsvd_status_t manifest_note(manifest_reader_t *r, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static inline int manifest_is_ctl(unsigned char c) { return c < 0x20 || c == 0x7f; }
/* The first control character of `s`, or NULL. */
const char *manifest_first_ctl(const char *s);
/* `s` with control characters escaped into buf, so a message stays one line. */
const char *manifest_shown(const char *s, char *buf, size_t cap);

/* FIELD's `tok` as an absolute, normalised path in *out (malloc'd): the
 * folders through realpath (in a glob, those before the first wildcard),
 * the rest lexically.  A folder that is missing, or a result holding a
 * control character, is a bad line. */
kqsvd_status_t manifest_resolve(manifest_reader_t *r, int line, const char *field, const char *tok,
                                int is_glob, char **out);
/* The regular files `pattern` matches, sorted, into *files (malloc'd) and
 * *n, each recorded by identity in `role`; a pattern matching nothing, or
 * reading more than a million folder entries, is a bad line. */
kqsvd_status_t manifest_expand(manifest_reader_t *r, int entry, const char *field,
                               const char *pattern, int role, char ***files, int *n);
/* Records the file `sb` as `role` of `entry` (-1: the manifest). */
kqsvd_status_t manifest_add_ident(manifest_reader_t *r, const struct stat *sb, int entry, int role);

/* Parses and checks one line of `len` bytes (NUL bytes included),
 * appending its entry; a bad line is KQSVD_ERR_INPUT with its reason
 * recorded. */
kqsvd_status_t manifest_parse_line(manifest_reader_t *r, int line, char *text, size_t len);

#endif
