# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The typed twin of kvd.wire.protocol's fast path: the four messages small requests are made of (a get request
and an append request, an fp16 get reply and an append reply), read straight from their msgpack bytes, and
written straight to them.

:mod:`kvd.wire.protocol` defines the fast path (``_fast_request_py`` / ``_fast_reply_py``) and the format; this
is the same reading compiled to C, for the same reason the Python flat path exists: each side wakes up to a
message with cold caches, and there a decode costs what it touches (memory, code), not what it computes. Every
function here returns exactly what its Python twin returns, or None where the twin would give a value the
generic decoder gives as well (msgpack encodings kvd never writes, such as an int in a signed encoding); None
hands the message to the Python path, which then decodes or refuses it. tests/unit/test_protocol_fast.py runs
every case against both twins.

No msgpack is unpacked here: a reader walks the header's bytes, takes only the encodings and key sets of kvd's
own messages, and gives up at anything else. The writers make the bytes msgpack-python makes of the generic
encoder's header map (same keys in the same order, the same shortest encodings), or None for anything they do
not take (a non-ASCII string, an int that is not a plain int, a limit), which the generic encoder then encodes or
refuses; tests/unit/test_protocol_fast.py compares the bytes.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.object cimport PyObject_GenericSetAttr
from cpython.unicode cimport PyUnicode_DecodeASCII
from libc.stdint cimport uint64_t
from libc.string cimport memcpy, strcmp, strlen

cdef extern from "Python.h":
    bint PyMemoryView_Check(object)  # exact: memoryview cannot be subclassed
    Py_buffer* PyMemoryView_GET_BUFFER(object)
    bint PyBuffer_IsContiguous(const Py_buffer*, char)
    bint PyList_CheckExact(object)
    bint PyTuple_CheckExact(object)
    bint PyLong_CheckExact(object)
    bint PyUnicode_CheckExact(object)
    bint PyUnicode_IS_ASCII(object)
    void* PyUnicode_DATA(object)
    Py_ssize_t PyUnicode_GET_LENGTH(object)
    unsigned long long PyLong_AsUnsignedLongLong(object)
    void* PyErr_Occurred()
    void PyErr_Clear()

# bound once by kvd.wire.protocol (bind): the message classes, the dtypes, the protocol version and kvd.wire.schema's
# bounds (so the two twins cannot drift apart)
cdef object _GetReply = None, _AppendReply = None, _GetRequest = None, _AppendRequest = None
cdef object _DTYPES = None, _F16 = None, _ndarray = None, _new = None, _tensor_view = None
cdef uint64_t _VERSION = 0
cdef uint64_t MAX_INDEX = 0, MAX_POSITION = 0
cdef Py_ssize_t MAX_NAMESPACE_BYTES = 0, MAX_SEQ_ID_BYTES = 0, MAX_TEXT_BYTES = 0

cdef struct Lim:
    Py_ssize_t header, frame, message

# the limits last seen, as C integers (a Limits is frozen: its identity names its values)
cdef object _lim = None
cdef Lim _lim_c


def bind(get_reply, append_reply, get_request, append_request, dtypes, uint64_t version, tensor_frame,
         uint64_t max_index, uint64_t max_position, Py_ssize_t max_namespace, Py_ssize_t max_seq_id,
         Py_ssize_t max_text):
    """Called once by kvd.wire.protocol: the classes to build, the constants to check against, and the function
    that makes an array's frame."""
    global _GetReply, _AppendReply, _GetRequest, _AppendRequest, _DTYPES, _F16, _ndarray, _new, _VERSION
    global _tensor_view, MAX_INDEX, MAX_POSITION, MAX_NAMESPACE_BYTES, MAX_SEQ_ID_BYTES, MAX_TEXT_BYTES
    import numpy
    _GetReply, _AppendReply, _GetRequest, _AppendRequest = get_reply, append_reply, get_request, append_request
    _DTYPES, _F16, _ndarray, _new = dtypes, dtypes["float16"], numpy.ndarray, object.__new__
    _VERSION = version
    _tensor_view = tensor_frame
    MAX_INDEX, MAX_POSITION = max_index, max_position
    MAX_NAMESPACE_BYTES, MAX_SEQ_ID_BYTES, MAX_TEXT_BYTES = max_namespace, max_seq_id, max_text


