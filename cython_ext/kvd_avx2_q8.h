/* AVX2 fast paths of the absmax encoders (q8 and fp8 rows, q8 columns), on the building blocks of
 * kvd_avx2_util.h; included by kvd_avx2.h. The ideas of kvd_avx512_q8.h on 256-bit vectors:
 * - rows: batches of 8 groups (consecutive in the flattened [n, d / g] group order, so their scales and codes
 *   are contiguous in the outputs); pass 1 takes the absmax of each group on (bits & 0x7fff) with an integer
 *   max, one transposed reduction turns the 8 accumulators into one vector of 8 absmax values, and the scale
 *   arithmetic runs on that vector (the same IEEE steps as kvd_absmax_scale, 8 groups per instruction).
 *   The statistics of batch k+1 are computed before the codes of batch k: independent work for the core.
 * - columns: blocks of 128 columns (256 contiguous bytes per token row instead of 32), 8 accumulators.
 * - codes: 32 at a time, narrowed with two packs and one dword permute; fp8 with the fma rounding of
 *   kvd512_fp8_w (see kvd_avx512_util.h for why it is exact and needs no clamp on these paths).
 */
#ifndef KVD_AVX2_Q8_H
#define KVD_AVX2_Q8_H

#include "kvd_avx2_util.h"

/* 8 vectors of 16 u16 (each <= 0x7fff) -> their 8 maxima, in order, as the u16 lanes of one __m128i */
KVD_I256 __m128i kvd256_red8_max(const __m256i *a) {
    __m256i v[4], w[2];
    KVD_UNROLL256
    for (int j = 0; j < 4; j++) /* lane 0: a[2j] folded to 8, lane 1: a[2j+1] folded to 8 */
        v[j] = _mm256_max_epu16(_mm256_permute2x128_si256(a[2 * j], a[2 * j + 1], 0x20),
                                _mm256_permute2x128_si256(a[2 * j], a[2 * j + 1], 0x31));
    KVD_UNROLL256
    for (int k = 0; k < 2; k++) /* lane 0: a[4k], a[4k+2] (4 each); lane 1: a[4k+1], a[4k+3] */
        w[k] = _mm256_max_epu16(_mm256_unpacklo_epi64(v[2 * k], v[2 * k + 1]),
                                _mm256_unpackhi_epi64(v[2 * k], v[2 * k + 1]));
    __m256 f0 = _mm256_castsi256_ps(w[0]), f1 = _mm256_castsi256_ps(w[1]);
    /* dwords: lane 0 = a0, a2, a4, a6; lane 1 = a1, a3, a5, a7 (two u16 partials each) */
    __m256i r = _mm256_max_epu16(_mm256_castps_si256(_mm256_shuffle_ps(f0, f1, 0x88)),
                                 _mm256_castps_si256(_mm256_shuffle_ps(f0, f1, 0xDD)));
    r = _mm256_and_si256(_mm256_max_epu16(r, _mm256_srli_epi32(r, 16)), _mm256_set1_epi32(0xffff));
    r = _mm256_packus_epi32(r, r);
    return _mm_unpacklo_epi16(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* 4 x 8 int32 codes (elements 0..31, each vector 8 consecutive elements) -> 32 int8 in order.
 * packs works per 128-bit lane: the dwords come out as e0-3 e8-11 e16-19 e24-27 | e4-7 e12-15 ..., which the
 * permute puts back in order. */
KVD_I256 __m256i kvd256_pack32_s8(__m256i q0, __m256i q1, __m256i q2, __m256i q3) {
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* 32 float16 at p -> 32 q8 codes; inverse scales per 8 elements */
KVD_I256 __m256i kvd256_q8_32(const uint16_t *p, __m256 i0, __m256 i1, __m256 i2, __m256 i3) {
    __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(kvd256_ld8(p), i0));
    __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(kvd256_ld8(p + 8), i1));
    __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(kvd256_ld8(p + 16), i2));
    __m256i q3 = _mm256_cvtps_epi32(_mm256_mul_ps(kvd256_ld8(p + 24), i3));
    /* |q| <= 128 at most: saturating packs, then -128 -> -127 like the reference's clip */
    return _mm256_max_epi8(kvd256_pack32_s8(q0, q1, q2, q3), _mm256_set1_epi8(-127));
}

