/* AVX2 + F16C + FMA building blocks shared by the kernels of kvd_avx2.h, kvd_avx2_q8.h and kvd_avx2_q4.h:
 * the target attributes, scalar F16C conversions and per-group scales, 8-lane float16 loads and stores, absmax,
 * code packing, the fp8 magnitude code, vector f16_up / f16_down, integer keys and nibble loads. See kvd_avx2.h.
 * The include order runs one way: kvd_scalar.h <- this file <- kvd_avx2_q8.h, kvd_avx2_q4.h <- kvd_avx2.h.
 */
#ifndef KVD_AVX2_UTIL_H
#define KVD_AVX2_UTIL_H

#include <immintrin.h>

#include "kvd_scalar.h"

#define KVD_T256 __attribute__((target("avx2,fma,f16c")))
#define KVD_I256 static inline __attribute__((always_inline)) KVD_T256
#define KVD_RNE256 (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* per-group scale arithmetic with F16C scalar conversions (the same IEEE conversions as kvd_h2f / kvd_f2h
 * for finite values, much cheaper than the portable bit manipulation) */
KVD_I256 float kvd256_h2f(uint16_t h) { return _cvtsh_ss(h); }
KVD_I256 uint16_t kvd256_f2h(float f) { return (uint16_t)_cvtss_sh(f, KVD_RNE256); }
KVD_I256 uint16_t kvd256_absmax_scale(uint16_t am, float code_max, float *inv) {
    const float v = kvd256_h2f(am) / code_max; /* >= 0: one step up is h + 1; branch-free (unpredictable) */
    uint16_t h = kvd256_f2h(v);
    h = (uint16_t)(h + (kvd256_h2f(h) < v));
    *inv = kvd_inv(kvd256_h2f(h));
    return h;
}
KVD_I256 uint16_t kvd256_q4_scale(float mn, float mx, uint16_t *min_bits, float *mnf, float *inv) {
    uint16_t m16 = kvd256_f2h(mn); /* one step toward -inf where needed: -1 for positive, +1 for negative */
    m16 = (uint16_t)(m16 + (kvd256_h2f(m16) > mn) * ((m16 & 0x8000u) ? 1 : -1));
    const float m = kvd256_h2f(m16), v = (mx - m) / 15.0f;
    uint16_t h = kvd256_f2h(v);
    h = (uint16_t)(h + (kvd256_h2f(h) < v));
    *min_bits = m16;
    *mnf = m;
    *inv = kvd_inv(kvd256_h2f(h));
    return h;
}

KVD_I256 __m256 kvd256_ld8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
KVD_I256 void kvd256_st8(uint16_t *o, __m256 v) { _mm_storeu_si128((__m128i *)o, _mm256_cvtps_ph(v, KVD_RNE256)); }
KVD_I256 __m256 kvd256_clip(__m256 v) { /* NaN passes: min/max return the second operand for NaN */
    return _mm256_max_ps(_mm256_set1_ps(-65504.0f), _mm256_min_ps(_mm256_set1_ps(65504.0f), v));
}

KVD_I256 uint16_t kvd256_hmax_epu16(__m256i v) {
    __m128i b = _mm_max_epu16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    b = _mm_max_epu16(b, _mm_srli_si128(b, 8));
    b = _mm_max_epu16(b, _mm_srli_si128(b, 4));
    b = _mm_max_epu16(b, _mm_srli_si128(b, 2));
    return (uint16_t)_mm_extract_epi16(b, 0);
}

/* absmax (bits & 0x7fff) of n values */
KVD_I256 uint16_t kvd256_absmax(const uint16_t *p, int64_t n) {
    __m256i acc = _mm256_setzero_si256();
    const __m256i m = _mm256_set1_epi16(0x7fff);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        acc = _mm256_max_epu16(acc, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + j)), m));
    uint16_t am = kvd256_hmax_epu16(acc);
    for (; j < n; j++)
        if ((p[j] & 0x7fffu) > am) am = p[j] & 0x7fffu;
    return am;
}

/* 8 int32 -> 8 bytes (signed or unsigned saturation) */
KVD_I256 __m128i kvd256_pack8(__m256i q, int is_signed) {
    __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    if (is_signed) return _mm_packs_epi16(_mm_packs_epi32(lo, hi), _mm_setzero_si128());
    return _mm_packus_epi16(_mm_packus_epi32(lo, hi), _mm_setzero_si128());
}

