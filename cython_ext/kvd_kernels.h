/* Backend registry: which kernel sets this build holds and which of them this CPU can run.
 *
 * The SIMD sets are compiled with function target attributes (never -march=native), so one x86-64 build
 * carries scalar, AVX2 and AVX-512 code and picks at run time with __builtin_cpu_supports. The NEON set is
 * compiled only on arm64, where Advanced SIMD and the float16 conversions are part of the baseline.
 */
#ifndef KVD_KERNELS_H
#define KVD_KERNELS_H

#include "kvd_common.h"
#include "kvd_scalar.h"

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define KVD_HAVE_X86 1
#include "kvd_avx2.h"
#include "kvd_avx512.h"
#endif

#if defined(__aarch64__)
#define KVD_HAVE_NEON 1
#include "kvd_neon.h"
#endif

/* compiled backends, best first (the scalar set is always there) */
static const kvd_backend *const kvd_compiled[] = {
#ifdef KVD_HAVE_X86
    &kvd_backend_avx512,
    &kvd_backend_avx2,
#endif
#ifdef KVD_HAVE_NEON
    &kvd_backend_neon,
#endif
    &kvd_backend_scalar,
};
#define KVD_NCOMPILED ((int)(sizeof(kvd_compiled) / sizeof(kvd_compiled[0])))

static void kvd_init(void) {
    kvd_init_tables();
#ifdef KVD_HAVE_X86
    __builtin_cpu_init();
#endif
}

static int kvd_runnable(const kvd_backend *b) {
#ifdef KVD_HAVE_X86
    if (b == &kvd_backend_avx512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
               __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (b == &kvd_backend_avx2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
    (void)b;
    return 1; /* scalar; NEON is baseline on arm64 */
}

static int kvd_ncompiled(void) { return KVD_NCOMPILED; }
static const kvd_backend *kvd_compiled_at(int i) { return (i >= 0 && i < KVD_NCOMPILED) ? kvd_compiled[i] : NULL; }

#endif
