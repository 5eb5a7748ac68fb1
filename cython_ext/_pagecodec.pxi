# Batched page codec: whole v1 pages (kernel + header + checksum) for many pages per call, without Python
# per page. Included by _kernels.pyx; the C side is kvd_pagecodec.h, the Python side kvd/codec/batch.py.
#
# Both entry points return -1 when every page was done, else the index of the first one that was not (a
# non-finite input, a page whose bytes do not match its spec, a format without a spec): the caller handles
# that one through kvd.pages, which raises the documented error or decodes it the slow way, and goes on.
# Arrays the C path cannot take as they are count as not done (index 0); specs and records that do not fit
# together raise ValueError (the store builds them itself, so that is a bug).
#
# The GIL is released while pages are coded, so the caller must keep other threads off the records and arrays
# for the call: the store holds its lock. decode_pages pins its pages with the buffer protocol.

from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize, PyByteArray_GET_SIZE
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport uint64_t
from libc.string cimport memcpy


cdef extern from "kvd_pagecodec.h" nogil:
    int KVD_CORRUPT
    int KVD_PAGE_HEAD_MAX
    ctypedef uint64_t (*kvd_hash_fn)(const void *, size_t, uint64_t)
    ctypedef struct kvd_page_spec:
        int level, axis, rotated
        int64_t group, rows, cols, off_data, off_scales, off_mins, prefix, size
        uint64_t seed
        uint8_t head[32]
        int ngaps
        int64_t gap_start[3]
        int64_t gap_len[3]
    void kvd_store_fence()
    int kvd_page_encode_kv(const kvd_backend *b, const kvd_page_spec *ks, const uint16_t *ksrc, uint8_t *kdst,
                           const kvd_page_spec *vs, const uint16_t *vsrc, uint8_t *vdst, kvd_hash_fn hash)
    int kvd_page_decode(const kvd_backend *b, const kvd_page_spec *s, const uint8_t *src, int64_t length,
                        uint16_t *dst, kvd_hash_fn hash, int stream)
    int kvd_page_check(const kvd_page_spec *s, const uint8_t *src, int64_t length, kvd_hash_fn hash)


cdef kvd_hash_fn _page_hash = NULL


def new_record(Py_ssize_t size):
    """A bytearray of ``size`` bytes, not zeroed (the codec writes every byte of a record)."""
    return PyByteArray_FromStringAndSize(NULL, size)


def set_page_hash(size_t address):
    """Use the C function at ``address`` (XXH3_64bits_withSeed) for page checksums; 0 disables the batch path."""
    global _page_hash
    _page_hash = <kvd_hash_fn>address


def page_hash(const unsigned char[::1] data, uint64_t seed) -> int:
    """The checksum function in use, on ``data`` (for the import-time check against xxhash)."""
    if _page_hash == NULL:
        raise ValueError("no page hash function set")
    return _page_hash(&data[0] if data.shape[0] else NULL, data.shape[0], seed)


cdef class PageSpec:
    """One page layout (no raw heads) flattened for the C codec; built by kvd.codec.batch from kvd.pages."""

    cdef kvd_page_spec s
    cdef readonly int64_t size, tokens, heads, head_dim

    def __cinit__(self, int level, int axis, bint rotated, int64_t group, int64_t rows, int64_t cols,
                  int64_t off_data, int64_t off_scales, int64_t off_mins, int64_t size, uint64_t seed,
                  bytes head, tuple shape, tuple gaps):
        cdef Py_ssize_t prefix = len(head)
        cdef int i
        if not (0 <= level <= 4 and 0 <= axis <= 2 and prefix == KVD_PAGE_HEAD_MAX and rows > 0 and cols > 0
                and size > prefix and 0 < off_data < size and 0 <= off_scales < size and 0 <= off_mins < size):
            raise ValueError(f"inconsistent page spec (level {level}, axis {axis}, size {size}, head {prefix})")
        self.tokens, self.heads, self.head_dim = shape
        if rows * cols != self.tokens * self.heads * self.head_dim:
            raise ValueError(f"page spec matrix {rows}x{cols} does not hold a {shape} page")
        self.s.level, self.s.axis, self.s.rotated, self.s.group = level, axis, rotated, group
        self.s.rows, self.s.cols, self.s.off_data = rows, cols, off_data
        self.s.off_scales, self.s.off_mins, self.s.prefix, self.s.size, self.s.seed = off_scales, off_mins, prefix, size, seed
        memcpy(self.s.head, <const char *>head, prefix)
        if len(gaps) > 3:
            raise ValueError(f"a page has at most 3 padding gaps, got {gaps}")
        self.s.ngaps = len(gaps)
        for i in range(self.s.ngaps):
            a, b = gaps[i]
            if not (prefix <= a < b <= size):
                raise ValueError(f"padding gap {gaps[i]} outside the page")
            self.s.gap_start[i], self.s.gap_len[i] = a, b - a
        self.size = size


