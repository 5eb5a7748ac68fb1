# The typed wire fast path (kvd.wire._flatwire, included by cython_ext/_flatwire.pyx):
# writing msgpack as msgpack-python does, into a header's room.

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
    """The frames (header, then the two tensor frames if given, or the one packed frame given as ``key_frame``
    with ``value_frame`` None), or None if a limit refuses them."""
    cdef Py_ssize_t size = w.p - start, n = 0, total
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
        if value_frame is not None:
            n = len(value_frame)
        if total > lim.frame or n > lim.frame or size + total + n > lim.message:
            return None
    if value_frame is None:
        return [header, key_frame]
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
