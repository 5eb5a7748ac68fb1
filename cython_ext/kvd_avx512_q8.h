/* AVX-512 kernels of the checked float16 copy, q8 (rows and columns) and fp8 (rows). See kvd_avx512.h. */
#ifndef KVD_AVX512_Q8_H
#define KVD_AVX512_Q8_H

#include "kvd_avx512_util.h"

/* ======================================================================================================== */
/* f16_copy_rows: check everything, then copy */

KVD_T512 static int kvd512_f16_copy_rows(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, uint16_t *out) {
    const __m512i m = _mm512_set1_epi16(0x7fff);
    __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *row = x + r * xs;
        int64_t j = 0;
        for (; j + 128 <= d; j += 128) {
            __m512i a = _mm512_max_epu16(_mm512_and_si512(_mm512_loadu_si512(row + j), m),
                                         _mm512_and_si512(_mm512_loadu_si512(row + j + 32), m));
            __m512i b = _mm512_max_epu16(_mm512_and_si512(_mm512_loadu_si512(row + j + 64), m),
                                         _mm512_and_si512(_mm512_loadu_si512(row + j + 96), m));
            acc0 = _mm512_max_epu16(acc0, a);
            acc1 = _mm512_max_epu16(acc1, b);
        }
        for (; j < d; j += 32)
            acc0 = _mm512_max_epu16(acc0, _mm512_and_si512(kvd512_ld_h32(row + j, kvd512_m32(d - j)), m));
        if ((r & 63) == 63 || r == n - 1) { /* stop early on bad input */
            if (_mm512_cmpge_epu16_mask(_mm512_max_epu16(acc0, acc1), _mm512_set1_epi16(0x7c00)))
                return KVD_NONFINITE;
        }
    }
    if (xs == d) {
        memmove(out, x, (size_t)(n * d) * 2); /* memmove: out may be x itself */
    } else {
        for (int64_t r = 0; r < n; r++) memmove(out + r * d, x + r * xs, (size_t)d * 2);
    }
    return KVD_OK;
}

/* ======================================================================================================== */
/* q8 / fp8 rows: absmax groups */

/* pass 2 of one 32-value half: codes of x[0..32) with inverse scale invb; returns 2 int32 code vectors and,
 * for fp8, the sign mask */
KVD_I512 void kvd512_absmax_half(const uint16_t *p, __m512 invb, const int fmt, __m512i *q0, __m512i *q1,
                                 __mmask32 *sign) {
    __m512i x = _mm512_loadu_si512(p);
    if (fmt < 0) {
        *q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(x)), invb), KVD_RNE);
        *q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(x, 1)), invb),
                                       KVD_RNE);
    } else {
        *sign = _mm512_movepi16_mask(x);
        __m512i a = _mm512_and_si512(x, _mm512_set1_epi16(0x7fff)); /* |x| * inv = |x * inv| (inv >= 0) */
        *q0 = kvd512_fp8_mag(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(a)), invb), fmt);
        *q1 = kvd512_fp8_mag(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(a, 1)), invb), fmt);
    }
}

/* one batch of (up to) 16 groups of the fast path: group pointers, scales, inverse scales */
typedef struct {
    const uint16_t *gp[16];
    __m256i s16;
    __m512 inv;
} kvd512_batch;

/* pass 1 of a batch: absmax of groups k0 .. k0+cnt-1 (G groups of g values per row); 1 on NaN/Inf */
KVD_I512 int kvd512_absmax_stats(kvd512_batch *b, const uint16_t *x, ptrdiff_t xs, int64_t g, int64_t G,
                                 int64_t k0, const int cnt, float code_max) {
    const __m512i m7fff = _mm512_set1_epi16(0x7fff);
    int64_t row = k0 / G, gcol = k0 % G;
    __m512i acc[16];
    KVD_UNROLL
    for (int i = 0; i < 16; i++) {
        if (i < cnt) {
            const uint16_t *p = x + row * xs + gcol * g;
            for (int64_t c = 0; c < g; c += 32) _mm_prefetch((const char *)(p + c + KVD_PF_AHEAD), _MM_HINT_T0);
            __m512i a = _mm512_and_si512(_mm512_loadu_si512(p), m7fff);
            for (int64_t c = 32; c < g; c += 32)
                a = _mm512_max_epu16(a, _mm512_and_si512(_mm512_loadu_si512(p + c), m7fff));
            b->gp[i] = p;
            acc[i] = a;
            if (++gcol == G) {
                gcol = 0;
                row++;
            }
        } else {
            acc[i] = _mm512_setzero_si512();
        }
    }
    __m256i am = kvd512_red_max_epu16(acc);
    if (_mm256_cmpge_epu16_mask(am, _mm256_set1_epi16(0x7c00))) return 1;
    kvd512_absmax_scales(am, code_max, &b->s16, &b->inv);
    return 0;
}

