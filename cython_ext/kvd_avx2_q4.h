/* AVX2 fast paths of the q4 encoders, on the building blocks of kvd_avx2_util.h; included by kvd_avx2.h.
 * Ports of kvd_avx512_q4.h:
 * - columns: blocks of 64 columns (128 contiguous bytes per token row), min/max on int16 keys (kvd256_key:
 *   float order, -0 below +0), the scale arithmetic 8 columns per instruction.
 * - rotated rows of d = 64 or 128: batches of 8 groups (8 / G rows); the transform runs on 8-float vectors in
 *   a batch buffer, min/max of the unnormalized Y = FWHT(x) with float min/max (zero results get their sign
 *   recomputed exactly, as in kvd512_rot_pass1), one transposed reduction per batch, vectorized scales.
 *   Codes use mD = d * min and invD = inv / d (both exact: powers of two), so (Y - mD) * invD rounds exactly
 *   like the reference's (y - min) * inv with y = Y / d. Pass 1 of batch k+1 runs before pass 2 of batch k.
 * The reference's clip of a q4 code to [0, 15] can never act (kvd_scalar.h): plain rint, unsigned packs.
 */
#ifndef KVD_AVX2_Q4_H
#define KVD_AVX2_Q4_H

#include "kvd_avx2_util.h"

/* 8 x 8 int32 codes in [0, 15] (elements 0..63, vector k = elements 8k..8k+7) -> 32 bytes, element 2i in the
 * low nibble of byte i. The packs leave 4-element dwords in the order 0 2 4 6 | 1 3 5 7 (per 32 elements);
 * maddubs (bytes times 1, 16) folds each even/odd pair inside its dword, so the order problem is only fixed
 * once, on the final 32 bytes: qwords E0246 F0246 | E1357 F1357 in units of 2 bytes -> permute4x64 + pshufb. */
KVD_I256 __m256i kvd256_pack64_q4(const __m256i *q) {
    const __m256i mul = _mm256_set1_epi16(0x1001);
    __m256i b0 = _mm256_packus_epi16(_mm256_packus_epi32(q[0], q[1]), _mm256_packus_epi32(q[2], q[3]));
    __m256i b1 = _mm256_packus_epi16(_mm256_packus_epi32(q[4], q[5]), _mm256_packus_epi32(q[6], q[7]));
    __m256i r = _mm256_packus_epi16(_mm256_maddubs_epi16(b0, mul), _mm256_maddubs_epi16(b1, mul));
    r = _mm256_permute4x64_epi64(r, 0xD8); /* lane 0: E0 E2 E4 E6 E1 E3 E5 E7 (units of 2 bytes), lane 1: F */
    const __m256i sh = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                        0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    return _mm256_shuffle_epi8(r, sh);
}

KVD_I256 __m256i kvd256_q4c(__m256 y, __m256 mn, __m256 inv) {
    return _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(y, mn), inv));
}

/* 8 group minimums / maximums (float32) -> q4 scales, mins (float16 bits), min (float32), 1/scale: the steps
 * of kvd_q4_scale on 8 lanes */
KVD_I256 void kvd256_q4_scales(__m256 mn, __m256 mx, __m128i *s16, __m128i *m16, __m256 *mnf, __m256 *inv) {
    const __m128i mh = kvd256_f16_down(mn);
    const __m256 m = _mm256_cvtph_ps(mh);
    const __m128i h = kvd256_f16_up_nonneg(_mm256_div_ps(_mm256_sub_ps(mx, m), _mm256_set1_ps(15.0f)));
    *s16 = h;
    *m16 = mh;
    *mnf = m;
    *inv = kvd256_inv(_mm256_cvtph_ps(h));
}

/* ---- columns ------------------------------------------------------------------------------------------- */

