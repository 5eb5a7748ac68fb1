/* AVX-512 building blocks shared by the kernels of kvd_avx512_q8.h and kvd_avx512_q4.h: masks, loads and
 * stores that avoid masked memory operations on whole vectors, the vector forms of f16_up / f16_down and the
 * scale computations, integer keys, transposed 16-way reductions, code packing, the fp8 rounding and the
 * in-register Hadamard transform. See kvd_avx512.h for the theory of operation.
 */
#ifndef KVD_AVX512_UTIL_H
#define KVD_AVX512_UTIL_H

#include <immintrin.h>

#include "kvd_scalar.h"

#define KVD_T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define KVD_I512 static inline __attribute__((always_inline)) KVD_T512
#define KVD_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define KVD_PF_AHEAD 2048 /* elements (4 KiB) of input prefetched ahead of the group being read */
#define KVD_UNROLL _Pragma("GCC unroll 16") /* small constant loops over registers: keep them in registers */

/* ---- small helpers -------------------------------------------------------------------------------------- */

KVD_I512 __mmask16 kvd512_m16(int64_t len) {
    return len >= 16 ? (__mmask16)0xffff : (len <= 0 ? 0 : (__mmask16)((1u << len) - 1u));
}
KVD_I512 __mmask32 kvd512_m32(int64_t len) {
    return len >= 32 ? (__mmask32)0xffffffffu : (len <= 0 ? 0 : (__mmask32)((1u << len) - 1u));
}
KVD_I512 __mmask64 kvd512_m64(int64_t len) {
    return len >= 64 ? (__mmask64)~0ull : (len <= 0 ? 0 : (__mmask64)((1ull << len) - 1ull));
}

/* masked stores are slow on some cores (AMD): store whole vectors unmasked, mask only a tail */
KVD_I512 void kvd512_st_h16(uint16_t *o, __mmask16 m, __m256i v) {
    if (m == (__mmask16)0xffff)
        _mm256_storeu_si256((__m256i *)o, v);
    else
        _mm256_mask_storeu_epi16(o, m, v);
}
KVD_I512 void kvd512_st_b64(void *o, __mmask64 m, __m512i v) {
    if (m == (__mmask64)~0ull)
        _mm512_storeu_si512(o, v);
    else
        _mm512_mask_storeu_epi8(o, m, v);
}
KVD_I512 void kvd512_st_b16(void *o, __mmask16 m, __m128i v) {
    if (m == (__mmask16)0xffff)
        _mm_storeu_si128((__m128i *)o, v);
    else
        _mm_mask_storeu_epi8(o, m, v);
}

KVD_I512 __m128i kvd512_ld_b16(const void *p, __mmask16 m) {
    return m == (__mmask16)0xffff ? _mm_loadu_si128((const __m128i *)p) : _mm_maskz_loadu_epi8(m, p);
}
KVD_I512 __m256i kvd512_ld_h16(const uint16_t *p, __mmask16 m) {
    return m == (__mmask16)0xffff ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(m, p);
}
KVD_I512 __m512i kvd512_ld_h32(const uint16_t *p, __mmask32 m) {
    return m == (__mmask32)0xffffffffu ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(m, p);
}

KVD_I512 __m512 kvd512_clip(__m512 v) { /* min/max return their second operand for NaN: NaN passes */
    v = _mm512_min_ps(_mm512_set1_ps(65504.0f), v);
    return _mm512_max_ps(_mm512_set1_ps(-65504.0f), v);
}

/* f16_up for v >= +0 (scales): RNE, then one step up where that fell below v */
KVD_I512 __m256i kvd512_f16_up_nonneg(__m512 v) {
    __m256i h = _mm512_cvtps_ph(v, KVD_RNE);
    __mmask16 lo = _mm512_cmp_ps_mask(_mm512_cvtph_ps(h), v, _CMP_LT_OQ);
    return _mm256_mask_add_epi16(h, lo, h, _mm256_set1_epi16(1));
}

/* f16_down for any finite v: one step toward -inf where RNE went above v */
KVD_I512 __m256i kvd512_f16_down(__m512 v) {
    __m256i h = _mm512_cvtps_ph(v, KVD_RNE);
    __mmask16 hi = _mm512_cmp_ps_mask(_mm512_cvtph_ps(h), v, _CMP_GT_OQ);
    __mmask16 neg = _mm256_movepi16_mask(h);
    h = _mm256_mask_add_epi16(h, hi & neg, h, _mm256_set1_epi16(1));
    return _mm256_mask_sub_epi16(h, hi & (__mmask16)~neg, h, _mm256_set1_epi16(1));
}

