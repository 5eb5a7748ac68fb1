/* AVX-512 kernels of q4 (rows, with or without the Hadamard rotation, and columns). See kvd_avx512.h. */
#ifndef KVD_AVX512_Q4_H
#define KVD_AVX512_Q4_H

#include "kvd_avx512_util.h"
#include "kvd_avx512_q4rot.h"

/* ======================================================================================================== */
/* q4 rows */

/* codes of 16 float32 values: rint((y - mn) * inv); the reference's clip to [0, 15] can never act (see
 * kvd_scalar.h: y - mn <= max - mn and the scale is rounded up) */
KVD_I512 __m512i kvd512_q4_codes(__m512 y, __m512 mn, __m512 inv) {
    return _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_sub_ps(y, mn), inv), KVD_RNE);
}

/* d % g == 0, g % 32 == 0, no rotation: 16 groups per batch, min/max on integer keys */
KVD_I512 int kvd512_q4_rows_fast(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, uint8_t *packed,
                                 uint16_t *scales, uint16_t *mins, int64_t g) {
    const int64_t G = d / g, total = n * G;
    int64_t row = 0, gcol = 0;
    for (int64_t k0 = 0; k0 < total; k0 += 16) {
        const int cnt = (int)kvd_min64(16, total - k0);
        const uint16_t *gp[16];
        __m512i amx[16], amn[16];
        KVD_UNROLL
        for (int i = 0; i < 16; i++) {
            if (i < cnt) {
                const uint16_t *p = x + row * xs + gcol * g;
                for (int64_t c = 0; c < g; c += 32) _mm_prefetch((const char *)(p + c + KVD_PF_AHEAD), _MM_HINT_T0);
                __m512i k = kvd512_key(_mm512_loadu_si512(p));
                __m512i mx = k, mn = k;
                for (int64_t c = 32; c < g; c += 32) {
                    k = kvd512_key(_mm512_loadu_si512(p + c));
                    mx = _mm512_max_epi16(mx, k);
                    mn = _mm512_min_epi16(mn, k);
                }
                gp[i] = p;
                amx[i] = mx;
                amn[i] = mn;
                if (++gcol == G) {
                    gcol = 0;
                    row++;
                }
            } else {
                amx[i] = amn[i] = _mm512_setzero_si512();
            }
        }
        __m256i kmx = kvd512_red_max_epi16(amx), kmn = kvd512_red_min_epi16(amn);
        if (_mm256_cmpge_epi16_mask(kmx, _mm256_set1_epi16(0x7c00)) |
            _mm256_cmple_epi16_mask(kmn, _mm256_set1_epi16(KVD_KEY16_LOW)))
            return KVD_NONFINITE;
        __m256i s16, m16;
        __m512 mnf, inv;
        kvd512_q4_scales(_mm512_cvtph_ps(kvd512_key256(kmn)), _mm512_cvtph_ps(kvd512_key256(kmx)), &s16, &m16, &mnf,
                         &inv);
        kvd512_st_h16(scales + k0, kvd512_m16(cnt), s16);
        kvd512_st_h16(mins + k0, kvd512_m16(cnt), m16);

        uint8_t *out = packed + (k0 * g) / 2;
        const int64_t nel = cnt * g;
        int gi = 0;
        int64_t off = 0;
        for (int64_t e = 0; e < nel; e += 128) {
            __m512i q[8];
            KVD_UNROLL
            for (int h = 0; h < 4; h++) {
                if (e + 32 * h < nel) {
                    const __m512i idx = kvd512_bcast_idx(gi);
                    __m512 mb = _mm512_permutexvar_ps(idx, mnf), ib = _mm512_permutexvar_ps(idx, inv);
                    __m512i xv = _mm512_loadu_si512(gp[gi] + off);
                    q[2 * h] = kvd512_q4_codes(_mm512_cvtph_ps(_mm512_castsi512_si256(xv)), mb, ib);
                    q[2 * h + 1] = kvd512_q4_codes(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(xv, 1)), mb, ib);
                    off += 32;
                    if (off == g) {
                        off = 0;
                        gi++;
                    }
                } else {
                    q[2 * h] = q[2 * h + 1] = _mm512_setzero_si512();
                }
            }
            __m512i b = kvd512_pack_q4(q);
            kvd512_st_b64(out + e / 2, kvd512_m64((nel - e) / 2), b);
        }
    }
    return KVD_OK;
}

