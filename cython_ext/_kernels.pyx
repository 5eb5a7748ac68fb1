# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled kernels of kvd: thin, checked entry points over the C kernel sets in ``cython_ext/*.h``.

Theory of operation
-------------------
Each :class:`Backend` binds the 11 kernels of :data:`kvd.codec.reference.KERNELS` to one compiled kernel set
("avx512", "avx2", "neon" or "scalar"). A call first runs a fast argument check straight on the numpy C API
(dtype, byte order, shape, contiguity, alignment, writability, ``group``/``fmt``/``rotate`` types). If any of
it fails, the call is handed to the reference function itself: the reference then raises exactly the error it
documents (same class, same message), or, for the rare valid arguments the fast path does not take (a
misaligned array, a numpy integer ``fmt``, a non-bool ``rotate``...), computes the same result more slowly.
When the checks pass, the kernel runs with the GIL released and writes into the caller's arrays.

Non-finite input: the kernel notices NaN/Inf in its absmax (or min/max) pass and stops; the wrapper then
raises the reference's :class:`kvd.errors.NonFiniteError`, which names the first non-finite position in
row-major order. ``f16_copy_rows`` checks everything before it copies; the quantizers may have written part
of their outputs by then (their contents are unspecified after the error).
"""

from libc.stddef cimport ptrdiff_t
from libc.stdint cimport int8_t, int64_t, uint8_t, uint16_t

cimport numpy as cnp

import numpy as np

from kvd.codec import reference as _ref
from kvd.errors import InvalidArgument, NonFiniteError, OutOfMemory

cnp.import_array()

cdef extern from "numpy/arrayobject.h":
    enum:
        NPY_HALF  # float16; not in Cython's numpy declarations


cdef extern from "kvd_kernels.h" nogil:
    ctypedef int (*kvd_f16_copy_rows_fn)(const uint16_t *, ptrdiff_t, int64_t, int64_t, uint16_t *)
    ctypedef int (*kvd_q8_encode_fn)(const uint16_t *, ptrdiff_t, int64_t, int64_t, int8_t *, uint16_t *, int64_t)
    ctypedef void (*kvd_q8_decode_fn)(const int8_t *, const uint16_t *, uint16_t *, int64_t, int64_t, int64_t)
    ctypedef int (*kvd_fp8_encode_fn)(const uint16_t *, ptrdiff_t, int64_t, int64_t, uint8_t *, uint16_t *,
                                      int64_t, int)
    ctypedef void (*kvd_fp8_decode_fn)(const uint8_t *, const uint16_t *, uint16_t *, int64_t, int64_t, int64_t,
                                       int)
    ctypedef int (*kvd_q4_encode_rows_fn)(const uint16_t *, ptrdiff_t, int64_t, int64_t, uint8_t *, uint16_t *,
                                          uint16_t *, int64_t, int)
    ctypedef int (*kvd_q4_encode_rows_pf_fn)(const uint16_t *, ptrdiff_t, int64_t, int64_t, uint8_t *, uint16_t *,
                                             uint16_t *, int64_t, int, const void *, int64_t)
    ctypedef int (*kvd_q4_decode_rows_fn)(const uint8_t *, const uint16_t *, const uint16_t *, uint16_t *,
                                          int64_t, int64_t, int64_t, int)
    ctypedef int (*kvd_q4_encode_cols_fn)(const uint16_t *, ptrdiff_t, int64_t, int64_t, uint8_t *, uint16_t *,
                                          uint16_t *, int64_t)
    ctypedef void (*kvd_q4_decode_cols_fn)(const uint8_t *, const uint16_t *, const uint16_t *, uint16_t *,
                                           int64_t, int64_t, int64_t)

    ctypedef struct kvd_backend:
        const char *name
        kvd_f16_copy_rows_fn f16_copy_rows
        kvd_q8_encode_fn q8_encode_rows
        kvd_q8_decode_fn q8_decode_rows
        kvd_q8_encode_fn q8_encode_cols
        kvd_q8_decode_fn q8_decode_cols
        kvd_fp8_encode_fn fp8_encode_rows
        kvd_fp8_decode_fn fp8_decode_rows
        kvd_q4_encode_rows_fn q4_encode_rows
        kvd_q4_decode_rows_fn q4_decode_rows
        kvd_q4_encode_cols_fn q4_encode_cols
        kvd_q4_decode_cols_fn q4_decode_cols
        kvd_q4_encode_rows_pf_fn q4_encode_rows_pf

    int kvd_q4_encode_rows_hinted(const kvd_backend *b, const uint16_t *x, ptrdiff_t xs, int64_t n, int64_t d,
                                  uint8_t *packed, uint16_t *scales, uint16_t *mins, int64_t group, int rotate,
                                  const void *pf, int64_t pf_bytes)
    int KVD_OK
    int KVD_NONFINITE
    int KVD_NOMEM
    void kvd_init()
    int kvd_ncompiled()
    const kvd_backend *kvd_compiled_at(int i)
    int kvd_runnable(const kvd_backend *b)
    # scalar helpers, exposed for tests
    float kvd_h2f(uint16_t h)
    uint16_t kvd_f2h(float f)
    uint16_t kvd_f16_up(float v)
    uint16_t kvd_f16_down(float v)
    uint8_t kvd_f32_to_fp8(float y, int fmt)
    float kvd_fp8_value(uint8_t code, int fmt)


kvd_init()


def compiled_backends() -> list:
    """Names of the kernel sets in this build, best first (whether or not this CPU can run them)."""
    return [kvd_compiled_at(i).name.decode() for i in range(kvd_ncompiled())]


def runnable_backends() -> list:
    """Names of the compiled kernel sets this CPU can run, best first."""
    return [kvd_compiled_at(i).name.decode() for i in range(kvd_ncompiled()) if kvd_runnable(kvd_compiled_at(i))]


cdef const kvd_backend *_find(str name):
    cdef int i
    for i in range(kvd_ncompiled()):
        if kvd_compiled_at(i).name.decode() == name:
            return kvd_compiled_at(i)
    return NULL


# ---------------------------------------------------------------------------------------------------------
# fast argument checks: True when the kernel can run on these arrays as they are

cdef int _OUT_FLAGS = cnp.NPY_ARRAY_C_CONTIGUOUS | cnp.NPY_ARRAY_ALIGNED | cnp.NPY_ARRAY_WRITEABLE


def _decode_inputs_may_be_read_only() -> bool:
    # The reference's _check_out also asks decode *inputs* (codes, scales, mins, packed) to be writable. Probe
    # what the reference does instead of copying that rule here, so compiled backends accept exactly what it
    # accepts even if that rule changes.
    codes = np.zeros((1, 1), np.int8)
    codes.flags.writeable = False
    try:
        _ref.q8_decode_rows(codes, np.ones((1, 1), np.float16), np.empty((1, 1), np.float16), 1)
    except InvalidArgument:
        return False
    return True


cdef int _IN_FLAGS = (cnp.NPY_ARRAY_C_CONTIGUOUS | cnp.NPY_ARRAY_ALIGNED) | (
    0 if _decode_inputs_may_be_read_only() else cnp.NPY_ARRAY_WRITEABLE
)


cdef inline bint _arr_ok(object a, int typenum, Py_ssize_t d0, Py_ssize_t d1, int flags) noexcept:
    if not cnp.PyArray_Check(a):
        return False
    cdef cnp.ndarray arr = <cnp.ndarray>a
    if cnp.PyArray_NDIM(arr) != 2 or cnp.PyArray_TYPE(arr) != typenum or not cnp.PyArray_ISNOTSWAPPED(arr):
        return False
    if cnp.PyArray_DIM(arr, 0) != d0 or cnp.PyArray_DIM(arr, 1) != d1:
        return False
    return (cnp.PyArray_FLAGS(arr) & flags) == flags


cdef inline bint _x_ok(object x) noexcept:
    """x: float16, 2-D, not empty, contiguous rows (any row stride), aligned."""
    if not cnp.PyArray_Check(x):
        return False
    cdef cnp.ndarray arr = <cnp.ndarray>x
    if cnp.PyArray_NDIM(arr) != 2 or cnp.PyArray_TYPE(arr) != NPY_HALF or not cnp.PyArray_ISNOTSWAPPED(arr):
        return False
    if cnp.PyArray_DIM(arr, 0) < 1 or cnp.PyArray_DIM(arr, 1) < 1:
        return False
    if cnp.PyArray_DIM(arr, 1) > 1 and cnp.PyArray_STRIDE(arr, 1) != 2:
        return False
    return (cnp.PyArray_FLAGS(arr) & cnp.NPY_ARRAY_ALIGNED) != 0


cdef inline Py_ssize_t _dim(object a, int i) noexcept:
    return cnp.PyArray_DIM(<cnp.ndarray>a, i)


cdef inline int64_t _group(object group) except? -2:
    """The group size if it is a valid int (or numpy integer), else -1 (the reference decides)."""
    cdef int64_t g
    if type(group) is int or (isinstance(group, np.integer) and not isinstance(group, np.bool_)):
        try:
            g = group
        except OverflowError:
            return -1
        if 1 <= g <= 65535:
            return g
    return -1


cdef inline int _fmt(object fmt) except? -2:
    if type(fmt) is int or isinstance(fmt, np.integer):
        if fmt == 0:
            return 0
        if fmt == 1:
            return 1
    return -1


cdef inline int _rotate(object rotate, Py_ssize_t d) except? -2:
    """0 / 1 for a bool (1 only if d is a power of two), else -1 (the reference decides)."""
    if rotate is False or rotate is True or isinstance(rotate, np.bool_):
        if not rotate:
            return 0
        if d >= 1 and (d & (d - 1)) == 0:
            return 1
    return -1


cdef inline ptrdiff_t _row_stride(object x) noexcept:
    # in elements; the ALIGNED flag guarantees a multiple of the item size
    return cnp.PyArray_STRIDE(<cnp.ndarray>x, 0) // 2


cdef inline void *_data(object a) noexcept:
    return cnp.PyArray_DATA(<cnp.ndarray>a)


cdef object _raise_status(int rc, object x):
    if rc == KVD_NONFINITE:
        _ref._check_finite(x)  # raises the reference's NonFiniteError naming the first bad position
        raise NonFiniteError("non-finite value in x; nothing was stored")  # not reached unless a kernel is wrong
    if rc == KVD_NOMEM:
        raise OutOfMemory(f"no memory for a scratch row of {_dim(x, 1)} float32 values")
    raise RuntimeError(f"kernel returned status {rc}")


cdef inline Py_ssize_t _ng(Py_ssize_t n, int64_t group) noexcept:
    return (n + group - 1) // group


# ---------------------------------------------------------------------------------------------------------


cdef class Backend:
    """The 11 kernels bound to one compiled kernel set; same signatures and errors as kvd.codec.reference."""

    cdef const kvd_backend *b
    cdef readonly str name

    def __cinit__(self, str name):
        self.b = _find(name)
        if self.b == NULL:
            raise ValueError(f"kernel set {name!r} is not in this build (have {compiled_backends()})")
        if not kvd_runnable(self.b):
            raise ValueError(f"this CPU cannot run the {name!r} kernels")
        self.name = name

    def __repr__(self):
        return f"<kvd kernels {self.name}>"

    def f16_copy_rows(self, x, out):
        """Copy float16 x [N, D] into out [N, D], refusing NaN/Inf (NonFiniteError) before anything is written."""
        cdef int rc
        if not (_x_ok(x) and _arr_ok(out, NPY_HALF, _dim(x, 0), _dim(x, 1), _OUT_FLAGS)):
            return _ref.f16_copy_rows(x, out)
        cdef const uint16_t *px = <const uint16_t *>_data(x)
        cdef ptrdiff_t xs = _row_stride(x)
        cdef int64_t n = _dim(x, 0), d = _dim(x, 1)
        cdef uint16_t *po = <uint16_t *>_data(out)
        with nogil:
            rc = self.b.f16_copy_rows(px, xs, n, d, po)
        if rc != KVD_OK:
            _raise_status(rc, x)

    def q8_encode_rows(self, x, codes, scales, group):
        """int8 codes [N, D] and float16 scales [N, ceil(D/group)] of x [N, D] (groups along each row)."""
        cdef int rc
        cdef int64_t g = _group(group)
        if not (g > 0 and _x_ok(x) and _arr_ok(codes, cnp.NPY_BYTE, _dim(x, 0), _dim(x, 1), _OUT_FLAGS)
                and _arr_ok(scales, NPY_HALF, _dim(x, 0), _ng(_dim(x, 1), g), _OUT_FLAGS)):
            return _ref.q8_encode_rows(x, codes, scales, group)
        cdef const uint16_t *px = <const uint16_t *>_data(x)
        cdef ptrdiff_t xs = _row_stride(x)
        cdef int64_t n = _dim(x, 0), d = _dim(x, 1)
        cdef int8_t *pc = <int8_t *>_data(codes)
        cdef uint16_t *ps = <uint16_t *>_data(scales)
        with nogil:
            rc = self.b.q8_encode_rows(px, xs, n, d, pc, ps, g)
        if rc != KVD_OK:
            _raise_status(rc, x)

    def q8_decode_rows(self, codes, scales, out, group):
        """out [N, D] float16 = codes * scales (inverse of q8_encode_rows)."""
        cdef int64_t g = _group(group)
        if not (g > 0 and cnp.PyArray_Check(out) and cnp.PyArray_NDIM(<cnp.ndarray>out) == 2):
            return _ref.q8_decode_rows(codes, scales, out, group)
        cdef int64_t n = _dim(out, 0), d = _dim(out, 1)
        if not (_arr_ok(codes, cnp.NPY_BYTE, n, d, _IN_FLAGS) and _arr_ok(scales, NPY_HALF, n, _ng(d, g), _IN_FLAGS)
                and _arr_ok(out, NPY_HALF, n, d, _OUT_FLAGS)):
            return _ref.q8_decode_rows(codes, scales, out, group)
        cdef const int8_t *pc = <const int8_t *>_data(codes)
        cdef const uint16_t *ps = <const uint16_t *>_data(scales)
        cdef uint16_t *po = <uint16_t *>_data(out)
        if n > 0 and d > 0:
            with nogil:
                self.b.q8_decode_rows(pc, ps, po, n, d, g)

    def q8_encode_cols(self, x, codes, scales, group):
        """int8 codes [T, C] and float16 scales [ceil(T/group), C] of x [T, C] (groups along each column)."""
        cdef int rc
        cdef int64_t g = _group(group)
        if not (g > 0 and _x_ok(x) and _arr_ok(codes, cnp.NPY_BYTE, _dim(x, 0), _dim(x, 1), _OUT_FLAGS)
                and _arr_ok(scales, NPY_HALF, _ng(_dim(x, 0), g), _dim(x, 1), _OUT_FLAGS)):
            return _ref.q8_encode_cols(x, codes, scales, group)
        cdef const uint16_t *px = <const uint16_t *>_data(x)
        cdef ptrdiff_t xs = _row_stride(x)
        cdef int64_t t = _dim(x, 0), c = _dim(x, 1)
        cdef int8_t *pc = <int8_t *>_data(codes)
        cdef uint16_t *ps = <uint16_t *>_data(scales)
        with nogil:
            rc = self.b.q8_encode_cols(px, xs, t, c, pc, ps, g)
        if rc != KVD_OK:
            _raise_status(rc, x)

    def q8_decode_cols(self, codes, scales, out, group):
        """out [T, C] float16 = codes * scales (inverse of q8_encode_cols)."""
        cdef int64_t g = _group(group)
        if not (g > 0 and cnp.PyArray_Check(out) and cnp.PyArray_NDIM(<cnp.ndarray>out) == 2):
            return _ref.q8_decode_cols(codes, scales, out, group)
        cdef int64_t t = _dim(out, 0), c = _dim(out, 1)
        if not (_arr_ok(codes, cnp.NPY_BYTE, t, c, _IN_FLAGS) and _arr_ok(scales, NPY_HALF, _ng(t, g), c, _IN_FLAGS)
                and _arr_ok(out, NPY_HALF, t, c, _OUT_FLAGS)):
            return _ref.q8_decode_cols(codes, scales, out, group)
        cdef const int8_t *pc = <const int8_t *>_data(codes)
        cdef const uint16_t *ps = <const uint16_t *>_data(scales)
        cdef uint16_t *po = <uint16_t *>_data(out)
        if t > 0 and c > 0:
            with nogil:
                self.b.q8_decode_cols(pc, ps, po, t, c, g)

    def fp8_encode_rows(self, x, codes, scales, group, fmt):
        """8-bit float codes [N, D] (uint8 bit patterns) and float16 scales [N, ceil(D/group)] of x [N, D]."""
        cdef int rc
        cdef int64_t g = _group(group)
        cdef int f = _fmt(fmt)
        if not (g > 0 and f >= 0 and _x_ok(x) and _arr_ok(codes, cnp.NPY_UBYTE, _dim(x, 0), _dim(x, 1), _OUT_FLAGS)
                and _arr_ok(scales, NPY_HALF, _dim(x, 0), _ng(_dim(x, 1), g), _OUT_FLAGS)):
            return _ref.fp8_encode_rows(x, codes, scales, group, fmt)
        cdef const uint16_t *px = <const uint16_t *>_data(x)
        cdef ptrdiff_t xs = _row_stride(x)
        cdef int64_t n = _dim(x, 0), d = _dim(x, 1)
        cdef uint8_t *pc = <uint8_t *>_data(codes)
        cdef uint16_t *ps = <uint16_t *>_data(scales)
        with nogil:
            rc = self.b.fp8_encode_rows(px, xs, n, d, pc, ps, g, f)
        if rc != KVD_OK:
            _raise_status(rc, x)

    def fp8_decode_rows(self, codes, scales, out, group, fmt):
        """out [N, D] float16 = fp8(codes) * scales (inverse of fp8_encode_rows)."""
        cdef int64_t g = _group(group)
        cdef int f = _fmt(fmt)
        if not (g > 0 and f >= 0 and cnp.PyArray_Check(out) and cnp.PyArray_NDIM(<cnp.ndarray>out) == 2):
            return _ref.fp8_decode_rows(codes, scales, out, group, fmt)
        cdef int64_t n = _dim(out, 0), d = _dim(out, 1)
        if not (_arr_ok(codes, cnp.NPY_UBYTE, n, d, _IN_FLAGS) and _arr_ok(scales, NPY_HALF, n, _ng(d, g), _IN_FLAGS)
                and _arr_ok(out, NPY_HALF, n, d, _OUT_FLAGS)):
            return _ref.fp8_decode_rows(codes, scales, out, group, fmt)
        cdef const uint8_t *pc = <const uint8_t *>_data(codes)
        cdef const uint16_t *ps = <const uint16_t *>_data(scales)
        cdef uint16_t *po = <uint16_t *>_data(out)
        if n > 0 and d > 0:
            with nogil:
                self.b.fp8_decode_rows(pc, ps, po, n, d, g, f)

    def q4_encode_rows(self, x, packed, scales, mins, group, rotate, prefetch=None):
        """Packed 4-bit codes [N, ceil(D/2)], float16 scales and mins [N, ceil(D/group)] of x [N, D].

        With ``rotate`` (D a power of two) the row is first Hadamard-rotated: ``y = FWHT(x) * (1/D)``.
        ``prefetch``: a C-contiguous array read into cache meanwhile (the next input), or None.
        """
        cdef int rc
        cdef int64_t g = _group(group)
        cdef int rot
        cdef const void *pf = NULL
        cdef int64_t pf_bytes = 0
        if prefetch is not None:
            if not (cnp.PyArray_Check(prefetch) and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>prefetch)):
                raise TypeError(f"prefetch must be a C-contiguous numpy array or None, got {type(prefetch).__name__}")
            pf, pf_bytes = <const void *>_data(prefetch), cnp.PyArray_NBYTES(<cnp.ndarray>prefetch)
        if not (g > 0 and _x_ok(x)):
            return _ref.q4_encode_rows(x, packed, scales, mins, group, rotate)
        cdef int64_t n = _dim(x, 0), d = _dim(x, 1)
        rot = _rotate(rotate, d)
        if not (rot >= 0 and _arr_ok(packed, cnp.NPY_UBYTE, n, (d + 1) // 2, _OUT_FLAGS)
                and _arr_ok(scales, NPY_HALF, n, _ng(d, g), _OUT_FLAGS)
                and _arr_ok(mins, NPY_HALF, n, _ng(d, g), _OUT_FLAGS)):
            return _ref.q4_encode_rows(x, packed, scales, mins, group, rotate)
        cdef const uint16_t *px = <const uint16_t *>_data(x)
        cdef ptrdiff_t xs = _row_stride(x)
        cdef uint8_t *pp = <uint8_t *>_data(packed)
        cdef uint16_t *ps = <uint16_t *>_data(scales)
        cdef uint16_t *pm = <uint16_t *>_data(mins)
        with nogil:
            rc = kvd_q4_encode_rows_hinted(self.b, px, xs, n, d, pp, ps, pm, g, rot, pf, pf_bytes)
        if rc != KVD_OK:
            _raise_status(rc, x)

    def q4_decode_rows(self, packed, scales, mins, out, group, rotate):
        """out [N, D] float16 = q * s + m, then FWHT if the rows were rotated (inverse of q4_encode_rows)."""
        cdef int rc = 0
        cdef int64_t g = _group(group)
        cdef int rot
        if not (g > 0 and cnp.PyArray_Check(out) and cnp.PyArray_NDIM(<cnp.ndarray>out) == 2):
            return _ref.q4_decode_rows(packed, scales, mins, out, group, rotate)
        cdef int64_t n = _dim(out, 0), d = _dim(out, 1)
        rot = _rotate(rotate, d)
        if not (rot >= 0 and _arr_ok(packed, cnp.NPY_UBYTE, n, (d + 1) // 2, _IN_FLAGS)
                and _arr_ok(scales, NPY_HALF, n, _ng(d, g), _IN_FLAGS)
                and _arr_ok(mins, NPY_HALF, n, _ng(d, g), _IN_FLAGS)
                and _arr_ok(out, NPY_HALF, n, d, _OUT_FLAGS)):
            return _ref.q4_decode_rows(packed, scales, mins, out, group, rotate)
        cdef const uint8_t *pp = <const uint8_t *>_data(packed)
        cdef const uint16_t *ps = <const uint16_t *>_data(scales)
        cdef const uint16_t *pm = <const uint16_t *>_data(mins)
        cdef uint16_t *po = <uint16_t *>_data(out)
        if n > 0 and d > 0:
            with nogil:
                rc = self.b.q4_decode_rows(pp, ps, pm, po, n, d, g, rot)
        if rc != KVD_OK:
            _raise_status(rc, out)

    def q4_encode_cols(self, x, packed, scales, mins, group):
        """Packed 4-bit codes [T, ceil(C/2)], float16 scales and mins [ceil(T/group), C] of x [T, C]."""
        cdef int rc
        cdef int64_t g = _group(group)
        if not (g > 0 and _x_ok(x)):
            return _ref.q4_encode_cols(x, packed, scales, mins, group)
        cdef int64_t t = _dim(x, 0), c = _dim(x, 1)
        if not (_arr_ok(packed, cnp.NPY_UBYTE, t, (c + 1) // 2, _OUT_FLAGS)
                and _arr_ok(scales, NPY_HALF, _ng(t, g), c, _OUT_FLAGS)
                and _arr_ok(mins, NPY_HALF, _ng(t, g), c, _OUT_FLAGS)):
            return _ref.q4_encode_cols(x, packed, scales, mins, group)
        cdef const uint16_t *px = <const uint16_t *>_data(x)
        cdef ptrdiff_t xs = _row_stride(x)
        cdef uint8_t *pp = <uint8_t *>_data(packed)
        cdef uint16_t *ps = <uint16_t *>_data(scales)
        cdef uint16_t *pm = <uint16_t *>_data(mins)
        with nogil:
            rc = self.b.q4_encode_cols(px, xs, t, c, pp, ps, pm, g)
        if rc != KVD_OK:
            _raise_status(rc, x)

    def q4_decode_cols(self, packed, scales, mins, out, group):
        """out [T, C] float16 = q * s + m (inverse of q4_encode_cols)."""
        cdef int64_t g = _group(group)
        if not (g > 0 and cnp.PyArray_Check(out) and cnp.PyArray_NDIM(<cnp.ndarray>out) == 2):
            return _ref.q4_decode_cols(packed, scales, mins, out, group)
        cdef int64_t t = _dim(out, 0), c = _dim(out, 1)
        if not (_arr_ok(packed, cnp.NPY_UBYTE, t, (c + 1) // 2, _IN_FLAGS)
                and _arr_ok(scales, NPY_HALF, _ng(t, g), c, _IN_FLAGS)
                and _arr_ok(mins, NPY_HALF, _ng(t, g), c, _IN_FLAGS)
                and _arr_ok(out, NPY_HALF, t, c, _OUT_FLAGS)):
            return _ref.q4_decode_cols(packed, scales, mins, out, group)
        cdef const uint8_t *pp = <const uint8_t *>_data(packed)
        cdef const uint16_t *ps = <const uint16_t *>_data(scales)
        cdef const uint16_t *pm = <const uint16_t *>_data(mins)
        cdef uint16_t *po = <uint16_t *>_data(out)
        if t > 0 and c > 0:
            with nogil:
                self.b.q4_decode_cols(pp, ps, pm, po, t, c, g)


# ---------------------------------------------------------------------------------------------------------
# the scalar float helpers, for tests


def h2f(int bits) -> float:
    """float16 bit pattern -> float (the C helper every backend shares)."""
    return kvd_h2f(<uint16_t>bits)


def f2h(float v) -> int:
    """float32 -> float16 bit pattern, round to nearest even."""
    return kvd_f2h(v)


def f16_up(float v) -> int:
    return kvd_f16_up(v)


def f16_down(float v) -> int:
    return kvd_f16_down(v)


def f32_to_fp8(y, int fmt):
    """fp8 codes (uint8) of a float32 array, by the C helper."""
    cdef cnp.ndarray[cnp.float32_t, ndim=1] a = np.ascontiguousarray(y, dtype=np.float32).ravel()
    cdef cnp.ndarray[cnp.uint8_t, ndim=1] out = np.empty(a.shape[0], np.uint8)
    cdef Py_ssize_t i
    for i in range(a.shape[0]):
        out[i] = kvd_f32_to_fp8(a[i], fmt)
    return out


def fp8_lut(int fmt):
    """The C fp8 decode table (float32 [256])."""
    return np.array([kvd_fp8_value(<uint8_t>c, fmt) for c in range(256)], dtype=np.float32)


# ---------------------------------------------------------------------------------------------------------
# whole pages, many per call (the store's batched paths)

include "_pagecodec.pxi"
include "_attend.pxi"


# ---------------------------------------------------------------------------------------------------------
# warm result buffers (kvd.store.buffers)

include "_warm.pxi"