cdef inline bint _pages_ok(object a, PageSpec spec, int nd, Py_ssize_t n0, int writable) noexcept:
    """a: float16 [n0 or more, ..., H, D] with ``nd`` dims whose token slices are C-contiguous: [L, T, H, D]
    (nd 4, n0 layers) or [T, H, D] (nd 3, n0 tokens)."""
    if not cnp.PyArray_Check(a):
        return False
    cdef cnp.ndarray arr = <cnp.ndarray>a
    if cnp.PyArray_NDIM(arr) != nd or cnp.PyArray_TYPE(arr) != NPY_HALF or not cnp.PyArray_ISNOTSWAPPED(arr):
        return False
    if not (cnp.PyArray_FLAGS(arr) & cnp.NPY_ARRAY_ALIGNED) or (writable and not cnp.PyArray_ISWRITEABLE(arr)):
        return False
    if cnp.PyArray_DIM(arr, 0) < n0 or cnp.PyArray_DIM(arr, nd - 2) != spec.heads or cnp.PyArray_DIM(arr, nd - 1) != spec.head_dim:
        return False
    return (cnp.PyArray_STRIDE(arr, nd - 1) == 2 and cnp.PyArray_STRIDE(arr, nd - 2) == 2 * spec.head_dim
            and cnp.PyArray_STRIDE(arr, nd - 3) == 2 * spec.head_dim * spec.heads)


def encode_row(Backend be, tuple layers, list recs, src_k, src_v, Py_ssize_t t0) -> int:
    """Encode one row of records: record ``i`` (a bytearray) gets the key page of ``src_k[i, t0:t0+P]``, the
    value page of ``src_v[i, t0:t0+P]`` and a trailer, per ``layers[i] = (key spec, value spec, trailer)``.
    ``src_k`` / ``src_v`` are float16 ``[L, T, H, D]`` with contiguous token slices. Returns -1, or the first
    layer whose pages could not be encoded (non-finite input: encode it through kvd.pages for the error)."""
    cdef Py_ssize_t n = len(recs), i, fail = -1
    cdef PageSpec ks, vs
    cdef bytes trailer
    cdef int rc
    if _page_hash == NULL or len(layers) != n:
        raise ValueError("encode_row: no hash function or layers/records mismatch")
    if n == 0:
        return -1
    ks = <PageSpec?>layers[0][0]
    if not (_pages_ok(src_k, ks, 4, n, 0) and _pages_ok(src_v, ks, 4, n, 0)) or t0 < 0 or \
            t0 + ks.tokens > cnp.PyArray_DIM(<cnp.ndarray>src_k, 1) or t0 + ks.tokens > cnp.PyArray_DIM(<cnp.ndarray>src_v, 1):
        return 0  # e.g. a misaligned array: the per-page path copes
    cdef char *kbase = <char *>_data(src_k) + t0 * cnp.PyArray_STRIDE(<cnp.ndarray>src_k, 1)
    cdef char *vbase = <char *>_data(src_v) + t0 * cnp.PyArray_STRIDE(<cnp.ndarray>src_v, 1)
    cdef Py_ssize_t kl = cnp.PyArray_STRIDE(<cnp.ndarray>src_k, 0), vl = cnp.PyArray_STRIDE(<cnp.ndarray>src_v, 0)
    cdef const kvd_page_spec **specs = <const kvd_page_spec **>PyMem_Malloc(2 * n * sizeof(void *))
    cdef uint8_t **dst = <uint8_t **>PyMem_Malloc(n * sizeof(void *))
    cdef const char **trail = <const char **>PyMem_Malloc(n * sizeof(void *))
    cdef Py_ssize_t *tlen = <Py_ssize_t *>PyMem_Malloc(n * sizeof(Py_ssize_t))
    if specs == NULL or dst == NULL or trail == NULL or tlen == NULL:
        PyMem_Free(specs); PyMem_Free(dst); PyMem_Free(trail); PyMem_Free(tlen)
        raise MemoryError()
    try:
        for i in range(n):
            ks, vs, trailer = layers[i]
            rec = recs[i]
            if type(rec) is not bytearray or PyByteArray_GET_SIZE(rec) != ks.size + vs.size + len(trailer) or \
                    ks.tokens != vs.tokens or ks.heads != vs.heads or ks.head_dim != vs.head_dim or \
                    ks.tokens != (<PageSpec>layers[0][0]).tokens:
                raise ValueError(f"encode_row: record {i} does not match its specs")
            specs[2 * i], specs[2 * i + 1] = &ks.s, &vs.s
            dst[i] = <uint8_t *>PyByteArray_AS_STRING(rec)
            trail[i], tlen[i] = <const char *>trailer, len(trailer)
        with nogil:
            for i in range(n):
                rc = kvd_page_encode_kv(be.b, specs[2 * i], <const uint16_t *>(kbase + i * kl), dst[i],
                                        specs[2 * i + 1], <const uint16_t *>(vbase + i * vl),
                                        dst[i] + specs[2 * i].size, _page_hash)
                if rc != KVD_OK:
                    fail = i
                    break
                memcpy(dst[i] + specs[2 * i].size + specs[2 * i + 1].size, trail[i], tlen[i])
            kvd_store_fence()  # streamed page stores are visible to every thread before Python goes on
    finally:
        PyMem_Free(specs); PyMem_Free(dst); PyMem_Free(trail); PyMem_Free(tlen)
    return fail