/* A prefetch hint spread over the rows: `step` bytes of the hinted region per row, `left` still to go. The
 * rotated rows are compute-bound (the transform) and read their own input in order, which the hardware
 * prefetchers follow; the memory bus is then mostly idle, and a caller that knows its next input (the page's
 * keys, whose column kernel waits on memory) has it loaded here at no cost. */
#define KVD_PF_ROW_MAX 1024 /* bytes of the hint prefetched per row at most */
typedef struct {
    const char *p;
    int64_t left, step;
} kvd512_pf;

KVD_I512 void kvd512_pf_row(kvd512_pf *pf) {
    if (pf->left <= 0) return;
    for (int64_t o = 0; o < pf->step && o < pf->left; o += 64) _mm_prefetch(pf->p + o, _MM_HINT_T0);
    pf->p += pf->step;
    pf->left -= pf->step;
}

/* rotated rows, d in {16, 32, 64, 128}, g % 16 == 0, d % g == 0: rows held in registers, 16 groups (R rows)
 * per batch. Min/max and codes work on Y = FWHT(x); y = Y / d exactly, so with mD = d * min and invD = inv / d
 * (both exact) (Y - mD) * invD rounds exactly like the reference's (y - min) * inv. Batches are software
 * pipelined: pass 1 and the scales of batch k+1 come before the codes of batch k. */
typedef struct {
    float y[16 * 128] __attribute__((aligned(64))); /* Y of the batch's rows */
    float mD[16], invD[16];                          /* per group, for pass 2 (broadcast loads) */
    __m256i s16, m16;
} kvd512_rot_batch;

KVD_I512 int kvd512_rot_pass1(kvd512_rot_batch *b, const uint16_t *x, ptrdiff_t xs, int64_t r0, const int rows,
                              const int d, const int g, kvd512_pf *pf) {
    const int nz = d / 16, G = d / g, zpg = g / 16;
    __m512 amx[16], amn[16];
    KVD_UNROLL
    for (int rr = 0; rr < rows; rr++) {
        const uint16_t *p = x + (r0 + rr) * xs;
        KVD_UNROLL
        for (int i = 0; i < d; i += 32) _mm_prefetch((const char *)(p + i + KVD_PF_AHEAD), _MM_HINT_T0);
        kvd512_pf_row(pf);
        __m512 z[8];
        KVD_UNROLL
        for (int i = 0; i < nz; i++) z[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 16 * i)));
        kvd512_fwht_regs(z, nz);
        KVD_UNROLL
        for (int i = 0; i < nz; i++) _mm512_store_ps(b->y + rr * d + 16 * i, z[i]);
        KVD_UNROLL
        for (int k = 0; k < G; k++) { /* float min/max: the sign of a zero result is fixed below */
            __m512 mx = z[k * zpg], mn = mx;
            KVD_UNROLL
            for (int i = 1; i < zpg; i++) {
                mx = _mm512_max_ps(mx, z[k * zpg + i]);
                mn = _mm512_min_ps(mn, z[k * zpg + i]);
            }
            amx[rr * G + k] = mx;
            amn[rr * G + k] = mn;
        }
    }
    KVD_UNROLL
    for (int i = rows * G; i < 16; i++) amx[i] = amn[i] = _mm512_setzero_ps();
    __m512 mxY = kvd512_red_max_ps(amx), mnY = kvd512_red_min_ps(amn);
    /* Every output of the unnormalized transform is a signed sum of all inputs of its row, and finite float16
     * rows cannot overflow float32: a NaN/Inf input shows up as a non-finite minimum or maximum. */
    const __m512 inf = _mm512_set1_ps(__builtin_inff());
    if (_mm512_cmp_ps_mask(mxY, inf, _CMP_NLT_UQ) | _mm512_cmp_ps_mask(mnY, _mm512_sub_ps(_mm512_setzero_ps(), inf), _CMP_NGT_UQ))
        return 1;
    /* a zero minimum / maximum: recompute its sign exactly (-0 below +0) from the stored values */
    __mmask16 zero = _mm512_cmp_ps_mask(mxY, _mm512_setzero_ps(), _CMP_EQ_OQ) |
                     _mm512_cmp_ps_mask(mnY, _mm512_setzero_ps(), _CMP_EQ_OQ);
    zero &= kvd512_m16(rows * G);
    if (zero) {
        float fmx[16], fmn[16];
        _mm512_storeu_ps(fmx, mxY);
        _mm512_storeu_ps(fmn, mnY);
        for (int k = 0; k < 16; k++)
            if ((zero >> k) & 1) kvd_minmax_f32(b->y + k * g, g, &fmn[k], &fmx[k]); /* groups contiguous in y */
        mxY = _mm512_loadu_ps(fmx);
        mnY = _mm512_loadu_ps(fmn);
    }
    const __m512 vdinv = _mm512_set1_ps(1.0f / (float)d);
    __m512 mnf, inv;
    kvd512_q4_scales(_mm512_mul_ps(mnY, vdinv), _mm512_mul_ps(mxY, vdinv), &b->s16, &b->m16, &mnf, &inv);
    _mm512_storeu_ps(b->mD, _mm512_mul_ps(mnf, _mm512_set1_ps((float)d)));
    _mm512_storeu_ps(b->invD, _mm512_mul_ps(inv, vdinv));
    return 0;
}