cdef int _limits(object limits, Lim* out) except -1:
    """``limits`` as C integers, in the caller's own copy (the cache is shared by every thread)."""
    global _lim, _lim_c
    cdef Lim fresh
    if limits is not _lim:
        fresh.header, fresh.frame = limits.max_header_bytes, limits.max_frame_bytes
        fresh.message = limits.max_message_bytes
        _lim_c = fresh  # with no Python code in between: the values and the identity change together
        _lim = limits
    out[0] = _lim_c
    return 0


# ---- reading msgpack -------------------------------------------------------------------------------------------

cdef struct Rd:
    const unsigned char* p
    const unsigned char* end


cdef inline uint64_t _be(const unsigned char* p, int n) noexcept nogil:
    cdef uint64_t x = 0
    cdef int i
    for i in range(n):
        x = (x << 8) | p[i]
    return x


cdef inline bint rd_uint(Rd* r, uint64_t* out) noexcept nogil:
    """A non-negative integer in an unsigned encoding (positive fixint, uint 8-64)."""
    cdef const unsigned char* p = r.p
    cdef unsigned char c
    cdef int n
    if p >= r.end:
        return False
    c = p[0]
    if c <= 0x7F:
        out[0] = c
        r.p = p + 1
        return True
    if 0xCC <= c <= 0xCF:
        n = 1 << (c - 0xCC)
        if r.end - p < 1 + n:
            return False
        out[0] = _be(p + 1, n)
        r.p = p + 1 + n
        return True
    return False


cdef inline bint rd_byte(Rd* r, unsigned char c) noexcept nogil:
    """One byte equal to ``c`` (nil 0xC0, true 0xC3)."""
    if r.p < r.end and r.p[0] == c:
        r.p += 1
        return True
    return False


cdef inline bint rd_str(Rd* r, const unsigned char** s, Py_ssize_t* n) noexcept nogil:
    cdef const unsigned char* p = r.p
    cdef unsigned char c
    cdef Py_ssize_t length, skip
    if p >= r.end:
        return False
    c = p[0]
    if 0xA0 <= c <= 0xBF:
        length, skip = c & 0x1F, 1
    elif 0xD9 <= c <= 0xDB:
        skip = 1 + (1 << (c - 0xD9))
        if r.end - p < skip:
            return False
        length = <Py_ssize_t>_be(p + 1, skip - 1)
    else:
        return False
    if r.end - p - skip < length:
        return False
    s[0] = p + skip
    n[0] = length
    r.p = p + skip + length
    return True


cdef inline bint rd_array(Rd* r, Py_ssize_t* n) noexcept nogil:
    cdef const unsigned char* p = r.p
    cdef unsigned char c
    if p >= r.end:
        return False
    c = p[0]
    if 0x90 <= c <= 0x9F:
        n[0] = c & 0x0F
        r.p = p + 1
        return True
    if c == 0xDC or c == 0xDD:
        if r.end - p < (3 if c == 0xDC else 5):
            return False
        n[0] = <Py_ssize_t>_be(p + 1, 2 if c == 0xDC else 4)
        r.p = p + (3 if c == 0xDC else 5)
        return True
    return False


cdef inline bint is_(const unsigned char* s, Py_ssize_t n, const char* lit) noexcept nogil:
    """Whether ``s[:n]`` is the NUL-terminated ``lit``."""
    cdef Py_ssize_t i = 0
    while i < n:
        if lit[i] == 0 or <unsigned char>lit[i] != s[i]:
            return False
        i += 1
    return lit[n] == 0


