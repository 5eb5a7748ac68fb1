/* Portable scalar backend (no intrinsics): the plain-C statement of every kernel, bit-identical to
 * kvd/codec/reference.py. The per-group helpers here (scale computation, one code, one nibble) are also what the
 * SIMD backends call for their generic paths and tails.
 *
 * One choice where the reference leaves the result to numpy: the q4 group minimum and maximum order -0.0
 * below +0.0 (IEEE 754-2019 minimum/maximum). numpy's min/max reductions return either zero for a group
 * holding both, depending on its SIMD reduction order; every group where numpy's answer is determined (all
 * zeros of one sign) gets numpy's answer under this rule, so backends can differ from the reference only in
 * the sign of a zero minimum / zero scale of a group that holds both +0.0 and -0.0.
 */
#ifndef KVD_SCALAR_H
#define KVD_SCALAR_H

#include "kvd_common.h"

#define KVD_SCRATCH_FLOATS 1024 /* rows up to this length are rotated in a stack buffer */

/* ---- per-group arithmetic (shared by every backend) ---------------------------------------------------- */

static inline uint16_t kvd_absmax_scale(uint16_t absmax_bits, float code_max, float *inv) {
    uint16_t s = kvd_f16_up(kvd_h2f(absmax_bits) / code_max);
    *inv = kvd_inv(kvd_h2f(s));
    return s;
}

static inline int8_t kvd_q8_code(uint16_t xb, float inv) {
    int32_t q = kvd_rint_small(kvd_h2f(xb) * inv);
    if (q > 127) q = 127;
    if (q < -127) q = -127;
    return (int8_t)q;
}

static inline uint8_t kvd_fp8_code(uint16_t xb, float inv, int fmt) { return kvd_f32_to_fp8(kvd_h2f(xb) * inv, fmt); }

/* float32 order with -0.0 below +0.0 (finite values) */
static inline int kvd_lt(float a, float b) {
    return a < b || (a == b && (kvd_f2u(a) >> 31) > (kvd_f2u(b) >> 31));
}

/* minimum and maximum of y[0..n) in kvd_lt order (n >= 1): the exact answer the SIMD paths fall back to when a
 * group's float min or max is zero and its sign matters */
static inline void kvd_minmax_f32(const float *y, int64_t n, float *mn_out, float *mx_out) {
    float mn = y[0], mx = y[0];
    for (int64_t j = 1; j < n; j++) {
        if (kvd_lt(y[j], mn)) mn = y[j];
        if (kvd_lt(mx, y[j])) mx = y[j];
    }
    *mn_out = mn;
    *mx_out = mx;
}

/* q4 scale and minimum of a group with minimum mn and maximum mx; returns the scale bits */
static inline uint16_t kvd_q4_scale(float mn, float mx, uint16_t *min_bits, float *mnf, float *inv) {
    uint16_t m16 = kvd_f16_down(mn);
    float m = kvd_h2f(m16);
    float rng = mx - m;
    uint16_t s16 = kvd_f16_up(rng / 15.0f);
    *min_bits = m16;
    *mnf = m;
    *inv = kvd_inv(kvd_h2f(s16));
    return s16;
}

static inline uint8_t kvd_q4_code(float y, float mnf, float inv) {
    int32_t q = kvd_rint_small((y - mnf) * inv);
    if (q > 15) q = 15;
    if (q < 0) q = 0;
    return (uint8_t)q;
}

static inline void kvd_put_nibble(uint8_t *packed, int64_t j, uint8_t q) {
    if (j & 1)
        packed[j >> 1] |= (uint8_t)(q << 4);
    else
        packed[j >> 1] = q; /* the even element comes first and clears the high nibble */
}

static inline uint8_t kvd_get_nibble(const uint8_t *packed, int64_t j) {
    return (j & 1) ? (uint8_t)(packed[j >> 1] >> 4) : (uint8_t)(packed[j >> 1] & 0x0f);
}

static inline uint16_t kvd_decode_f16(float v) { return kvd_f2h(kvd_clip_f16(v)); }

/* unnormalized fast Walsh-Hadamard transform, butterflies in the reference's order h = 1, 2, 4, ... */
static void kvd_fwht_scalar(float *y, int64_t d) {
    for (int64_t h = 1; h < d; h *= 2)
        for (int64_t i = 0; i < d; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                float a = y[j], b = y[j + h];
                y[j] = a + b;
                y[j + h] = a - b;
            }
}

static inline int kvd_row_finite(const uint16_t *row, int64_t d) {
    for (int64_t j = 0; j < d; j++)
        if ((row[j] & 0x7fffu) >= 0x7c00u) return 0;
    return 1;
}

/* ---- kernels ---------------------------------------------------------------------------------------------- */

static int kvd_scalar_f16_copy_rows(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, uint16_t *out) {
    for (int64_t r = 0; r < n; r++)
        if (!kvd_row_finite(x + r * xs, d)) return KVD_NONFINITE;
    for (int64_t r = 0; r < n; r++) memmove(out + r * d, x + r * xs, (size_t)d * 2);
    return KVD_OK;
}