/* one block of 64 columns of token group [t0, t1): 1 on NaN/Inf */
KVD_I256 int kvd256_q4_cols_block64(const uint16_t *x, ptrdiff_t xs, int64_t t0, int64_t t1, int64_t c0,
                                    uint8_t *packed, int64_t pb, uint16_t *srow, uint16_t *mrow) {
    __m256i mx[4], mn[4];
    {
        const uint16_t *p = x + t0 * xs + c0;
        KVD_UNROLL256
        for (int k = 0; k < 4; k++) mx[k] = mn[k] = kvd256_key(_mm256_loadu_si256((const __m256i *)(p + 16 * k)));
    }
    for (int64_t i = t0 + 1; i < t1; i++) {
        const uint16_t *p = x + i * xs + c0;
        KVD_UNROLL256
        for (int k = 0; k < 4; k++) {
            const __m256i kk = kvd256_key(_mm256_loadu_si256((const __m256i *)(p + 16 * k)));
            mx[k] = _mm256_max_epi16(mx[k], kk);
            mn[k] = _mm256_min_epi16(mn[k], kk);
        }
    }
    __m256i amx = _mm256_max_epi16(_mm256_max_epi16(mx[0], mx[1]), _mm256_max_epi16(mx[2], mx[3]));
    __m256i amn = _mm256_min_epi16(_mm256_min_epi16(mn[0], mn[1]), _mm256_min_epi16(mn[2], mn[3]));
    /* keys >= 0x7c00 are +inf/+NaN, keys <= -31745 are -inf/-NaN */
    if (_mm256_movemask_epi8(_mm256_or_si256(_mm256_cmpgt_epi16(amx, _mm256_set1_epi16(0x7bff)),
                                             _mm256_cmpgt_epi16(_mm256_set1_epi16(-31744), amn))))
        return 1;
    float mnf[64] __attribute__((aligned(32))), inv[64] __attribute__((aligned(32)));
    KVD_UNROLL256
    for (int k = 0; k < 8; k++) {
        const __m256i kmn = kvd256_key(mn[k / 2]), kmx = kvd256_key(mx[k / 2]); /* keys back to bits */
        const __m128i bmn = k & 1 ? _mm256_extracti128_si256(kmn, 1) : _mm256_castsi256_si128(kmn);
        const __m128i bmx = k & 1 ? _mm256_extracti128_si256(kmx, 1) : _mm256_castsi256_si128(kmx);
        __m128i s16, m16;
        __m256 mf, iv;
        kvd256_q4_scales(_mm256_cvtph_ps(bmn), _mm256_cvtph_ps(bmx), &s16, &m16, &mf, &iv);
        _mm_storeu_si128((__m128i *)(srow + 8 * k), s16);
        _mm_storeu_si128((__m128i *)(mrow + 8 * k), m16);
        _mm256_store_ps(mnf + 8 * k, mf);
        _mm256_store_ps(inv + 8 * k, iv);
    }
    for (int64_t i = t0; i < t1; i++) {
        const uint16_t *p = x + i * xs + c0;
        __m256i q[8];
        _mm_prefetch((const char *)(p + 64), _MM_HINT_T0); /* the next block of this row */
        _mm_prefetch((const char *)(p + 96), _MM_HINT_T0);
        KVD_UNROLL256
        for (int k = 0; k < 8; k++)
            q[k] = kvd256_q4c(kvd256_ld8(p + 8 * k), _mm256_load_ps(mnf + 8 * k), _mm256_load_ps(inv + 8 * k));
        _mm256_storeu_si256((__m256i *)(packed + i * pb + c0 / 2), kvd256_pack64_q4(q));
    }
    return 0;
}

/* ---- rotated rows ---------------------------------------------------------------------------------------- */

/* 8 float vectors -> one vector of their 8 reductions, in order (OP: min or max) */
#define KVD256_RED8_PS(NAME, OP)                                                                             \
    KVD_I256 __m256 NAME(const __m256 *a) {                                                                  \
        __m256 v[4], w[2];                                                                                   \
        KVD_UNROLL256                                                                                        \
        for (int j = 0; j < 4; j++) /* lane 0: a[2j] folded to 4, lane 1: a[2j+1] */                        \
            v[j] = OP(_mm256_permute2f128_ps(a[2 * j], a[2 * j + 1], 0x20),                                  \
                      _mm256_permute2f128_ps(a[2 * j], a[2 * j + 1], 0x31));                                 \
        KVD_UNROLL256                                                                                        \
        for (int k = 0; k < 2; k++) /* lane 0: a[4k], a[4k+2] (2 each); lane 1: a[4k+1], a[4k+3] */         \
            w[k] = OP(_mm256_shuffle_ps(v[2 * k], v[2 * k + 1], 0x44), _mm256_shuffle_ps(v[2 * k], v[2 * k + 1], 0xEE)); \
        /* lane 0: a0 a2 a4 a6, lane 1: a1 a3 a5 a7 */                                                       \
        __m256 r = OP(_mm256_shuffle_ps(w[0], w[1], 0x88), _mm256_shuffle_ps(w[0], w[1], 0xDD));             \
        return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));                       \
    }
