/* Attention tiles that read a q8 / q4 page pair as stored: scores and weighted values straight from the codes,
 * no float16 scratch page (kvd_attend.h has the state and the float16 tile).
 *
 * The pair they read (kvd_attend_fused_ok): keys on the channel axis (element (j, c) = code * s[c] (+ m[c] at
 * q4), one scale and min per channel for each group of kg tokens), values on the token axis (element (j, c) =
 * code * s[j][c / vg] (+ m[j][c / vg] at q4), optionally rotated: the row is FWHT(code * s + m)), every head
 * quantized. For a run of tokens that share a key group
 *   q . k_j = sum_c (q[c] s[c]) code[j][c] + sum_c q[c] m[c],
 * so the query is scaled by the group's channel scales once (qs) and the min term is one dot per group;
 * each code row is then one dot with qs. The weighted sum of values, with p_j the softmax weights,
 *   sum_j p_j v_j = FWHT( sum_j (p_j s[j][gi]) code[j] + sum_j p_j m[j][gi] )
 * is linear in the rows, so the rotation runs once per page and query head on the page's sum instead of on
 * every row, the per-token scale goes into the weight (pw = p_j s[j][gi]) and the min term is one sum per
 * value group.
 *
 * Rounding differs from decode-then-tile: the page codec rounds every decoded element to float16 (and clamps
 * it to +-65504); these tiles keep code * scale (+ min) in float32 and sum in another order. Against float64
 * attention over the decoded pages the difference is that rounding (tests/unit/test_attend.py bounds it).
 */
#ifndef KVD_ATTEND_Q_H
#define KVD_ATTEND_Q_H

#include "kvd_attend.h"
#include "kvd_pagecodec.h"

typedef void (*kvd_attend_qtile_fn)(const kvd_attend_state *st, const kvd_page_spec *ks, const uint8_t *kp,
                                    const kvd_page_spec *vs, const uint8_t *vp, int64_t token0, float *work,
                                    const uint8_t *next, int64_t next_len);

/* 1 when the fused tiles read the page pair of key spec ks and value spec vs (hkv heads of d channels) */
static int kvd_attend_fused_ok(const kvd_page_spec *ks, const kvd_page_spec *vs, int64_t hkv, int64_t d) {
    return (ks->level == KVD_LV_Q8 || ks->level == KVD_LV_Q4) && ks->axis == KVD_AX_CHANNEL && !ks->rotated &&
           ks->cols == hkv * d && ks->group >= 1 && (vs->level == KVD_LV_Q8 || vs->level == KVD_LV_Q4) &&
           vs->axis == KVD_AX_TOKEN && vs->rows == ks->rows * hkv && vs->cols == d && d % 16 == 0 &&
           vs->group % 16 == 0 && (!vs->rotated || (d & (d - 1)) == 0);
}

/* floats of work space a fused tile needs for pages of n tokens of d channels (value groups of a multiple of 16
 * channels: at most d / 16 of them per row, and a run of 16 channels never crosses a group) */
static int64_t kvd_attend_work_floats(int64_t n, int64_t d) {
    return KVD_ATTEND_GROUP * (2 * d + (n + 1) * (d / 16) + 8);
}

/* the sections of a page pair, as the fused tiles read them */
typedef struct {
    const uint8_t *kd, *vd;                   /* codes (int8) or packed nibbles */
    const uint16_t *ks, *km, *vs, *vm;        /* scales, mins (float16) */
    int64_t kg, vg, gv, krow, vrow;           /* key group (tokens), value group (channels), value groups per
                                                 row, bytes per key row (all heads) and per value row */
    int kq4, vq4, rot;
    const uint8_t *pf;                        /* the next page pair's bytes, read into cache meanwhile */
    int64_t pf_off, pf_len, pf_step;
} kvd_attend_page;

static inline kvd_attend_page kvd_attend_sections(const kvd_page_spec *ks, const uint8_t *kp,
                                                  const kvd_page_spec *vs, const uint8_t *vp) {
    kvd_attend_page pg;
    pg.kd = kp + ks->off_data;
    pg.vd = vp + vs->off_data;
    pg.ks = (const uint16_t *)(kp + ks->off_scales);
    pg.km = (const uint16_t *)(kp + ks->off_mins);
    pg.vs = (const uint16_t *)(vp + vs->off_scales);
    pg.vm = (const uint16_t *)(vp + vs->off_mins);
    pg.kq4 = ks->level == KVD_LV_Q4;
    pg.vq4 = vs->level == KVD_LV_Q4;
    pg.rot = vs->rotated;
    pg.kg = ks->group;
    pg.vg = vs->group;
    pg.gv = kvd_ngroups(vs->cols, vs->group);
    pg.krow = pg.kq4 ? (ks->cols + 1) / 2 : ks->cols;
    pg.vrow = pg.vq4 ? (vs->cols + 1) / 2 : vs->cols;
    pg.pf = NULL;
    pg.pf_off = pg.pf_len = pg.pf_step = 0;
    return pg;
}