KVD_I512 void kvd512_rot_pass2(const kvd512_rot_batch *b, uint8_t *out, const int rows, const int d, const int g) {
    const int zpg = g / 16, nel = rows * d;
    KVD_UNROLL
    for (int e = 0; e < nel; e += 128) {
        __m512i q[8];
        KVD_UNROLL
        for (int s = 0; s < 8; s++) {
            const int sub = e / 16 + s;
            if (16 * sub < nel)
                q[s] = kvd512_q4_codes(_mm512_load_ps(b->y + 16 * sub), _mm512_set1_ps(b->mD[sub / zpg]),
                                       _mm512_set1_ps(b->invD[sub / zpg]));
            else
                q[s] = _mm512_setzero_si512();
        }
        kvd512_st_b64(out + e / 2, kvd512_m64((nel - e) / 2), kvd512_pack_q4(q));
    }
}

KVD_I512 int kvd512_q4_rows_rot(const uint16_t *x, ptrdiff_t xs, int64_t n, uint8_t *packed, uint16_t *scales,
                                uint16_t *mins, const int d, const int g, kvd512_pf *pf) {
    const int G = d / g, R = 16 / G;
    kvd512_rot_batch bb[2];
    int cur = 0;
    if (n >= R ? kvd512_rot_pass1(&bb[0], x, xs, 0, R, d, g, pf) : kvd512_rot_pass1(&bb[0], x, xs, 0, (int)n, d, g, pf))
        return KVD_NONFINITE;
    for (int64_t r0 = 0; r0 < n; r0 += R) {
        const int64_t left = n - r0 - R;
        if (left >= R) {
            if (kvd512_rot_pass1(&bb[cur ^ 1], x, xs, r0 + R, R, d, g, pf)) return KVD_NONFINITE;
        } else if (left > 0) {
            if (kvd512_rot_pass1(&bb[cur ^ 1], x, xs, r0 + R, (int)left, d, g, pf)) return KVD_NONFINITE;
        }
        const kvd512_rot_batch *b = &bb[cur];
        if (n - r0 >= R) {
            kvd512_rot_pass2(b, packed + r0 * (d / 2), R, d, g);
            _mm256_storeu_si256((__m256i *)(scales + r0 * G), b->s16);
            _mm256_storeu_si256((__m256i *)(mins + r0 * G), b->m16);
        } else {
            const int rows = (int)(n - r0);
            kvd512_rot_pass2(b, packed + r0 * (d / 2), rows, d, g);
            kvd512_st_h16(scales + r0 * G, kvd512_m16(rows * G), b->s16);
            kvd512_st_h16(mins + r0 * G, kvd512_m16(rows * G), b->m16);
        }
        cur ^= 1;
    }
    return KVD_OK;
}

