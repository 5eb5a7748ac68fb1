/* NEON backend (arm64 only: Advanced SIMD and the float16 conversions are baseline there).
 *
 * Bit-identical to kvd/codec/reference.py under the default FPCR (round to nearest even, no flush-to-zero). The
 * absmax / NaN check runs on 8 float16 bit patterns per vector ((bits & 0x7fff), unsigned max); quantizing and
 * dequantizing run on 4 float32 lanes (vcvtnq_s32_f32 rounds to nearest even like np.rint; vcvt_f16_f32 rounds
 * to nearest even). Per-group scale arithmetic, fp8 rounding and the q4 kernels use the shared scalar helpers
 * of kvd_scalar.h (the q4 kernels are the scalar ones), so those steps cannot drift from the other backends.
 * This file is compiled and checked against the scalar backend only on arm64 builds.
 */
#ifndef KVD_NEON_H
#define KVD_NEON_H

#include <arm_neon.h>

#include "kvd_scalar.h"

static inline uint16_t kvdn_absmax(const uint16_t *p, int64_t n) {
    uint16x8_t acc = vdupq_n_u16(0);
    const uint16x8_t m = vdupq_n_u16(0x7fff);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) acc = vmaxq_u16(acc, vandq_u16(vld1q_u16(p + j), m));
    uint16_t am = vmaxvq_u16(acc);
    for (; j < n; j++)
        if ((p[j] & 0x7fffu) > am) am = p[j] & 0x7fffu;
    return am;
}

static inline float32x4_t kvdn_ld4(const uint16_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
static inline void kvdn_st4(uint16_t *o, float32x4_t v) { vst1_u16(o, vreinterpret_u16_f16(vcvt_f16_f32(v))); }
static inline float32x4_t kvdn_clip(float32x4_t v) {
    /* FMIN/FMAX would turn NaN into the default NaN only with FPCR.DN; compare-and-select keeps NaN as is */
    v = vbslq_f32(vcgtq_f32(v, vdupq_n_f32(65504.0f)), vdupq_n_f32(65504.0f), v);
    return vbslq_f32(vcltq_f32(v, vdupq_n_f32(-65504.0f)), vdupq_n_f32(-65504.0f), v);
}

/* 8 q8 codes of 8 float16 values */
static inline int8x8_t kvdn_q8_codes8(const uint16_t *p, float32x4_t inv) {
    int32x4_t a = vcvtnq_s32_f32(vmulq_f32(kvdn_ld4(p), inv));
    int32x4_t b = vcvtnq_s32_f32(vmulq_f32(kvdn_ld4(p + 4), inv));
    int16x8_t w = vcombine_s16(vqmovn_s32(a), vqmovn_s32(b));
    return vmax_s8(vqmovn_s16(w), vdup_n_s8(-127));
}

static int kvdn_f16_copy_rows(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, uint16_t *out) {
    for (int64_t r = 0; r < n; r++)
        if (kvdn_absmax(x + r * xs, d) >= 0x7c00u) return KVD_NONFINITE;
    if (xs == d)
        memmove(out, x, (size_t)(n * d) * 2); /* memmove: out may be x itself */
    else
        for (int64_t r = 0; r < n; r++) memmove(out + r * d, x + r * xs, (size_t)d * 2);
    return KVD_OK;
}

static int kvdn_absmax_rows(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, uint8_t *codes,
                            uint16_t *scales, int64_t group, int fmt) {
    const int64_t ng = kvd_ngroups(d, group);
    const float code_max = fmt < 0 ? 127.0f : kvd_fp8_max[fmt];
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *row = x + r * xs;
        uint8_t *crow = codes + r * d;
        for (int64_t gi = 0, j0 = 0; gi < ng; gi++, j0 += group) {
            const int64_t j1 = kvd_min64(j0 + group, d);
            const uint16_t am = kvdn_absmax(row + j0, j1 - j0);
            if (am >= 0x7c00u) return KVD_NONFINITE;
            float inv;
            scales[r * ng + gi] = kvd_absmax_scale(am, code_max, &inv);
            int64_t j = j0;
            if (fmt < 0) {
                const float32x4_t iv = vdupq_n_f32(inv);
                for (; j + 8 <= j1; j += 8) vst1_s8((int8_t *)crow + j, kvdn_q8_codes8(row + j, iv));
                for (; j < j1; j++) crow[j] = (uint8_t)kvd_q8_code(row[j], inv);
            } else {
                for (; j < j1; j++) crow[j] = kvd_fp8_code(row[j], inv, fmt);
            }
        }
    }
    return KVD_OK;
}

static int kvdn_q8_encode_rows(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, int8_t *codes,
                               uint16_t *scales, int64_t group) {
    return kvdn_absmax_rows(x, xs, n, d, (uint8_t *)codes, scales, group, -1);
}

static int kvdn_fp8_encode_rows(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, uint8_t *codes,
                                uint16_t *scales, int64_t group, int fmt) {
    return kvdn_absmax_rows(x, xs, n, d, codes, scales, group, fmt);
}