KVD256_RED8_PS(kvd256_red8_max_ps, _mm256_max_ps)
KVD256_RED8_PS(kvd256_red8_min_ps, _mm256_min_ps)

typedef struct {
    float y[8 * 128] __attribute__((aligned(32))); /* Y of the batch's rows */
    float mD[8], invD[8];                           /* per group, for pass 2 (broadcast loads) */
    __m128i s16, m16;
} kvd256_rot_batch;

/* in-register butterflies h = 1, 2, 4 of one 8-float vector (fma with a +-1 multiplier: one rounding, exactly
 * the reference's add or subtract) */
KVD_I256 __m256 kvd256_fwht8(__m256 v) {
    const __m256 s1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1), s2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
    const __m256 s4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
    v = _mm256_fmadd_ps(v, s1, _mm256_permute_ps(v, 0xB1));
    v = _mm256_fmadd_ps(v, s2, _mm256_permute_ps(v, 0x4E));
    return _mm256_fmadd_ps(v, s4, _mm256_permute2f128_ps(v, v, 0x01));
}

/* the butterflies between 8 registers (element distance 8, 16, 32), in the reference's stage order */
KVD_I256 void kvd256_fwht_regs8(__m256 *z) {
    KVD_UNROLL256
    for (int h = 1; h < 8; h *= 2)
        KVD_UNROLL256
        for (int i = 0; i < 8; i += 2 * h)
            KVD_UNROLL256
            for (int j = i; j < i + h; j++) {
                if (j + h >= 8) break; /* never: keeps GCC's array-bounds check quiet */
                const __m256 a = z[j], c = z[j + h];
                z[j] = _mm256_add_ps(a, c);
                z[j + h] = _mm256_sub_ps(a, c);
            }
}