/* any shape: one row at a time through a float32 scratch row and a staging row of byte codes */
KVD_I512 void kvd512_q4_row_generic(const float *y, int64_t d, int64_t group, uint8_t *stage, uint8_t *prow,
                                    uint16_t *srow, uint16_t *mrow) {
    const int64_t ng = kvd_ngroups(d, group);
    for (int64_t gi = 0; gi < ng; gi++) {
        const int64_t j0 = gi * group, j1 = kvd_min64(j0 + group, d);
        __m512i mx = _mm512_set1_epi32(INT32_MIN), mn = _mm512_set1_epi32(INT32_MAX);
        for (int64_t j = j0; j < j1; j += 16) {
            const __mmask16 m = kvd512_m16(j1 - j);
            __m512i k = kvd512_key32(_mm512_maskz_loadu_epi32(m, y + j));
            mx = _mm512_mask_max_epi32(mx, m, mx, k);
            mn = _mm512_mask_min_epi32(mn, m, mn, k);
        }
        int32_t kmn = _mm512_reduce_min_epi32(mn), kmx = _mm512_reduce_max_epi32(mx);
        float fmn = kvd_u2f((uint32_t)(kmn ^ ((kmn >> 31) & 0x7fffffff)));
        float fmx = kvd_u2f((uint32_t)(kmx ^ ((kmx >> 31) & 0x7fffffff)));
        float mnf, inv;
        srow[gi] = kvd_q4_scale(fmn, fmx, &mrow[gi], &mnf, &inv);
        const __m512 mb = _mm512_set1_ps(mnf), ib = _mm512_set1_ps(inv);
        for (int64_t j = j0; j < j1; j += 16) {
            const __mmask16 m = kvd512_m16(j1 - j);
            __m512i q = kvd512_q4_codes(_mm512_maskz_loadu_ps(m, y + j), mb, ib);
            kvd512_st_b16(stage + j, m, _mm512_cvtepi32_epi8(q));
        }
    }
    int64_t j = 0;
    for (; j + 32 <= d; j += 32) { /* 32 codes -> 16 bytes */
        __m256i b = _mm256_loadu_si256((const __m256i *)(stage + j));
        __m256i w = _mm256_maddubs_epi16(b, _mm256_set1_epi16(0x1001));
        _mm_storeu_si128((__m128i *)(prow + j / 2), _mm256_cvtepi16_epi8(w));
    }
    for (; j < d; j++) kvd_put_nibble(prow, j, stage[j]);
}

#define KVD_STAGE_MAX 4096

KVD_T512 static int kvd512_q4_encode_rows_pf(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d,
                                             uint8_t *packed, uint16_t *scales, uint16_t *mins, int64_t group,
                                             int rotate, const void *pf_at, int64_t pf_bytes) {
    const int64_t g = kvd_min64(group, d);
    /* the hint is used by the rotated rows only (the compute-bound ones), spread evenly over them */
    kvd512_pf pf = {(const char *)pf_at, pf_at && n > 0 ? pf_bytes : 0, 0};
    if (pf.left > 0) /* at most 16 lines a row: a hint larger than the rows can carry is cut, never a stall */
        pf.step = kvd_min64(KVD_PF_ROW_MAX, ((pf.left + n - 1) / n + 63) & ~(int64_t)63);
    if (!rotate && g % 32 == 0 && d % g == 0) return kvd512_q4_rows_fast(x, xs, n, d, packed, scales, mins, g);
    if (rotate && d >= 16 && d <= 128 && g % 16 == 0 && d % g == 0) {
        switch (d) {
        case 16: return kvd512_q4_rows_rot(x, xs, n, packed, scales, mins, 16, 16, &pf);
        case 32: return g == 16 ? kvd512_q4_rows_rot(x, xs, n, packed, scales, mins, 32, 16, &pf)
                                : kvd512_q4_rows_rot(x, xs, n, packed, scales, mins, 32, 32, &pf);
        case 64:
            switch (g) {
            case 16: return kvd512_q4_rows_rot(x, xs, n, packed, scales, mins, 64, 16, &pf);
            case 32: return kvd512_q4_rows_rot(x, xs, n, packed, scales, mins, 64, 32, &pf);
            default: return kvd512_q4_rows_rot(x, xs, n, packed, scales, mins, 64, 64, &pf);
            }
        default:
            switch (g) {
            case 16: return kvd512_q4_rows_rot(x, xs, n, packed, scales, mins, 128, 16, &pf);
            case 32: return kvd512_q4_rows_rot(x, xs, n, packed, scales, mins, 128, 32, &pf);
            case 64: return kvd512_q4_rows_rot(x, xs, n, packed, scales, mins, 128, 64, &pf);
            default: return kvd512_q4_rows_rot(x, xs, n, packed, scales, mins, 128, 128, &pf);
            }
        }
    }
    if (d > KVD_STAGE_MAX) return kvd_scalar_q4_encode_rows(x, xs, n, d, packed, scales, mins, group, rotate);
    float y[KVD_STAGE_MAX] __attribute__((aligned(64)));
    uint8_t stage[KVD_STAGE_MAX];
    const int64_t ng = kvd_ngroups(d, group), pb = (d + 1) / 2;
    const __m512 dinv = _mm512_set1_ps(1.0f / (float)d);
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *row = x + r * xs;
        __m256i nf = _mm256_setzero_si256();
        for (int64_t j = 0; j < d; j += 16) {
            const __mmask16 m = kvd512_m16(d - j);
            __m256i h = kvd512_ld_h16(row + j, m);
            nf = _mm256_max_epu16(nf, _mm256_and_si256(h, _mm256_set1_epi16(0x7fff)));
            _mm512_mask_storeu_ps(y + j, m, _mm512_cvtph_ps(h));
        }
        if (_mm256_cmpge_epu16_mask(nf, _mm256_set1_epi16(0x7c00))) return KVD_NONFINITE;
        if (rotate) {
            kvd512_fwht_buf(y, d);
            for (int64_t j = 0; j < d; j += 16) {
                const __mmask16 m = kvd512_m16(d - j);
                _mm512_mask_storeu_ps(y + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, y + j), dinv));
            }
        }
        kvd512_q4_row_generic(y, d, group, stage, packed + r * pb, scales + r * ng, mins + r * ng);
    }
    return KVD_OK;
}

