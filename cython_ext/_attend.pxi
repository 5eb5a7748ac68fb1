# Attention over pages (kvd/codec/attend.py): the tile kernel of kvd_attend.h on float16 keys and values, and a
# run over a layer's records in C with the GIL released: a q8 / q4 page pair is read as stored by the fused tile
# of kvd_attend_q.h, any other page is decoded into a scratch page with the page codec and folded in by the
# float16 tile. Included by _kernels.pyx, after _pagecodec.pxi (its PageSpec and checksum).
#
# The arrays come from kvd.codec.attend, which builds them: a mismatch raises ValueError (a bug, not an input).

from libc.stdint cimport int64_t


cdef extern from "kvd_attend.h" nogil:
    ctypedef struct kvd_attend_state:
        const float *q
        const int64_t *pos
        float *m
        float *l
        float *acc
        float *scores
        int64_t tq, hq, hkv, d
    ctypedef void (*kvd_attend_tile_fn)(const kvd_attend_state *st, const uint16_t *k, const uint16_t *v,
                                        int64_t n, int64_t token0)
    enum: KVD_ATTEND_GROUP
    kvd_attend_tile_fn kvd_attend_pick(const kvd_backend *b)
    const char *kvd_attend_name(const kvd_backend *b)


cdef extern from "kvd_attend_q.h" nogil:
    ctypedef void (*kvd_attend_qtile_fn)(const kvd_attend_state *st, const kvd_page_spec *ks, const uint8_t *kp,
                                         const kvd_page_spec *vs, const uint8_t *vp, int64_t token0, float *work,
                                         const uint8_t *next, int64_t next_len)
    int kvd_attend_fused_ok(const kvd_page_spec *ks, const kvd_page_spec *vs, int64_t hkv, int64_t d)
    int64_t kvd_attend_work_floats(int64_t n, int64_t d)
    kvd_attend_qtile_fn kvd_attend_qpick(const kvd_backend *b)


def attend_fused(PageSpec ks, PageSpec vs) -> bool:
    """Whether :func:`attend_run` reads a page pair of key spec ``ks`` and value spec ``vs`` as stored (the fused
    tile of kvd_attend_q.h) rather than decoding it first."""
    return bool(kvd_attend_fused_ok(&ks.s, &vs.s, ks.heads, ks.head_dim))


def attend_kernel(Backend be) -> str:
    """The tile kernel the kernel set ``be`` runs attention with: ``"avx2"`` or ``"scalar"``."""
    return kvd_attend_name(be.b).decode()


cdef bint _f32(object a, int nd, int writable) noexcept:
    if not cnp.PyArray_Check(a):
        return False
    cdef cnp.ndarray arr = <cnp.ndarray>a
    cdef int flags = cnp.NPY_ARRAY_C_CONTIGUOUS | cnp.NPY_ARRAY_ALIGNED | (cnp.NPY_ARRAY_WRITEABLE if writable else 0)
    return (cnp.PyArray_NDIM(arr) == nd and cnp.PyArray_TYPE(arr) == cnp.NPY_FLOAT32 and cnp.PyArray_ISNOTSWAPPED(arr)
            and (cnp.PyArray_FLAGS(arr) & flags) == flags)


