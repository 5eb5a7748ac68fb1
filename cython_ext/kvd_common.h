/* Shared definitions of kvd's kernels: the backend table, status codes and the portable scalar helpers.
 *
 * Every backend (scalar, AVX2, AVX-512, NEON) must give bit-identical results to kvd/codec/reference.py. The
 * helpers below are the exact scalar forms of the reference's float steps; the SIMD backends use them for
 * per-group scale arithmetic on their generic paths and for tails, so the rounding rules live in one place:
 *
 *   kvd_h2f / kvd_f2h    float16 <-> float32 (round to nearest even, subnormals, overflow to inf, quiet NaN)
 *   kvd_f16_up / _down   the smallest float16 >= v / the largest float16 <= v (numpy nextafter semantics)
 *   kvd_rint_small       round half to even for |v| < 2^22 (what np.rint does under the default rounding mode)
 *   kvd_f32_to_fp8       reference f32_to_fp8 (nearest even, saturating, sign of -0 kept)
 *
 * All arithmetic is plain IEEE float32 in round-to-nearest-even; the extension is built with
 * -ffp-contract=off so no multiply-add is ever fused.
 *
 * Pointers: float16 data is passed as uint16_t bit patterns. The Cython wrapper only calls a kernel with
 * arrays numpy flags as aligned, so uint16_t access is always aligned. Input rows have a stride `xs` in
 * elements (any sign); every output is C-contiguous.
 */
#ifndef KVD_COMMON_H
#define KVD_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KVD_OK 0
#define KVD_NONFINITE 1 /* NaN or Inf in the input; the wrapper finds and names a position */
#define KVD_NOMEM 2     /* a scratch buffer (rotation of very long rows) could not be allocated */

typedef int (*kvd_f16_copy_rows_fn)(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, uint16_t *out);
typedef int (*kvd_q8_encode_fn)(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, int8_t *codes,
                                uint16_t *scales, int64_t group);
typedef void (*kvd_q8_decode_fn)(const int8_t *codes, const uint16_t *scales, uint16_t *out, int64_t n,
                                 int64_t d, int64_t group);
typedef int (*kvd_fp8_encode_fn)(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, uint8_t *codes,
                                 uint16_t *scales, int64_t group, int fmt);
typedef void (*kvd_fp8_decode_fn)(const uint8_t *codes, const uint16_t *scales, uint16_t *out, int64_t n,
                                  int64_t d, int64_t group, int fmt);
typedef int (*kvd_q4_encode_rows_fn)(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, uint8_t *packed,
                                     uint16_t *scales, uint16_t *mins, int64_t group, int rotate);
/* the same with a prefetch hint: `pf_bytes` bytes at `pf` (the next input, e.g. the page's keys) are read into
 * cache while the arithmetic of these rows runs; the result is the same */
typedef int (*kvd_q4_encode_rows_pf_fn)(const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d, uint8_t *packed,
                                        uint16_t *scales, uint16_t *mins, int64_t group, int rotate,
                                        const void *pf, int64_t pf_bytes);
typedef int (*kvd_q4_decode_rows_fn)(const uint8_t *packed, const uint16_t *scales, const uint16_t *mins,
                                     uint16_t *out, int64_t n, int64_t d, int64_t group, int rotate);
typedef int (*kvd_q4_encode_cols_fn)(const uint16_t *x, ptrdiff_t xs, int64_t t, int64_t c, uint8_t *packed,
                                     uint16_t *scales, uint16_t *mins, int64_t group);
typedef void (*kvd_q4_decode_cols_fn)(const uint8_t *packed, const uint16_t *scales, const uint16_t *mins,
                                      uint16_t *out, int64_t t, int64_t c, int64_t group);

/* One backend: the 11 kernels of kvd_ref.KERNELS. Rows kernels take x [n, d] (groups along d); columns
 * kernels take x [t, c] (groups along t). Encoders return KVD_OK / KVD_NONFINITE / KVD_NOMEM; on an error
 * return the outputs may have been partly written. */
typedef struct {
    const char *name;
    kvd_f16_copy_rows_fn f16_copy_rows;
    kvd_q8_encode_fn q8_encode_rows;
    kvd_q8_decode_fn q8_decode_rows;
    kvd_q8_encode_fn q8_encode_cols;
    kvd_q8_decode_fn q8_decode_cols;
    kvd_fp8_encode_fn fp8_encode_rows;
    kvd_fp8_decode_fn fp8_decode_rows;
    kvd_q4_encode_rows_fn q4_encode_rows;
    kvd_q4_decode_rows_fn q4_decode_rows;
    kvd_q4_encode_cols_fn q4_encode_cols;
    kvd_q4_decode_cols_fn q4_decode_cols;
    kvd_q4_encode_rows_pf_fn q4_encode_rows_pf; /* NULL: the backend's rows are not compute-bound enough */
} kvd_backend;

/* q4 rows with the prefetch hint where the backend takes one (pf may be NULL) */
static inline int kvd_q4_encode_rows_hinted(const kvd_backend *b, const uint16_t *x, ptrdiff_t xs, int64_t n,
                                            int64_t d, uint8_t *packed, uint16_t *scales, uint16_t *mins,
                                            int64_t group, int rotate, const void *pf, int64_t pf_bytes) {
    if (pf && b->q4_encode_rows_pf) return b->q4_encode_rows_pf(x, xs, n, d, packed, scales, mins, group, rotate, pf, pf_bytes);
    return b->q4_encode_rows(x, xs, n, d, packed, scales, mins, group, rotate);
}

/* ------------------------------------------------------------------------------------------------------ */
/* scalar float helpers */