def decode_run(Backend be, list recs, Py_ssize_t r0, Py_ssize_t r1, tuple specs_by_code, Py_ssize_t code_from_end,
               kout, vout, bint stream=False) -> int:
    """Decode the records ``recs[r0:r1]`` (consecutive full pages of one layer) into tokens ``[(r - r0) * P,
    (r - r0 + 1) * P)`` of ``kout`` / ``vout``, float16 ``[(r1 - r0) * P or more, H, D]``, C-contiguous. A record's format code is its byte at
    ``-code_from_end``; ``specs_by_code[code]`` is ``(key spec, value spec)`` or None; ``stream``: fp16 pages
    bypass the cache (a very large read). Returns -1, or the first ``r`` not decoded (no spec, or its bytes do not match the spec: decode it through kvd.pages)."""
    cdef Py_ssize_t n = r1 - r0, i, fail = -1, code, size
    cdef PageSpec ks, vs
    cdef int rc
    if _page_hash == NULL or r0 < 0 or r1 > len(recs) or n < 0 or code_from_end < 1:
        raise ValueError("decode_run: no hash function or bad row range")
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
    if not (_pages_ok(kout, ks, 3, n * ks.tokens, 1) and _pages_ok(vout, ks, 3, n * ks.tokens, 1)):
        return r0
    cdef char *kbase = <char *>_data(kout)
    cdef char *vbase = <char *>_data(vout)
    cdef Py_ssize_t kl = ks.tokens * cnp.PyArray_STRIDE(<cnp.ndarray>kout, 0)
    cdef Py_ssize_t vl = ks.tokens * cnp.PyArray_STRIDE(<cnp.ndarray>vout, 0)
    cdef const kvd_page_spec **specs = <const kvd_page_spec **>PyMem_Malloc(2 * n * sizeof(void *))
    cdef const uint8_t **src = <const uint8_t **>PyMem_Malloc(n * sizeof(void *))
    if specs == NULL or src == NULL:
        PyMem_Free(specs); PyMem_Free(src)
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
            if ks.tokens != (<PageSpec>first).tokens or ks.size + vs.size > size - code_from_end:
                n = i
                break
            specs[2 * i], specs[2 * i + 1] = &ks.s, &vs.s
            src[i] = <const uint8_t *>PyByteArray_AS_STRING(rec)
        with nogil:
            for i in range(n):
                rc = kvd_page_decode(be.b, specs[2 * i], src[i], specs[2 * i].size,
                                     <uint16_t *>(kbase + i * kl), _page_hash, stream)
                if rc == KVD_OK:
                    rc = kvd_page_decode(be.b, specs[2 * i + 1], src[i] + specs[2 * i].size, specs[2 * i + 1].size,
                                         <uint16_t *>(vbase + i * vl), _page_hash, stream)
                if rc != KVD_OK:
                    fail = r0 + i
                    break
            kvd_store_fence()
    finally:
        PyMem_Free(specs); PyMem_Free(src)
    if fail < 0 and n < r1 - r0:
        fail = r0 + n
    return fail