KVD_I512 __m512 kvd512_inv(__m512 s) {
    return _mm512_maskz_div_ps(_mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_GT_OQ), _mm512_set1_ps(1.0f), s);
}

/* 16 absmax values (float16 bits) -> scales (float16 bits) and 1/scale */
KVD_I512 void kvd512_absmax_scales(__m256i am, float code_max, __m256i *s16, __m512 *inv) {
    __m512 v = _mm512_div_ps(_mm512_cvtph_ps(am), _mm512_set1_ps(code_max));
    __m256i h = kvd512_f16_up_nonneg(v);
    *s16 = h;
    *inv = kvd512_inv(_mm512_cvtph_ps(h));
}

/* 16 group minimums / maximums (float32) -> q4 scales, mins (float16 bits), min as float32, 1/scale */
KVD_I512 void kvd512_q4_scales(__m512 mn, __m512 mx, __m256i *s16, __m256i *m16, __m512 *mnf, __m512 *inv) {
    __m256i mh = kvd512_f16_down(mn);
    __m512 m = _mm512_cvtph_ps(mh);
    __m256i h = kvd512_f16_up_nonneg(_mm512_div_ps(_mm512_sub_ps(mx, m), _mm512_set1_ps(15.0f)));
    *s16 = h;
    *m16 = mh;
    *mnf = m;
    *inv = kvd512_inv(_mm512_cvtph_ps(h));
}

/* signed integer key of float16 / float32 bits with the float order, -0 just below +0 (sign-magnitude to
 * two's complement: flip the magnitude bits of negatives); the same map turns a key back. 0x78 = a ^ (b & c) */
KVD_I512 __m512i kvd512_key(__m512i b) {
    return _mm512_ternarylogic_epi32(b, _mm512_srai_epi16(b, 15), _mm512_set1_epi16(0x7fff), 0x78);
}
KVD_I512 __m256i kvd512_key256(__m256i b) {
    return _mm256_ternarylogic_epi32(b, _mm256_srai_epi16(b, 15), _mm256_set1_epi16(0x7fff), 0x78);
}
KVD_I512 __m512i kvd512_key32(__m512i b) {
    return _mm512_ternarylogic_epi32(b, _mm512_srai_epi32(b, 31), _mm512_set1_epi32(0x7fffffff), 0x78);
}
#define KVD_KEY16_LOW (-31745) /* keys <= this are -inf / -NaN (0xfc00 ^ 0x7fff) */

KVD_I512 __m512i kvd512_bcast_idx(int i) { return _mm512_set1_epi32(i); }

/* ---- transposed reductions: 16 vectors -> one vector holding the 16 results in natural order ----------- */
/* Slot s of the tree reads input 4*(s%4) + s/4, which makes the tree's output order the input order. */
#define KVD_SIG(s) (4 * ((s) % 4) + (s) / 4)

#define KVD_RED16_INT(NAME, OP)                                                                              \
    KVD_I512 __m256i NAME(const __m512i *a) {                                                                \
        __m512i v[8], w[4];                                                                                  \
        KVD_UNROLL \
        for (int j = 0; j < 8; j++) {                                                                        \
            __m512i p = a[KVD_SIG(2 * j)], q = a[KVD_SIG(2 * j + 1)];                                        \
            v[j] = OP(_mm512_shuffle_i64x2(p, q, 0x44), _mm512_shuffle_i64x2(p, q, 0xEE));                   \
        }                                                                                                    \
        KVD_UNROLL \
        for (int k = 0; k < 4; k++)                                                                          \
            w[k] = OP(_mm512_shuffle_i64x2(v[2 * k], v[2 * k + 1], 0x88),                                    \
                      _mm512_shuffle_i64x2(v[2 * k], v[2 * k + 1], 0xDD));                                   \
        __m512i z0 = OP(_mm512_unpacklo_epi64(w[0], w[1]), _mm512_unpackhi_epi64(w[0], w[1]));               \
        __m512i z1 = OP(_mm512_unpacklo_epi64(w[2], w[3]), _mm512_unpackhi_epi64(w[2], w[3]));               \
        __m512 f0 = _mm512_castsi512_ps(z0), f1 = _mm512_castsi512_ps(z1);                                   \
        __m512i r = OP(_mm512_castps_si512(_mm512_shuffle_ps(f0, f1, 0x88)),                                 \
                       _mm512_castps_si512(_mm512_shuffle_ps(f0, f1, 0xDD)));                                \
        r = OP(r, _mm512_srli_epi32(r, 16));                                                                 \
        return _mm512_cvtepi32_epi16(r);                                                                     \
    }
