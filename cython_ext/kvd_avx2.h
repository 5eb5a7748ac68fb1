/* AVX2 + F16C + FMA backend, bit-identical to kvd/codec/reference.py.
 *
 * Simpler than the AVX-512 set: one group (rows) or one block of 16 columns (columns) at a time, 8 float32
 * lanes per operation, and the scalar helpers of kvd_scalar.h for tails and for per-group scale arithmetic of
 * row groups. Column blocks compute 8 scales per vector with the same IEEE steps. The float16 tricks are the
 * ones of kvd_avx512.h: absmax and the NaN/Inf check on (bits & 0x7fff), q4 min/max on signed integer keys
 * (-0 ordered just below +0), FMA with a +-1 multiplier for the in-register Hadamard butterflies.
 *
 * The codec's shapes take the tuned paths of kvd_avx2_q8.h (q8 / fp8 rows with groups of 32k: batches of 8
 * groups with vectorized scales; q8 columns in blocks of 128) and kvd_avx2_q4.h (q4 columns in blocks of 64;
 * rotated q4 rows of 64 or 128 values, encode and decode). The code below is the generic path and the tails.
 * The building blocks of all three are in kvd_avx2_util.h, which each of them includes.
 */
#ifndef KVD_AVX2_H
#define KVD_AVX2_H

#include "kvd_avx2_util.h"
#include "kvd_avx2_q8.h"
#include "kvd_avx2_q4.h"

/* ======================================================================================================== */

KVD_T256 static int kvd256_f16_copy_rows(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, uint16_t *out) {
    for (int64_t r = 0; r < n; r++)
        if (kvd256_absmax(x + r * xs, d) >= 0x7c00u) return KVD_NONFINITE;
    if (xs == d)
        memmove(out, x, (size_t)(n * d) * 2); /* memmove: out may be x itself */
    else
        for (int64_t r = 0; r < n; r++) memmove(out + r * d, x + r * xs, (size_t)d * 2);
    return KVD_OK;
}

KVD_I256 int kvd256_absmax_rows(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, uint8_t *codes,
                                uint16_t *scales, int64_t group, const int fmt) {
    if (group % 32 == 0 && d % group == 0) return kvd256_absmax_rows_fast(x, xs, n, d, codes, scales, group, fmt);
    const int64_t ng = kvd_ngroups(d, group);
    const float code_max = fmt < 0 ? 127.0f : kvd_fp8_max[fmt];
    float invs[256];
    const int64_t chunk = 256; /* groups whose scales are computed before their codes: independent chains */
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *row = x + r * xs;
        uint8_t *crow = codes + r * d;
        for (int64_t g0 = 0; g0 < ng; g0 += chunk) {
            const int64_t g1 = kvd_min64(g0 + chunk, ng);
            for (int64_t gi = g0; gi < g1; gi++) {
                const int64_t j0 = gi * group, j1 = kvd_min64(j0 + group, d);
                const uint16_t am = kvd256_absmax(row + j0, j1 - j0);
                if (am >= 0x7c00u) return KVD_NONFINITE;
                scales[r * ng + gi] = kvd256_absmax_scale(am, code_max, &invs[gi - g0]);
            }
            for (int64_t gi = g0; gi < g1; gi++) {
                const int64_t j0 = gi * group, j1 = kvd_min64(j0 + group, d);
                const float inv = invs[gi - g0];
                const __m256 iv = _mm256_set1_ps(inv);
                int64_t j = j0;
                for (; j + 8 <= j1; j += 8) _mm_storel_epi64((__m128i *)(crow + j), kvd256_codes8(row + j, iv, fmt));
                for (; j < j1; j++)
                    crow[j] = fmt < 0 ? (uint8_t)kvd_q8_code(row[j], inv) : kvd_fp8_code(row[j], inv, fmt);
            }
        }
    }
    return KVD_OK;
}

KVD_T256 static int kvd256_q8_encode_rows(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, int8_t *codes,
                                          uint16_t *scales, int64_t group) {
    return kvd256_absmax_rows(x, xs, n, d, (uint8_t *)codes, scales, group, -1);
}