/* the fp8 rounding of kvd512_fp8_w on 8 lanes: a = |x| * inv >= +0, finite, a <= max * (1 + 3 * 2^-24) */
#define KVD256_FP8_W_OFF(fmt) ((fmt) ? 17152 : 18048)
#define KVD256_FP8_W_SH(fmt) ((fmt) ? 5 : 4)
KVD_I256 __m256i kvd256_fp8_w(__m256 a, const int fmt) {
    const __m256i minn = _mm256_castps_si256(_mm256_set1_ps(fmt ? 6.103515625e-05f : 0.015625f));
    const __m256i m = _mm256_max_epi32(_mm256_castps_si256(a), minn); /* a >= +0: integer order = float order */
    const __m256 e = _mm256_castsi256_ps(_mm256_and_si256(m, _mm256_set1_epi32(0x7f800000)));
    /* 2^e * 2^(23 - mbits) is exact, so the fma rounds once: c + a on the fp8 grid, nearest-even */
    const __m256 s = _mm256_fmadd_ps(e, _mm256_set1_ps(fmt ? 2097152.0f : 1048576.0f), a);
    return _mm256_madd_epi16(_mm256_castps_si256(s), _mm256_set1_epi32(fmt ? 0x00010020 : 0x00010010));
}

/* 32 float16 at p -> 32 fp8 codes, one inverse scale */
KVD_I256 __m256i kvd256_fp8_32(const uint16_t *p, __m256 iv, const int fmt) {
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)p), x1 = _mm256_loadu_si256((const __m256i *)(p + 16));
    /* |x * inv| = |x| * inv (inv >= 0, symmetric rounding): convert straight from memory (no lane extracts)
     * and clear the float sign after the multiply */
    const __m256 ab = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256i w0 = kvd256_fp8_w(_mm256_and_ps(_mm256_mul_ps(kvd256_ld8(p), iv), ab), fmt);
    __m256i w1 = kvd256_fp8_w(_mm256_and_ps(_mm256_mul_ps(kvd256_ld8(p + 8), iv), ab), fmt);
    __m256i w2 = kvd256_fp8_w(_mm256_and_ps(_mm256_mul_ps(kvd256_ld8(p + 16), iv), ab), fmt);
    __m256i w3 = kvd256_fp8_w(_mm256_and_ps(_mm256_mul_ps(kvd256_ld8(p + 24), iv), ab), fmt);
    const __m256i off = _mm256_set1_epi16(KVD256_FP8_W_OFF(fmt));
    /* the w are below 2^15: the signed saturating pack is exact */
    __m256i p0 = _mm256_srli_epi16(_mm256_sub_epi16(_mm256_packs_epi32(w0, w1), off), KVD256_FP8_W_SH(fmt));
    __m256i p1 = _mm256_srli_epi16(_mm256_sub_epi16(_mm256_packs_epi32(w2, w3), off), KVD256_FP8_W_SH(fmt));
    __m256i b = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(p0, p1), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    /* sign bytes: packs gives the qwords e0-7 e16-23 | e8-15 e24-31; permute4x64 (0, 2, 1, 3) orders them */
    __m256i sg = _mm256_packs_epi16(_mm256_srai_epi16(x0, 15), _mm256_srai_epi16(x1, 15));
    sg = _mm256_permute4x64_epi64(sg, 0xD8);
    return _mm256_or_si256(b, _mm256_and_si256(sg, _mm256_set1_epi8((char)0x80)));
}

/* ---- rows ------------------------------------------------------------------------------------------------ */

typedef struct {
    const uint16_t *gp[8];
    __m128i s16;
    float inv[8];
} kvd256_batch;

/* pass 1 of a batch: absmax of groups k0 .. k0+cnt-1 (G groups of g values per row); 1 on NaN/Inf */
KVD_I256 int kvd256_absmax_stats(kvd256_batch *b, const uint16_t *x, ptrdiff_t xs, int64_t g, int64_t G, int64_t k0,
                                 const int cnt, float code_max) {
    const __m256i m7fff = _mm256_set1_epi16(0x7fff);
    int64_t row = k0 / G, gcol = k0 % G;
    __m256i acc[8];
    KVD_UNROLL256
    for (int i = 0; i < 8; i++) {
        if (i < cnt) {
            const uint16_t *p = x + row * xs + gcol * g;
            for (int64_t c = 0; c < g; c += 32) _mm_prefetch((const char *)(p + c + KVD256_PF_AHEAD), _MM_HINT_T0);
            __m256i a = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)p), m7fff);
            for (int64_t c = 16; c < g; c += 16)
                a = _mm256_max_epu16(a, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + c)), m7fff));
            b->gp[i] = p;
            acc[i] = a;
            if (++gcol == G) {
                gcol = 0;
                row++;
            }
        } else {
            acc[i] = _mm256_setzero_si256();
        }
    }
    const __m128i am = kvd256_red8_max(acc);
    if (_mm_movemask_epi8(_mm_cmpgt_epi16(am, _mm_set1_epi16(0x7bff)))) return 1; /* am <= 0x7fff: signed ok */
    /* kvd_absmax_scale on 8 lanes: f16_up(h2f(am) / code_max), then 1 / scale (0 for a zero scale) */
    b->s16 = kvd256_f16_up_nonneg(_mm256_div_ps(_mm256_cvtph_ps(am), _mm256_set1_ps(code_max)));
    _mm256_storeu_ps(b->inv, kvd256_inv(_mm256_cvtph_ps(b->s16)));
    return 0;
}