KVD_RED16_INT(kvd512_red_max_epu16, _mm512_max_epu16)
KVD_RED16_INT(kvd512_red_max_epi16, _mm512_max_epi16)
KVD_RED16_INT(kvd512_red_min_epi16, _mm512_min_epi16)

#define KVD_RED16_PS(NAME, OP)                                                                               \
    KVD_I512 __m512 NAME(const __m512 *a) {                                                                  \
        __m512 v[8], w[4];                                                                                   \
        KVD_UNROLL \
        for (int j = 0; j < 8; j++) {                                                                        \
            __m512 p = a[KVD_SIG(2 * j)], q = a[KVD_SIG(2 * j + 1)];                                         \
            v[j] = OP(_mm512_shuffle_f32x4(p, q, 0x44), _mm512_shuffle_f32x4(p, q, 0xEE));                    \
        }                                                                                                    \
        KVD_UNROLL \
        for (int k = 0; k < 4; k++)                                                                          \
            w[k] = OP(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x88),                                    \
                      _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xDD));                                   \
        __m512 z0 = OP(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(w[0]), _mm512_castps_pd(w[1]))),  \
                       _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(w[0]), _mm512_castps_pd(w[1])))); \
        __m512 z1 = OP(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(w[2]), _mm512_castps_pd(w[3]))),  \
                       _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(w[2]), _mm512_castps_pd(w[3])))); \
        return OP(_mm512_shuffle_ps(z0, z1, 0x88), _mm512_shuffle_ps(z0, z1, 0xDD));                         \
    }
KVD_RED16_PS(kvd512_red_max_ps, _mm512_max_ps)
KVD_RED16_PS(kvd512_red_min_ps, _mm512_min_ps)
#define KVD_MAXK(a, b) _mm512_castsi512_ps(_mm512_max_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)))
#define KVD_MINK(a, b) _mm512_castsi512_ps(_mm512_min_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)))
KVD_RED16_PS(kvd512_red_max_k32, KVD_MAXK) /* int32 keys carried in float vectors */
KVD_RED16_PS(kvd512_red_min_k32, KVD_MINK)

/* horizontal reductions of one vector (generic paths) */
KVD_I512 uint16_t kvd512_hmax_epu16(__m512i v) {
    __m256i a = _mm256_max_epu16(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
    __m128i b = _mm_max_epu16(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    b = _mm_max_epu16(b, _mm_srli_si128(b, 8));
    b = _mm_max_epu16(b, _mm_srli_si128(b, 4));
    b = _mm_max_epu16(b, _mm_srli_si128(b, 2));
    return (uint16_t)_mm_extract_epi16(b, 0);
}

/* ---- packing -------------------------------------------------------------------------------------------- */

/* 4 x 16 int32 codes (elements 0..63, |q| <= 127) -> 64 int8 in order */
KVD_I512 __m512i kvd512_pack_q8(__m512i q0, __m512i q1, __m512i q2, __m512i q3) {
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m512i b = _mm512_packs_epi16(_mm512_packs_epi32(q0, q1), _mm512_packs_epi32(q2, q3));
    return _mm512_permutexvar_epi32(idx, b);
}

/* 8 x 16 int32 codes in [0, 15] (elements 0..127) -> 64 bytes, element 2k in the low nibble of byte k */
KVD_I512 __m512i kvd512_pack_q4(const __m512i *q) {
    const __m512i idx = _mm512_set_epi16(31, 23, 15, 7, 30, 22, 14, 6, 29, 21, 13, 5, 28, 20, 12, 4,  /* 31..16 */
                                         27, 19, 11, 3, 26, 18, 10, 2, 25, 17, 9, 1, 24, 16, 8, 0); /* 15..0 */
    const __m512i mul = _mm512_set1_epi16(0x1001); /* bytes (1, 16): even + 16 * odd */
    __m512i b0 = _mm512_packus_epi16(_mm512_packus_epi32(q[0], q[1]), _mm512_packus_epi32(q[2], q[3]));
    __m512i b1 = _mm512_packus_epi16(_mm512_packus_epi32(q[4], q[5]), _mm512_packus_epi32(q[6], q[7]));
    __m512i p = _mm512_packus_epi16(_mm512_maddubs_epi16(b0, mul), _mm512_maddubs_epi16(b1, mul));
    return _mm512_permutexvar_epi16(idx, p);
}

/* |y| (>= 0, finite) -> fp8 magnitude code (0..126 / 0..123), the reference f32_to_fp8 without the sign */
KVD_I512 __m512i kvd512_fp8_mag(__m512 a, const int fmt) {
    const int mbits = fmt ? 2 : 3, bias = fmt ? 15 : 7, shift = 23 - mbits;
    const float magic = fmt ? 128.0f : 16384.0f; /* ulp(magic) = the subnormal step 2^-(bias + mbits - 1) */
    a = _mm512_min_ps(a, _mm512_set1_ps(fmt ? 57344.0f : 448.0f));
    __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(a, _mm512_set1_ps(magic))),
                                   _mm512_set1_epi32((int)kvd_f2u(magic)));
    __m512i ai = _mm512_castps_si512(a);
    __m512i t = _mm512_add_epi32(ai, _mm512_set1_epi32((1 << (shift - 1)) - 1 - ((127 - bias) << 23)));
    t = _mm512_mask_add_epi32(t, _mm512_test_epi32_mask(ai, _mm512_set1_epi32(1 << shift)), t,
                              _mm512_set1_epi32(1));
    __mmask16 issub = _mm512_cmp_ps_mask(a, _mm512_set1_ps(fmt ? 6.103515625e-05f : 0.015625f), _CMP_LT_OQ);
    return _mm512_mask_mov_epi32(_mm512_srli_epi32(t, shift), issub, sub);
}

