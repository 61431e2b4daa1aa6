/* XXH3-64 streaming update with the vector kernel chosen at run time.
 *
 * xxhash.h picks its vector code (SSE2, AVX2, AVX-512) when it is compiled; a portable build
 * gets SSE2 on x86-64, which hashes at about half (AVX2) or a quarter (AVX-512) of the speed
 * the CPU could.  xxhash.h also carries per-target kernels for its own dispatcher
 * (xxh_x86dispatch.c, enabled by XXH_DISPATCH_AVX2/AVX512); this header enables them and
 * picks one with __builtin_cpu_supports, which also checks that the OS saves the registers.
 * The kernels and XXH3_update are internal to xxhash 0.8.1, so any other version gets the
 * compiled default.  The result is the same XXH3-64 value whichever kernel runs.
 */
#ifndef REWARM_XXH3_DISPATCH_H
#define REWARM_XXH3_DISPATCH_H

#if defined(__x86_64__) && defined(__GNUC__)
#  include <immintrin.h>
#  define XXH_X86DISPATCH 1          /* 64-byte aligned accumulators, as its dispatcher needs */
#  define XXH_DISPATCH_AVX2 1
#  define XXH_DISPATCH_AVX512 1
#  define XXH_TARGET_AVX2 __attribute__((__target__("avx2")))
#  define XXH_TARGET_AVX512 __attribute__((__target__("avx512f")))
#  define REWARM_XXH_X86 1
#endif
#include "xxhash.h"

typedef XXH_errorcode (*rw_update_fn)(XXH3_state_t *, const void *, size_t);

static XXH_errorcode rw_update_default(XXH3_state_t *s, const void *in, size_t len) {
    return XXH3_64bits_update(s, in, len);
}

#if defined(REWARM_XXH_X86) && XXH_VERSION_NUMBER == 801
XXH_TARGET_AVX512 static XXH_errorcode rw_update_avx512(XXH3_state_t *s, const void *in, size_t len) {
    return XXH3_update(s, (const xxh_u8 *)in, len, XXH3_accumulate_512_avx512, XXH3_scrambleAcc_avx512);
}
XXH_TARGET_AVX2 static XXH_errorcode rw_update_avx2(XXH3_state_t *s, const void *in, size_t len) {
    return XXH3_update(s, (const xxh_u8 *)in, len, XXH3_accumulate_512_avx2, XXH3_scrambleAcc_avx2);
}
#endif

static rw_update_fn rw_update = rw_update_default;
static const char *rw_update_name = "default";

/* Choose the kernel once, at module import. */
static void rw_pick_update(void) {
#if defined(REWARM_XXH_X86) && XXH_VERSION_NUMBER == 801
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) { rw_update = rw_update_avx512; rw_update_name = "avx512"; return; }
    if (__builtin_cpu_supports("avx2")) { rw_update = rw_update_avx2; rw_update_name = "avx2"; return; }
#endif
    rw_update = rw_update_default;
    rw_update_name = "default";
}

/* Pick a kernel by name (tests compare them); returns 0, or -1 if this build lacks it. */
static int rw_force_update(const char *name) {
    if (name[0] == 'd') { rw_update = rw_update_default; rw_update_name = "default"; return 0; }
#if defined(REWARM_XXH_X86) && XXH_VERSION_NUMBER == 801
    __builtin_cpu_init();
    if (name[0] == 'a' && name[3] == '2' && __builtin_cpu_supports("avx2")) {
        rw_update = rw_update_avx2; rw_update_name = "avx2"; return 0; }
    if (name[0] == 'a' && name[3] == '5' && __builtin_cpu_supports("avx512f")) {
        rw_update = rw_update_avx512; rw_update_name = "avx512"; return 0; }
#endif
    return -1;
}

#endif