def decode_pages(Backend be, list specs, list srcs, list outs) -> int:
    """Check and decode page ``srcs[i]`` (any buffer) into ``outs[i]``, a C-contiguous float16 ``[T, H, D]``,
    by ``specs[i]``. Returns -1, or the first ``i`` not decoded (its bytes do not match the spec, or an output
    the C path cannot take: decode it through kvd.pages)."""
    cdef Py_ssize_t n = len(specs), i, got = 0, fail = -1
    cdef PageSpec spec
    cdef int rc
    if _page_hash == NULL or len(srcs) != n or len(outs) != n:
        raise ValueError("decode_pages: no hash function or specs/pages/outputs mismatch")
    if n == 0:
        return -1
    cdef Py_buffer *views = <Py_buffer *>PyMem_Malloc(n * sizeof(Py_buffer))
    cdef const kvd_page_spec **sp = <const kvd_page_spec **>PyMem_Malloc(n * sizeof(void *))
    cdef uint16_t **dst = <uint16_t **>PyMem_Malloc(n * sizeof(void *))
    if views == NULL or sp == NULL or dst == NULL:
        PyMem_Free(views); PyMem_Free(sp); PyMem_Free(dst)
        raise MemoryError()
    try:
        for i in range(n):
            spec = <PageSpec?>specs[i]
            out = outs[i]
            if not _pages_ok(out, spec, 3, spec.tokens, 1) or cnp.PyArray_DIM(<cnp.ndarray>out, 0) != spec.tokens:
                break
            try:
                PyObject_GetBuffer(srcs[i], &views[i], PyBUF_SIMPLE)
            except (TypeError, BufferError):  # not a contiguous buffer: kvd.pages names the problem
                break
            got += 1
            sp[i], dst[i] = &spec.s, <uint16_t *>_data(out)
        with nogil:
            for i in range(got):
                rc = kvd_page_decode(be.b, sp[i], <const uint8_t *>views[i].buf, views[i].len, dst[i], _page_hash, 0)
                if rc != KVD_OK:
                    fail = i
                    break
            kvd_store_fence()
    finally:
        for i in range(got):
            PyBuffer_Release(&views[i])
        PyMem_Free(views); PyMem_Free(sp); PyMem_Free(dst)
    if fail < 0 and got < n:
        fail = got
    return fail


def any_nonfinite(a) -> int:
    """1 if the float16 ``[L, T, H, D]`` array (every ``[i]`` C-contiguous) holds a NaN or Inf, 0 if not, -1 if
    the array is not of that form (ask numpy). The cheap check of an append's tokens that stay unencoded."""
    if not cnp.PyArray_Check(a):
        return -1
    cdef cnp.ndarray arr = <cnp.ndarray>a
    if cnp.PyArray_NDIM(arr) != 4 or cnp.PyArray_TYPE(arr) != NPY_HALF or not cnp.PyArray_ISNOTSWAPPED(arr) \
            or not (cnp.PyArray_FLAGS(arr) & cnp.NPY_ARRAY_ALIGNED):
        return -1
    cdef Py_ssize_t l = cnp.PyArray_DIM(arr, 0), t = cnp.PyArray_DIM(arr, 1)
    cdef Py_ssize_t h = cnp.PyArray_DIM(arr, 2), d = cnp.PyArray_DIM(arr, 3)
    if (t > 1 and cnp.PyArray_STRIDE(arr, 1) != 2 * h * d) or (h > 1 and cnp.PyArray_STRIDE(arr, 2) != 2 * d) \
            or (d > 1 and cnp.PyArray_STRIDE(arr, 3) != 2):
        return -1
    cdef const char *base = <const char *>_data(arr)
    cdef Py_ssize_t s0 = cnp.PyArray_STRIDE(arr, 0), n = t * h * d, i, j
    cdef const uint16_t *row
    cdef uint16_t bad = 0
    with nogil:
        for i in range(l):
            row = <const uint16_t *>(base + i * s0)
            for j in range(n):
                bad |= <uint16_t>((row[j] & 0x7c00) == 0x7c00)
    return 1 if bad else 0