KVD_T256 static int kvd256_fp8_encode_rows(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, uint8_t *codes,
                                           uint16_t *scales, int64_t group, int fmt) {
    if (fmt == 0) return kvd256_absmax_rows(x, xs, n, d, codes, scales, group, 0);
    return kvd256_absmax_rows(x, xs, n, d, codes, scales, group, 1);
}

/* decoders along rows: per group, 8 values at a time with the group's broadcast parameters */
KVD_T256 static void kvd256_q8_decode_rows(const int8_t *codes, const uint16_t *scales, uint16_t *out, int64_t n,
                                           int64_t d, int64_t group) {
    const int64_t ng = kvd_ngroups(d, group);
    for (int64_t r = 0; r < n; r++)
        for (int64_t gi = 0, j0 = 0; gi < ng; gi++, j0 += group) {
            const int64_t j1 = kvd_min64(j0 + group, d), base = r * d;
            const float s = kvd_h2f(scales[r * ng + gi]);
            const __m256 sv = _mm256_set1_ps(s);
            int64_t j = j0;
            for (; j + 8 <= j1; j += 8) {
                __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + base + j))));
                kvd256_st8(out + base + j, kvd256_clip(_mm256_mul_ps(c, sv)));
            }
            for (; j < j1; j++) out[base + j] = kvd_decode_f16((float)codes[base + j] * s);
        }
}

/* 8 fp8 codes -> the reference table's float32 values times s (exponent-31 E5M2 codes: see kvd512_fp8_times) */
KVD_I256 __m256 kvd256_fp8_times8(const uint8_t *c, __m256 s, const int fmt) {
    __m128i u = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)c)), 8);
    if (fmt == 0)
        return _mm256_mul_ps(_mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(u, 1), _mm_set1_epi16((short)0xBFFF))),
                             _mm256_mul_ps(s, _mm256_set1_ps(256.0f)));
    return _mm256_mul_ps(_mm256_cvtph_ps(u), s);
}

KVD_T256 static void kvd256_fp8_decode_rows(const uint8_t *codes, const uint16_t *scales, uint16_t *out, int64_t n,
                                            int64_t d, int64_t group, int fmt) {
    const int64_t ng = kvd_ngroups(d, group);
    const float *lut = kvd_fp8_lut[fmt];
    for (int64_t r = 0; r < n; r++)
        for (int64_t gi = 0, j0 = 0; gi < ng; gi++, j0 += group) {
            const int64_t j1 = kvd_min64(j0 + group, d), base = r * d;
            const float s = kvd_h2f(scales[r * ng + gi]);
            const __m256 sv = _mm256_set1_ps(s);
            int64_t j = j0;
            for (; j + 8 <= j1; j += 8) {
                const uint8_t *c = codes + base + j;
                uint64_t w;
                memcpy(&w, c, 8);
                if (fmt == 1 && (((w & 0x7c7c7c7c7c7c7c7cull) + 0x0404040404040404ull) & 0x8080808080808080ull))
                    break; /* an exponent-31 E5M2 code: the table below */
                kvd256_st8(out + base + j, kvd256_clip(fmt == 0 ? kvd256_fp8_times8(c, sv, 0) : kvd256_fp8_times8(c, sv, 1)));
            }
            for (; j < j1; j++) out[base + j] = kvd_decode_f16(lut[codes[base + j]] * s);
        }
}

/* ======================================================================================================== */
/* columns: blocks of 16 columns (tail columns one by one) */