KVD_I256 int kvd256_rot_pass1(kvd256_rot_batch *b, const uint16_t *x, ptrdiff_t xs, int64_t r0, const int rows,
                              const int d, const int g) {
    const int nz = d / 8, G = d / g, zpg = g / 8;
    __m256 amx[8], amn[8];
/* group min/max of vector v (value val) of a row: the first vector of a group starts it. Float min/max: the
 * sign of a zero result is fixed in kvd256_rot_pass1. */
#define KVD256_MM(v, val)                                                                                    \
    do {                                                                                                     \
        const int k_ = ((v) / zpg) & 7; /* < G <= 8; the mask only tells GCC so */                          \
        if ((v) % zpg == 0) {                                                                                \
            gmx[k_] = gmn[k_] = (val);                                                                       \
        } else {                                                                                             \
            gmx[k_] = _mm256_max_ps(gmx[k_], (val));                                                         \
            gmn[k_] = _mm256_min_ps(gmn[k_], (val));                                                         \
        }                                                                                                    \
    } while (0)
    KVD_UNROLL256
    for (int rr = 0; rr < 8; rr++) {
        if (rr >= rows) break;
        const uint16_t *p = x + (r0 + rr) * xs;
        float *y = b->y + rr * d;
        __m256 gmx[8], gmn[8];
        for (int i = 0; i < d; i += 32) _mm_prefetch((const char *)(p + i + KVD256_PF_AHEAD), _MM_HINT_T0);
        /* h = 1, 2, 4 in registers, then h = 8 .. 32 between the 8 vectors of a half row (stages never leave
         * it), then for d = 128 h = 64 between the halves: each element sees the reference's additions in the
         * reference's order, only independent elements are interleaved differently. Min/max are taken from
         * the registers of the last stage. */
        KVD_UNROLL256
        for (int h0 = 0; h0 < nz; h0 += 8) {
            __m256 z[8];
            KVD_UNROLL256
            for (int i = 0; i < 8; i++) z[i] = kvd256_fwht8(kvd256_ld8(p + 8 * (h0 + i)));
            kvd256_fwht_regs8(z);
            if (nz == 8) { /* d = 64: done */
                KVD_UNROLL256
                for (int i = 0; i < 8; i++) {
                    _mm256_store_ps(y + 8 * i, z[i]);
                    KVD256_MM(i, z[i]);
                }
            } else if (h0 == 0) {
                KVD_UNROLL256
                for (int i = 0; i < 8; i++) _mm256_store_ps(y + 8 * i, z[i]);
            } else { /* h = 64 with the first half */
                KVD_UNROLL256
                for (int j = 0; j < 8; j++) {
                    const __m256 a = _mm256_load_ps(y + 8 * j), sum = _mm256_add_ps(a, z[j]), dif = _mm256_sub_ps(a, z[j]);
                    _mm256_store_ps(y + 8 * j, sum);
                    _mm256_store_ps(y + 64 + 8 * j, dif);
                    KVD256_MM(j, sum);
                    KVD256_MM(8 + j, dif);
                }
            }
        }
        KVD_UNROLL256
        for (int k = 0; k < G; k++) {
            amx[(rr * G + k) & 7] = gmx[k & 7]; /* rows * G <= 8 */
            amn[(rr * G + k) & 7] = gmn[k & 7];
        }
    }
#undef KVD256_MM
    for (int i = rows * G; i < 8; i++) amx[i] = amn[i] = _mm256_setzero_ps();
    __m256 mxY = kvd256_red8_max_ps(amx), mnY = kvd256_red8_min_ps(amn);
    /* Every output of the unnormalized transform is a signed sum of all inputs of its row, and finite float16
     * rows cannot overflow float32: a NaN/Inf input makes every output of its row non-finite, so the group's
     * minimum or maximum is non-finite whatever order min/max saw the values in. */
    const __m256 inf = _mm256_set1_ps(__builtin_inff());
    if (_mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(mxY, inf, _CMP_NLT_UQ),
                                        _mm256_cmp_ps(mnY, _mm256_sub_ps(_mm256_setzero_ps(), inf), _CMP_NGT_UQ))))
        return 1;
    /* a zero minimum / maximum: recompute its sign exactly (-0 below +0) from the stored values */
    int zero = _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(mxY, _mm256_setzero_ps(), _CMP_EQ_OQ),
                                               _mm256_cmp_ps(mnY, _mm256_setzero_ps(), _CMP_EQ_OQ)));
    zero &= (1 << (rows * G)) - 1;
    if (zero) {
        float fmx[8], fmn[8];
        _mm256_storeu_ps(fmx, mxY);
        _mm256_storeu_ps(fmn, mnY);
        for (int k = 0; k < 8; k++)
            if ((zero >> k) & 1) kvd_minmax_f32(b->y + k * g, g, &fmn[k], &fmx[k]); /* groups contiguous in y */
        mxY = _mm256_loadu_ps(fmx);
        mnY = _mm256_loadu_ps(fmn);
    }
    const __m256 vdinv = _mm256_set1_ps(1.0f / (float)d); /* y = Y * (1/d) exactly as the reference scales */
    __m256 mnf, inv;
    kvd256_q4_scales(_mm256_mul_ps(mnY, vdinv), _mm256_mul_ps(mxY, vdinv), &b->s16, &b->m16, &mnf, &inv);
    _mm256_storeu_ps(b->mD, _mm256_mul_ps(mnf, _mm256_set1_ps((float)d)));
    _mm256_storeu_ps(b->invD, _mm256_mul_ps(inv, vdinv));
    return 0;
}

KVD_I256 void kvd256_rot_pass2(const kvd256_rot_batch *b, uint8_t *out, const int rows, const int d, const int g) {
    const int zpg = g / 8, G = d / g; /* d % 64 == 0: whole 64-element chunks */
    for (int rr = 0; rr < rows; rr++) {
        const float *y = b->y + rr * d, *mD = b->mD + rr * G, *invD = b->invD + rr * G;
        KVD_UNROLL256
        for (int e = 0; e < d; e += 64) {
            __m256i q[8];
            KVD_UNROLL256
            for (int s = 0; s < 8; s++) {
                const int v = e / 8 + s; /* vector of the row: group v / zpg (constants when d and g are) */
                q[s] = kvd256_q4c(_mm256_load_ps(y + 8 * v), _mm256_broadcast_ss(mD + v / zpg),
                                  _mm256_broadcast_ss(invD + v / zpg));
            }
            _mm256_storeu_si256((__m256i *)(out + rr * (d / 2) + e / 2), kvd256_pack64_q4(q));
        }
    }
}