/* fp8 rounding for the fast paths, in 4 operations per 16 values and no clamp or mask registers.
 * No clamp: there a = |x| * (1/s) with s = f16_up(absmax / max), so a <= max * (1 + 3 * 2^-24) (three
 * roundings), which rounds to max exactly like the clamped value would (the midpoint to the next, unused, code
 * is max * 1.036 in both formats).
 * Rounding: c = 2^(e + 23 - mbits) with e = the exponent of max(a, smallest normal) has ulp(c) = the fp8 step at
 * a (2^(e - mbits), also the subnormal step below the smallest normal), and c + a stays in c's binade, so the
 * single rounding of fma(2^e, 2^(23 - mbits), a) = c + a is a rounded to the fp8 grid, nearest-even (c's
 * mantissa is even). Its bits are field << 23 | low with low = a's fp8 step count in [0, 2^(mbits+1)], and the
 * code is low + 2^mbits * (field - field0) (field0 = the field of c for the subnormal range). One vpmaddwd on
 * the two 16-bit halves (low, field << 7) forms 2^(7 - mbits) * (code + 2^mbits * field0) without a shift;
 * kvd512_fp8_pack takes the offset and scale out after narrowing to 16 bits (32 lanes per instruction).
 * Checked exhaustively against kvd_f32_to_fp8 for every float32 in [0, max * (1 + 2^-20)], both formats. */
#define KVD_FP8_W_OFF(fmt) ((fmt) ? 17152 : 18048) /* 2^(7-mbits) * 2^mbits * field0: 32*4*134, 16*8*141 */
#define KVD_FP8_W_SH(fmt) ((fmt) ? 5 : 4)          /* 7 - mbits */
KVD_I512 __m512i kvd512_fp8_w(__m512 a, const int fmt) {
    const __m512i minn = _mm512_castps_si512(_mm512_set1_ps(fmt ? 6.103515625e-05f : 0.015625f));
    const __m512i m = _mm512_max_epi32(_mm512_castps_si512(a), minn); /* a >= +0: integer order is float order */
    const __m512 e = _mm512_castsi512_ps(_mm512_and_si512(m, _mm512_set1_epi32(0x7f800000)));
    const __m512 s = _mm512_fmadd_ps(e, _mm512_set1_ps(fmt ? 2097152.0f : 1048576.0f), a);
    return _mm512_madd_epi16(_mm512_castps_si512(s), _mm512_set1_epi32(fmt ? 0x00010020 : 0x00010010));
}