KVD_T512 static int kvd512_q4_encode_rows(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, uint8_t *packed,
                                          uint16_t *scales, uint16_t *mins, int64_t group, int rotate) {
    return kvd512_q4_encode_rows_pf(x, xs, n, d, packed, scales, mins, group, rotate, NULL, 0);
}

/* 16 nibbles (8 packed bytes at an even position) -> 16 float32 codes */
KVD_I512 __m512 kvd512_nib16(const uint8_t *p, int64_t nbytes) {
    __m128i b = nbytes >= 8 ? _mm_loadl_epi64((const __m128i *)p) : _mm_maskz_loadu_epi8(kvd512_m16(nbytes), p);
    __m128i w = _mm_cvtepu8_epi16(b);
    w = _mm_and_si128(_mm_or_si128(w, _mm_slli_epi16(w, 4)), _mm_set1_epi16(0x0f0f)); /* (lo, hi) bytes */
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(w));
}

/* rotated rows of d = 16..128 values: the whole row in registers (d a compile-time constant) */
KVD_I512 void kvd512_q4_dec_rot(const uint8_t *packed, const uint16_t *scales, const uint16_t *mins, uint16_t *out,
                                int64_t n, const int64_t d, int64_t group) {
    const int64_t ng = kvd_ngroups(d, group), pb = d / 2;
    {
        const int nz = (int)d / 16;
        int64_t gz[8];
        KVD_UNROLL
        for (int i = 0; i < 8; i++) gz[i] = (16 * i) / group; /* group of register i (used when group % 16 == 0) */
        float sf[8], mf[8];
        for (int64_t r = 0; r < n; r++) {
            const uint8_t *prow = packed + r * pb;
            __m512 z[8];
            if (nz == 1) {
                z[0] = kvd512_nib16(prow, 8);
            } else {
                KVD_UNROLL
                for (int i = 0; i < 8; i += 2) { /* 16 packed bytes -> 32 codes, low nibble first */
                    if (i >= nz) break;
                    __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(prow + 8 * i)));
                    w = _mm256_and_si256(_mm256_or_si256(w, _mm256_slli_epi16(w, 4)), _mm256_set1_epi16(0x0f0f));
                    z[i] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(w)));
                    z[i + 1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(w, 1)));
                }
            }
            if (group % 16 == 0 && ng <= 8) { /* this row's parameters as float32, broadcast from memory */
                const __mmask8 mg = (__mmask8)((1u << ng) - 1u);
                _mm256_storeu_ps(sf, _mm256_cvtph_ps(_mm_maskz_loadu_epi16(mg, scales + r * ng)));
                _mm256_storeu_ps(mf, _mm256_cvtph_ps(_mm_maskz_loadu_epi16(mg, mins + r * ng)));
                KVD_UNROLL
                for (int i = 0; i < 8; i++) {
                    if (i >= nz) break;
                    z[i] = _mm512_add_ps(_mm512_mul_ps(z[i], _mm512_set1_ps(sf[gz[i]])), _mm512_set1_ps(mf[gz[i]]));
                }
            } else {
                KVD_UNROLL
                for (int i = 0; i < 8; i++) {
                    if (i >= nz) break;
                    z[i] = _mm512_add_ps(_mm512_mul_ps(z[i], kvd512_lane_param(scales + r * ng, 16 * i, group, d)),
                                         kvd512_lane_param(mins + r * ng, 16 * i, group, d));
                }
            }
            kvd512_fwht_regs(z, nz);
            KVD_UNROLL
            for (int i = 0; i < 8; i++) {
                if (i >= nz) break;
                _mm256_storeu_si256((__m256i *)(out + r * d + 16 * i), _mm512_cvtps_ph(kvd512_clip(z[i]), KVD_RNE));
            }
        }
        }
}

