# The typed wire fast path (kvd.wire._flatwire, included by cython_ext/_flatwire.pyx):
# reading msgpack, the few encodings kvd writes.

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