/* d in {64, 128}, g % 8 == 0, d % g == 0, d / g <= 8 */
KVD_I256 int kvd256_q4_rows_rot(const uint16_t *x, ptrdiff_t xs, int64_t n, uint8_t *packed, uint16_t *scales,
                                uint16_t *mins, const int d, const int g) {
    const int G = d / g, R = 8 / G;
    kvd256_rot_batch bb[2];
    int cur = 0;
    if (kvd256_rot_pass1(&bb[0], x, xs, 0, n >= R ? R : (int)n, d, g)) return KVD_NONFINITE;
    for (int64_t r0 = 0; r0 < n; r0 += R) {
        const int64_t left = n - r0 - R;
        if (left > 0 && kvd256_rot_pass1(&bb[cur ^ 1], x, xs, r0 + R, left >= R ? R : (int)left, d, g))
            return KVD_NONFINITE;
        const kvd256_rot_batch *b = &bb[cur];
        const int rows = (int)kvd_min64(R, n - r0);
        kvd256_rot_pass2(b, packed + r0 * (d / 2), rows, d, g);
        if (rows * G == 8) {
            _mm_storeu_si128((__m128i *)(scales + r0 * G), b->s16);
            _mm_storeu_si128((__m128i *)(mins + r0 * G), b->m16);
        } else {
            uint16_t ts[8], tm[8];
            _mm_storeu_si128((__m128i *)ts, b->s16);
            _mm_storeu_si128((__m128i *)tm, b->m16);
            memcpy(scales + r0 * G, ts, (size_t)(rows * G) * 2);
            memcpy(mins + r0 * G, tm, (size_t)(rows * G) * 2);
        }
        cur ^= 1;
    }
    return KVD_OK;
}

/* ---- rotated rows: decode ------------------------------------------------------------------------------- */

/* one row of d = 64 or 128 (G groups of g): v = q * s + m (a multiply and an add, the reference's two
 * roundings), the transform in the order of kvd256_rot_pass1, clip, float16. Half a row in registers; for
 * d = 128 the first half waits in y for the h = 64 stage. */
KVD_I256 void kvd256_q4d_rot_row(const uint8_t *prow, const uint16_t *srow, const uint16_t *mrow, uint16_t *o,
                                 const int d, const int g) {
    const int nz = d / 8, G = d / g, zpg = g / 8;
    float sf[8], mf[8];
    KVD_UNROLL256
    for (int k = 0; k < G; k++) {
        sf[k & 7] = kvd256_h2f(srow[k]);
        mf[k & 7] = kvd256_h2f(mrow[k]);
    }
    float y[64] __attribute__((aligned(32)));
    KVD_UNROLL256
    for (int h0 = 0; h0 < nz; h0 += 8) {
        __m256 z[8];
        KVD_UNROLL256
        for (int i = 0; i < 8; i++) {
            const int v = h0 + i, k = (v / zpg) & 7;
            const __m256 q = kvd256_nib8(prow + 4 * v);
            z[i] = kvd256_fwht8(_mm256_add_ps(_mm256_mul_ps(q, _mm256_broadcast_ss(&sf[k])), _mm256_broadcast_ss(&mf[k])));
        }
        kvd256_fwht_regs8(z);
        if (nz == 8) {
            KVD_UNROLL256
            for (int i = 0; i < 8; i++) kvd256_st8(o + 8 * i, kvd256_clip(z[i]));
        } else if (h0 == 0) {
            KVD_UNROLL256
            for (int i = 0; i < 8; i++) _mm256_store_ps(y + 8 * i, z[i]);
        } else { /* h = 64 with the first half */
            KVD_UNROLL256
            for (int j = 0; j < 8; j++) {
                const __m256 a = _mm256_load_ps(y + 8 * j);
                kvd256_st8(o + 8 * j, kvd256_clip(_mm256_add_ps(a, z[j])));
                kvd256_st8(o + 64 + 8 * j, kvd256_clip(_mm256_sub_ps(a, z[j])));
            }
        }
    }
}

/* d in {64, 128}, g % 8 == 0, d % g == 0, d / g <= 8 */
KVD_I256 void kvd256_q4_decode_rot(const uint8_t *packed, const uint16_t *scales, const uint16_t *mins, uint16_t *out,
                                   int64_t n, const int d, const int g) {
    const int G = d / g;
    for (int64_t r = 0; r < n; r++)
        kvd256_q4d_rot_row(packed + r * (d / 2), scales + r * G, mins + r * G, out + r * d, d, g);
}

#endif