/* pass 2 of a batch: codes of its cnt * g values (contiguous in the output) */
KVD_I512 void kvd512_absmax_quant(const kvd512_batch *b, uint8_t *out, int64_t g, const int cnt, const int fmt) {
    const int64_t nel = cnt * g;
    int gi = 0;
    int64_t off = 0;
    for (int64_t e = 0; e < nel; e += 64) {
        __m512i q[4];
        __mmask32 sg[2] = {0, 0};
        KVD_UNROLL
        for (int h = 0; h < 2; h++) {
            if (e + 32 * h < nel) {
                __m512 invb = _mm512_permutexvar_ps(kvd512_bcast_idx(gi), b->inv);
                kvd512_absmax_half(b->gp[gi] + off, invb, fmt, &q[2 * h], &q[2 * h + 1], &sg[h]);
                off += 32;
                if (off == g) {
                    off = 0;
                    gi++;
                }
            } else {
                q[2 * h] = q[2 * h + 1] = _mm512_setzero_si512();
            }
        }
        __m512i v = kvd512_pack_q8(q[0], q[1], q[2], q[3]);
        if (fmt >= 0) {
            __mmask64 sign = (__mmask64)sg[0] | ((__mmask64)sg[1] << 32);
            v = _mm512_mask_add_epi8(v, sign, v, _mm512_set1_epi8((char)0x80));
        } else {
            v = _mm512_max_epi8(v, _mm512_set1_epi8(-127));
        }
        if (nel - e >= 64)
            _mm512_storeu_si512(out + e, v);
        else
            _mm256_storeu_si256((__m256i *)(out + e), _mm512_castsi512_si256(v));
    }
}

/* d % g == 0 and g % 32 == 0: 16 groups per batch; the statistics of batch k+1 are computed before the codes
 * of batch k, so the long scale computation overlaps with quantizing */
KVD_I512 int kvd512_absmax_rows_fast(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, uint8_t *codes,
                                     uint16_t *scales, int64_t g, const int fmt) {
    const int64_t G = d / g, total = n * G;
    const float code_max = fmt < 0 ? 127.0f : (fmt ? 57344.0f : 448.0f);
    kvd512_batch cur, nxt;
    if (total >= 16 ? kvd512_absmax_stats(&cur, x, xs, g, G, 0, 16, code_max)
                    : kvd512_absmax_stats(&cur, x, xs, g, G, 0, (int)total, code_max))
        return KVD_NONFINITE;
    for (int64_t k0 = 0; k0 < total; k0 += 16) {
        const int64_t left = total - k0 - 16;
        if (left >= 16) {
            if (kvd512_absmax_stats(&nxt, x, xs, g, G, k0 + 16, 16, code_max)) return KVD_NONFINITE;
        } else if (left > 0) {
            if (kvd512_absmax_stats(&nxt, x, xs, g, G, k0 + 16, (int)left, code_max)) return KVD_NONFINITE;
        }
        if (total - k0 >= 16) {
            kvd512_absmax_quant(&cur, codes + k0 * g, g, 16, fmt);
            _mm256_storeu_si256((__m256i *)(scales + k0), cur.s16);
        } else {
            const int cnt = (int)(total - k0);
            kvd512_absmax_quant(&cur, codes + k0 * g, g, cnt, fmt);
            kvd512_st_h16(scales + k0, kvd512_m16(cnt), cur.s16);
        }
        cur = nxt;
    }
    return KVD_OK;
}

/* groups of 32 with G = d / 32 dividing 16 (the codec's fp8 pages: d = 128, 4 groups a row): 16 / G whole rows
 * per batch, all 16 groups loaded once into registers, reduced by the transposed tree and quantized from the
 * registers (no second load, no group bookkeeping). Rows left over take kvd512_absmax_rows_fast. */
