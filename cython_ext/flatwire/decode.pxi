# The typed wire fast path (kvd.wire._flatwire, included by cython_ext/_flatwire.pyx):
# the four messages from their frames (fast_reply, fast_request).

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


cdef object _arrays(object frames, uint64_t* dims, object kind, uint64_t need):
    """Keys and values as arrays of ``dims`` and ``kind``: views of the message's two tensor frames, or of its one
    packed frame (keys, then values at ``need``) when it has two frames in all."""
    shape = (dims[0], dims[1], dims[2], dims[3])
    if len(frames) == 2:
        return _ndarray(shape, kind, frames[1]), _ndarray(shape, kind, frames[1], need)
    return _ndarray(shape, kind, frames[1]), _ndarray(shape, kind, frames[2])


cdef inline bint _tensor_frames(object frames, Py_ssize_t n, uint64_t need, const Lim* lim) except -1:
    """Whether the message's tensor frames are two of ``need`` bytes each, or (``n`` == 2) one packed frame of
    twice that (which must fit the frame limit too: _tensor_bytes checked each half)."""
    if n == 2:
        return need <= <uint64_t>lim.frame / 2 and _tensor_frame(frames[1], 2 * need)
    return _tensor_frame(frames[1], need) and _tensor_frame(frames[2], need)


cdef inline int _set(object obj, str name, object value) except -1:
    return PyObject_GenericSetAttr(obj, name, value)