/* ---- portable C ---------------------------------------------------------------------------------------- */

static inline float kvd_attend_code(const uint8_t *row, int64_t c, int q4) {
    return q4 ? (float)kvd_get_nibble(row, c) : (float)((const int8_t *)row)[c];
}

static void kvd_attend_qtile_scalar(const kvd_attend_state *st, const kvd_page_spec *ks, const uint8_t *kp,
                                    const kvd_page_spec *vs, const uint8_t *vp, int64_t token0, float *work,
                                    const uint8_t *next, int64_t next_len) {
    (void)next, (void)next_len;
    const kvd_attend_page pg = kvd_attend_sections(ks, kp, vs, vp);
    const int64_t hq = st->hq, hkv = st->hkv, d = st->d, g = hq / hkv, n = ks->rows, W = hkv * d, G = pg.gv;
    float *sc = st->scores, *qs = work, *o = qs + d, *mg = o + d, *pw = mg + G;
    for (int64_t t = 0; t < st->tq; t++) {
        int64_t lim = st->pos[t] - token0 + 1;
        if (lim <= 0) continue;
        if (lim > n) lim = n;
        for (int64_t h = 0; h < hq; h++) {
            const int64_t kh = h / g, c0 = kh * d; /* the KV head's first column of a key row */
            const float *qv = st->q + (t * hq + h) * d;
            for (int64_t j0 = 0; j0 < lim; j0 += pg.kg) { /* the tokens of one key group */
                const int64_t j1 = j0 + pg.kg < lim ? j0 + pg.kg : lim, sr = (j0 / pg.kg) * W + c0;
                float base = 0.0f;
                for (int64_t c = 0; c < d; c++) {
                    qs[c] = qv[c] * kvd_h2f(pg.ks[sr + c]);
                    if (pg.kq4) base += qv[c] * kvd_h2f(pg.km[sr + c]);
                }
                for (int64_t j = j0; j < j1; j++) {
                    const uint8_t *row = pg.kd + j * pg.krow;
                    float s = 0.0f;
                    for (int64_t c = 0; c < d; c++) s += qs[c] * kvd_attend_code(row, c0 + c, pg.kq4);
                    sc[j] = s + base;
                }
            }
            const float alpha = kvd_attend_softmax_scalar(st, t, h, sc, lim);
            for (int64_t gi = 0; gi < G; gi++) mg[gi] = 0.0f;
            for (int64_t j = 0; j < lim; j++) {
                const int64_t r = j * hkv + kh;
                for (int64_t gi = 0; gi < G; gi++) {
                    pw[j * G + gi] = sc[j] * kvd_h2f(pg.vs[r * G + gi]);
                    if (pg.vq4) mg[gi] += sc[j] * kvd_h2f(pg.vm[r * G + gi]);
                }
            }
            for (int64_t c = 0; c < d; c++) o[c] = 0.0f;
            for (int64_t j = 0; j < lim; j++) {
                const uint8_t *row = pg.vd + (j * hkv + kh) * pg.vrow;
                for (int64_t c = 0; c < d; c++) o[c] += pw[j * G + c / pg.vg] * kvd_attend_code(row, c, pg.vq4);
            }
            if (pg.vq4)
                for (int64_t c = 0; c < d; c++) o[c] += mg[c / pg.vg];
            if (pg.rot) kvd_fwht_scalar(o, d);
            float *ap = st->acc + (t * hq + h) * d;
            for (int64_t c = 0; c < d; c++) ap[c] = ap[c] * alpha + o[c];
        }
    }
}

/* ---- AVX2 + FMA + F16C --------------------------------------------------------------------------------- */

#ifdef KVD_HAVE_X86

