# Warm result buffers: large blocks whose memory is reused once their last user is gone. Included by
# _kernels.pyx; the Python side is kvd/store/buffers.py (which explains why).

from cpython.buffer cimport PyBuffer_FillInfo
from libc.stdlib cimport free, malloc

cdef enum:
    _MAX_CACHED = 16

cdef void *_cache_ptr[_MAX_CACHED]
cdef Py_ssize_t _cache_len[_MAX_CACHED]
cdef int _cached = 0
cdef Py_ssize_t _cached_bytes = 0
cdef Py_ssize_t _cache_limit = 0


def warm_cache_limit(Py_ssize_t limit=-1) -> int:
    """Set the bytes of freed blocks kept for reuse (-1: leave it); returns the limit in force. Lowering it
    frees what no longer fits."""
    global _cache_limit
    if limit >= 0:
        _cache_limit = limit
        _trim(_cache_limit)
    return _cache_limit


def warm_cache_info() -> tuple:
    """(blocks kept, bytes kept)."""
    return _cached, _cached_bytes


cdef void _trim(Py_ssize_t room) noexcept:
    """Free the oldest kept blocks until at most `room` bytes are kept."""
    global _cached, _cached_bytes
    cdef int i
    while _cached and _cached_bytes > room:
        free(_cache_ptr[0])
        _cached_bytes -= _cache_len[0]
        _cached -= 1
        for i in range(_cached):
            _cache_ptr[i], _cache_len[i] = _cache_ptr[i + 1], _cache_len[i + 1]


cdef class WarmBlock:
    """``size`` bytes (contents undefined) exposed through the buffer protocol. When the block dies (no array
    or view uses it any more) its memory is kept for the next block of about that size, up to the cache limit,
    instead of going back to the OS: a kept block is already faulted in and costs no page faults."""

    cdef void *ptr
    cdef readonly Py_ssize_t size
    cdef Py_ssize_t cap

    def __cinit__(self, Py_ssize_t size):
        global _cached, _cached_bytes
        cdef int i, best = -1
        if size < 1:
            raise ValueError(f"a block must hold at least one byte, got {size}")
        for i in range(_cached):  # the newest block that fits without wasting over a quarter of it
            if size <= _cache_len[i] <= size + size // 4:
                best = i
        if best >= 0:
            self.ptr, self.cap = _cache_ptr[best], _cache_len[best]
            _cached_bytes -= self.cap
            _cached -= 1
            for i in range(best, _cached):
                _cache_ptr[i], _cache_len[i] = _cache_ptr[i + 1], _cache_len[i + 1]
        else:
            self.ptr, self.cap = malloc(size), size
            if self.ptr == NULL:
                raise MemoryError(f"cannot allocate {size} bytes")
        self.size = size

    def __getbuffer__(self, Py_buffer *view, int flags):
        PyBuffer_FillInfo(view, self, self.ptr, self.size, 0, flags)

    def __releasebuffer__(self, Py_buffer *view):
        pass

    def __dealloc__(self):
        global _cached, _cached_bytes
        if self.ptr == NULL:
            return
        if self.cap > _cache_limit:
            free(self.ptr)
            return
        _trim(_cache_limit - self.cap)
        if _cached == _MAX_CACHED:
            _trim(_cached_bytes - _cache_len[0])
        _cache_ptr[_cached], _cache_len[_cached] = self.ptr, self.cap
        _cached += 1
        _cached_bytes += self.cap