cdef Py_ssize_t _open(object frames, object limits, Lim* lim, const unsigned char** head, Py_ssize_t* n) except -2:
    """The header of a message of 1 to 3 frames (``n``) as bytes (``head``, the returned size), with ``limits`` as
    C integers in ``lim``; -1 for anything else (not a list or tuple, another frame count, an empty header or one
    over the header limit)."""
    cdef Py_ssize_t size
    if not PyList_CheckExact(frames) and not PyTuple_CheckExact(frames):
        return -1
    n[0] = len(frames)
    if not 1 <= n[0] <= 3:
        return -1
    _limits(limits, lim)
    size = _byte_frame(frames[0], head)
    return size if 0 < size <= lim.header else -1


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
    # a map of 10 entries (a get reply), 11 (a packed one: protocol 1.4) or 5 (an append reply)
    if size < 0 or head[0] != (0x8A if n == 3 else 0x8B if n == 2 else 0x85):
        return None
    r.p, r.end = head + 1, head + size
    for i in range(head[0] & 0x0F):
        if not rd_str(&r, &k, &klen):
            return None
        env = rd_envelope(&r, k, klen, b"append" if n == 1 else b"get", &v, &rid)
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
        elif n == 2 and is_(k, klen, b"packed"):
            bit = 1024
            if not rd_byte(&r, 0xC3):
                return None
        else:
            return None
        if seen & bit:  # a duplicate key
            return None
        seen |= bit
    # every key once, nothing after
    if r.p != r.end or v != _VERSION or seen != (0x3FF if n == 3 else 0x7FF if n == 2 else 0x1F):
        return None
    if n == 1:
        reply = _new(_AppendReply)
        _set(reply, "request_id", rid)
        _set(reply, "length", length)
        _set(reply, "notice", None)  # (a reply with a notice takes the Python path)
        return reply
    if not start <= end <= MAX_POSITION or shape[0] != <uint64_t>nlay or shape[1] != end - start \
            or shape[1] > MAX_INDEX or not 1 <= shape[2] <= MAX_INDEX or not 1 <= shape[3] <= MAX_INDEX:
        return None
    if not _tensor_bytes(shape, 2, size, &lim, &need) or not _tensor_frames(frames, n, need, &lim):
        return None
    keys, values = _arrays(frames, shape, _F16, need)
    got = _new(_GetReply)
    _set(got, "request_id", rid)
    _set(got, "start", start)
    _set(got, "end", end)
    _set(got, "layers", _layer_tuple(lays, nlay))
    _set(got, "keys", keys)
    _set(got, "values", values)
    _set(got, "dtype", "float16")
    _set(got, "packed", frames[1] if n == 2 else None)
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
    cdef bint seq_is_int = False, has_layers = False, pages = False, packed = False, notices = False
    cdef int has_end = 0, has_offset = 0, has_position = 0  # 1: a value, 0: nil or absent, -1: a bad value
    cdef uint64_t shape[4]
    cdef uint64_t lays[MAX_FLAT_LAYERS]
    cdef Lim lim
    size = _open(frames, limits, &lim, &head, &n)
    if size < 0:
        return None
    entries = head[0] ^ 0x80
    # a get: packed only when true; an append: position, incarnation and notices only when set, packed when 2
    # frames
    if (n == 1 and not 9 <= entries <= 10) or (n == 3 and not 8 <= entries <= 11) \
            or (n == 2 and not 9 <= entries <= 12):
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
        elif n == 1 and is_(k, klen, b"packed"):
            bit = 512
            if not rd_byte(&r, 0xC3):  # sent only when true
                return None
            packed = True
        elif n != 1 and is_(k, klen, b"offset"):
            bit = 32
            has_offset = rd_opt_position(&r, &offset)
        elif n != 1 and is_(k, klen, b"dtype"):
            bit = 64
            if not rd_str(&r, &dt, &dt_len):
                return None
        elif n != 1 and is_(k, klen, b"shape"):
            bit = 128
            if not rd_shape(&r, shape):
                return None
        elif n != 1 and is_(k, klen, b"position"):
            bit = 256
            has_position = rd_opt_position(&r, &position)
        elif n != 1 and is_(k, klen, b"incarnation"):
            bit = 512
            if rd_byte(&r, 0xC0):
                inc = NULL
            elif not rd_text(&r, &inc, &inc_len, 1, MAX_TEXT_BYTES):
                return None
        elif n == 2 and is_(k, klen, b"packed"):
            bit = 1024
            if not rd_byte(&r, 0xC3):
                return None
        elif n != 1 and is_(k, klen, b"notices"):
            bit = 2048
            if not rd_byte(&r, 0xC3):  # sent only when true
                return None
            notices = True
        else:
            return None
        if seen & bit or has_end < 0 or has_offset < 0 or has_position < 0:  # a duplicate key, a bad position
            return None
        seen |= bit
    # every required key: v, id, op, namespace, seq_id and the op's own (the optional ones are 256, 512 and 2048,
    # and packed, 1024, which a packed append must have)
    if r.p != r.end or v != _VERSION or (seen & 0xFF) != 0xFF or (n == 2 and not seen & 1024):
        return None
    namespace = PyUnicode_DecodeASCII(<const char*>ns, ns_len, NULL)
    seq_id = seq_int if seq_is_int else PyUnicode_DecodeASCII(<const char*>seq, seq_len, NULL)
    if n == 1:
        if (seen | 512) != 0x3FF or (has_end and end < start):
            return None
        req = _new(_GetRequest)
        _set(req, "request_id", rid)
        _set(req, "namespace", namespace)
        _set(req, "seq_id", seq_id)
        _set(req, "start", start)
        _set(req, "end", end if has_end else None)
        _set(req, "layers", _layer_tuple(lays, nlay) if has_layers else None)
        _set(req, "format", "pages" if pages else "fp16")
        _set(req, "packed", packed)
        return req
    dtype = PyUnicode_DecodeASCII(<const char*>dt, dt_len, NULL) if ascii(dt, dt_len) else None
    kind = _DTYPES.get(dtype) if dtype is not None else None
    if kind is None:
        return None
    for i in range(4):
        if not 1 <= shape[i] <= MAX_INDEX:
            return None
    if not _tensor_bytes(shape, kind.itemsize, size, &lim, &need) or not _tensor_frames(frames, n, need, &lim):
        return None
    keys, values = _arrays(frames, shape, kind, need)
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
    _set(req, "packed", n == 2)
    _set(req, "parent", None)  # (a request with a parent takes the generic decoder)
    _set(req, "notices", notices)
    return req
