/* Whole pages in C: kernel + header + checksum of one v1 page per call, for the batched paths of the store.
 *
 * kvd/codec/pages.py defines the page format (docs/formats.md). For a page without raw heads everything but the
 * checksum is a constant of its layout, so a layout is flattened once into a kvd_page_spec (built by
 * kvd/codec/batch.py from kvd.pages' own layout) and a page is then encoded or checked and decoded here
 * without touching Python: the per-page Python work (array views, argument checks, dispatch) costs more than
 * the kernel itself on small pages. The bytes are identical to kvd.pages.encode's (the tests compare them).
 *
 * The checksum is xxh3-64 of the payload seeded with the layout's header hash. kvd does not carry its own
 * copy of xxHash: the caller hands over the XXH3_64bits_withSeed of the xxhash module Python has loaded (the
 * very function kvd.pages calls), checked against it at import (kvd/codec/batch.py).
 */
#ifndef KVD_PAGECODEC_H
#define KVD_PAGECODEC_H

#include "kvd_common.h"

#define KVD_CORRUPT 3 /* header bytes, length or checksum do not match the spec: the caller re-checks in Python */
#define KVD_PAGE_HEAD_MAX 32 /* a page without raw heads has a 32-byte prefix (header + checksum) */
#define KVD_SUM_OFFSET 24    /* the checksum's place in the header */

typedef uint64_t (*kvd_hash_fn)(const void *data, size_t len, uint64_t seed);

enum { KVD_LV_FP16 = 0, KVD_LV_Q8 = 1, KVD_LV_E4M3 = 2, KVD_LV_E5M2 = 3, KVD_LV_Q4 = 4 };
enum { KVD_AX_NONE = 0, KVD_AX_TOKEN = 1, KVD_AX_CHANNEL = 2 };

typedef struct {
    int level, axis, rotated;
    int64_t group;
    int64_t rows, cols;         /* the kernel's matrix: [T*H, D] by token, [T, H*D] by channel or raw */
    int64_t off_data;           /* raw float16, int8/fp8 codes or packed nibbles */
    int64_t off_scales, off_mins;
    int64_t prefix, size;       /* header bytes; the whole page */
    uint64_t seed;              /* xxh3 of the header fields the checksum covers */
    uint8_t head[KVD_PAGE_HEAD_MAX]; /* the first `prefix` bytes with a zero checksum */
    int ngaps;                  /* alignment padding after sections, zeroed: a reused buffer keeps no old bytes */
    int64_t gap_start[3], gap_len[3];
} kvd_page_spec;

static inline void kvd_store_le64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static inline uint64_t kvd_load_le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* Copy n float16 values and report NaN/Inf (exponent all ones) in the same pass. The fp16 page's own copy:
 * the public f16_copy_rows checks everything before writing anything, a second pass over the source that a
 * page being built does not need (a failed record is thrown away). Plain C: compilers vectorize it with
 * the baseline's 16-bit compares, and the loop runs at memory speed. */
static int kvd_copy_f16_checked(const uint16_t *restrict src, uint16_t *restrict dst, int64_t n) {
    uint16_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        uint16_t v = src[i];
        dst[i] = v;
        bad |= (uint16_t)((v & 0x7c00) == 0x7c00);
    }
    return bad ? KVD_NONFINITE : KVD_OK;
}

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
/* The same with streaming stores (SSE2, the x86-64 baseline) to a 16-byte aligned dst. A page is written
 * once and not read again soon, so filling cache lines that are about to be overwritten whole (the read
 * for ownership of ordinary stores) is a third of the memory traffic of an fp16 page; numpy.copyto avoids it
 * the same way on large copies. The caller hashes the source (same bytes) and fences before returning. */