KVD_T256 static int kvd256_q8_encode_cols(const uint16_t *x, ptrdiff_t xs, int64_t t, int64_t c, int8_t *codes,
                                          uint16_t *scales, int64_t group) {
    const __m256i m7fff = _mm256_set1_epi16(0x7fff);
    for (int64_t t0 = 0, gi = 0; t0 < t; t0 += group, gi++) {
        const int64_t t1 = kvd_min64(t0 + group, t);
        int64_t c0 = 0;
        for (; c0 + 128 <= c; c0 += 128)
            if (kvd256_q8_cols_block128(x, xs, t0, t1, c, c0, codes, scales + gi * c + c0)) return KVD_NONFINITE;
        for (; c0 + 16 <= c; c0 += 16) {
            __m256i a = _mm256_setzero_si256();
            for (int64_t i = t0; i < t1; i++)
                a = _mm256_max_epu16(a, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i * xs + c0)), m7fff));
            if (kvd256_hmax_epu16(a) >= 0x7c00u) return KVD_NONFINITE;
            __m256 inv[2];
            for (int k = 0; k < 2; k++) {
                __m128i amk = k ? _mm256_extracti128_si256(a, 1) : _mm256_castsi256_si128(a);
                __m128i h = kvd256_f16_up_nonneg(_mm256_div_ps(_mm256_cvtph_ps(amk), _mm256_set1_ps(127.0f)));
                _mm_storeu_si128((__m128i *)(scales + gi * c + c0 + 8 * k), h);
                inv[k] = kvd256_inv(_mm256_cvtph_ps(h));
            }
            for (int64_t i = t0; i < t1; i++) {
                const uint16_t *p = x + i * xs + c0;
                __m128i lo = kvd256_codes8(p, inv[0], -1), hi = kvd256_codes8(p + 8, inv[1], -1);
                _mm_storeu_si128((__m128i *)(codes + i * c + c0), _mm_unpacklo_epi64(lo, hi));
            }
        }
        for (; c0 < c; c0++) {
            uint16_t am = 0;
            for (int64_t i = t0; i < t1; i++)
                if ((x[i * xs + c0] & 0x7fffu) > am) am = x[i * xs + c0] & 0x7fffu;
            if (am >= 0x7c00u) return KVD_NONFINITE;
            float inv;
            scales[gi * c + c0] = kvd256_absmax_scale(am, 127.0f, &inv);
            for (int64_t i = t0; i < t1; i++) codes[i * c + c0] = kvd_q8_code(x[i * xs + c0], inv);
        }
    }
    return KVD_OK;
}

KVD_T256 static void kvd256_q8_decode_cols(const int8_t *codes, const uint16_t *scales, uint16_t *out, int64_t t,
                                           int64_t c, int64_t group) {
    for (int64_t i = 0; i < t; i++) {
        const uint16_t *srow = scales + (i / group) * c;
        int64_t j = 0;
        for (; j + 8 <= c; j += 8) {
            __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + i * c + j))));
            kvd256_st8(out + i * c + j, kvd256_clip(_mm256_mul_ps(v, kvd256_ld8(srow + j))));
        }
        for (; j < c; j++) out[i * c + j] = kvd_decode_f16((float)codes[i * c + j] * kvd_h2f(srow[j]));
    }
}

/* ======================================================================================================== */
/* q4 */

/* FWHT of a float32 buffer (d a power of two), stages in the reference's order */
KVD_I256 void kvd256_fwht_buf(float *y, int64_t d) {
    if (d < 8) {
        kvd_fwht_scalar(y, d);
        return;
    }
    const __m256 s1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1), s2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
    const __m256 s4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
    for (int64_t j = 0; j < d; j += 8) { /* h = 1, 2, 4 inside a register: fma(v, +-1, partner) = partner +- v */
        __m256 v = _mm256_loadu_ps(y + j);
        v = _mm256_fmadd_ps(v, s1, _mm256_permute_ps(v, 0xB1));
        v = _mm256_fmadd_ps(v, s2, _mm256_permute_ps(v, 0x4E));
        v = _mm256_fmadd_ps(v, s4, _mm256_permute2f128_ps(v, v, 0x01));
        _mm256_storeu_ps(y + j, v);
    }
    for (int64_t h = 8; h < d; h *= 2)
        for (int64_t i = 0; i < d; i += 2 * h)
            for (int64_t j = i; j < i + h; j += 8) {
                __m256 a = _mm256_loadu_ps(y + j), b = _mm256_loadu_ps(y + j + h);
                _mm256_storeu_ps(y + j, _mm256_add_ps(a, b));
                _mm256_storeu_ps(y + j + h, _mm256_sub_ps(a, b));
            }
}

KVD_I256 int32_t kvd256_hred_epi32(__m256i v, int is_max) {
    __m128i b = is_max ? _mm_max_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1))
                       : _mm_min_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    __m128i c = _mm_shuffle_epi32(b, 0x4E);
    b = is_max ? _mm_max_epi32(b, c) : _mm_min_epi32(b, c);
    c = _mm_shuffle_epi32(b, 0xB1);
    b = is_max ? _mm_max_epi32(b, c) : _mm_min_epi32(b, c);
    return _mm_cvtsi128_si32(b);
}