/* 4 x 16 kvd512_fp8_w results (elements 0..63) and the 64 sign bits -> 64 fp8 codes in order */
KVD_I512 __m512i kvd512_fp8_pack(__m512i w0, __m512i w1, __m512i w2, __m512i w3, __mmask64 sign, const int fmt) {
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i off = _mm512_set1_epi16(KVD_FP8_W_OFF(fmt));
    /* the w are below 2^15: the signed saturating pack is exact */
    __m512i p0 = _mm512_srli_epi16(_mm512_sub_epi16(_mm512_packs_epi32(w0, w1), off), KVD_FP8_W_SH(fmt));
    __m512i p1 = _mm512_srli_epi16(_mm512_sub_epi16(_mm512_packs_epi32(w2, w3), off), KVD_FP8_W_SH(fmt));
    __m512i b = _mm512_permutexvar_epi32(idx, _mm512_packus_epi16(p0, p1));
    return _mm512_mask_add_epi8(b, sign, b, _mm512_set1_epi8((char)0x80)); /* the sign bit (bit 7 is clear) */
}

/* the four in-register butterfly stages (lane distance 1, 2, 4, 8), on each of nz registers; a multiply by
 * +-1 is exact, so each fma rounds once, exactly like the reference's add or subtract */
KVD_I512 void kvd512_fwht_lanes(__m512 *z, const int nz) {
    const __m512 s1 = _mm512_setr_ps(1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1);
    const __m512 s2 = _mm512_setr_ps(1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1);
    const __m512 s4 = _mm512_setr_ps(1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1);
    const __m512 s8 = _mm512_setr_ps(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
    KVD_UNROLL
    for (int i = 0; i < nz; i++) z[i] = _mm512_fmadd_ps(z[i], s1, _mm512_permute_ps(z[i], 0xB1));
    KVD_UNROLL
    for (int i = 0; i < nz; i++) z[i] = _mm512_fmadd_ps(z[i], s2, _mm512_permute_ps(z[i], 0x4E));
    KVD_UNROLL
    for (int i = 0; i < nz; i++) z[i] = _mm512_fmadd_ps(z[i], s4, _mm512_shuffle_f32x4(z[i], z[i], 0xB1));
    KVD_UNROLL
    for (int i = 0; i < nz; i++) z[i] = _mm512_fmadd_ps(z[i], s8, _mm512_shuffle_f32x4(z[i], z[i], 0x4E));
}

/* ---- unnormalized FWHT of one row held in nz (1, 2, 4 or 8) registers --------------------------------- */
KVD_I512 void kvd512_fwht_regs(__m512 *z, const int nz) {
    /* stage by stage across the registers: independent operations side by side */
    kvd512_fwht_lanes(z, nz);
    KVD_UNROLL
    for (int h = 1; h < nz; h *= 2)
        KVD_UNROLL
        for (int i = 0; i < nz; i += 2 * h)
            KVD_UNROLL
            for (int j = i; j < i + h; j++) {
                __m512 a = z[j], b = z[j + h];
                z[j] = _mm512_add_ps(a, b);
                z[j + h] = _mm512_sub_ps(a, b);
            }
}

/* FWHT of a float32 buffer of length d (a power of two), in the reference's stage order */
KVD_I512 void kvd512_fwht_buf(float *y, int64_t d) {
    if (d < 16) {
        kvd_fwht_scalar(y, d);
        return;
    }
    for (int64_t j = 0; j < d; j += 16) {
        __m512 z = _mm512_loadu_ps(y + j);
        kvd512_fwht_regs(&z, 1);
        _mm512_storeu_ps(y + j, z);
    }
    for (int64_t h = 16; h < d; h *= 2)
        for (int64_t i = 0; i < d; i += 2 * h)
            for (int64_t j = i; j < i + h; j += 16) {
                __m512 a = _mm512_loadu_ps(y + j), b = _mm512_loadu_ps(y + j + h);
                _mm512_storeu_ps(y + j, _mm512_add_ps(a, b));
                _mm512_storeu_ps(y + j + h, _mm512_sub_ps(a, b));
            }
}

/* lane parameters of values j..j+15 of a row whose group parameters start at p (float16 bits) */
KVD_I512 __m512 kvd512_lane_param(const uint16_t *p, int64_t j, int64_t group, int64_t d) {
    if (group >= 16 && (j / group) == ((kvd_min64(j + 16, d) - 1) / group))
        return _mm512_cvtph_ps(_mm256_set1_epi16((short)p[j / group]));
    uint16_t tmp[16];
    KVD_UNROLL
    for (int l = 0; l < 16; l++) tmp[l] = j + l < d ? p[(j + l) / group] : 0;
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)tmp));
}

#endif