KVD_T512 static int kvd512_q4_decode_rows(const uint8_t *packed, const uint16_t *scales, const uint16_t *mins,
                                          uint16_t *out, int64_t n, int64_t d, int64_t group, int rotate) {
    const int64_t ng = kvd_ngroups(d, group), pb = (d + 1) / 2;
    if (rotate && group == 32 && (d == 128 || d == 64)) { /* the codec's shapes: tables, see kvd_avx512_q4rot.h */
        if (d == 128)
            kvd512_q4d_rot32(packed, scales, mins, out, n, 4);
        else
            kvd512_q4d_rot32(packed, scales, mins, out, n, 2);
        return KVD_OK;
    }
    if (rotate && d >= 16 && d <= 128) {
        switch (d) {
        case 16: kvd512_q4_dec_rot(packed, scales, mins, out, n, 16, group); break;
        case 32: kvd512_q4_dec_rot(packed, scales, mins, out, n, 32, group); break;
        case 64: kvd512_q4_dec_rot(packed, scales, mins, out, n, 64, group); break;
        default: kvd512_q4_dec_rot(packed, scales, mins, out, n, 128, group); break;
        }
        return KVD_OK;
    }
    float stackbuf[KVD_STAGE_MAX] __attribute__((aligned(64)));
    float *y = NULL;
    if (rotate) {
        y = d <= KVD_STAGE_MAX ? stackbuf : (float *)malloc((size_t)d * sizeof(float));
        if (!y) return KVD_NOMEM;
    }
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *prow = packed + r * pb;
        uint16_t *o = out + r * d;
        for (int64_t j = 0, gi = 0, jn = group; j < d; j += 16) {
            const __mmask16 m = kvd512_m16(d - j);
            __m512 q = kvd512_nib16(prow + j / 2, (kvd_min64(j + 16, d) - j + 1) / 2), sv, mv;
            if (group % 16 == 0) {
                if (j == jn) {
                    gi++;
                    jn += group;
                }
                sv = _mm512_cvtph_ps(_mm256_set1_epi16((short)scales[r * ng + gi]));
                mv = _mm512_cvtph_ps(_mm256_set1_epi16((short)mins[r * ng + gi]));
            } else {
                sv = kvd512_lane_param(scales + r * ng, j, group, d);
                mv = kvd512_lane_param(mins + r * ng, j, group, d);
            }
            __m512 v = _mm512_add_ps(_mm512_mul_ps(q, sv), mv);
            if (rotate)
                _mm512_mask_storeu_ps(y + j, m, v);
            else
                kvd512_st_h16(o + j, m, _mm512_cvtps_ph(kvd512_clip(v), KVD_RNE));
        }
        if (rotate) {
            kvd512_fwht_buf(y, d);
            for (int64_t j = 0; j < d; j += 16) {
                const __mmask16 m = kvd512_m16(d - j);
                kvd512_st_h16(o + j, m, _mm512_cvtps_ph(kvd512_clip(_mm512_maskz_loadu_ps(m, y + j)), KVD_RNE));
            }
        }
    }
    if (y && y != stackbuf) free(y);
    return KVD_OK;
}

/* ======================================================================================================== */
/* q4 columns */