KVD_I512 int kvd512_absmax_rows_g32(const uint16_t *x, ptrdiff_t xs, int64_t n, uint8_t *codes, uint16_t *scales,
                                    const int G, const int fmt) {
    const int R = 16 / G, d = 32 * G;
    const float code_max = fmt < 0 ? 127.0f : (fmt ? 57344.0f : 448.0f);
    const __m512i m7fff = _mm512_set1_epi16(0x7fff);
    int64_t r0 = 0;
    for (; r0 + R <= n; r0 += R) {
        /* q8 quantizes the signed values z; fp8 the magnitudes a (kept in registers from pass 1, so z dies
         * there and nothing spills) with the sign bits parked in memory as one 32-bit mask per group */
        __m512i z[16], a[16];
        uint32_t sg[16];
        KVD_UNROLL
        for (int i = 0; i < 16; i++) {
            const uint16_t *p = x + (r0 + i / G) * xs + 32 * (i % G);
            _mm_prefetch((const char *)(p + KVD_PF_AHEAD), _MM_HINT_T0);
            z[i] = _mm512_loadu_si512(p);
            a[i] = _mm512_and_si512(z[i], m7fff);
            if (fmt >= 0) _store_mask32((__mmask32 *)&sg[i], _mm512_movepi16_mask(z[i]));
        }
        __m256i am = kvd512_red_max_epu16(a);
        if (_mm256_cmpge_epu16_mask(am, _mm256_set1_epi16(0x7c00))) return KVD_NONFINITE;
        __m256i s16;
        __m512 inv;
        kvd512_absmax_scales(am, code_max, &s16, &inv);
        float invs[16] __attribute__((aligned(64)));
        _mm512_store_ps(invs, inv);
        /* re-read the inverse scales from memory: a broadcast load costs no ALU slot, while GCC otherwise
         * broadcasts them from the register with a vpbroadcastd + vpermd pair */
        __asm__ volatile("" ::: "memory");
        uint8_t *out = codes + r0 * d;
        KVD_UNROLL
        for (int i = 0; i < 16; i += 2) {
            __m512i q[4];
            KVD_UNROLL
            for (int h = 0; h < 2; h++) {
                const __m512 invb = _mm512_set1_ps(invs[i + h]);
                if (fmt < 0) {
                    const __m512i v = z[i + h];
                    q[2 * h] = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(v)), invb), KVD_RNE);
                    q[2 * h + 1] = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1)), invb), KVD_RNE);
                } else {
                    const __m512i av = a[i + h];
                    q[2 * h] = kvd512_fp8_w(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(av)), invb), fmt);
                    q[2 * h + 1] = kvd512_fp8_w(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(av, 1)), invb), fmt);
                }
            }
            __m512i b;
            if (fmt >= 0) /* groups i and i + 1: one 64-bit mask straight from memory */
                b = kvd512_fp8_pack(q[0], q[1], q[2], q[3], _load_mask64((__mmask64 *)&sg[i]), fmt);
            else
                b = _mm512_max_epi8(kvd512_pack_q8(q[0], q[1], q[2], q[3]), _mm512_set1_epi8(-127));
            _mm512_storeu_si512(out + 32 * i, b);
        }
        _mm256_storeu_si256((__m256i *)(scales + r0 * G), s16);
    }
    if (r0 < n) return kvd512_absmax_rows_fast(x + r0 * xs, xs, n - r0, d, codes + r0 * d, scales + r0 * G, 32, fmt);
    return KVD_OK;
}