static int kvd_scalar_q8_encode_rows(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, int8_t *codes,
                                     uint16_t *scales, int64_t group) {
    int64_t ng = kvd_ngroups(d, group);
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *row = x + r * xs;
        for (int64_t g = 0; g < ng; g++) {
            int64_t j0 = g * group, j1 = kvd_min64(j0 + group, d);
            uint16_t am = 0;
            for (int64_t j = j0; j < j1; j++) {
                uint16_t b = row[j] & 0x7fffu;
                if (b > am) am = b;
            }
            if (am >= 0x7c00u) return KVD_NONFINITE;
            float inv;
            scales[r * ng + g] = kvd_absmax_scale(am, 127.0f, &inv);
            for (int64_t j = j0; j < j1; j++) codes[r * d + j] = kvd_q8_code(row[j], inv);
        }
    }
    return KVD_OK;
}

static void kvd_scalar_q8_decode_rows(const int8_t *codes, const uint16_t *scales, uint16_t *out, int64_t n,
                                      int64_t d, int64_t group) {
    int64_t ng = kvd_ngroups(d, group);
    for (int64_t r = 0; r < n; r++)
        for (int64_t j = 0; j < d; j++)
            out[r * d + j] = kvd_decode_f16((float)codes[r * d + j] * kvd_h2f(scales[r * ng + j / group]));
}

static int kvd_scalar_q8_encode_cols(const uint16_t *x, ptrdiff_t xs, int64_t t, int64_t c, int8_t *codes,
                                     uint16_t *scales, int64_t group) {
    for (int64_t t0 = 0, gi = 0; t0 < t; t0 += group, gi++) {
        int64_t t1 = kvd_min64(t0 + group, t);
        for (int64_t col = 0; col < c; col++) {
            uint16_t am = 0;
            for (int64_t i = t0; i < t1; i++) {
                uint16_t b = x[i * xs + col] & 0x7fffu;
                if (b > am) am = b;
            }
            if (am >= 0x7c00u) return KVD_NONFINITE;
            float inv;
            scales[gi * c + col] = kvd_absmax_scale(am, 127.0f, &inv);
            for (int64_t i = t0; i < t1; i++) codes[i * c + col] = kvd_q8_code(x[i * xs + col], inv);
        }
    }
    return KVD_OK;
}

static void kvd_scalar_q8_decode_cols(const int8_t *codes, const uint16_t *scales, uint16_t *out, int64_t t,
                                      int64_t c, int64_t group) {
    for (int64_t i = 0; i < t; i++) {
        const uint16_t *srow = scales + (i / group) * c;
        for (int64_t col = 0; col < c; col++)
            out[i * c + col] = kvd_decode_f16((float)codes[i * c + col] * kvd_h2f(srow[col]));
    }
}

static int kvd_scalar_fp8_encode_rows(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, uint8_t *codes,
                                      uint16_t *scales, int64_t group, int fmt) {
    int64_t ng = kvd_ngroups(d, group);
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *row = x + r * xs;
        for (int64_t g = 0; g < ng; g++) {
            int64_t j0 = g * group, j1 = kvd_min64(j0 + group, d);
            uint16_t am = 0;
            for (int64_t j = j0; j < j1; j++) {
                uint16_t b = row[j] & 0x7fffu;
                if (b > am) am = b;
            }
            if (am >= 0x7c00u) return KVD_NONFINITE;
            float inv;
            scales[r * ng + g] = kvd_absmax_scale(am, kvd_fp8_max[fmt], &inv);
            for (int64_t j = j0; j < j1; j++) codes[r * d + j] = kvd_fp8_code(row[j], inv, fmt);
        }
    }
    return KVD_OK;
}

static void kvd_scalar_fp8_decode_rows(const uint8_t *codes, const uint16_t *scales, uint16_t *out, int64_t n,
                                       int64_t d, int64_t group, int fmt) {
    int64_t ng = kvd_ngroups(d, group);
    const float *lut = kvd_fp8_lut[fmt];
    for (int64_t r = 0; r < n; r++)
        for (int64_t j = 0; j < d; j++)
            out[r * d + j] = kvd_decode_f16(lut[codes[r * d + j]] * kvd_h2f(scales[r * ng + j / group]));
}

/* q4 rows on float32 values y (already rotated when asked) */
static void kvd_scalar_q4_row_f32(const float *y, int64_t d, int64_t group, uint8_t *prow, uint16_t *srow,
                                  uint16_t *mrow) {
    int64_t ng = kvd_ngroups(d, group);
    for (int64_t g = 0; g < ng; g++) {
        int64_t j0 = g * group, j1 = kvd_min64(j0 + group, d);
        float mn, mx, mnf, inv;
        kvd_minmax_f32(y + j0, j1 - j0, &mn, &mx);
        srow[g] = kvd_q4_scale(mn, mx, &mrow[g], &mnf, &inv);
        for (int64_t j = j0; j < j1; j++) kvd_put_nibble(prow, j, kvd_q4_code(y[j], mnf, inv));
    }
}