static int kvd_copy_f16_checked_nt(const uint16_t *restrict src, uint16_t *restrict dst, int64_t n) {
    const __m128i expo = _mm_set1_epi16(0x7c00);
    __m128i bad = _mm_setzero_si128();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 8));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i e = _mm_loadu_si128((const __m128i *)(src + i + 24));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 8), b);
        _mm_stream_si128((__m128i *)(dst + i + 16), c);
        _mm_stream_si128((__m128i *)(dst + i + 24), e);
        bad = _mm_or_si128(bad, _mm_cmpeq_epi16(_mm_and_si128(a, expo), expo));
        bad = _mm_or_si128(bad, _mm_cmpeq_epi16(_mm_and_si128(b, expo), expo));
        bad = _mm_or_si128(bad, _mm_cmpeq_epi16(_mm_and_si128(c, expo), expo));
        bad = _mm_or_si128(bad, _mm_cmpeq_epi16(_mm_and_si128(e, expo), expo));
    }
    int rc = _mm_movemask_epi8(bad) ? KVD_NONFINITE : KVD_OK;
    if (kvd_copy_f16_checked(src + i, dst + i, n - i) != KVD_OK) rc = KVD_NONFINITE;
    return rc;
}
/* n bytes to a 16-byte aligned dst with streaming stores (a decoded page of a very large read) */
static void kvd_copy_nt(const uint8_t *restrict src, uint8_t *restrict dst, int64_t n) {
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), e);
    }
    memcpy(dst + i, src + i, (size_t)(n - i));
}
#define KVD_HAVE_NT 1
static inline void kvd_store_fence(void) { _mm_sfence(); }
#else
static inline void kvd_store_fence(void) {}
#endif

/* Encode the [T, H, D] float16 page at src (C-contiguous) into dst (spec->size bytes). KVD_OK, or the
 * kernel's KVD_NONFINITE / KVD_NOMEM (dst is then unspecified). `pf`, `pf_bytes`: the next input, read into
 * cache meanwhile where the kernel has time for it (q4 rows; see kvd_page_encode_kv), or NULL. */
static int kvd_page_encode(const kvd_backend *b, const kvd_page_spec *s, const uint16_t *src, uint8_t *dst,
                           kvd_hash_fn hash, const void *pf, int64_t pf_bytes) {
    int rc = KVD_OK;
    int64_t n = s->rows, d = s->cols, g = s->group;
    uint8_t *data = dst + s->off_data;
    uint16_t *scales = (uint16_t *)(dst + s->off_scales), *mins = (uint16_t *)(dst + s->off_mins);
    switch (s->level) {
    case KVD_LV_FP16:
#ifdef KVD_HAVE_NT
        /* streaming stores when the payload is exactly the copied bytes (no padding), so the checksum can
         * be taken over the source, still in cache, instead of reading the streamed page back */
        if (((uintptr_t)data & 15) == 0 && s->size - s->prefix == n * d * 2) {
            rc = kvd_copy_f16_checked_nt(src, (uint16_t *)data, n * d);
            if (rc != KVD_OK) return rc;
            memcpy(dst, s->head, (size_t)s->prefix);
            kvd_store_le64(dst + KVD_SUM_OFFSET, hash(src, (size_t)(n * d * 2), s->seed));
            return KVD_OK;
        }
#endif
        rc = kvd_copy_f16_checked(src, (uint16_t *)data, n * d);
        break;
    case KVD_LV_Q8:
        rc = (s->axis == KVD_AX_TOKEN ? b->q8_encode_rows : b->q8_encode_cols)(src, d, n, d, (int8_t *)data,
                                                                               scales, g);
        break;
    case KVD_LV_E4M3:
    case KVD_LV_E5M2:
        rc = b->fp8_encode_rows(src, d, n, d, data, scales, g, s->level == KVD_LV_E5M2);
        break;
    case KVD_LV_Q4:
        rc = s->axis == KVD_AX_TOKEN
                 ? kvd_q4_encode_rows_hinted(b, src, d, n, d, data, scales, mins, g, s->rotated, pf, pf_bytes)
                 : b->q4_encode_cols(src, d, n, d, data, scales, mins, g);
        break;
    default:
        return KVD_CORRUPT;
    }
    if (rc != KVD_OK) return rc;
    for (int i = 0; i < s->ngaps; i++) memset(dst + s->gap_start[i], 0, (size_t)s->gap_len[i]);
    memcpy(dst, s->head, (size_t)s->prefix);
    kvd_store_le64(dst + KVD_SUM_OFFSET, hash(dst + s->prefix, (size_t)(s->size - s->prefix), s->seed));
    return KVD_OK;
}