cdef int _attend_state(kvd_attend_state *st, object q, object pos, object m, object l, object acc,
                       int64_t hkv, int64_t d) except -1:
    if not (_f32(q, 3, 0) and _f32(m, 2, 1) and _f32(l, 2, 1) and _f32(acc, 3, 1)) or not cnp.PyArray_Check(pos):
        raise ValueError("attend: q, m, l, acc must be C-contiguous float32 arrays (m, l, acc writable)")
    cdef cnp.ndarray pa = <cnp.ndarray>pos
    st.tq, st.hq, st.d = _dim(q, 0), _dim(q, 1), _dim(q, 2)
    st.hkv = hkv
    if (cnp.PyArray_NDIM(pa) != 1 or cnp.PyArray_TYPE(pa) != cnp.NPY_INT64 or not cnp.PyArray_ISCARRAY_RO(pa)
            or _dim(pos, 0) != st.tq or _dim(m, 0) != st.tq or _dim(m, 1) != st.hq or _dim(l, 0) != st.tq
            or _dim(l, 1) != st.hq or _dim(acc, 0) != st.tq or _dim(acc, 1) != st.hq or _dim(acc, 2) != st.d
            or st.d != d or hkv < 1 or st.hq % hkv):
        raise ValueError("attend: shapes of q, pos, m, l, acc and the keys do not agree")
    st.q, st.pos = <const float *>_data(q), <const int64_t *>_data(pos)
    st.m, st.l, st.acc = <float *>_data(m), <float *>_data(l), <float *>_data(acc)
    return 0


cdef bint _kv_ok(object a) noexcept:
    if not cnp.PyArray_Check(a):
        return False
    cdef cnp.ndarray arr = <cnp.ndarray>a
    return (cnp.PyArray_NDIM(arr) == 3 and cnp.PyArray_TYPE(arr) == NPY_HALF and cnp.PyArray_ISNOTSWAPPED(arr)
            and cnp.PyArray_ISCARRAY_RO(arr))


def attend_tile(Backend be, q, pos, m, l, acc, k, v, int64_t token0):
    """Fold float16 keys ``k`` and values ``v`` ``[n, Hkv, D]`` (C-contiguous; positions ``token0 ..``) into the
    online softmax ``m``, ``l``, ``acc`` of queries ``q`` at ``pos`` (kvd_attend.h)."""
    cdef kvd_attend_state st
    if not (_kv_ok(k) and _kv_ok(v)) or (<cnp.ndarray>k).shape[0] != (<cnp.ndarray>v).shape[0] or \
            _dim(k, 1) != _dim(v, 1) or _dim(k, 2) != _dim(v, 2):
        raise ValueError("attend_tile: k and v must be C-contiguous float16 [n, Hkv, D] of one shape")
    _attend_state(&st, q, pos, m, l, acc, _dim(k, 1), _dim(k, 2))
    cdef int64_t n = _dim(k, 0)
    if n == 0:
        return
    cdef kvd_attend_tile_fn fn = kvd_attend_pick(be.b)
    cdef const uint16_t *pk = <const uint16_t *>_data(k)
    cdef const uint16_t *pv = <const uint16_t *>_data(v)
    st.scores = <float *>PyMem_Malloc(KVD_ATTEND_GROUP * n * sizeof(float))
    if st.scores == NULL:
        raise MemoryError()
    try:
        with nogil:
            fn(&st, pk, pv, n, token0)
    finally:
        PyMem_Free(st.scores)