/* any shape: one group at a time */
KVD_I512 int kvd512_absmax_rows_generic(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, uint8_t *codes,
                                        uint16_t *scales, int64_t group, const int fmt) {
    const int64_t ng = kvd_ngroups(d, group);
    const __m512i m7fff = _mm512_set1_epi16(0x7fff);
    const float code_max = fmt < 0 ? 127.0f : kvd_fp8_max[fmt];
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *row = x + r * xs;
        uint8_t *crow = codes + r * d;
        for (int64_t gi = 0; gi < ng; gi++) {
            const int64_t j0 = gi * group, j1 = kvd_min64(j0 + group, d);
            __m512i acc = _mm512_setzero_si512();
            for (int64_t j = j0; j < j1; j += 32)
                acc = _mm512_max_epu16(acc, _mm512_and_si512(kvd512_ld_h32(row + j, kvd512_m32(j1 - j)), m7fff));
            const uint16_t am = kvd512_hmax_epu16(acc);
            if (am >= 0x7c00u) return KVD_NONFINITE;
            float inv;
            scales[r * ng + gi] = kvd_absmax_scale(am, code_max, &inv);
            const __m512 invb = _mm512_set1_ps(inv);
            for (int64_t j = j0; j < j1; j += 16) {
                const __mmask16 m = kvd512_m16(j1 - j);
                __m256i xh = kvd512_ld_h16(row + j, m);
                __m128i c;
                if (fmt < 0) {
                    __m512i q = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_cvtph_ps(xh), invb), KVD_RNE);
                    c = _mm512_cvtsepi32_epi8(_mm512_max_epi32(q, _mm512_set1_epi32(-127)));
                } else {
                    __m256i a = _mm256_and_si256(xh, _mm256_set1_epi16(0x7fff));
                    __m512i q = kvd512_fp8_mag(_mm512_mul_ps(_mm512_cvtph_ps(a), invb), fmt);
                    q = _mm512_mask_or_epi32(q, _mm512_cmplt_epi32_mask(_mm512_cvtepi16_epi32(xh), _mm512_setzero_si512()),
                                             q, _mm512_set1_epi32(0x80));
                    c = _mm512_cvtepi32_epi8(q);
                }
                kvd512_st_b16(crow + j, m, c);
            }
        }
    }
    return KVD_OK;
}

KVD_I512 int kvd512_absmax_rows(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, uint8_t *codes,
                                uint16_t *scales, int64_t group, const int fmt) {
    const int64_t g = kvd_min64(group, d);
    if (g == 32 && d == 128) return kvd512_absmax_rows_g32(x, xs, n, codes, scales, 4, fmt);
    if (g == 32 && d == 64) return kvd512_absmax_rows_g32(x, xs, n, codes, scales, 2, fmt);
    if (g % 32 == 0 && d % g == 0) return kvd512_absmax_rows_fast(x, xs, n, d, codes, scales, g, fmt);
    return kvd512_absmax_rows_generic(x, xs, n, d, codes, scales, group, fmt);
}

KVD_T512 static int kvd512_q8_encode_rows(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, int8_t *codes,
                                          uint16_t *scales, int64_t group) {
    return kvd512_absmax_rows(x, xs, n, d, (uint8_t *)codes, scales, group, -1);
}

KVD_T512 static int kvd512_fp8_encode_rows(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, uint8_t *codes,
                                           uint16_t *scales, int64_t group, int fmt) {
    if (fmt == 0) return kvd512_absmax_rows(x, xs, n, d, codes, scales, group, 0);
    return kvd512_absmax_rows(x, xs, n, d, codes, scales, group, 1);
}

/* ======================================================================================================== */
/* decoders along rows: 16 values at a time, the scale (and min) of each lane from its group */

KVD_I512 void kvd512_q8_dec16(const int8_t *c, uint16_t *o, __m512 sv, __mmask16 m) {
    __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(kvd512_ld_b16(c, m)));
    kvd512_st_h16(o, m, _mm512_cvtps_ph(kvd512_clip(_mm512_mul_ps(v, sv)), KVD_RNE));
}

KVD_T512 static void kvd512_q8_decode_rows(const int8_t *codes, const uint16_t *scales, uint16_t *out, int64_t n,
                                           int64_t d, int64_t group) {
    const int64_t ng = kvd_ngroups(d, group);
    for (int64_t r = 0; r < n; r++) {
        const int8_t *c = codes + r * d;
        uint16_t *o = out + r * d;
        const uint16_t *s = scales + r * ng;
        if (group % 16 == 0) { /* whole 16-value chunks per group: one broadcast scale */
            for (int64_t gi = 0, j0 = 0; gi < ng; gi++, j0 += group) {
                const int64_t j1 = kvd_min64(j0 + group, d);
                const __m512 sv = _mm512_cvtph_ps(_mm256_set1_epi16((short)s[gi]));
                int64_t j = j0;
                for (; j + 16 <= j1; j += 16) kvd512_q8_dec16(c + j, o + j, sv, 0xffff);
                if (j < j1) kvd512_q8_dec16(c + j, o + j, sv, kvd512_m16(j1 - j));
            }
        } else {
            for (int64_t j = 0; j < d; j += 16)
                kvd512_q8_dec16(c + j, o + j, kvd512_lane_param(s, j, group, d), kvd512_m16(d - j));
        }
    }
}