KVD_I256 float kvd256_unkey32(int32_t k) { return kvd_u2f((uint32_t)(k ^ ((k >> 31) & 0x7fffffff))); }

/* one row of float32 values y -> packed codes, scales, mins (stage: d bytes of scratch) */
KVD_I256 void kvd256_q4_row(const float *y, int64_t d, int64_t group, uint8_t *stage, uint8_t *prow,
                            uint16_t *srow, uint16_t *mrow) {
    const int64_t ng = kvd_ngroups(d, group);
    for (int64_t gi = 0, j0 = 0; gi < ng; gi++, j0 += group) {
        const int64_t j1 = kvd_min64(j0 + group, d);
        __m256i mx = _mm256_set1_epi32(INT32_MIN), mn = _mm256_set1_epi32(INT32_MAX);
        int64_t j = j0;
        for (; j + 8 <= j1; j += 8) {
            __m256i k = kvd256_key32(_mm256_castps_si256(_mm256_loadu_ps(y + j)));
            mx = _mm256_max_epi32(mx, k);
            mn = _mm256_min_epi32(mn, k);
        }
        float fmn = y[j0], fmx = y[j0];
        if (j > j0) {
            fmn = kvd256_unkey32(kvd256_hred_epi32(mn, 0));
            fmx = kvd256_unkey32(kvd256_hred_epi32(mx, 1));
        }
        for (; j < j1; j++) {
            if (kvd_lt(y[j], fmn)) fmn = y[j];
            if (kvd_lt(fmx, y[j])) fmx = y[j];
        }
        float mnf, inv;
        srow[gi] = kvd256_q4_scale(fmn, fmx, &mrow[gi], &mnf, &inv);
        const __m256 mb = _mm256_set1_ps(mnf), ib = _mm256_set1_ps(inv);
        for (j = j0; j + 8 <= j1; j += 8)
            _mm_storel_epi64((__m128i *)(stage + j),
                             kvd256_pack8(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(y + j), mb), ib)), 0));
        for (; j < j1; j++) stage[j] = kvd_q4_code(y[j], mnf, inv);
    }
    int64_t j = 0;
    for (; j + 16 <= d; j += 16) { /* 16 codes -> 8 bytes */
        __m128i w = _mm_maddubs_epi16(_mm_loadu_si128((const __m128i *)(stage + j)), _mm_set1_epi16(0x1001));
        _mm_storel_epi64((__m128i *)(prow + j / 2), _mm_packus_epi16(w, w));
    }
    for (; j < d; j++) kvd_put_nibble(prow, j, stage[j]);
}

KVD_T256 static int kvd256_q4_encode_rows(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, uint8_t *packed,
                                          uint16_t *scales, uint16_t *mins, int64_t group, int rotate) {
    if (rotate && (d == 64 || d == 128) && group % 8 == 0 && d % group == 0 && d / group <= 8) {
        /* constant shapes for the codec's pages (groups of 32): fully unrolled transform and passes */
        if (d == 128 && group == 32) return kvd256_q4_rows_rot(x, xs, n, packed, scales, mins, 128, 32);
        if (d == 64 && group == 32) return kvd256_q4_rows_rot(x, xs, n, packed, scales, mins, 64, 32);
        return kvd256_q4_rows_rot(x, xs, n, packed, scales, mins, (int)d, (int)group);
    }
    if (d > KVD_SCRATCH_FLOATS) return kvd_scalar_q4_encode_rows(x, xs, n, d, packed, scales, mins, group, rotate);
    float y[KVD_SCRATCH_FLOATS];
    uint8_t stage[KVD_SCRATCH_FLOATS];
    const int64_t ng = kvd_ngroups(d, group), pb = (d + 1) / 2;
    const __m256 dinv = _mm256_set1_ps(1.0f / (float)d);
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *row = x + r * xs;
        if (kvd256_absmax(row, d) >= 0x7c00u) return KVD_NONFINITE;
        int64_t j = 0;
        for (; j + 8 <= d; j += 8) _mm256_storeu_ps(y + j, kvd256_ld8(row + j));
        for (; j < d; j++) y[j] = kvd_h2f(row[j]);
        if (rotate) {
            kvd256_fwht_buf(y, d);
            for (j = 0; j + 8 <= d; j += 8) _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_loadu_ps(y + j), dinv));
            for (; j < d; j++) y[j] = y[j] * (1.0f / (float)d);
        }
        kvd256_q4_row(y, d, group, stage, packed + r * pb, scales + r * ng, mins + r * ng);
    }
    return KVD_OK;
}

