/* A file's identity for hashes that must change when an input changes:
 * checkpoint fingerprints and the inputs hash that `--skip-done` and
 * manifests compare.  Not collective. */
#ifndef KQSVD_IDENTITY_H
#define KQSVD_IDENTITY_H

#include <stdint.h>

/* Chains a file's identity into an FNV-1a hash (kqsvd_fnv1a): its real
 * path, size, modification and change times to the nanosecond, device and
 * inode (the path alone when it cannot be read).  Cannot fail. */
uint64_t kqsvd_hash_file(uint64_t h, const char *path);

#endif
