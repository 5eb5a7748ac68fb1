/* AVX-512 q4 rows with the Hadamard rotation for the codec's shapes: groups of 32 along rows of d = 64 or 128
 * (2 or 4 groups a row). See kvd_avx512.h for the theory of operation; this file adds two tricks.
 *
 * Decode by table. A group has 16 possible values q * s + m; computing them once per group (one multiply and
 * one add, rounded exactly like the reference's per-element q * s + m) turns decoding into one vpermps per
 * 16 values. vpermps reads only the low 4 bits of each index lane, so a packed byte zero-extended to 32 bits
 * indexes its low nibble (the even element) as it is, and shifted right by 4 its high nibble (the odd one):
 * no nibble masking. Each group then sits in two registers, E (its even elements) and O (its odd ones).
 *
 * Even/odd layout for the transform. With element j = 32 k + 2 i + n held in lane i of register (k, n), the
 * butterflies of h = 1 pair whole registers (E, O), those of h = 2, 4, 8, 16 pair lanes i ^ 1, 2, 4, 8 inside a
 * register (the same in-register stages as kvd512_fwht_regs), and h = 32, 64 pair groups k ^ 1, k ^ 2. Every
 * stage performs exactly the reference's additions in the reference's order, only the storage order differs;
 * a vpermw per 32 outputs interleaves E and O back into row order after the float16 conversion.
 */
#ifndef KVD_AVX512_Q4ROT_H
#define KVD_AVX512_Q4ROT_H

#include "kvd_avx512_util.h"

/* ======================================================================================================== */
/* decode */

/* one row of G groups: tables from the float32 scales / mins sf[0..G), mf[0..G) */
KVD_I512 void kvd512_q4d_rot_row(const uint8_t *p, const float *sf, const float *mf, uint16_t *o, const int G,
                                 const int clip) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    /* word w of a group's output: element w, i.e. lane w / 2 of E (w even) or of O (w odd, upper half) */
    const __m512i widx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                          23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 z[8]; /* z[2k] = E of group k, z[2k + 1] = O */
    KVD_UNROLL
    for (int k = 0; k < G; k++) {
        const __m512 t = _mm512_add_ps(_mm512_mul_ps(iota, _mm512_set1_ps(sf[k])), _mm512_set1_ps(mf[k]));
        const __m512i dw = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * k)));
        const __m512 e = _mm512_permutexvar_ps(dw, t), od = _mm512_permutexvar_ps(_mm512_srli_epi32(dw, 4), t);
        z[2 * k] = _mm512_add_ps(e, od); /* h = 1 */
        z[2 * k + 1] = _mm512_sub_ps(e, od);
    }
    kvd512_fwht_lanes(z, 2 * G); /* h = 2 .. 16 */
    KVD_UNROLL
    for (int h = 2; h < 2 * G; h *= 2) /* h = 32, 64: register pairs (k, k + h/2 groups) */
        KVD_UNROLL
        for (int i = 0; i < 2 * G; i += 2 * h)
            KVD_UNROLL
            for (int j = i; j < i + h; j++) {
                if (j + h >= 8) break; /* never: keeps GCC's array-bounds check quiet for unused G */
                const __m512 a = z[j], b = z[j + h];
                z[j] = _mm512_add_ps(a, b);
                z[j + h] = _mm512_sub_ps(a, b);
            }
    KVD_UNROLL
    for (int k = 0; k < G; k++) {
        __m512 e = z[2 * k], od = z[2 * k + 1];
        if (clip) {
            e = kvd512_clip(e);
            od = kvd512_clip(od);
        }
        const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtps_ph(e, KVD_RNE)),
                                             _mm512_cvtps_ph(od, KVD_RNE), 1);
        _mm512_storeu_si512(o + 32 * k, _mm512_permutexvar_epi16(widx, w));
    }
}

/* rows of d = 32 G, groups of 32; batches of 16 / G rows share one conversion of their scales and mins */
KVD_I512 void kvd512_q4d_rot32(const uint8_t *packed, const uint16_t *scales, const uint16_t *mins, uint16_t *out,
                               int64_t n, const int G) {
    const int d = 32 * G, R = 16 / G;
    for (int64_t r0 = 0; r0 < n; r0 += R) {
        const int rows = (int)kvd_min64(R, n - r0);
        const __mmask16 m = kvd512_m16(rows * G);
        const __m512 S = _mm512_cvtph_ps(kvd512_ld_h16(scales + r0 * G, m));
        const __m512 M = _mm512_cvtph_ps(kvd512_ld_h16(mins + r0 * G, m));
        /* The clamp to +-65504 can only act when some |output| >= 65520 (below that, round-to-nearest already
         * gives at most 65504): every output is a signed sum of the row's d <= 128 table values, each at most
         * 15 |s| + |m| (times 1 + 2^-23 for its two roundings, and the transform's seven roundings add less
         * than 2^-20 more), so 128 (15 |s| + |m|) < 128 * 511 = 65408 makes it a no-op. Non-finite or
         * negative parameters (never written by an encoder) fail the test and take the clamp. */
        const __m512 absm = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(M), _mm512_set1_epi32(0x7fffffff)));
        const __m512 abss = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(S), _mm512_set1_epi32(0x7fffffff)));
        const __m512 bound = _mm512_add_ps(_mm512_mul_ps(abss, _mm512_set1_ps(15.0f)), absm);
        const __mmask16 ok = _mm512_cmp_ps_mask(bound, _mm512_set1_ps(511.0f), _CMP_LT_OQ);
        float sf[16] __attribute__((aligned(64))), mf[16] __attribute__((aligned(64)));
        _mm512_store_ps(sf, S);
        _mm512_store_ps(mf, M);
        __asm__ volatile("" ::: "memory"); /* broadcast the parameters from memory (see kvd512_absmax_rows_g32) */
        if ((ok & m) == m) {
            for (int rr = 0; rr < rows; rr++)
                kvd512_q4d_rot_row(packed + (r0 + rr) * (d / 2), sf + rr * G, mf + rr * G, out + (r0 + rr) * d, G, 0);
        } else {
            for (int rr = 0; rr < rows; rr++)
                kvd512_q4d_rot_row(packed + (r0 + rr) * (d / 2), sf + rr * G, mf + rr * G, out + (r0 + rr) * d, G, 1);
        }
    }
}

#endif