/* full blocks of 256 columns (see kvd512_q8_cols_block256) */
KVD_I512 int kvd512_q4_cols_block256(const uint16_t *x, ptrdiff_t xs, int64_t t0, int64_t t1, int64_t c0,
                                     uint8_t *packed, int64_t pb, uint16_t *srow, uint16_t *mrow) {
    __m512i mx[8], mn[8];
    {
        const uint16_t *p = x + t0 * xs + c0;
        KVD_UNROLL
        for (int k = 0; k < 8; k++) mx[k] = mn[k] = kvd512_key(_mm512_loadu_si512(p + 32 * k));
    }
    for (int64_t i = t0 + 1; i < t1; i++) {
        const uint16_t *p = x + i * xs + c0;
        KVD_UNROLL
        for (int k = 0; k < 8; k++) {
            __m512i kk = kvd512_key(_mm512_loadu_si512(p + 32 * k));
            mx[k] = _mm512_max_epi16(mx[k], kk);
            mn[k] = _mm512_min_epi16(mn[k], kk);
        }
    }
    __m512i amx = mx[0], amn = mn[0];
    KVD_UNROLL
    for (int k = 1; k < 8; k++) {
        amx = _mm512_max_epi16(amx, mx[k]);
        amn = _mm512_min_epi16(amn, mn[k]);
    }
    if (_mm512_cmpge_epi16_mask(amx, _mm512_set1_epi16(0x7c00)) |
        _mm512_cmple_epi16_mask(amn, _mm512_set1_epi16(KVD_KEY16_LOW)))
        return 1;
    __m512 mnf[16], inv[16];
    KVD_UNROLL
    for (int k = 0; k < 16; k++) {
        __m256i kmn = (k & 1) ? _mm512_extracti64x4_epi64(mn[k / 2], 1) : _mm512_castsi512_si256(mn[k / 2]);
        __m256i kmx = (k & 1) ? _mm512_extracti64x4_epi64(mx[k / 2], 1) : _mm512_castsi512_si256(mx[k / 2]);
        __m256i s16, m16;
        kvd512_q4_scales(_mm512_cvtph_ps(kvd512_key256(kmn)), _mm512_cvtph_ps(kvd512_key256(kmx)), &s16, &m16,
                         &mnf[k], &inv[k]);
        _mm256_storeu_si256((__m256i *)(srow + 16 * k), s16);
        _mm256_storeu_si256((__m256i *)(mrow + 16 * k), m16);
    }
    for (int64_t i = t0; i < t1; i++) {
        const uint16_t *p = x + i * xs + c0;
        KVD_UNROLL
        for (int k = 0; k < 8; k++) _mm_prefetch((const char *)(p + 256 + 32 * k), _MM_HINT_T0); /* next block */
        KVD_UNROLL
        for (int b = 0; b < 2; b++) {
            __m512i q[8];
            KVD_UNROLL
            for (int k = 0; k < 8; k++)
                q[k] = kvd512_q4_codes(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 128 * b + 16 * k))),
                                       mnf[8 * b + k], inv[8 * b + k]);
            _mm512_storeu_si512(packed + i * pb + c0 / 2 + 64 * b, kvd512_pack_q4(q));
        }
    }
    return 0;
}

KVD_T512 static int kvd512_q4_encode_cols(const uint16_t *x, ptrdiff_t xs, int64_t t, int64_t c, uint8_t *packed,
                                          uint16_t *scales, uint16_t *mins, int64_t group) {
    const int64_t pb = (c + 1) / 2;
    for (int64_t t0 = 0, gi = 0; t0 < t; t0 += group, gi++) {
        const int64_t t1 = kvd_min64(t0 + group, t);
        int64_t cb = 0;
        for (; cb + 256 <= c; cb += 256)
            if (kvd512_q4_cols_block256(x, xs, t0, t1, cb, packed, pb, scales + gi * c + cb, mins + gi * c + cb))
                return KVD_NONFINITE;
        for (int64_t c0 = cb; c0 < c; c0 += 64) {
            const int64_t w = kvd_min64(64, c - c0);
            const __mmask32 ma = kvd512_m32(w), mb = kvd512_m32(w - 32);
            __m512i mx0, mx1, mn0, mn1;
            {
                const uint16_t *p = x + t0 * xs + c0;
                mx0 = mn0 = kvd512_key(kvd512_ld_h32(p, ma));
                mx1 = mn1 = kvd512_key(kvd512_ld_h32(p + 32, mb));
            }
            for (int64_t i = t0 + 1; i < t1; i++) {
                const uint16_t *p = x + i * xs + c0;
                __m512i k0 = kvd512_key(kvd512_ld_h32(p, ma));
                __m512i k1 = kvd512_key(kvd512_ld_h32(p + 32, mb));
                mx0 = _mm512_max_epi16(mx0, k0);
                mn0 = _mm512_min_epi16(mn0, k0);
                mx1 = _mm512_max_epi16(mx1, k1);
                mn1 = _mm512_min_epi16(mn1, k1);
            }
            if (_mm512_cmpge_epi16_mask(_mm512_max_epi16(mx0, mx1), _mm512_set1_epi16(0x7c00)) |
                _mm512_cmple_epi16_mask(_mm512_min_epi16(mn0, mn1), _mm512_set1_epi16(KVD_KEY16_LOW)))
                return KVD_NONFINITE;
            __m256i kmn[4] = {_mm512_castsi512_si256(mn0), _mm512_extracti64x4_epi64(mn0, 1),
                              _mm512_castsi512_si256(mn1), _mm512_extracti64x4_epi64(mn1, 1)};
            __m256i kmx[4] = {_mm512_castsi512_si256(mx0), _mm512_extracti64x4_epi64(mx0, 1),
                              _mm512_castsi512_si256(mx1), _mm512_extracti64x4_epi64(mx1, 1)};
            __m512 mnf[4], inv[4];
            KVD_UNROLL
            for (int k = 0; k < 4; k++) {
                __m256i s16, m16;
                kvd512_q4_scales(_mm512_cvtph_ps(kvd512_key256(kmn[k])), _mm512_cvtph_ps(kvd512_key256(kmx[k])), &s16,
                                 &m16, &mnf[k], &inv[k]);
                kvd512_st_h16(scales + gi * c + c0 + 16 * k, kvd512_m16(w - 16 * k), s16);
                kvd512_st_h16(mins + gi * c + c0 + 16 * k, kvd512_m16(w - 16 * k), m16);
            }
            const __mmask64 mo = kvd512_m64((w + 1) / 2);
            for (int64_t i = t0; i < t1; i++) {
                const uint16_t *p = x + i * xs + c0;
                _mm_prefetch((const char *)(p + 128), _MM_HINT_T0); /* the column block after next */
                _mm_prefetch((const char *)(p + 160), _MM_HINT_T0);
                __m512i xa = kvd512_ld_h32(p, ma), xb = kvd512_ld_h32(p + 32, mb);
                __m512i q[8];
                q[0] = kvd512_q4_codes(_mm512_cvtph_ps(_mm512_castsi512_si256(xa)), mnf[0], inv[0]);
                q[1] = kvd512_q4_codes(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(xa, 1)), mnf[1], inv[1]);
                q[2] = kvd512_q4_codes(_mm512_cvtph_ps(_mm512_castsi512_si256(xb)), mnf[2], inv[2]);
                q[3] = kvd512_q4_codes(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(xb, 1)), mnf[3], inv[3]);
                if (w < 64) /* the high nibble after an odd last column stays zero */
                    KVD_UNROLL
                    for (int k = 0; k < 4; k++) q[k] = _mm512_maskz_mov_epi32(kvd512_m16(w - 16 * k), q[k]);
                q[4] = q[5] = q[6] = q[7] = _mm512_setzero_si512();
                __builtin_prefetch(packed + i * pb + c0 / 2 + 32, 1, 3); /* the next block's output */
                kvd512_st_b64(packed + i * pb + c0 / 2, mo, kvd512_pack_q4(q));
            }
        }
    }
    return KVD_OK;
}