/* fp8 code bytes -> float32 value of the reference table, times the lane scale */
KVD_I512 __m512 kvd512_fp8_times(__m128i c, __m512 s, const int fmt) {
    __m256i u = _mm256_slli_epi16(_mm256_cvtepu8_epi16(c), 8); /* the code in the high byte */
    if (fmt == 0) {
        /* E4M3 as float16 with the exponent field shifted down: (1+m/8) 2^(e-15); exact times 2^8 */
        __m256i h = _mm256_and_si256(_mm256_srai_epi16(u, 1), _mm256_set1_epi16((short)0xBFFF));
        return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_mul_ps(s, _mm512_set1_ps(256.0f)));
    }
    /* E5M2 is the top byte of a float16 (exponent 31 handled by the caller) */
    return _mm512_mul_ps(_mm512_cvtph_ps(u), s);
}

/* 16 fp8 codes times their scales, any fmt, exponent-31 E5M2 codes included (the reference table) */
KVD_I512 __m512 kvd512_fp8_chunk(__m128i cb, __m512 sv, const int fmt) {
    if (fmt == 0) return kvd512_fp8_times(cb, sv, 0);
    if (!_mm_cmpeq_epi8_mask(_mm_and_si128(cb, _mm_set1_epi8(0x7c)), _mm_set1_epi8(0x7c)))
        return kvd512_fp8_times(cb, sv, 1);
    float tmp[16], sc[16]; /* exponent 31 (never produced by an encoder): the table's finite values */
    uint8_t cc[16];
    _mm512_storeu_ps(sc, sv);
    _mm_storeu_si128((__m128i *)cc, cb);
    for (int l = 0; l < 16; l++) tmp[l] = kvd_fp8_lut[1][cc[l]] * sc[l];
    return _mm512_loadu_ps(tmp);
}

KVD_I512 void kvd512_fp8_decode_impl(const uint8_t *codes, const uint16_t *scales, uint16_t *out, int64_t n,
                                     int64_t d, int64_t group, const int fmt) {
    const int64_t ng = kvd_ngroups(d, group);
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *c = codes + r * d;
        uint16_t *o = out + r * d;
        const uint16_t *s = scales + r * ng;
        if (group % 32 == 0) { /* 32 values at a time, one broadcast scale per group */
            for (int64_t gi = 0, j0 = 0; gi < ng; gi++, j0 += group) {
                const int64_t j1 = kvd_min64(j0 + group, d);
                const __m512 sv = _mm512_cvtph_ps(_mm256_set1_epi16((short)s[gi]));
                const __m512 s256 = _mm512_mul_ps(sv, _mm512_set1_ps(256.0f)); /* exact */
                int64_t j = j0;
                for (; j + 32 <= j1; j += 32) {
                    const __m256i cb = _mm256_loadu_si256((const __m256i *)(c + j));
                    if (fmt == 1 && _mm256_cmpeq_epi8_mask(_mm256_and_si256(cb, _mm256_set1_epi8(0x7c)), _mm256_set1_epi8(0x7c))) {
                        _mm256_storeu_si256((__m256i *)(o + j), _mm512_cvtps_ph(kvd512_clip(kvd512_fp8_chunk(_mm256_castsi256_si128(cb), sv, 1)), KVD_RNE));
                        _mm256_storeu_si256((__m256i *)(o + j + 16), _mm512_cvtps_ph(kvd512_clip(kvd512_fp8_chunk(_mm256_extracti128_si256(cb, 1), sv, 1)), KVD_RNE));
                        continue;
                    }
                    __m512i u = _mm512_slli_epi16(_mm512_cvtepu8_epi16(cb), 8); /* the code in the high byte */
                    __m512 scale = sv;
                    if (fmt == 0) { /* E4M3 as float16 (1+m/8) 2^(e-15), times 2^8 exactly */
                        u = _mm512_and_si512(_mm512_srai_epi16(u, 1), _mm512_set1_epi16((short)0xBFFF));
                        scale = s256;
                    }
                    __m512 v0 = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(u)), scale);
                    __m512 v1 = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(u, 1)), scale);
                    _mm256_storeu_si256((__m256i *)(o + j), _mm512_cvtps_ph(kvd512_clip(v0), KVD_RNE));
                    _mm256_storeu_si256((__m256i *)(o + j + 16), _mm512_cvtps_ph(kvd512_clip(v1), KVD_RNE));
                }
                for (; j < j1; j += 16) {
                    const __mmask16 m = kvd512_m16(j1 - j);
                    kvd512_st_h16(o + j, m, _mm512_cvtps_ph(kvd512_clip(kvd512_fp8_chunk(kvd512_ld_b16(c + j, m), sv, fmt)), KVD_RNE));
                }
            }
        } else {
            for (int64_t j = 0, gi = 0, jn = group; j < d; j += 16) {
                const __mmask16 m = kvd512_m16(d - j);
                __m512 sv;
                if (group % 16 == 0) { /* chunks never straddle groups */
                    if (j == jn) {
                        gi++;
                        jn += group;
                    }
                    sv = _mm512_cvtph_ps(_mm256_set1_epi16((short)s[gi]));
                } else {
                    sv = kvd512_lane_param(s, j, group, d);
                }
                kvd512_st_h16(o + j, m, _mm512_cvtps_ph(kvd512_clip(kvd512_fp8_chunk(kvd512_ld_b16(c + j, m), sv, fmt)), KVD_RNE));
            }
        }
    }
}