static int kvd_scalar_q4_encode_rows(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, uint8_t *packed,
                                     uint16_t *scales, uint16_t *mins, int64_t group, int rotate) {
    float stackbuf[KVD_SCRATCH_FLOATS];
    float *y = d <= KVD_SCRATCH_FLOATS ? stackbuf : (float *)malloc((size_t)d * sizeof(float));
    if (!y) return KVD_NOMEM;
    int64_t ng = kvd_ngroups(d, group), pb = (d + 1) / 2;
    int rc = KVD_OK;
    float scale = 1.0f / (float)d; /* exact: d is a power of two when rotating */
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *row = x + r * xs;
        if (!kvd_row_finite(row, d)) {
            rc = KVD_NONFINITE;
            break;
        }
        for (int64_t j = 0; j < d; j++) y[j] = kvd_h2f(row[j]);
        if (rotate) {
            kvd_fwht_scalar(y, d);
            for (int64_t j = 0; j < d; j++) y[j] = y[j] * scale;
        }
        kvd_scalar_q4_row_f32(y, d, group, packed + r * pb, scales + r * ng, mins + r * ng);
    }
    if (y != stackbuf) free(y);
    return rc;
}

static int kvd_scalar_q4_decode_rows(const uint8_t *packed, const uint16_t *scales, const uint16_t *mins,
                                     uint16_t *out, int64_t n, int64_t d, int64_t group, int rotate) {
    float stackbuf[KVD_SCRATCH_FLOATS];
    float *y = d <= KVD_SCRATCH_FLOATS ? stackbuf : (float *)malloc((size_t)d * sizeof(float));
    if (!y) return KVD_NOMEM;
    int64_t ng = kvd_ngroups(d, group), pb = (d + 1) / 2;
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *prow = packed + r * pb;
        for (int64_t j = 0; j < d; j++) {
            int64_t g = r * ng + j / group;
            y[j] = (float)kvd_get_nibble(prow, j) * kvd_h2f(scales[g]) + kvd_h2f(mins[g]);
        }
        if (rotate) kvd_fwht_scalar(y, d);
        for (int64_t j = 0; j < d; j++) out[r * d + j] = kvd_decode_f16(y[j]);
    }
    if (y != stackbuf) free(y);
    return KVD_OK;
}

static int kvd_scalar_q4_encode_cols(const uint16_t *x, ptrdiff_t xs, int64_t t, int64_t c, uint8_t *packed,
                                     uint16_t *scales, uint16_t *mins, int64_t group) {
    int64_t pb = (c + 1) / 2;
    for (int64_t t0 = 0, gi = 0; t0 < t; t0 += group, gi++) {
        int64_t t1 = kvd_min64(t0 + group, t);
        for (int64_t col = 0; col < c; col++) { /* increasing col: the even nibble is written first */
            float mn = kvd_h2f(x[t0 * xs + col]), mx = mn;
            for (int64_t i = t0; i < t1; i++) {
                uint16_t b = x[i * xs + col];
                if ((b & 0x7fffu) >= 0x7c00u) return KVD_NONFINITE;
                float v = kvd_h2f(b);
                if (kvd_lt(v, mn)) mn = v;
                if (kvd_lt(mx, v)) mx = v;
            }
            float mnf, inv;
            scales[gi * c + col] = kvd_q4_scale(mn, mx, &mins[gi * c + col], &mnf, &inv);
            for (int64_t i = t0; i < t1; i++)
                kvd_put_nibble(packed + i * pb, col, kvd_q4_code(kvd_h2f(x[i * xs + col]), mnf, inv));
        }
    }
    return KVD_OK;
}

static void kvd_scalar_q4_decode_cols(const uint8_t *packed, const uint16_t *scales, const uint16_t *mins,
                                      uint16_t *out, int64_t t, int64_t c, int64_t group) {
    int64_t pb = (c + 1) / 2;
    for (int64_t i = 0; i < t; i++) {
        const uint16_t *srow = scales + (i / group) * c, *mrow = mins + (i / group) * c;
        for (int64_t col = 0; col < c; col++) {
            float v = (float)kvd_get_nibble(packed + i * pb, col) * kvd_h2f(srow[col]) + kvd_h2f(mrow[col]);
            out[i * c + col] = kvd_decode_f16(v);
        }
    }
}

static const kvd_backend kvd_backend_scalar = {
    "scalar",
    kvd_scalar_f16_copy_rows,
    kvd_scalar_q8_encode_rows,
    kvd_scalar_q8_decode_rows,
    kvd_scalar_q8_encode_cols,
    kvd_scalar_q8_decode_cols,
    kvd_scalar_fp8_encode_rows,
    kvd_scalar_fp8_decode_rows,
    kvd_scalar_q4_encode_rows,
    kvd_scalar_q4_decode_rows,
    kvd_scalar_q4_encode_cols,
    kvd_scalar_q4_decode_cols,
    NULL,
};

#endif