/* pass 2 of a batch: the codes of its cnt groups of g values (contiguous in the output) */
KVD_I256 void kvd256_absmax_quant(const kvd256_batch *b, uint8_t *out, int64_t g, const int cnt, const int fmt) {
    for (int i = 0; i < cnt; i++) {
        /* broadcast from memory: a load-port op instead of a shuffle */
        const __m256 iv = _mm256_broadcast_ss(&b->inv[i]);
        const uint16_t *p = b->gp[i];
        uint8_t *o = out + i * g;
        for (int64_t j = 0; j < g; j += 32) {
            __m256i v = fmt < 0 ? kvd256_q8_32(p + j, iv, iv, iv, iv) : kvd256_fp8_32(p + j, iv, fmt);
            _mm256_storeu_si256((__m256i *)(o + j), v);
        }
    }
}

/* d % g == 0 and g % 32 == 0 */
KVD_I256 int kvd256_absmax_rows_fast(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, uint8_t *codes,
                                     uint16_t *scales, int64_t g, const int fmt) {
    const int64_t G = d / g, total = n * G;
    const float code_max = fmt < 0 ? 127.0f : kvd_fp8_max[fmt];
    kvd256_batch cur, nxt;
    if (kvd256_absmax_stats(&cur, x, xs, g, G, 0, total >= 8 ? 8 : (int)total, code_max)) return KVD_NONFINITE;
    for (int64_t k0 = 0; k0 < total; k0 += 8) {
        const int64_t left = total - k0 - 8;
        if (left > 0 && kvd256_absmax_stats(&nxt, x, xs, g, G, k0 + 8, left >= 8 ? 8 : (int)left, code_max))
            return KVD_NONFINITE;
        if (total - k0 >= 8) {
            kvd256_absmax_quant(&cur, codes + k0 * g, g, 8, fmt);
            _mm_storeu_si128((__m128i *)(scales + k0), cur.s16);
        } else {
            const int cnt = (int)(total - k0);
            uint16_t tmp[8];
            kvd256_absmax_quant(&cur, codes + k0 * g, g, cnt, fmt);
            _mm_storeu_si128((__m128i *)tmp, cur.s16);
            memcpy(scales + k0, tmp, (size_t)cnt * 2);
        }
        cur = nxt;
    }
    return KVD_OK;
}

/* ---- columns ------------------------------------------------------------------------------------------- */

/* one block of 128 columns of token group [t0, t1): 1 on NaN/Inf */
KVD_I256 int kvd256_q8_cols_block128(const uint16_t *x, ptrdiff_t xs, int64_t t0, int64_t t1, int64_t c, int64_t c0,
                                     int8_t *codes, uint16_t *srow) {
    const __m256i m7fff = _mm256_set1_epi16(0x7fff);
    __m256i a[8];
    KVD_UNROLL256
    for (int k = 0; k < 8; k++) a[k] = _mm256_setzero_si256();
    for (int64_t i = t0; i < t1; i++) {
        const uint16_t *p = x + i * xs + c0;
        KVD_UNROLL256
        for (int k = 0; k < 8; k++)
            a[k] = _mm256_max_epu16(a[k], _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + 16 * k)), m7fff));
    }
    __m256i all = a[0];
    KVD_UNROLL256
    for (int k = 1; k < 8; k++) all = _mm256_max_epu16(all, a[k]);
    if (_mm256_movemask_epi8(_mm256_cmpgt_epi16(all, _mm256_set1_epi16(0x7bff)))) return 1;
    float inv[128] __attribute__((aligned(32)));
    KVD_UNROLL256
    for (int k = 0; k < 16; k++) {
        const __m128i am = k & 1 ? _mm256_extracti128_si256(a[k / 2], 1) : _mm256_castsi256_si128(a[k / 2]);
        const __m128i h = kvd256_f16_up_nonneg(_mm256_div_ps(_mm256_cvtph_ps(am), _mm256_set1_ps(127.0f)));
        _mm_storeu_si128((__m128i *)(srow + 8 * k), h);
        _mm256_store_ps(inv + 8 * k, kvd256_inv(_mm256_cvtph_ps(h)));
    }
    for (int64_t i = t0; i < t1; i++) {
        const uint16_t *p = x + i * xs + c0;
        int8_t *o = codes + i * c + c0;
        KVD_UNROLL256
        for (int k = 0; k < 4; k++) _mm_prefetch((const char *)(p + 128 + 32 * k), _MM_HINT_T0); /* next block */
        KVD_UNROLL256
        for (int b = 0; b < 4; b++)
            _mm256_storeu_si256((__m256i *)(o + 32 * b),
                                kvd256_q8_32(p + 32 * b, _mm256_load_ps(inv + 32 * b), _mm256_load_ps(inv + 32 * b + 8),
                                             _mm256_load_ps(inv + 32 * b + 16), _mm256_load_ps(inv + 32 * b + 24)));
    }
    return 0;
}

#endif