KVD_T512 static void kvd512_fp8_decode_rows(const uint8_t *codes, const uint16_t *scales, uint16_t *out, int64_t n,
                                            int64_t d, int64_t group, int fmt) {
    if (fmt == 0)
        kvd512_fp8_decode_impl(codes, scales, out, n, d, group, 0);
    else
        kvd512_fp8_decode_impl(codes, scales, out, n, d, group, 1);
}

/* ======================================================================================================== */
/* q8 columns */

/* full blocks of 256 columns (512 contiguous bytes per token row: friendlier to the prefetchers than 64) */
KVD_I512 int kvd512_q8_cols_block256(const uint16_t *x, ptrdiff_t xs, int64_t t0, int64_t t1, int64_t c,
                                     int64_t c0, int8_t *codes, uint16_t *srow) {
    const __m512i m7fff = _mm512_set1_epi16(0x7fff);
    __m512i a[8];
    KVD_UNROLL
    for (int k = 0; k < 8; k++) a[k] = _mm512_setzero_si512();
    for (int64_t i = t0; i < t1; i++) {
        const uint16_t *p = x + i * xs + c0;
        KVD_UNROLL
        for (int k = 0; k < 8; k++) a[k] = _mm512_max_epu16(a[k], _mm512_and_si512(_mm512_loadu_si512(p + 32 * k), m7fff));
    }
    __m512i all = a[0];
    KVD_UNROLL
    for (int k = 1; k < 8; k++) all = _mm512_max_epu16(all, a[k]);
    if (_mm512_cmpge_epu16_mask(all, _mm512_set1_epi16(0x7c00))) return 1;
    __m512 inv[16];
    KVD_UNROLL
    for (int k = 0; k < 8; k++) {
        __m256i s0, s1;
        kvd512_absmax_scales(_mm512_castsi512_si256(a[k]), 127.0f, &s0, &inv[2 * k]);
        kvd512_absmax_scales(_mm512_extracti64x4_epi64(a[k], 1), 127.0f, &s1, &inv[2 * k + 1]);
        _mm256_storeu_si256((__m256i *)(srow + 32 * k), s0);
        _mm256_storeu_si256((__m256i *)(srow + 32 * k + 16), s1);
    }
    for (int64_t i = t0; i < t1; i++) {
        const uint16_t *p = x + i * xs + c0;
        KVD_UNROLL
        for (int k = 0; k < 8; k++) _mm_prefetch((const char *)(p + 256 + 32 * k), _MM_HINT_T0); /* next block */
        KVD_UNROLL
        for (int b = 0; b < 4; b++) {
            __m512i q[4];
            KVD_UNROLL
            for (int k = 0; k < 4; k++)
                q[k] = _mm512_cvt_roundps_epi32(
                    _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 64 * b + 16 * k))), inv[4 * b + k]),
                    KVD_RNE);
            _mm512_storeu_si512(codes + i * c + c0 + 64 * b,
                                _mm512_max_epi8(kvd512_pack_q8(q[0], q[1], q[2], q[3]), _mm512_set1_epi8(-127)));
        }
    }
    return 0;
}