KVD_T256 static int kvd256_q4_decode_rows(const uint8_t *packed, const uint16_t *scales, const uint16_t *mins,
                                          uint16_t *out, int64_t n, int64_t d, int64_t group, int rotate) {
    if (rotate && (d == 64 || d == 128) && group % 8 == 0 && d % group == 0 && d / group <= 8) {
        if (d == 128 && group == 32)
            kvd256_q4_decode_rot(packed, scales, mins, out, n, 128, 32);
        else if (d == 64 && group == 32)
            kvd256_q4_decode_rot(packed, scales, mins, out, n, 64, 32);
        else
            kvd256_q4_decode_rot(packed, scales, mins, out, n, (int)d, (int)group);
        return KVD_OK;
    }
    if (d > KVD_SCRATCH_FLOATS) return kvd_scalar_q4_decode_rows(packed, scales, mins, out, n, d, group, rotate);
    float y[KVD_SCRATCH_FLOATS];
    const int64_t ng = kvd_ngroups(d, group), pb = (d + 1) / 2;
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *prow = packed + r * pb;
        for (int64_t gi = 0, j0 = 0; gi < ng; gi++, j0 += group) {
            const int64_t j1 = kvd_min64(j0 + group, d);
            const float s = kvd_h2f(scales[r * ng + gi]), m = kvd_h2f(mins[r * ng + gi]);
            const __m256 sv = _mm256_set1_ps(s), mv = _mm256_set1_ps(m);
            int64_t j = j0;
            if ((j & 1) == 0)
                for (; j + 8 <= j1; j += 8)
                    _mm256_storeu_ps(y + j, _mm256_add_ps(_mm256_mul_ps(kvd256_nib8(prow + j / 2), sv), mv));
            for (; j < j1; j++) y[j] = (float)kvd_get_nibble(prow, j) * s + m;
        }
        if (rotate) kvd256_fwht_buf(y, d);
        int64_t j = 0;
        for (; j + 8 <= d; j += 8) kvd256_st8(out + r * d + j, kvd256_clip(_mm256_loadu_ps(y + j)));
        for (; j < d; j++) out[r * d + j] = kvd_decode_f16(y[j]);
    }
    return KVD_OK;
}