/* 16 codes from row + c (q8: 16 int8 at byte c; q4: 16 nibbles at byte c / 2, c even) -> two float vectors */
KVD_I256 void kvd256_codes16(const uint8_t *row, int64_t c, const int q4, __m256 *lo, __m256 *hi) {
    __m128i b;
    if (q4) {
        /* 8 bytes -> 16-bit lanes b | b << 4, masked: low byte = low nibble (element 2i), high byte = high */
        b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(row + c / 2)));
        b = _mm_and_si128(_mm_or_si128(b, _mm_slli_epi16(b, 4)), _mm_set1_epi16(0x0f0f));
        *lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
        *hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
    } else {
        b = _mm_loadu_si128((const __m128i *)(row + c));
        *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
    }
}

/* 8 vectors -> the vector of their 8 horizontal sums, in order */
KVD_I256 __m256 kvd256_hsum8(const __m256 *a) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Scores of query t's heads h0 .. h0 + NB - 1 (KV head kh) for tokens [0, lim), two tokens at a time: each
 * code row is converted once for the NB heads. KQ4 a constant at each call. */
KVD_I256 void kvd_attend_qscores_avx2(const kvd_attend_state *st, kvd_attend_page *pg, int64_t t, int64_t h0,
                                      const int NB, int64_t kh, int64_t lim, float *const *sc, float *const *qs,
                                      const int KQ4) {
    const int64_t hq = st->hq, d = st->d, W = st->hkv * d, c0 = kh * d;
    for (int64_t j0 = 0; j0 < lim; j0 += pg->kg) {
        const int64_t j1 = j0 + pg->kg < lim ? j0 + pg->kg : lim, sr = (j0 / pg->kg) * W + c0;
        /* the query times the group's channel scales; at q4 the min term q . m */
        __m256 bs[KVD_ATTEND_GROUP];
        for (int b = 0; b < NB; b++) bs[b] = _mm256_setzero_ps();
        for (int64_t c = 0; c < d; c += 8) {
            const __m256 s = kvd256_ld8(pg->ks + sr + c);
            for (int b = 0; b < NB; b++) {
                const __m256 q = _mm256_loadu_ps(st->q + (t * hq + h0 + b) * d + c);
                _mm256_storeu_ps(qs[b] + c, _mm256_mul_ps(q, s));
                if (KQ4) bs[b] = _mm256_fmadd_ps(q, kvd256_ld8(pg->km + sr + c), bs[b]);
            }
        }
        float base[KVD_ATTEND_GROUP];
        for (int b = 0; b < NB; b++) base[b] = KQ4 ? kvd256_hsum(bs[b]) : 0.0f;
        int64_t j = j0;
        for (; j + 2 <= j1; j += 2) {
            const uint8_t *r0 = pg->kd + j * pg->krow, *r1 = r0 + pg->krow;
            /* a few lines of the next page pair: by the time its checksum reads it, it is in cache */
            for (int64_t e = pg->pf_off + pg->pf_step; pg->pf_off < e && pg->pf_off < pg->pf_len; pg->pf_off += 64)
                _mm_prefetch((const char *)(pg->pf + pg->pf_off), _MM_HINT_T1);
            __m256 a[2 * KVD_ATTEND_GROUP];
            for (int b = 0; b < 2 * KVD_ATTEND_GROUP; b++) a[b] = _mm256_setzero_ps();
            for (int64_t c = 0; c < d; c += 16) {
                __m256 k0l, k0h, k1l, k1h;
                kvd256_codes16(r0, c0 + c, KQ4, &k0l, &k0h);
                kvd256_codes16(r1, c0 + c, KQ4, &k1l, &k1h);
                for (int b = 0; b < NB; b++) {
                    const __m256 ql = _mm256_loadu_ps(qs[b] + c), qh = _mm256_loadu_ps(qs[b] + c + 8);
                    a[b] = _mm256_fmadd_ps(qh, k0h, _mm256_fmadd_ps(ql, k0l, a[b]));
                    a[KVD_ATTEND_GROUP + b] = _mm256_fmadd_ps(qh, k1h, _mm256_fmadd_ps(ql, k1l, a[KVD_ATTEND_GROUP + b]));
                }
            }
            float s8[8];
            _mm256_storeu_ps(s8, kvd256_hsum8(a));
            for (int b = 0; b < NB; b++) {
                sc[b][j] = s8[b] + base[b];
                sc[b][j + 1] = s8[KVD_ATTEND_GROUP + b] + base[b];
            }
        }
        for (; j < j1; j++) {
            const uint8_t *r0 = pg->kd + j * pg->krow;
            __m256 a[KVD_ATTEND_GROUP];
            for (int b = 0; b < NB; b++) a[b] = _mm256_setzero_ps();
            for (int64_t c = 0; c < d; c += 16) {
                __m256 kl, kh8;
                kvd256_codes16(r0, c0 + c, KQ4, &kl, &kh8);
                for (int b = 0; b < NB; b++)
                    a[b] = _mm256_fmadd_ps(_mm256_loadu_ps(qs[b] + c + 8), kh8,
                                           _mm256_fmadd_ps(_mm256_loadu_ps(qs[b] + c), kl, a[b]));
            }
            for (int b = 0; b < NB; b++) sc[b][j] = kvd256_hsum(a[b]) + base[b];
        }
    }
}