static void kvdn_q8_decode_rows(const int8_t *codes, const uint16_t *scales, uint16_t *out, int64_t n, int64_t d,
                                int64_t group) {
    const int64_t ng = kvd_ngroups(d, group);
    for (int64_t r = 0; r < n; r++)
        for (int64_t gi = 0, j0 = 0; gi < ng; gi++, j0 += group) {
            const int64_t j1 = kvd_min64(j0 + group, d), base = r * d;
            const float s = kvd_h2f(scales[r * ng + gi]);
            const float32x4_t sv = vdupq_n_f32(s);
            int64_t j = j0;
            for (; j + 8 <= j1; j += 8) {
                int16x8_t c = vmovl_s8(vld1_s8(codes + base + j));
                kvdn_st4(out + base + j, kvdn_clip(vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(c))), sv)));
                kvdn_st4(out + base + j + 4, kvdn_clip(vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(c))), sv)));
            }
            for (; j < j1; j++) out[base + j] = kvd_decode_f16((float)codes[base + j] * s);
        }
}

static void kvdn_fp8_decode_rows(const uint8_t *codes, const uint16_t *scales, uint16_t *out, int64_t n, int64_t d,
                                 int64_t group, int fmt) {
    const int64_t ng = kvd_ngroups(d, group);
    const float *lut = kvd_fp8_lut[fmt];
    for (int64_t r = 0; r < n; r++)
        for (int64_t gi = 0, j0 = 0; gi < ng; gi++, j0 += group) {
            const int64_t j1 = kvd_min64(j0 + group, d), base = r * d;
            const float s = kvd_h2f(scales[r * ng + gi]);
            const float32x4_t sv = vdupq_n_f32(s);
            int64_t j = j0;
            for (; j + 4 <= j1; j += 4) {
                const uint8_t *c = codes + base + j;
                float t[4] = {lut[c[0]], lut[c[1]], lut[c[2]], lut[c[3]]};
                kvdn_st4(out + base + j, kvdn_clip(vmulq_f32(vld1q_f32(t), sv)));
            }
            for (; j < j1; j++) out[base + j] = kvd_decode_f16(lut[codes[base + j]] * s);
        }
}

static int kvdn_q8_encode_cols(const uint16_t *x, ptrdiff_t xs, int64_t t, int64_t c, int8_t *codes,
                               uint16_t *scales, int64_t group) {
    const uint16x8_t m7fff = vdupq_n_u16(0x7fff);
    for (int64_t t0 = 0, gi = 0; t0 < t; t0 += group, gi++) {
        const int64_t t1 = kvd_min64(t0 + group, t);
        int64_t c0 = 0;
        for (; c0 + 8 <= c; c0 += 8) {
            uint16x8_t a = vdupq_n_u16(0);
            for (int64_t i = t0; i < t1; i++) a = vmaxq_u16(a, vandq_u16(vld1q_u16(x + i * xs + c0), m7fff));
            if (vmaxvq_u16(a) >= 0x7c00u) return KVD_NONFINITE;
            uint16_t am[8];
            float inv[8];
            vst1q_u16(am, a);
            for (int k = 0; k < 8; k++) scales[gi * c + c0 + k] = kvd_absmax_scale(am[k], 127.0f, &inv[k]);
            const float32x4_t i0 = vld1q_f32(inv), i1 = vld1q_f32(inv + 4);
            for (int64_t i = t0; i < t1; i++) {
                const uint16_t *p = x + i * xs + c0;
                int32x4_t a0 = vcvtnq_s32_f32(vmulq_f32(kvdn_ld4(p), i0));
                int32x4_t a1 = vcvtnq_s32_f32(vmulq_f32(kvdn_ld4(p + 4), i1));
                int8x8_t b = vmax_s8(vqmovn_s16(vcombine_s16(vqmovn_s32(a0), vqmovn_s32(a1))), vdup_n_s8(-127));
                vst1_s8(codes + i * c + c0, b);
            }
        }
        for (; c0 < c; c0++) {
            uint16_t am = 0;
            for (int64_t i = t0; i < t1; i++)
                if ((x[i * xs + c0] & 0x7fffu) > am) am = x[i * xs + c0] & 0x7fffu;
            if (am >= 0x7c00u) return KVD_NONFINITE;
            float inv;
            scales[gi * c + c0] = kvd_absmax_scale(am, 127.0f, &inv);
            for (int64_t i = t0; i < t1; i++) codes[i * c + c0] = kvd_q8_code(x[i * xs + c0], inv);
        }
    }
    return KVD_OK;
}

static void kvdn_q8_decode_cols(const int8_t *codes, const uint16_t *scales, uint16_t *out, int64_t t, int64_t c,
                                int64_t group) {
    for (int64_t i = 0; i < t; i++) {
        const uint16_t *srow = scales + (i / group) * c;
        int64_t j = 0;
        for (; j + 8 <= c; j += 8) {
            int16x8_t q = vmovl_s8(vld1_s8(codes + i * c + j));
            kvdn_st4(out + i * c + j, kvdn_clip(vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(q))), kvdn_ld4(srow + j))));
            kvdn_st4(out + i * c + j + 4,
                     kvdn_clip(vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(q))), kvdn_ld4(srow + j + 4))));
        }
        for (; j < c; j++) out[i * c + j] = kvd_decode_f16((float)codes[i * c + j] * kvd_h2f(srow[j]));
    }
}

static const kvd_backend kvd_backend_neon = {
    "neon",
    kvdn_f16_copy_rows,
    kvdn_q8_encode_rows,
    kvdn_q8_decode_rows,
    kvdn_q8_encode_cols,
    kvdn_q8_decode_cols,
    kvdn_fp8_encode_rows,
    kvdn_fp8_decode_rows,
    kvd_scalar_q4_encode_rows,
    kvd_scalar_q4_decode_rows,
    kvd_scalar_q4_encode_cols,
    kvd_scalar_q4_decode_cols,
    NULL,
};

#endif