KVD_T256 static int kvd256_q4_encode_cols(const uint16_t *x, ptrdiff_t xs, int64_t t, int64_t c, uint8_t *packed,
                                          uint16_t *scales, uint16_t *mins, int64_t group) {
    const int64_t pb = (c + 1) / 2;
    for (int64_t t0 = 0, gi = 0; t0 < t; t0 += group, gi++) {
        const int64_t t1 = kvd_min64(t0 + group, t);
        int64_t c0 = 0;
        for (; c0 + 64 <= c; c0 += 64)
            if (kvd256_q4_cols_block64(x, xs, t0, t1, c0, packed, pb, scales + gi * c + c0, mins + gi * c + c0))
                return KVD_NONFINITE;
        for (; c0 + 16 <= c; c0 += 16) {
            __m256i mx = kvd256_key(_mm256_loadu_si256((const __m256i *)(x + t0 * xs + c0))), mn = mx;
            for (int64_t i = t0 + 1; i < t1; i++) {
                __m256i k = kvd256_key(_mm256_loadu_si256((const __m256i *)(x + i * xs + c0)));
                mx = _mm256_max_epi16(mx, k);
                mn = _mm256_min_epi16(mn, k);
            }
            /* keys >= 0x7c00 are +inf/+NaN, keys <= -31745 are -inf/-NaN */
            if (_mm256_movemask_epi8(_mm256_or_si256(_mm256_cmpgt_epi16(mx, _mm256_set1_epi16(0x7bff)),
                                                     _mm256_cmpgt_epi16(_mm256_set1_epi16(-31744), mn))))
                return KVD_NONFINITE;
            mx = kvd256_key(mx);
            mn = kvd256_key(mn);
            __m256 mnf[2], inv[2];
            for (int k = 0; k < 2; k++) {
                __m128i mnk = k ? _mm256_extracti128_si256(mn, 1) : _mm256_castsi256_si128(mn);
                __m128i mxk = k ? _mm256_extracti128_si256(mx, 1) : _mm256_castsi256_si128(mx);
                __m128i m16 = kvd256_f16_down(_mm256_cvtph_ps(mnk));
                __m256 m = _mm256_cvtph_ps(m16);
                __m128i s16 = kvd256_f16_up_nonneg(
                    _mm256_div_ps(_mm256_sub_ps(_mm256_cvtph_ps(mxk), m), _mm256_set1_ps(15.0f)));
                _mm_storeu_si128((__m128i *)(scales + gi * c + c0 + 8 * k), s16);
                _mm_storeu_si128((__m128i *)(mins + gi * c + c0 + 8 * k), m16);
                mnf[k] = m;
                inv[k] = kvd256_inv(_mm256_cvtph_ps(s16));
            }
            for (int64_t i = t0; i < t1; i++) {
                const uint16_t *p = x + i * xs + c0;
                __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(kvd256_ld8(p), mnf[0]), inv[0]));
                __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(kvd256_ld8(p + 8), mnf[1]), inv[1]));
                __m128i b = _mm_unpacklo_epi64(kvd256_pack8(q0, 0), kvd256_pack8(q1, 0));
                __m128i w = _mm_maddubs_epi16(b, _mm_set1_epi16(0x1001));
                _mm_storel_epi64((__m128i *)(packed + i * pb + c0 / 2), _mm_packus_epi16(w, w));
            }
        }
        for (; c0 < c; c0++) { /* remaining columns, increasing: even nibbles first */
            float mn = kvd_h2f(x[t0 * xs + c0]), mx = mn;
            for (int64_t i = t0; i < t1; i++) {
                uint16_t b = x[i * xs + c0];
                if ((b & 0x7fffu) >= 0x7c00u) return KVD_NONFINITE;
                float v = kvd_h2f(b);
                if (kvd_lt(v, mn)) mn = v;
                if (kvd_lt(mx, v)) mx = v;
            }
            float mnf, inv;
            scales[gi * c + c0] = kvd256_q4_scale(mn, mx, &mins[gi * c + c0], &mnf, &inv);
            for (int64_t i = t0; i < t1; i++)
                kvd_put_nibble(packed + i * pb, c0, kvd_q4_code(kvd_h2f(x[i * xs + c0]), mnf, inv));
        }
    }
    return KVD_OK;
}

KVD_T256 static void kvd256_q4_decode_cols(const uint8_t *packed, const uint16_t *scales, const uint16_t *mins,
                                           uint16_t *out, int64_t t, int64_t c, int64_t group) {
    const int64_t pb = (c + 1) / 2;
    for (int64_t i = 0; i < t; i++) {
        const uint16_t *srow = scales + (i / group) * c, *mrow = mins + (i / group) * c;
        const uint8_t *prow = packed + i * pb;
        int64_t j = 0;
        for (; j + 8 <= c; j += 8)
            kvd256_st8(out + i * c + j,
                       kvd256_clip(_mm256_add_ps(_mm256_mul_ps(kvd256_nib8(prow + j / 2), kvd256_ld8(srow + j)), kvd256_ld8(mrow + j))));
        for (; j < c; j++)
            out[i * c + j] = kvd_decode_f16((float)kvd_get_nibble(prow, j) * kvd_h2f(srow[j]) + kvd_h2f(mrow[j]));
    }
}

static const kvd_backend kvd_backend_avx2 = {
    "avx2",
    kvd256_f16_copy_rows,
    kvd256_q8_encode_rows,
    kvd256_q8_decode_rows,
    kvd256_q8_encode_cols,
    kvd256_q8_decode_cols,
    kvd256_fp8_encode_rows,
    kvd256_fp8_decode_rows,
    kvd256_q4_encode_rows,
    kvd256_q4_decode_rows,
    kvd256_q4_encode_cols,
    kvd256_q4_decode_cols,
    NULL, /* q4_encode_rows_pf: no hint */
};

#endif