/* The page's weighted values of the NB heads into o[b][0 .. d), unrotated: 16 channels of the NB sums in
 * registers over every token, each code row converted once. VQ4 a constant at each call. */
KVD_I256 void kvd_attend_qvalues_avx2(const kvd_attend_state *st, const kvd_attend_page *pg, const int NB,
                                      int64_t kh, int64_t lim, float *const *pw, float *const *o, const int VQ4) {
    const int64_t hkv = st->hkv, d = st->d, G = pg->gv;
    for (int64_t c = 0; c < d; c += 16) {
        const int64_t gi = c / pg->vg;
        __m256 o0[KVD_ATTEND_GROUP], o1[KVD_ATTEND_GROUP];
        for (int b = 0; b < NB; b++) o0[b] = o1[b] = _mm256_setzero_ps();
        for (int64_t j = 0; j < lim; j++) {
            __m256 v0, v1;
            kvd256_codes16(pg->vd + (j * hkv + kh) * pg->vrow, c, VQ4, &v0, &v1);
            for (int b = 0; b < NB; b++) {
                const __m256 p = _mm256_broadcast_ss(pw[b] + j * G + gi);
                o0[b] = _mm256_fmadd_ps(p, v0, o0[b]);
                o1[b] = _mm256_fmadd_ps(p, v1, o1[b]);
            }
        }
        for (int b = 0; b < NB; b++) {
            _mm256_storeu_ps(o[b] + c, o0[b]);
            _mm256_storeu_ps(o[b] + c + 8, o1[b]);
        }
    }
}

/* scores, softmax update and values of query t's heads h0 .. h0 + NB - 1 (KV head kh) over one page pair */
KVD_I256 void kvd_attend_qgroup_avx2(const kvd_attend_state *st, kvd_attend_page *pg, int64_t t, int64_t h0,
                                     const int NB, int64_t kh, int64_t lim, float *work) {
    const int64_t hq = st->hq, hkv = st->hkv, d = st->d, G = pg->gv;
    float *sc[KVD_ATTEND_GROUP], *qs[KVD_ATTEND_GROUP], *o[KVD_ATTEND_GROUP], *mg[KVD_ATTEND_GROUP],
        *pw[KVD_ATTEND_GROUP];
    for (int b = 0; b < NB; b++) {
        sc[b] = st->scores + b * lim;
        qs[b] = work + b * d;
        o[b] = work + (KVD_ATTEND_GROUP + b) * d;
        mg[b] = work + 2 * KVD_ATTEND_GROUP * d + b * G;
        pw[b] = work + 2 * KVD_ATTEND_GROUP * d + KVD_ATTEND_GROUP * G + b * (lim * G + 8);
    }
    if (pg->kq4)
        kvd_attend_qscores_avx2(st, pg, t, h0, NB, kh, lim, sc, qs, 1);
    else
        kvd_attend_qscores_avx2(st, pg, t, h0, NB, kh, lim, sc, qs, 0);
    float alpha[KVD_ATTEND_GROUP];
    for (int b = 0; b < NB; b++) alpha[b] = kvd_attend_softmax_avx2(st, t, h0 + b, sc[b], lim);
    /* the weights times each token's value scales (pw); at q4 the min term of each value group (mg): the G <= 8
     * scales of a token as one vector (a token's 8 lanes overlap the next token's, written in order; each
     * head's pw ends with room for the last 8) */
    if (G <= 8) {
        __m256 am[KVD_ATTEND_GROUP];
        for (int b = 0; b < NB; b++) am[b] = _mm256_setzero_ps();
        for (int64_t j = 0; j < lim; j++) {
            const int64_t r = (j * hkv + kh) * G;
            uint16_t s16[8] = {0}, m16[8] = {0};
            memcpy(s16, pg->vs + r, (size_t)G * 2);
            const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s16));
            if (pg->vq4) memcpy(m16, pg->vm + r, (size_t)G * 2);
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)m16));
            for (int b = 0; b < NB; b++) {
                const __m256 p = _mm256_broadcast_ss(sc[b] + j);
                _mm256_storeu_ps(pw[b] + j * G, _mm256_mul_ps(p, s));
                am[b] = _mm256_fmadd_ps(p, m, am[b]);
            }
        }
        for (int b = 0; b < NB; b++) {
            float m8[8];
            _mm256_storeu_ps(m8, am[b]);
            for (int64_t gi = 0; gi < G; gi++) mg[b][gi] = m8[gi];
        }
    } else {
        for (int b = 0; b < NB; b++)
            for (int64_t gi = 0; gi < G; gi++) mg[b][gi] = 0.0f;
        for (int64_t j = 0; j < lim; j++) {
            const int64_t r = (j * hkv + kh) * G;
            for (int64_t gi = 0; gi < G; gi++) {
                const float s = kvd256_h2f(pg->vs[r + gi]), m = pg->vq4 ? kvd256_h2f(pg->vm[r + gi]) : 0.0f;
                for (int b = 0; b < NB; b++) {
                    pw[b][j * G + gi] = sc[b][j] * s;
                    mg[b][gi] += sc[b][j] * m;
                }
            }
        }
    }
    if (pg->vq4)
        kvd_attend_qvalues_avx2(st, pg, NB, kh, lim, pw, o, 1);
    else
        kvd_attend_qvalues_avx2(st, pg, NB, kh, lim, pw, o, 0);
    for (int b = 0; b < NB; b++) {
        if (pg->vq4)
            for (int64_t c = 0; c < d; c += 8) {
                const __m256 m = _mm256_set1_ps(mg[b][c / pg->vg]);
                _mm256_storeu_ps(o[b] + c, _mm256_add_ps(_mm256_loadu_ps(o[b] + c), m));
            }
        if (pg->rot) kvd256_fwht_buf(o[b], d);
        float *ap = st->acc + (t * hq + h0 + b) * d;
        const __m256 va = _mm256_set1_ps(alpha[b]);
        for (int64_t c = 0; c < d; c += 8)
            _mm256_storeu_ps(ap + c, _mm256_fmadd_ps(_mm256_loadu_ps(ap + c), va, _mm256_loadu_ps(o[b] + c)));
    }
}

