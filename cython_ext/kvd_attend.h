/* Attention tiles: one run of float16 keys and values folded into an online softmax (flash-decoding's state).
 *
 * The state (kvd/codec/attend.py) is, per query t and query head h, the running maximum m, the denominator l and
 * the unnormalised output acc[D] of softmax(q . k_j) v_j over the tokens seen so far; q is float32 and already
 * scaled. A tile holds n tokens at positions token0 .. token0 + n - 1 (k, v: float16 [n, Hkv, D], C order);
 * query t sees those at positions <= pos[t]; query head h reads KV head h / (Hq / Hkv) (grouped-query).
 * A q8 / q4 page pair is read as stored by the fused tiles of kvd_attend_q.h; any other page is decoded into a
 * one-page scratch with the codec's kernels and read from cache by the float16 tile here.
 *
 * Not bit-identical to the numpy twin (kvd.codec.attend.tile_reference): sums run in another order and the
 * AVX2 exp is a polynomial (Cephes' expf, relative error < 2e-7). Every value that enters is finite (pages hold
 * finite values, the queries are checked), so the only infinity is m's initial -inf, taken by scalar expf.
 */
#ifndef KVD_ATTEND_H
#define KVD_ATTEND_H

#include <math.h>

#include "kvd_kernels.h"

typedef struct {
    const float *q;       /* [tq, hq, d] */
    const int64_t *pos;   /* [tq] */
    float *m, *l, *acc;   /* [tq, hq], [tq, hq], [tq, hq, d] */
    float *scores;        /* scratch: KVD_ATTEND_GROUP * n floats */
    int64_t tq, hq, hkv, d;
} kvd_attend_state;

/* Query heads of one KV head that the AVX2 tile serves in one pass over the keys and values: each float16 row
 * is converted to float32 once for all of them instead of once per head. */
#define KVD_ATTEND_GROUP 4

typedef void (*kvd_attend_tile_fn)(const kvd_attend_state *st, const uint16_t *k, const uint16_t *v, int64_t n,
                                   int64_t token0);

/* ---- portable C ---------------------------------------------------------------------------------------- */

/* The online-softmax update of query t, head h over its scores sc[0 .. lim): sc becomes the weights
 * exp(s - m'), m and l move on; returns alpha = exp(m - m'), the rescale of the head's accumulator. */
static float kvd_attend_softmax_scalar(const kvd_attend_state *st, int64_t t, int64_t h, float *sc, int64_t lim) {
    float mx = -INFINITY;
    for (int64_t j = 0; j < lim; j++) mx = sc[j] > mx ? sc[j] : mx;
    float *mp = st->m + t * st->hq + h, *lp = st->l + t * st->hq + h;
    const float top = mx > *mp ? mx : *mp, alpha = expf(*mp - top);
    float sum = 0.0f;
    for (int64_t j = 0; j < lim; j++) {
        sc[j] = expf(sc[j] - top);
        sum += sc[j];
    }
    *lp = *lp * alpha + sum;
    *mp = top;
    return alpha;
}

static void kvd_attend_tile_scalar(const kvd_attend_state *st, const uint16_t *k, const uint16_t *v, int64_t n,
                                   int64_t token0) {
    const int64_t hq = st->hq, d = st->d, g = hq / st->hkv, hd = st->hkv * d;
    float *sc = st->scores;
    for (int64_t t = 0; t < st->tq; t++) {
        int64_t lim = st->pos[t] - token0 + 1;
        if (lim <= 0) continue;
        if (lim > n) lim = n;
        for (int64_t h = 0; h < hq; h++) {
            const float *qv = st->q + (t * hq + h) * d;
            const uint16_t *kb = k + (h / g) * d, *vb = v + (h / g) * d;
            for (int64_t j = 0; j < lim; j++) {
                float s = 0.0f;
                for (int64_t c = 0; c < d; c++) s += qv[c] * kvd_h2f(kb[j * hd + c]);
                sc[j] = s;
            }
            const float alpha = kvd_attend_softmax_scalar(st, t, h, sc, lim);
            float *ap = st->acc + (t * hq + h) * d;
            for (int64_t c = 0; c < d; c++) ap[c] *= alpha;
            for (int64_t j = 0; j < lim; j++)
                for (int64_t c = 0; c < d; c++) ap[c] += sc[j] * kvd_h2f(vb[j * hd + c]);
        }
    }
}