KVD_T512 static int kvd512_q8_encode_cols(const uint16_t *x, ptrdiff_t xs, int64_t t, int64_t c, int8_t *codes,
                                          uint16_t *scales, int64_t group) {
    const __m512i m7fff = _mm512_set1_epi16(0x7fff);
    for (int64_t t0 = 0, gi = 0; t0 < t; t0 += group, gi++) {
        const int64_t t1 = kvd_min64(t0 + group, t);
        int64_t cb = 0;
        for (; cb + 256 <= c; cb += 256)
            if (kvd512_q8_cols_block256(x, xs, t0, t1, c, cb, codes, scales + gi * c + cb)) return KVD_NONFINITE;
        for (int64_t c0 = cb; c0 < c; c0 += 64) {
            const int64_t w = kvd_min64(64, c - c0);
            const __mmask32 ma = kvd512_m32(w), mb = kvd512_m32(w - 32);
            __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
            for (int64_t i = t0; i < t1; i++) {
                const uint16_t *p = x + i * xs + c0;
                a0 = _mm512_max_epu16(a0, _mm512_and_si512(kvd512_ld_h32(p, ma), m7fff));
                a1 = _mm512_max_epu16(a1, _mm512_and_si512(kvd512_ld_h32(p + 32, mb), m7fff));
            }
            if (_mm512_cmpge_epu16_mask(_mm512_max_epu16(a0, a1), _mm512_set1_epi16(0x7c00))) return KVD_NONFINITE;
            __m256i s16[4];
            __m512 inv[4];
            kvd512_absmax_scales(_mm512_castsi512_si256(a0), 127.0f, &s16[0], &inv[0]);
            kvd512_absmax_scales(_mm512_extracti64x4_epi64(a0, 1), 127.0f, &s16[1], &inv[1]);
            kvd512_absmax_scales(_mm512_castsi512_si256(a1), 127.0f, &s16[2], &inv[2]);
            kvd512_absmax_scales(_mm512_extracti64x4_epi64(a1, 1), 127.0f, &s16[3], &inv[3]);
            uint16_t *srow = scales + gi * c + c0;
            KVD_UNROLL
            for (int k = 0; k < 4; k++) kvd512_st_h16(srow + 16 * k, kvd512_m16(w - 16 * k), s16[k]);
            const __mmask64 mc = kvd512_m64(w);
            for (int64_t i = t0; i < t1; i++) {
                const uint16_t *p = x + i * xs + c0;
                _mm_prefetch((const char *)(p + 128), _MM_HINT_T0); /* the column block after next */
                _mm_prefetch((const char *)(p + 160), _MM_HINT_T0);
                __m512i xa = kvd512_ld_h32(p, ma), xb = kvd512_ld_h32(p + 32, mb);
                __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(xa)), inv[0]), KVD_RNE);
                __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(xa, 1)), inv[1]), KVD_RNE);
                __m512i q2 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(xb)), inv[2]), KVD_RNE);
                __m512i q3 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(xb, 1)), inv[3]), KVD_RNE);
                __m512i b = _mm512_max_epi8(kvd512_pack_q8(q0, q1, q2, q3), _mm512_set1_epi8(-127));
                __builtin_prefetch(codes + i * c + c0 + 64, 1, 3); /* the next block's output line */
                kvd512_st_b64(codes + i * c + c0, mc, b);
            }
        }
    }
    return KVD_OK;
}

KVD_T512 static void kvd512_q8_decode_cols(const int8_t *codes, const uint16_t *scales, uint16_t *out, int64_t t,
                                           int64_t c, int64_t group) {
    for (int64_t i = 0; i < t; i++) {
        const uint16_t *srow = scales + (i / group) * c;
        const int8_t *crow = codes + i * c;
        uint16_t *o = out + i * c;
        for (int64_t j = 0; j < c; j += 16) {
            const __mmask16 m = kvd512_m16(c - j);
            __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(kvd512_ld_b16(crow + j, m)));
            v = _mm512_mul_ps(v, _mm512_cvtph_ps(kvd512_ld_h16(srow + j, m)));
            kvd512_st_h16(o + j, m, _mm512_cvtps_ph(kvd512_clip(v), KVD_RNE));
        }
    }
}

#endif