/* |y| -> fp8 magnitude code (see kvd512_fp8_mag) */
KVD_I256 __m256i kvd256_fp8_mag(__m256 a, const int fmt) {
    const int mbits = fmt ? 2 : 3, bias = fmt ? 15 : 7, shift = 23 - mbits;
    const float magic = fmt ? 128.0f : 16384.0f;
    a = _mm256_min_ps(a, _mm256_set1_ps(fmt ? 57344.0f : 448.0f));
    __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(a, _mm256_set1_ps(magic))),
                                   _mm256_set1_epi32((int)kvd_f2u(magic)));
    __m256i ai = _mm256_castps_si256(a);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(ai, shift), _mm256_set1_epi32(1));
    __m256i t = _mm256_add_epi32(_mm256_add_epi32(ai, odd),
                                 _mm256_set1_epi32((1 << (shift - 1)) - 1 - ((127 - bias) << 23)));
    __m256 issub = _mm256_cmp_ps(a, _mm256_set1_ps(fmt ? 6.103515625e-05f : 0.015625f), _CMP_LT_OQ);
    return _mm256_blendv_epi8(_mm256_srli_epi32(t, shift), sub, _mm256_castps_si256(issub));
}

/* 8 codes of x (float16 at p) with inverse scale inv: q8 (fmt < 0) or fp8 */
KVD_I256 __m128i kvd256_codes8(const uint16_t *p, __m256 inv, const int fmt) {
    __m256 y = _mm256_mul_ps(kvd256_ld8(p), inv);
    if (fmt < 0) return kvd256_pack8(_mm256_max_epi32(_mm256_cvtps_epi32(y), _mm256_set1_epi32(-127)), 1);
    __m256i yi = _mm256_castps_si256(y);
    __m256i mag = kvd256_fp8_mag(_mm256_castsi256_ps(_mm256_and_si256(yi, _mm256_set1_epi32(0x7fffffff))), fmt);
    __m256i sign = _mm256_and_si256(_mm256_srli_epi32(yi, 24), _mm256_set1_epi32(0x80));
    return kvd256_pack8(_mm256_or_si256(mag, sign), 0);
}

/* vector f16_up (v >= +0) and f16_down: 8 lanes */
KVD_I256 __m128i kvd256_f16_up_nonneg(__m256 v) {
    __m128i h = _mm256_cvtps_ph(v, KVD_RNE256);
    __m256 lt = _mm256_cmp_ps(_mm256_cvtph_ps(h), v, _CMP_LT_OQ);
    __m128i lt16 = _mm_packs_epi32(_mm256_castsi256_si128(_mm256_castps_si256(lt)),
                                   _mm256_extracti128_si256(_mm256_castps_si256(lt), 1));
    return _mm_sub_epi16(h, lt16); /* -1 where below: one step up */
}
KVD_I256 __m128i kvd256_f16_down(__m256 v) {
    __m128i h = _mm256_cvtps_ph(v, KVD_RNE256);
    __m256 gt = _mm256_cmp_ps(_mm256_cvtph_ps(h), v, _CMP_GT_OQ);
    __m128i gt16 = _mm_packs_epi32(_mm256_castsi256_si128(_mm256_castps_si256(gt)),
                                   _mm256_extracti128_si256(_mm256_castps_si256(gt), 1));
    __m128i neg = _mm_srai_epi16(h, 15); /* negative: +1 (away from zero), positive: -1 */
    __m128i adj = _mm_sub_epi16(_mm_sub_epi16(h, _mm_set1_epi16(1)), _mm_add_epi16(neg, neg));
    return _mm_blendv_epi8(h, adj, gt16);
}
KVD_I256 __m256 kvd256_inv(__m256 s) {
    __m256 pos = _mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_GT_OQ);
    return _mm256_and_ps(pos, _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_blendv_ps(_mm256_set1_ps(1.0f), s, pos)));
}

/* float16 key with the float order (-0 below +0); the same map turns a key back */
KVD_I256 __m256i kvd256_key(__m256i b) {
    return _mm256_xor_si256(b, _mm256_and_si256(_mm256_srai_epi16(b, 15), _mm256_set1_epi16(0x7fff)));
}
KVD_I256 __m256i kvd256_key32(__m256i b) {
    return _mm256_xor_si256(b, _mm256_and_si256(_mm256_srai_epi32(b, 31), _mm256_set1_epi32(0x7fffffff)));
}

/* 8 nibbles starting at an even element -> float32 */
KVD_I256 __m256 kvd256_nib8(const uint8_t *p) {
    uint32_t w;
    memcpy(&w, p, 4);
    __m128i b = _mm_cvtepu8_epi16(_mm_cvtsi32_si128((int)w));
    b = _mm_and_si128(_mm_or_si128(b, _mm_slli_epi16(b, 4)), _mm_set1_epi16(0x0f0f));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
}

#define KVD_UNROLL256 _Pragma("GCC unroll 16")
#define KVD256_PF_AHEAD 2048 /* elements (4 KiB) of input prefetched ahead of the rows being read */

#endif