/* ---- AVX2 + FMA + F16C --------------------------------------------------------------------------------- */

#ifdef KVD_HAVE_X86

/* exp(x) for x <= 0 (Cephes expf: range reduction by ln 2 in two parts, degree-5 polynomial) */
KVD_I256 __m256 kvd256_exp(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.33654475f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

KVD_I256 float kvd256_hsum(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* kvd_attend_softmax_scalar on 8 scores at a time (the maximum, the polynomial exp) */
KVD_I256 float kvd_attend_softmax_avx2(const kvd_attend_state *st, int64_t t, int64_t h, float *sc, int64_t lim) {
    __m256 vmx = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= lim; j += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(sc + j));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmx), _mm256_extractf128_ps(vmx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float mx = _mm_cvtss_f32(m4);
    for (; j < lim; j++) mx = sc[j] > mx ? sc[j] : mx;
    float *mp = st->m + t * st->hq + h, *lp = st->l + t * st->hq + h;
    const float top = mx > *mp ? mx : *mp, alpha = expf(*mp - top);
    const __m256 vtop = _mm256_set1_ps(top);
    __m256 vsum = _mm256_setzero_ps();
    j = 0;
    for (; j + 8 <= lim; j += 8) {
        const __m256 p = kvd256_exp(_mm256_sub_ps(_mm256_loadu_ps(sc + j), vtop));
        _mm256_storeu_ps(sc + j, p);
        vsum = _mm256_add_ps(vsum, p);
    }
    float sum = kvd256_hsum(vsum);
    for (; j < lim; j++) {
        sc[j] = expf(sc[j] - top);
        sum += sc[j];
    }
    *lp = *lp * alpha + sum;
    *mp = top;
    return alpha;
}

/* Scores, softmax update and values of query t's heads h0 .. h0 + NB - 1, which share the KV head whose rows
 * start at kb / vb: each key and value row is loaded and converted once for the NB heads. NB is a constant at
 * each call (kvd_attend_tile_avx2), so the head loops unroll and the accumulators stay in registers. */
KVD_I256 void kvd_attend_group_avx2(const kvd_attend_state *st, int64_t t, int64_t h0, const int NB,
                                    const uint16_t *kb, const uint16_t *vb, int64_t lim) {
    const int64_t hq = st->hq, d = st->d, hd = st->hkv * d, d8 = d & ~(int64_t)7;
    const float *qv[KVD_ATTEND_GROUP];
    float *sc[KVD_ATTEND_GROUP];
    for (int b = 0; b < NB; b++) {
        qv[b] = st->q + (t * hq + h0 + b) * d;
        sc[b] = st->scores + b * lim;
    }
    /* scores: one key row, converted once, against the NB queries */
    for (int64_t j = 0; j < lim; j++) {
        const uint16_t *k0 = kb + j * hd;
        __m256 a[KVD_ATTEND_GROUP];
        for (int b = 0; b < NB; b++) a[b] = _mm256_setzero_ps();
        int64_t c = 0;
        for (; c < d8; c += 8) {
            const __m256 kc = kvd256_ld8(k0 + c);
            for (int b = 0; b < NB; b++) a[b] = _mm256_fmadd_ps(_mm256_loadu_ps(qv[b] + c), kc, a[b]);
        }
        for (int b = 0; b < NB; b++) {
            float s = kvd256_hsum(a[b]);
            for (int64_t cc = c; cc < d; cc++) s += qv[b][cc] * kvd256_h2f(k0[cc]);
            sc[b][j] = s;
        }
    }
    /* the softmax update of each head, as in the tile of one head */
    float alpha[KVD_ATTEND_GROUP];
    for (int b = 0; b < NB; b++) alpha[b] = kvd_attend_softmax_avx2(st, t, h0 + b, sc[b], lim);
    /* values: 16 channels of the NB outputs in registers over every token, each value row converted once */
    float *ap[KVD_ATTEND_GROUP];
    for (int b = 0; b < NB; b++) ap[b] = st->acc + (t * hq + h0 + b) * d;
    int64_t c = 0;
    for (; c + 16 <= d8; c += 16) {
        __m256 o0[KVD_ATTEND_GROUP], o1[KVD_ATTEND_GROUP];
        for (int b = 0; b < NB; b++) {
            const __m256 va = _mm256_set1_ps(alpha[b]);
            o0[b] = _mm256_mul_ps(_mm256_loadu_ps(ap[b] + c), va);
            o1[b] = _mm256_mul_ps(_mm256_loadu_ps(ap[b] + c + 8), va);
        }
        for (int64_t j = 0; j < lim; j++) {
            const uint16_t *vr = vb + j * hd + c;
            const __m256 v0 = kvd256_ld8(vr), v1 = kvd256_ld8(vr + 8);
            for (int b = 0; b < NB; b++) {
                const __m256 p = _mm256_broadcast_ss(sc[b] + j);
                o0[b] = _mm256_fmadd_ps(p, v0, o0[b]);
                o1[b] = _mm256_fmadd_ps(p, v1, o1[b]);
            }
        }
        for (int b = 0; b < NB; b++) {
            _mm256_storeu_ps(ap[b] + c, o0[b]);
            _mm256_storeu_ps(ap[b] + c + 8, o1[b]);
        }
    }
    for (; c < d; c++) {  /* the channels past the last 16: one at a time */
        for (int b = 0; b < NB; b++) {
            float o = ap[b][c] * alpha[b];
            for (int64_t j = 0; j < lim; j++) o += sc[b][j] * kvd256_h2f(vb[j * hd + c]);
            ap[b][c] = o;
        }
    }
}

KVD_T256 static void kvd_attend_tile_avx2(const kvd_attend_state *st, const uint16_t *k, const uint16_t *v,
                                          int64_t n, int64_t token0) {
    const int64_t hq = st->hq, d = st->d, g = hq / st->hkv, hd = st->hkv * d, d8 = d & ~(int64_t)7;
    float *sc = st->scores;
    for (int64_t t = 0; t < st->tq; t++) {
        int64_t lim = st->pos[t] - token0 + 1;
        if (lim <= 0) continue;
        if (lim > n) lim = n;
        if (g > 1) {  /* grouped-query: a KV head's query heads in passes of up to KVD_ATTEND_GROUP */
            for (int64_t kh = 0; kh < st->hkv; kh++) {
                const uint16_t *kb = k + kh * d, *vb = v + kh * d;
                for (int64_t h0 = kh * g; h0 < (kh + 1) * g; h0 += KVD_ATTEND_GROUP) {
                    switch ((kh + 1) * g - h0 >= KVD_ATTEND_GROUP ? KVD_ATTEND_GROUP : (kh + 1) * g - h0) {
                    case 4: kvd_attend_group_avx2(st, t, h0, 4, kb, vb, lim); break;
                    case 3: kvd_attend_group_avx2(st, t, h0, 3, kb, vb, lim); break;
                    case 2: kvd_attend_group_avx2(st, t, h0, 2, kb, vb, lim); break;
                    default: kvd_attend_group_avx2(st, t, h0, 1, kb, vb, lim); break;
                    }
                }
            }
            continue;
        }
        for (int64_t h = 0; h < hq; h++) {  /* one query head per KV head */
            const float *qv = st->q + (t * hq + h) * d;
            const uint16_t *kb = k + (h / g) * d, *vb = v + (h / g) * d;
            /* scores, two tokens at a time (two independent FMA chains) */
            int64_t j = 0;
            for (; j + 2 <= lim; j += 2) {
                const uint16_t *k0 = kb + j * hd, *k1 = k0 + hd;
                __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
                int64_t c = 0;
                for (; c < d8; c += 8) {
                    const __m256 qc = _mm256_loadu_ps(qv + c);
                    a0 = _mm256_fmadd_ps(qc, kvd256_ld8(k0 + c), a0);
                    a1 = _mm256_fmadd_ps(qc, kvd256_ld8(k1 + c), a1);
                }
                float s0 = kvd256_hsum(a0), s1 = kvd256_hsum(a1);
                for (; c < d; c++) {
                    s0 += qv[c] * kvd256_h2f(k0[c]);
                    s1 += qv[c] * kvd256_h2f(k1[c]);
                }
                sc[j] = s0;
                sc[j + 1] = s1;
            }
            for (; j < lim; j++) {
                const uint16_t *k0 = kb + j * hd;
                __m256 a0 = _mm256_setzero_ps();
                int64_t c = 0;
                for (; c < d8; c += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qv + c), kvd256_ld8(k0 + c), a0);
                float s0 = kvd256_hsum(a0);
                for (; c < d; c++) s0 += qv[c] * kvd256_h2f(k0[c]);
                sc[j] = s0;
            }
            const float alpha = kvd_attend_softmax_avx2(st, t, h, sc, lim);
            float *ap = st->acc + (t * hq + h) * d;
            /* values: 32 channels at a time held in registers over every token */
            const __m256 va = _mm256_set1_ps(alpha);
            int64_t c = 0;
            for (; c + 32 <= d8; c += 32) {
                __m256 o0 = _mm256_mul_ps(_mm256_loadu_ps(ap + c), va), o1 = _mm256_mul_ps(_mm256_loadu_ps(ap + c + 8), va);
                __m256 o2 = _mm256_mul_ps(_mm256_loadu_ps(ap + c + 16), va);
                __m256 o3 = _mm256_mul_ps(_mm256_loadu_ps(ap + c + 24), va);
                for (int64_t jj = 0; jj < lim; jj++) {
                    const uint16_t *vr = vb + jj * hd + c;
                    const __m256 p = _mm256_broadcast_ss(sc + jj);
                    o0 = _mm256_fmadd_ps(p, kvd256_ld8(vr), o0);
                    o1 = _mm256_fmadd_ps(p, kvd256_ld8(vr + 8), o1);
                    o2 = _mm256_fmadd_ps(p, kvd256_ld8(vr + 16), o2);
                    o3 = _mm256_fmadd_ps(p, kvd256_ld8(vr + 24), o3);
                }
                _mm256_storeu_ps(ap + c, o0);
                _mm256_storeu_ps(ap + c + 8, o1);
                _mm256_storeu_ps(ap + c + 16, o2);
                _mm256_storeu_ps(ap + c + 24, o3);
            }
            for (; c < d8; c += 8) {
                __m256 o0 = _mm256_mul_ps(_mm256_loadu_ps(ap + c), va);
                for (int64_t jj = 0; jj < lim; jj++)
                    o0 = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + jj), kvd256_ld8(vb + jj * hd + c), o0);
                _mm256_storeu_ps(ap + c, o0);
            }
            for (; c < d; c++) {
                float o = ap[c] * alpha;
                for (int64_t jj = 0; jj < lim; jj++) o += sc[jj] * kvd256_h2f(vb[jj * hd + c]);
                ap[c] = o;
            }
        }
    }
}
#endif

/* The tile for a kernel set: AVX2 for the x86 SIMD sets (AVX-512 CPUs run AVX2), else portable C. */
static kvd_attend_tile_fn kvd_attend_pick(const kvd_backend *b) {
#ifdef KVD_HAVE_X86
    if (b == &kvd_backend_avx2 || b == &kvd_backend_avx512) return kvd_attend_tile_avx2;
#endif
    (void)b;
    return kvd_attend_tile_scalar;
}

static const char *kvd_attend_name(const kvd_backend *b) {
    return kvd_attend_pick(b) == kvd_attend_tile_scalar ? "scalar" : "avx2";
}

#endif