KVD_T512 static void kvd512_q4_decode_cols(const uint8_t *packed, const uint16_t *scales, const uint16_t *mins,
                                           uint16_t *out, int64_t t, int64_t c, int64_t group) {
    const int64_t pb = (c + 1) / 2;
    float sf[2048] __attribute__((aligned(64))), mf[2048] __attribute__((aligned(64)));
    const int64_t cw = c & ~(int64_t)63; /* columns done 64 at a time from float32 copies of the group's rows */
    for (int64_t i = 0; i < t; i++) {
        const uint16_t *srow = scales + (i / group) * c, *mrow = mins + (i / group) * c;
        const uint8_t *prow = packed + i * pb;
        uint16_t *o = out + i * c;
        int64_t j = 0;
        if (c <= 2048) {
            if (i % group == 0)
                for (int64_t k = 0; k < cw; k += 16) {
                    _mm512_store_ps(sf + k, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(srow + k))));
                    _mm512_store_ps(mf + k, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mrow + k))));
                }
            for (; j < cw; j += 64) {
                /* 32 packed bytes -> 64 codes (low nibble first) -> 4 x 16 float32 */
                __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(prow + j / 2)));
                w = _mm512_and_si512(_mm512_or_si512(w, _mm512_slli_epi16(w, 4)), _mm512_set1_epi16(0x0f0f));
                KVD_UNROLL
                for (int k = 0; k < 4; k++) {
                    __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(w, k)));
                    __m512 v = _mm512_add_ps(_mm512_mul_ps(q, _mm512_load_ps(sf + j + 16 * k)), _mm512_load_ps(mf + j + 16 * k));
                    _mm256_storeu_si256((__m256i *)(o + j + 16 * k), _mm512_cvtps_ph(kvd512_clip(v), KVD_RNE));
                }
            }
        }
        for (; j < c; j += 16) {
            const __mmask16 m = kvd512_m16(c - j);
            __m512 q = kvd512_nib16(prow + j / 2, (kvd_min64(j + 16, c) - j + 1) / 2);
            __m512 v = _mm512_add_ps(_mm512_mul_ps(q, _mm512_cvtph_ps(kvd512_ld_h16(srow + j, m))),
                                     _mm512_cvtph_ps(kvd512_ld_h16(mrow + j, m)));
            kvd512_st_h16(o + j, m, _mm512_cvtps_ph(kvd512_clip(v), KVD_RNE));
        }
    }
}

#endif