static inline uint32_t kvd_f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float kvd_u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float kvd_h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    if (e == 0x1fu) {
        bits = sign | 0x7f800000u | (m << 13); /* inf, or NaN with its payload */
    } else if (e != 0) {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    } else if (m == 0) {
        bits = sign;
    } else { /* subnormal m * 2^-24: normalize (no float arithmetic, so DAZ/FTZ cannot interfere) */
        uint32_t sh = 0;
        while (!(m & 0x400u)) { m <<= 1; sh++; }
        bits = sign | ((113u - sh) << 23) | ((m & 0x3ffu) << 13);
    }
    return kvd_u2f(bits);
}

static inline uint16_t kvd_f2h(float f) {
    uint32_t x = kvd_f2u(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); /* NaN, quieted */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);                       /* >= 65520: inf */
    if (a >= 0x38800000u) {                                                          /* normal float16 */
        uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
        return (uint16_t)(sign | ((r >> 13) - (112u << 10)));
    }
    if (a <= 0x33000000u) return sign; /* <= 2^-25 (a tie at 2^-25 goes to the even 0) */
    {                                  /* subnormal float16: rint(a / 2^-24) */
        uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u, sh = 126u - e;
        uint32_t q = m >> sh, rem = m & ((1u << sh) - 1u), half = 1u << (sh - 1u);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
}

/* numpy's nextafter on float16 bit patterns */
static inline uint16_t kvd_h_next_up(uint16_t h) {
    if ((h & 0x7fffu) == 0) return 0x0001u;
    return (h & 0x8000u) ? (uint16_t)(h - 1u) : (uint16_t)(h + 1u);
}
static inline uint16_t kvd_h_next_down(uint16_t h) {
    if ((h & 0x7fffu) == 0) return 0x8001u;
    return (h & 0x8000u) ? (uint16_t)(h + 1u) : (uint16_t)(h - 1u);
}

/* reference f16_up / f16_down (v finite, within float16 range) */
static inline uint16_t kvd_f16_up(float v) {
    uint16_t h = kvd_f2h(v);
    return kvd_h2f(h) < v ? kvd_h_next_up(h) : h;
}
static inline uint16_t kvd_f16_down(float v) {
    uint16_t h = kvd_f2h(v);
    return kvd_h2f(h) > v ? kvd_h_next_down(h) : h;
}

/* reference _inv: 1/s, or 0 for a zero scale */
static inline float kvd_inv(float s) { return s > 0.0f ? 1.0f / s : 0.0f; }

/* reference _to_f16's clip (NaN passes through, like np.clip) */
static inline float kvd_clip_f16(float v) {
    if (v > 65504.0f) return 65504.0f;
    if (v < -65504.0f) return -65504.0f;
    return v;
}

/* np.rint for |v| < 2^22 under round-to-nearest-even: adding 1.5 * 2^23 rounds at the units place. The
 * sign of a zero result is lost, which does not matter since the result is converted to an integer. */
static inline int32_t kvd_rint_small(float v) {
    float r = (v + 12582912.0f) - 12582912.0f; /* not reassociated: no -ffast-math */
    return (int32_t)r;
}

/* ------------------------------------------------------------------------------------------------------ */
/* fp8 (fmt 0 = E4M3: 3 mantissa bits, bias 7, max 448; fmt 1 = E5M2: 2 mantissa bits, bias 15, max 57344) */

static const int kvd_fp8_mbits[2] = {3, 2};
static const int kvd_fp8_bias[2] = {7, 15};
static const float kvd_fp8_max[2] = {448.0f, 57344.0f};

static inline float kvd_pow2f(int k) { return kvd_u2f((uint32_t)(127 + k) << 23); } /* normal range only */

static inline uint8_t kvd_f32_to_fp8(float y, int fmt) {
    int mbits = kvd_fp8_mbits[fmt], bias = kvd_fp8_bias[fmt], shift = 23 - mbits;
    uint32_t bits = kvd_f2u(y);
    uint32_t sign = (bits >> 24) & 0x80u;
    float a = kvd_u2f(bits & 0x7fffffffu);
    if (a > kvd_fp8_max[fmt]) a = kvd_fp8_max[fmt];
    int32_t code;
    if (a < kvd_pow2f(1 - bias)) {
        code = kvd_rint_small(a * kvd_pow2f(bias + mbits - 1)); /* exact scaling, then nearest even */
    } else {
        uint32_t ab = kvd_f2u(a);
        uint32_t r = ab + ((1u << (shift - 1)) - 1u) + ((ab >> shift) & 1u);
        code = (int32_t)(r >> shift) - ((127 - bias) << mbits);
    }
    return (uint8_t)((uint32_t)code | sign);
}

/* value of an fp8 code: the reference _fp8_lut (E4M3 0x7f/0xff -> +-480 and E5M2 exponent 31 -> finite
 * values, exactly like the reference table; an encoder never produces those codes) */
static inline float kvd_fp8_value(uint8_t code, int fmt) {
    int mbits = kvd_fp8_mbits[fmt], bias = kvd_fp8_bias[fmt];
    int mag = code & 0x7f, e = mag >> mbits, m = mag & ((1 << mbits) - 1);
    float v = e == 0 ? (float)m * kvd_pow2f(1 - bias - mbits)
                     : (float)((1 << mbits) | m) * kvd_pow2f(e - bias - mbits);
    return (code & 0x80) ? -v : v;
}

/* the fp8 decode table (filled once by kvd_init) */
static float kvd_fp8_lut[2][256];

static void kvd_init_tables(void) {
    for (int f = 0; f < 2; f++)
        for (int c = 0; c < 256; c++) kvd_fp8_lut[f][c] = kvd_fp8_value((uint8_t)c, f);
}

static inline int64_t kvd_min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t kvd_ngroups(int64_t n, int64_t group) { return (n + group - 1) / group; }

#endif
