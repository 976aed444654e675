/* Which kernel set runs: the CPU's best, or the one KQSVD_ISA names. */
#include "kqsvd_isa.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <threads.h>

static const char *const g_names[KQSVD_ISA_COUNT] = {"base", "avx2", "avx512"};

const char *kqsvd_isa_name(kqsvd_isa_t isa) {
  return (unsigned)isa < KQSVD_ISA_COUNT ? g_names[isa] : "?";
}

bool kqsvd_isa_supported(kqsvd_isa_t isa) {
  switch (isa) {
  case KQSVD_ISA_BASE: return true;
#ifdef KQSVD_ISA_X86_CLONES
  /* What tpqr.c's target attributes enable. */
  case KQSVD_ISA_AVX2:
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  case KQSVD_ISA_AVX512:
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("fma");
#endif
  default: return false;
  }
}

kqsvd_isa_t kqsvd_isa_best(void) {
  int isa = KQSVD_ISA_COUNT - 1;
  while (isa > KQSVD_ISA_BASE && !kqsvd_isa_supported((kqsvd_isa_t)isa)) isa--;
  return (kqsvd_isa_t)isa;
}

/* "avx512, avx2 and base": the sets this CPU and build can run. */
static void supported_list(char *out, size_t size) {
  size_t len = 0;
  out[0] = '\0';
  for (int isa = kqsvd_isa_best(); isa >= 0 && len < size; isa--)
    len += (size_t)snprintf(out + len, size - len, "%s%s", g_names[isa],
                            isa == 1  ? " and "
                            : isa > 1 ? ", "
                                      : "");
}

/* The set named `value` (any case), or KQSVD_ISA_COUNT. */
static int lookup(const char *value) {
  int isa = 0;
  while (isa < KQSVD_ISA_COUNT && strcasecmp(value, g_names[isa]) != 0) isa++;
  return isa;
}

kqsvd_status_t kqsvd_isa_parse(const char *value, kqsvd_isa_t *out) {
  kqsvd_status_t st = KQSVD_OK;
  char have[64];
  if (!value || !*value) {
    *out = kqsvd_isa_best();
    return KQSVD_OK;
  }
  supported_list(have, sizeof have);
  const int isa = lookup(value);
  KQSVD_CHECK(isa < KQSVD_ISA_COUNT, KQSVD_ERR_USAGE,
              "KQSVD_ISA=%s: unknown kernel set; expected avx512, avx2 or base (any case), or "
              "unset for the best this CPU supports: %s",
              value, have);
#ifndef KQSVD_ISA_X86_CLONES
  KQSVD_CHECK(isa == KQSVD_ISA_BASE, KQSVD_ERR_USAGE,
              "KQSVD_ISA=%s: this build has the base kernels only (the %s ones need a GCC "
              "build for x86); it supports %s",
              value, g_names[isa], have);
#endif
  KQSVD_CHECK(kqsvd_isa_supported((kqsvd_isa_t)isa), KQSVD_ERR_USAGE,
              "KQSVD_ISA=%s: this CPU cannot run the %s kernels (they need %s); it supports %s",
              value, g_names[isa],
              isa == KQSVD_ISA_AVX512 ? "AVX-512 F, VL, BW, DQ and CD, and FMA" : "AVX2 and FMA",
              have);
  *out = (kqsvd_isa_t)isa;
done:
  return st;
}

/* The variable as read once; an invalid value is parsed again (cheaply) at
 * each kqsvd_isa_select so that every caller gets the message. */
static once_flag g_once = ONCE_FLAG_INIT; /* as convert.c's table */
static char g_value[64];
static bool g_valid, g_long;
static kqsvd_isa_t g_isa;

static void choose(void) {
  const char *v = getenv("KQSVD_ISA");
  g_long = v && strlen(v) >= sizeof g_value;
  snprintf(g_value, sizeof g_value, "%s", v ? v : "");
  /* kqsvd_isa_parse's checks without its message (which would replace
   * an error already pending); kqsvd_isa_select gives the message. */
  const int isa = g_value[0] ? lookup(g_value) : (int)kqsvd_isa_best();
  g_valid = !g_long && isa < KQSVD_ISA_COUNT && kqsvd_isa_supported((kqsvd_isa_t)isa);
  g_isa = g_valid ? (kqsvd_isa_t)isa : kqsvd_isa_best();
}

kqsvd_status_t kqsvd_isa_select(kqsvd_isa_t *isa) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_isa_t parsed = KQSVD_ISA_BASE;
  call_once(&g_once, choose);
  if (!g_valid) {
    /* No name is that long: say so without cutting the value. */
    KQSVD_CHECK(!g_long, KQSVD_ERR_USAGE,
                "KQSVD_ISA=%.40s...: unknown kernel set; expected avx512, avx2 or base", g_value);
    KQSVD_CALL(kqsvd_isa_parse(g_value, &parsed));
    KQSVD_FAIL(KQSVD_ERR_BUG, "KQSVD_ISA=%s: accepted at the second look", g_value);
  }
  if (isa) *isa = g_isa;
done:
  return st;
}

kqsvd_isa_t kqsvd_isa_active(void) {
  call_once(&g_once, choose);
  return g_isa;
}