cdef inline bint ascii(const unsigned char* s, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        if s[i] >= 0x80:
            return False
    return True


cdef inline int rd_opt_position(Rd* r, uint64_t* out) noexcept nogil:
    """nil (0), or an integer in [0, MAX_POSITION] (1); -1 for anything else."""
    if rd_byte(r, 0xC0):
        return 0
    return 1 if rd_uint(r, out) and out[0] <= MAX_POSITION else -1


cdef inline bint rd_text(Rd* r, const unsigned char** s, Py_ssize_t* n, Py_ssize_t low,
                         Py_ssize_t high) noexcept nogil:
    """An ASCII string of ``low`` to ``high`` bytes."""
    return rd_str(r, s, n) and low <= n[0] <= high and ascii(s[0], n[0])


cdef enum:
    # more layers in one header: the Python path (a set, not a quadratic check). Fewer than msgpack's array limit
    # (at least _MIN_ARRAY_LEN), so that limit never binds here.
    MAX_FLAT_LAYERS = 64


cdef inline bint rd_layers(Rd* r, uint64_t* out, Py_ssize_t* count) noexcept nogil:
    """A non-empty array of distinct integers in [0, MAX_INDEX], of at most MAX_FLAT_LAYERS items."""
    cdef Py_ssize_t n, i, j
    if not rd_array(r, &n) or n < 1 or n > MAX_FLAT_LAYERS:
        return False
    for i in range(n):
        if not rd_uint(r, &out[i]) or out[i] > MAX_INDEX:
            return False
        for j in range(i):
            if out[i] == out[j]:
                return False
    count[0] = n
    return True


cdef tuple _layer_tuple(uint64_t* layers, Py_ssize_t n):
    return tuple([layers[i] for i in range(n)])


cdef inline bint rd_shape(Rd* r, uint64_t* shape) noexcept nogil:
    cdef Py_ssize_t n, i
    if not rd_array(r, &n) or n != 4:
        return False
    for i in range(4):
        if not rd_uint(r, &shape[i]):
            return False
    return True


# ---- frames ------------------------------------------------------------------------------------------------------

cdef inline Py_ssize_t _byte_frame(object frame, const unsigned char** data) except -2:
    """The size of a byte frame (bytes, or a 1-D contiguous memoryview of format "B") and its bytes in ``data``;
    -1 for anything else."""
    cdef Py_buffer* view
    if PyBytes_CheckExact(frame):
        data[0] = <const unsigned char*>PyBytes_AS_STRING(frame)
        return PyBytes_GET_SIZE(frame)
    if PyMemoryView_Check(frame):
        view = PyMemoryView_GET_BUFFER(frame)
        if view.ndim == 1 and (view.format == NULL or strcmp(view.format, b"B") == 0) \
                and PyBuffer_IsContiguous(view, b'C'):
            data[0] = <const unsigned char*>view.buf
            return view.len
    return -1


cdef inline bint _tensor_frame(object frame, uint64_t need) except -1:
    """Whether ``frame`` is a byte frame of ``need`` bytes."""
    cdef const unsigned char* data
    return <uint64_t>_byte_frame(frame, &data) == need


cdef inline bint _tensor_bytes(uint64_t* dims, uint64_t itemsize, Py_ssize_t size, const Lim* lim,
                               uint64_t* need) noexcept nogil:
    """The bytes of each tensor frame of ``dims`` in ``need``, if they fit the frame and message limits."""
    cdef uint64_t n = itemsize
    cdef uint64_t cap = <uint64_t>lim.frame
    cdef int i
    for i in range(4):
        if dims[i] == 0:
            need[0] = 0
            return True
    for i in range(4):
        if n > cap / dims[i]:  # so n * dims[i] <= cap, which is under 2**63: no overflow
            return False
        n *= dims[i]
    if n > <uint64_t>(lim.message - size) / 2:  # size <= max_header_bytes <= max_message_bytes
        return False
    need[0] = n
    return True


cdef object _arrays(object frames, uint64_t* dims, object kind):
    shape = (dims[0], dims[1], dims[2], dims[3])
    return _ndarray(shape, kind, frames[1]), _ndarray(shape, kind, frames[2])


cdef inline int _set(object obj, str name, object value) except -1:
    return PyObject_GenericSetAttr(obj, name, value)


cdef Py_ssize_t _open(object frames, object limits, Lim* lim, const unsigned char** head, Py_ssize_t* n) except -2:
    """The header of a message of 1 or 3 frames (``n``) as bytes (``head``, the returned size), with ``limits`` as
    C integers in ``lim``; -1 for anything else (not a list or tuple, another frame count, an empty header or one
    over the header limit)."""
    cdef Py_ssize_t size
    if not PyList_CheckExact(frames) and not PyTuple_CheckExact(frames):
        return -1
    n[0] = len(frames)
    if n[0] != 3 and n[0] != 1:
        return -1
    _limits(limits, lim)
    size = _byte_frame(frames[0], head)
    return size if 0 < size <= lim.header else -1


cdef inline int rd_envelope(Rd* r, const unsigned char* k, Py_ssize_t klen, const char* op, uint64_t* v,
                            uint64_t* rid) noexcept nogil:
    """The value of an envelope key (v, id, op: ``op`` is the only one taken): its bit (1, 2, 4); 0 if ``k`` is
    another key, -1 for a value not taken."""
    cdef const unsigned char* s
    cdef Py_ssize_t slen
    if is_(k, klen, b"v"):
        return 1 if rd_uint(r, v) else -1
    if is_(k, klen, b"id"):
        return 2 if rd_uint(r, rid) else -1
    if is_(k, klen, b"op"):
        return 4 if rd_str(r, &s, &slen) and is_(s, slen, op) else -1
    return 0


# ---- replies -----------------------------------------------------------------------------------------------------

def fast_reply(frames, limits):
    """An fp16 get reply or an append reply in kvd's own header shape, else None (kvd.wire.protocol)."""
    cdef Py_ssize_t n, size, i, klen, slen, nlay = 0
    cdef const unsigned char* head
    cdef const unsigned char* k
    cdef const unsigned char* s
    cdef Rd r
    cdef unsigned int seen = 0, bit
    cdef int env
    cdef uint64_t v = 0, rid = 0, start = 0, end = 0, length = 0, need = 0
    cdef uint64_t shape[4]
    cdef uint64_t lays[MAX_FLAT_LAYERS]
    cdef Lim lim
    size = _open(frames, limits, &lim, &head, &n)
    if size < 0 or head[0] != (0x8A if n == 3 else 0x85):  # a map of 10 or 5 entries
        return None
    r.p, r.end = head + 1, head + size
    for i in range(head[0] & 0x0F):
        if not rd_str(&r, &k, &klen):
            return None
        env = rd_envelope(&r, k, klen, b"get" if n == 3 else b"append", &v, &rid)
        if env < 0:
            return None
        if env:
            bit = env
        elif is_(k, klen, b"ok"):
            bit = 8
            if not rd_byte(&r, 0xC3):
                return None
        elif n == 1:
            bit = 16
            if not is_(k, klen, b"length") or not rd_uint(&r, &length) or length > MAX_POSITION:
                return None
        elif is_(k, klen, b"start"):
            bit = 16
            if not rd_uint(&r, &start):
                return None
        elif is_(k, klen, b"end"):
            bit = 32
            if not rd_uint(&r, &end):
                return None
        elif is_(k, klen, b"layers"):
            bit = 64
            if not rd_layers(&r, lays, &nlay):
                return None
        elif is_(k, klen, b"format"):
            bit = 128
            if not rd_str(&r, &s, &slen) or not is_(s, slen, b"fp16"):
                return None
        elif is_(k, klen, b"dtype"):
            bit = 256
            if not rd_str(&r, &s, &slen) or not is_(s, slen, b"float16"):
                return None
        elif is_(k, klen, b"shape"):
            bit = 512
            if not rd_shape(&r, shape):
                return None
        else:
            return None
        if seen & bit:  # a duplicate key
            return None
        seen |= bit
    if r.p != r.end or v != _VERSION or seen != (0x3FF if n == 3 else 0x1F):  # every key once, nothing after
        return None
    if n == 1:
        reply = _new(_AppendReply)
        _set(reply, "request_id", rid)
        _set(reply, "length", length)
        return reply
    if not start <= end <= MAX_POSITION or shape[0] != <uint64_t>nlay or shape[1] != end - start \
            or shape[1] > MAX_INDEX or not 1 <= shape[2] <= MAX_INDEX or not 1 <= shape[3] <= MAX_INDEX:
        return None
    if not _tensor_bytes(shape, 2, size, &lim, &need) or not _tensor_frame(frames[1], need) \
            or not _tensor_frame(frames[2], need):
        return None
    keys, values = _arrays(frames, shape, _F16)
    got = _new(_GetReply)
    _set(got, "request_id", rid)
    _set(got, "start", start)
    _set(got, "end", end)
    _set(got, "layers", _layer_tuple(lays, nlay))
    _set(got, "keys", keys)
    _set(got, "values", values)
    _set(got, "dtype", "float16")
    return got


# ---- requests ----------------------------------------------------------------------------------------------------

def fast_request(frames, limits):
    """A get or an append request in kvd's own client's header shape, else None (kvd.wire.protocol)."""
    cdef Py_ssize_t n, size, i, klen, slen, nlay = 0, ns_len = 0, seq_len = 0, inc_len = 0
    cdef Py_ssize_t dt_len = 0
    cdef const unsigned char* head
    cdef const unsigned char* k
    cdef const unsigned char* s
    cdef const unsigned char* ns = NULL
    cdef const unsigned char* seq = NULL
    cdef const unsigned char* inc = NULL
    cdef const unsigned char* dt = NULL
    cdef Rd r
    cdef unsigned int seen = 0, bit, entries
    cdef int env
    cdef uint64_t v = 0, rid = 0, start = 0, end = 0, offset = 0, position = 0, seq_int = 0, need = 0
    cdef bint seq_is_int = False, has_layers = False, pages = False
    cdef int has_end = 0, has_offset = 0, has_position = 0  # 1: a value, 0: nil or absent, -1: a bad value
    cdef uint64_t shape[4]
    cdef uint64_t lays[MAX_FLAT_LAYERS]
    cdef Lim lim
    size = _open(frames, limits, &lim, &head, &n)
    if size < 0:
        return None
    entries = head[0] ^ 0x80
    if (n == 1 and entries != 9) or (n == 3 and not 8 <= entries <= 10):
        return None
    r.p, r.end = head + 1, head + size
    for i in range(entries):
        if not rd_str(&r, &k, &klen):
            return None
        env = rd_envelope(&r, k, klen, b"get" if n == 1 else b"append", &v, &rid)
        if env < 0:
            return None
        if env:
            bit = env
        elif is_(k, klen, b"namespace"):
            bit = 8
            if not rd_text(&r, &ns, &ns_len, 1, MAX_NAMESPACE_BYTES):
                return None
        elif is_(k, klen, b"seq_id"):
            bit = 16
            if rd_uint(&r, &seq_int):
                seq_is_int = True
                if seq_int > MAX_POSITION:
                    return None
            elif not rd_text(&r, &seq, &seq_len, 0, MAX_SEQ_ID_BYTES):
                return None
        elif n == 1 and is_(k, klen, b"start"):
            bit = 32
            if not rd_uint(&r, &start) or start > MAX_POSITION:
                return None
        elif n == 1 and is_(k, klen, b"end"):
            bit = 64
            has_end = rd_opt_position(&r, &end)
        elif n == 1 and is_(k, klen, b"layers"):
            bit = 128
            if not rd_byte(&r, 0xC0):  # nil first: a failed array read has moved the reader
                if not rd_layers(&r, lays, &nlay):
                    return None
                has_layers = True
        elif n == 1 and is_(k, klen, b"format"):
            bit = 256
            if not rd_str(&r, &s, &slen):
                return None
            if is_(s, slen, b"pages"):
                pages = True
            elif not is_(s, slen, b"fp16"):
                return None
        elif n == 3 and is_(k, klen, b"offset"):
            bit = 32
            has_offset = rd_opt_position(&r, &offset)
        elif n == 3 and is_(k, klen, b"dtype"):
            bit = 64
            if not rd_str(&r, &dt, &dt_len):
                return None
        elif n == 3 and is_(k, klen, b"shape"):
            bit = 128
            if not rd_shape(&r, shape):
                return None
        elif n == 3 and is_(k, klen, b"position"):
            bit = 256
            has_position = rd_opt_position(&r, &position)
        elif n == 3 and is_(k, klen, b"incarnation"):
            bit = 512
            if rd_byte(&r, 0xC0):
                inc = NULL
            elif not rd_text(&r, &inc, &inc_len, 1, MAX_TEXT_BYTES):
                return None
        else:
            return None
        if seen & bit or has_end < 0 or has_offset < 0 or has_position < 0:  # a duplicate key, a bad position
            return None
        seen |= bit
    # every required key: v, id, op, namespace, seq_id and the op's own (the optional ones are 256 and 512)
    if r.p != r.end or v != _VERSION or (seen & 0xFF) != 0xFF:
        return None
    namespace = PyUnicode_DecodeASCII(<const char*>ns, ns_len, NULL)
    seq_id = seq_int if seq_is_int else PyUnicode_DecodeASCII(<const char*>seq, seq_len, NULL)
    if n == 1:
        if seen != 0x1FF or (has_end and end < start):
            return None
        req = _new(_GetRequest)
        _set(req, "request_id", rid)
        _set(req, "namespace", namespace)
        _set(req, "seq_id", seq_id)
        _set(req, "start", start)
        _set(req, "end", end if has_end else None)
        _set(req, "layers", _layer_tuple(lays, nlay) if has_layers else None)
        _set(req, "format", "pages" if pages else "fp16")
        _set(req, "packed", False)
        return req
    dtype = PyUnicode_DecodeASCII(<const char*>dt, dt_len, NULL) if ascii(dt, dt_len) else None
    kind = _DTYPES.get(dtype) if dtype is not None else None
    if kind is None:
        return None
    for i in range(4):
        if not 1 <= shape[i] <= MAX_INDEX:
            return None
    if not _tensor_bytes(shape, kind.itemsize, size, &lim, &need) or not _tensor_frame(frames[1], need) \
            or not _tensor_frame(frames[2], need):
        return None
    keys, values = _arrays(frames, shape, kind)
    req = _new(_AppendRequest)
    _set(req, "request_id", rid)
    _set(req, "namespace", namespace)
    _set(req, "seq_id", seq_id)
    _set(req, "keys", keys)
    _set(req, "values", values)
    _set(req, "offset", offset if has_offset else None)
    _set(req, "dtype", dtype)
    _set(req, "position", position if has_position else None)
    _set(req, "incarnation", PyUnicode_DecodeASCII(<const char*>inc, inc_len, NULL) if inc != NULL else None)
    return req


# ---- writing msgpack ---------------------------------------------------------------------------------------------

cdef enum:
    # kvd's own headers of these four messages take at most ~2.5 KB (the longest texts, 64 layers). The room is
    # the smallest max_header_bytes a Limits allows, so a header that fits it fits every header limit.
    HEADER_ROOM = 4096

ROOM = HEADER_ROOM


cdef struct Wr:
    unsigned char* p
    unsigned char* end
    bint bad  # out of room: the message goes to the generic encoder


cdef inline void w_bytes(Wr* w, const void* src, Py_ssize_t n) noexcept nogil:
    if w.end - w.p < n:
        w.bad = True
        return
    memcpy(w.p, src, n)
    w.p += n


cdef inline void w_byte(Wr* w, unsigned char c) noexcept nogil:
    w_bytes(w, &c, 1)


cdef inline void w_be(Wr* w, unsigned char tag, uint64_t x, int n) noexcept nogil:
    cdef unsigned char buf[9]
    cdef int i
    buf[0] = tag
    for i in range(n):
        buf[n - i] = <unsigned char>(x >> (8 * i))
    w_bytes(w, buf, n + 1)


cdef inline void w_uint(Wr* w, uint64_t x) noexcept nogil:
    """msgpack's shortest encoding of a non-negative integer, as msgpack-python packs it."""
    if x < 0x80:
        w_byte(w, <unsigned char>x)
    elif x < 0x100:
        w_be(w, 0xCC, x, 1)
    elif x < 0x10000:
        w_be(w, 0xCD, x, 2)
    elif x < 0x100000000ULL:
        w_be(w, 0xCE, x, 4)
    else:
        w_be(w, 0xCF, x, 8)


cdef inline void w_str(Wr* w, const char* s, Py_ssize_t n) noexcept nogil:
    if n < 32:
        w_byte(w, 0xA0 | <unsigned char>n)
    elif n < 0x100:
        w_be(w, 0xD9, n, 1)
    elif n < 0x10000:
        w_be(w, 0xDA, n, 2)
    else:
        w_be(w, 0xDB, n, 4)
    w_bytes(w, s, n)


cdef inline void w_key(Wr* w, const char* lit) noexcept nogil:
    w_str(w, lit, <Py_ssize_t>strlen(lit))


cdef inline void w_array(Wr* w, Py_ssize_t n) noexcept nogil:
    if n < 16:
        w_byte(w, 0x90 | <unsigned char>n)
    elif n < 0x10000:
        w_be(w, 0xDC, n, 2)
    else:
        w_be(w, 0xDD, n, 4)


cdef inline bint py_uint(object x, uint64_t* out) except -1:
    """A plain int in [0, 2**64) (not a bool, not an int subclass)."""
    if not PyLong_CheckExact(x):
        return False
    cdef unsigned long long v = PyLong_AsUnsignedLongLong(x)
    if v == <unsigned long long>-1 and PyErr_Occurred() != NULL:  # negative or too large
        PyErr_Clear()
        return False
    out[0] = v
    return True


cdef inline bint w_pyuint(Wr* w, object x) except -1:
    cdef uint64_t v
    if not py_uint(x, &v):
        return False
    w_uint(w, v)
    return True


cdef inline bint w_pystr(Wr* w, object s) except -1:
    """A str that is all ASCII (its UTF-8 is its characters)."""
    if not PyUnicode_CheckExact(s) or not PyUnicode_IS_ASCII(s):
        return False
    w_str(w, <const char*>PyUnicode_DATA(s), PyUnicode_GET_LENGTH(s))
    return True


cdef inline bint w_pyints(Wr* w, object items) except -1:
    """A tuple or list of plain ints as an array (at most MAX_FLAT_LAYERS: the generic encoder packs more)."""
    cdef Py_ssize_t n, i
    if not PyTuple_CheckExact(items) and not PyList_CheckExact(items):
        return False
    n = len(items)
    if n > MAX_FLAT_LAYERS:
        return False
    w_array(w, n)
    for i in range(n):
        if not w_pyuint(w, items[i]):
            return False
    return True


cdef inline bint w_opt_uint(Wr* w, object x) except -1:
    if x is None:
        w_byte(w, 0xC0)
        return True
    return w_pyuint(w, x)


cdef inline bint w_seq_id(Wr* w, object x) except -1:
    return w_pyuint(w, x) if PyLong_CheckExact(x) else w_pystr(w, x)


cdef list _message(Wr* w, unsigned char* start, object limits, object key_frame, object value_frame):
    """The frames (header, and the two tensor frames if given), or None if a limit refuses them."""
    cdef Py_ssize_t size = w.p - start, n, total
    cdef Lim lim
    if w.bad:
        return None
    # (the header fits every header limit, see HEADER_ROOM, and every limit allows 3 frames)
    header = PyBytes_FromStringAndSize(<const char*>start, size)
    if key_frame is None:
        return [header]
    if limits is not None:
        _limits(limits, &lim)
        total = len(key_frame)
        n = len(value_frame)
        if total > lim.frame or n > lim.frame or size + total + n > lim.message:
            return None
    return [header, key_frame, value_frame]


cdef inline bint w_envelope(Wr* w, unsigned char entries, object request_id, const char* op) except -1:
    """A map of ``entries`` and its first keys, v, id and op (the generic encoder's envelope, in its order)."""
    w_byte(w, 0x80 | entries)
    w_key(w, b"v")
    w_uint(w, _VERSION)
    w_key(w, b"id")
    if not w_pyuint(w, request_id):
        return False
    w_key(w, b"op")
    w_key(w, op)
    return True


cdef inline bint w_uint_field(Wr* w, const char* key, object value) except -1:
    w_key(w, key)
    return w_pyuint(w, value)


cdef inline bint w_str_field(Wr* w, const char* key, object value) except -1:
    w_key(w, key)
    return w_pystr(w, value)


cdef inline bint w_sequence(Wr* w, object req) except -1:
    """A request's namespace and seq_id."""
    if not w_str_field(w, b"namespace", req.namespace):
        return False
    w_key(w, b"seq_id")
    return w_seq_id(w, req.seq_id)


def encode_request(req, limits):
    """The frames of a get or an append request, as the generic encoder makes them; else None."""
    cdef unsigned char buf[HEADER_ROOM]
    cdef Wr w
    w.p, w.end, w.bad = buf, buf + HEADER_ROOM, False
    cls = type(req)
    if cls is _GetRequest:
        if req.packed is not False or not w_envelope(&w, 9, req.request_id, b"get") or not w_sequence(&w, req) \
                or not w_uint_field(&w, b"start", req.start):
            return None
        w_key(&w, b"end")
        if not w_opt_uint(&w, req.end):
            return None
        w_key(&w, b"layers")
        layers = req.layers
        if layers is None:
            w_byte(&w, 0xC0)
        elif not w_pyints(&w, layers):
            return None
        if not w_str_field(&w, b"format", req.format):
            return None
        return _message(&w, buf, limits, None, None)
    if cls is not _AppendRequest:
        return None
    keys, values, position, incarnation = req.keys, req.values, req.position, req.incarnation
    if not w_envelope(&w, 8 + (position is not None) + (incarnation is not None), req.request_id, b"append") \
            or not w_sequence(&w, req):
        return None
    w_key(&w, b"offset")
    if not w_opt_uint(&w, req.offset) or not w_str_field(&w, b"dtype", req.dtype):
        return None
    w_key(&w, b"shape")
    if not w_pyints(&w, list(keys.shape)):
        return None
    if position is not None and not w_uint_field(&w, b"position", position):
        return None
    if incarnation is not None and not w_str_field(&w, b"incarnation", incarnation):
        return None
    return _message(&w, buf, limits, _tensor_view(keys), _tensor_view(values))


def encode_reply(reply, limits):
    """The frames of an fp16 get reply or an append reply, as the generic encoder makes them; else None."""
    cdef unsigned char buf[HEADER_ROOM]
    cdef Wr w
    w.p, w.end, w.bad = buf, buf + HEADER_ROOM, False
    cls = type(reply)
    if cls is not _GetReply and cls is not _AppendReply:
        return None
    if not w_envelope(&w, 10 if cls is _GetReply else 5, reply.request_id, b"get" if cls is _GetReply
                      else b"append"):
        return None
    w_key(&w, b"ok")
    w_byte(&w, 0xC3)
    if cls is _AppendReply:
        if not w_uint_field(&w, b"length", reply.length):
            return None
        return _message(&w, buf, limits, None, None)
    keys, values = reply.keys, reply.values
    if not w_uint_field(&w, b"start", reply.start) or not w_uint_field(&w, b"end", reply.end):
        return None
    w_key(&w, b"layers")
    if not w_pyints(&w, reply.layers):
        return None
    w_key(&w, b"format")
    w_key(&w, b"fp16")
    if not w_str_field(&w, b"dtype", reply.dtype):
        return None
    w_key(&w, b"shape")
    if not w_pyints(&w, list(keys.shape)):
        return None
    return _message(&w, buf, limits, _tensor_view(keys), _tensor_view(values))