/* A layer's key and value pages into kdst and vdst. With q4 values (rows, compute-bound: the rotation) the
 * values go first and read the keys into cache meanwhile; the keys' column kernel, which reads 32 rows 2 KiB
 * apart and otherwise waits on memory, then finds them there (C harness, 256 cold page pairs: 18.8 -> 16.5 us a pair; BENCHMARKS.md).
 * KVD_OK, or the first error of either page. */
static int kvd_page_encode_kv(const kvd_backend *b, const kvd_page_spec *ks, const uint16_t *ksrc, uint8_t *kdst,
                              const kvd_page_spec *vs, const uint16_t *vsrc, uint8_t *vdst, kvd_hash_fn hash) {
    if (vs->level == KVD_LV_Q4 && vs->axis == KVD_AX_TOKEN && b->q4_encode_rows_pf) {
        int rc = kvd_page_encode(b, vs, vsrc, vdst, hash, ksrc, ks->rows * ks->cols * 2);
        return rc != KVD_OK ? rc : kvd_page_encode(b, ks, ksrc, kdst, hash, NULL, 0);
    }
    int rc = kvd_page_encode(b, ks, ksrc, kdst, hash, NULL, 0);
    return rc != KVD_OK ? rc : kvd_page_encode(b, vs, vsrc, vdst, hash, NULL, 0);
}

/* Check the page at src (len bytes) against the spec (header bytes, length, checksum): KVD_OK or KVD_CORRUPT. */
static int kvd_page_check(const kvd_page_spec *s, const uint8_t *src, int64_t len, kvd_hash_fn hash) {
    if (len != s->size || memcmp(src, s->head, KVD_SUM_OFFSET) != 0 ||
        memcmp(src + KVD_SUM_OFFSET + 8, s->head + KVD_SUM_OFFSET + 8,
               (size_t)(s->prefix - KVD_SUM_OFFSET - 8)) != 0)
        return KVD_CORRUPT;
    if (hash(src + s->prefix, (size_t)(s->size - s->prefix), s->seed) != kvd_load_le64(src + KVD_SUM_OFFSET))
        return KVD_CORRUPT;
    return KVD_OK;
}

/* kvd_page_check, then decode the page into dst, a C-contiguous float16 [T, H, D]; `stream`: write fp16 pages
 * past the cache (for outputs too large to be read back from it; a reply about to be sent is better left in
 * cache). KVD_CORRUPT (nothing written) when anything does not match: the caller then hands the page to
 * kvd.pages, which decodes any valid page and names what is wrong otherwise. */
static int kvd_page_decode(const kvd_backend *b, const kvd_page_spec *s, const uint8_t *src, int64_t len,
                           uint16_t *dst, kvd_hash_fn hash, int stream) {
    if (kvd_page_check(s, src, len, hash) != KVD_OK) return KVD_CORRUPT;
    int64_t n = s->rows, d = s->cols, g = s->group;
    const uint8_t *data = src + s->off_data;
    const uint16_t *scales = (const uint16_t *)(src + s->off_scales);
    const uint16_t *mins = (const uint16_t *)(src + s->off_mins);
    switch (s->level) {
    case KVD_LV_FP16:
#ifdef KVD_HAVE_NT
        if (stream && ((uintptr_t)dst & 15) == 0) {
            kvd_copy_nt(data, (uint8_t *)dst, n * d * 2);
            return KVD_OK;
        }
#endif
        memcpy(dst, data, (size_t)(n * d * 2));
        return KVD_OK;
    case KVD_LV_Q8:
        (s->axis == KVD_AX_TOKEN ? b->q8_decode_rows : b->q8_decode_cols)((const int8_t *)data, scales, dst, n, d,
                                                                          g);
        return KVD_OK;
    case KVD_LV_E4M3:
    case KVD_LV_E5M2:
        b->fp8_decode_rows(data, scales, dst, n, d, g, s->level == KVD_LV_E5M2);
        return KVD_OK;
    case KVD_LV_Q4:
        if (s->axis == KVD_AX_TOKEN) return b->q4_decode_rows(data, scales, mins, dst, n, d, g, s->rotated);
        b->q4_decode_cols(data, scales, mins, dst, n, d, g);
        return KVD_OK;
    default:
        return KVD_CORRUPT;
    }
}

#endif