KVD_T256 static void kvd_attend_qtile_avx2(const kvd_attend_state *st, const kvd_page_spec *ks, const uint8_t *kp,
                                           const kvd_page_spec *vs, const uint8_t *vp, int64_t token0, float *work,
                                           const uint8_t *next, int64_t next_len) {
    kvd_attend_page pg = kvd_attend_sections(ks, kp, vs, vp);
    const int64_t g = st->hq / st->hkv, n = ks->rows;
    if (next != NULL && n >= 2) { /* spread over the token pairs of the first query's passes */
        const int64_t pairs = st->hkv * ((g + KVD_ATTEND_GROUP - 1) / KVD_ATTEND_GROUP) * (n / 2);
        pg.pf = next;
        pg.pf_len = next_len;
        pg.pf_step = ((next_len + 63) / 64 + pairs - 1) / pairs * 64;
    }
    for (int64_t t = 0; t < st->tq; t++) {
        int64_t lim = st->pos[t] - token0 + 1;
        if (lim <= 0) continue;
        if (lim > n) lim = n;
        for (int64_t kh = 0; kh < st->hkv; kh++)
            for (int64_t h0 = kh * g; h0 < (kh + 1) * g; h0 += KVD_ATTEND_GROUP) {
                switch ((kh + 1) * g - h0 >= KVD_ATTEND_GROUP ? KVD_ATTEND_GROUP : (kh + 1) * g - h0) {
                case 4: kvd_attend_qgroup_avx2(st, &pg, t, h0, 4, kh, lim, work); break;
                case 3: kvd_attend_qgroup_avx2(st, &pg, t, h0, 3, kh, lim, work); break;
                case 2: kvd_attend_qgroup_avx2(st, &pg, t, h0, 2, kh, lim, work); break;
                default: kvd_attend_qgroup_avx2(st, &pg, t, h0, 1, kh, lim, work); break;
                }
            }
    }
}
#endif

/* The fused tile for a kernel set, as kvd_attend_pick chooses the float16 one. */
static kvd_attend_qtile_fn kvd_attend_qpick(const kvd_backend *b) {
#ifdef KVD_HAVE_X86
    if (kvd_attend_pick(b) == kvd_attend_tile_avx2) return kvd_attend_qtile_avx2;
#endif
    return kvd_attend_qtile_scalar;
}

#endif