def attend_run(Backend be, list recs, Py_ssize_t r0, Py_ssize_t r1, tuple specs_by_code, Py_ssize_t code_from_end,
               q, pos, m, l, acc, kscratch, vscratch, bint fused=True) -> int:
    """Fold the full pages of ``recs[r0:r1]`` (one layer; row ``r`` holds positions ``r * P ..``) into the online
    softmax, each page checked, then read as stored by the fused tile when :func:`attend_fused` (and ``fused``),
    else decoded into ``kscratch`` / ``vscratch`` (float16 ``[P, H, D]``) and folded in by the float16 tile. A
    record's format code is its byte at ``-code_from_end``, ``specs_by_code[code]`` its ``(key spec, value
    spec)`` or None. Returns -1, or the first row not folded in (no spec, or bytes that do not match it)."""
    cdef Py_ssize_t n = r1 - r0, i, fail = -1, code, size
    cdef PageSpec ks, vs
    cdef int rc
    cdef kvd_attend_state st
    if _page_hash == NULL or r0 < 0 or r1 > len(recs) or n < 0 or code_from_end < 1:
        raise ValueError("attend_run: no hash function or bad row range")
    if n == 0:
        return -1
    cdef object first = None
    for spec in specs_by_code:
        if spec is not None:
            first = spec[0]
            break
    if first is None:
        return r0
    ks = <PageSpec?>first
    cdef int64_t p = ks.tokens
    if not (_pages_ok(kscratch, ks, 3, p, 1) and _pages_ok(vscratch, ks, 3, p, 1)
            and cnp.PyArray_ISCARRAY(<cnp.ndarray>kscratch) and cnp.PyArray_ISCARRAY(<cnp.ndarray>vscratch)):
        raise ValueError("attend_run: scratch pages must be C-contiguous float16 [P, H, D]")
    _attend_state(&st, q, pos, m, l, acc, ks.heads, ks.head_dim)
    cdef kvd_attend_tile_fn fn = kvd_attend_pick(be.b)
    cdef kvd_attend_qtile_fn qfn = kvd_attend_qpick(be.b)
    cdef uint16_t *kbuf = <uint16_t *>_data(kscratch)
    cdef uint16_t *vbuf = <uint16_t *>_data(vscratch)
    cdef const kvd_page_spec **specs = <const kvd_page_spec **>PyMem_Malloc(2 * n * sizeof(void *))
    cdef const uint8_t **src = <const uint8_t **>PyMem_Malloc(n * sizeof(void *))
    st.scores = <float *>PyMem_Malloc(KVD_ATTEND_GROUP * p * sizeof(float))
    cdef float *work = <float *>PyMem_Malloc(kvd_attend_work_floats(p, st.d) * sizeof(float))
    if specs == NULL or src == NULL or st.scores == NULL or work == NULL:
        PyMem_Free(specs); PyMem_Free(src); PyMem_Free(st.scores); PyMem_Free(work)
        raise MemoryError()
    try:
        for i in range(n):
            rec = recs[r0 + i]
            if type(rec) is not bytearray:
                n = i
                break
            size = PyByteArray_GET_SIZE(rec)
            code = <uint8_t>PyByteArray_AS_STRING(rec)[size - code_from_end] if size >= code_from_end else 255
            pair = specs_by_code[code] if code < len(specs_by_code) else None
            if pair is None:
                n = i
                break
            ks, vs = pair
            if ks.tokens != p or ks.size + vs.size > size - code_from_end:
                n = i
                break
            specs[2 * i], specs[2 * i + 1] = &ks.s, &vs.s
            src[i] = <const uint8_t *>PyByteArray_AS_STRING(rec)
        with nogil:
            for i in range(n):
                if fused and kvd_attend_fused_ok(specs[2 * i], specs[2 * i + 1], st.hkv, st.d):
                    rc = kvd_page_check(specs[2 * i], src[i], specs[2 * i].size, _page_hash)
                    if rc == KVD_OK:
                        rc = kvd_page_check(specs[2 * i + 1], src[i] + specs[2 * i].size, specs[2 * i + 1].size,
                                            _page_hash)
                    if rc != KVD_OK:
                        fail = r0 + i
                        break
                    qfn(&st, specs[2 * i], src[i], specs[2 * i + 1], src[i] + specs[2 * i].size, (r0 + i) * p, work,
                        src[i + 1] if i + 1 < n else NULL,
                        specs[2 * i + 2].size + specs[2 * i + 3].size if i + 1 < n else 0)
                    continue
                rc = kvd_page_decode(be.b, specs[2 * i], src[i], specs[2 * i].size, kbuf, _page_hash, 0)
                if rc == KVD_OK:
                    rc = kvd_page_decode(be.b, specs[2 * i + 1], src[i] + specs[2 * i].size, specs[2 * i + 1].size,
                                         vbuf, _page_hash, 0)
                if rc != KVD_OK:
                    fail = r0 + i
                    break
                fn(&st, kbuf, vbuf, p, (r0 + i) * p)
    finally:
        PyMem_Free(specs); PyMem_Free(src); PyMem_Free(st.scores); PyMem_Free(work)
    if fail < 0 and n < r1 - r0:
        fail = r0 + n
    return fail
