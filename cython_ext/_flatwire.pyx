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

Layout: this file holds the module's state (what kvd.wire.protocol binds, the limits cache); cython_ext/flatwire/
holds one job per file: reader.pxi (msgpack in), decode.pxi (the messages from frames), writer.pxi (msgpack out),
encode.pxi (the messages to frames).
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
cdef object _DTYPES = None, _F16 = None, _ndarray = None, _new = None, _tensor_view = None, _packed_tensors = None
cdef uint64_t _VERSION = 0
cdef uint64_t MAX_INDEX = 0, MAX_POSITION = 0
cdef Py_ssize_t MAX_NAMESPACE_BYTES = 0, MAX_SEQ_ID_BYTES = 0, MAX_TEXT_BYTES = 0

cdef struct Lim:
    Py_ssize_t header, frame, message

# the limits last seen, as C integers (a Limits is frozen: its identity names its values)
cdef object _lim = None
cdef Lim _lim_c


def bind(get_reply, append_reply, get_request, append_request, dtypes, uint64_t version, tensor_frame,
         packed_tensors, uint64_t max_index, uint64_t max_position, Py_ssize_t max_namespace,
         Py_ssize_t max_seq_id, Py_ssize_t max_text):
    """Called once by kvd.wire.protocol: the classes to build, the constants to check against, and the functions
    that make an array's frame and the one frame of packed keys and values."""
    global _GetReply, _AppendReply, _GetRequest, _AppendRequest, _DTYPES, _F16, _ndarray, _new, _VERSION
    global _tensor_view, _packed_tensors, MAX_INDEX, MAX_POSITION, MAX_NAMESPACE_BYTES, MAX_SEQ_ID_BYTES
    global MAX_TEXT_BYTES
    import numpy
    _GetReply, _AppendReply, _GetRequest, _AppendRequest = get_reply, append_reply, get_request, append_request
    _DTYPES, _F16, _ndarray, _new = dtypes, dtypes["float16"], numpy.ndarray, object.__new__
    _VERSION = version
    _tensor_view, _packed_tensors = tensor_frame, packed_tensors
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


cdef enum:
    # more layers in one header: the Python path (a set, not a quadratic check). Fewer than msgpack's array limit
    # (at least _MIN_ARRAY_LEN), so that limit never binds here.
    MAX_FLAT_LAYERS = 64


# one job per file, in this order (each uses the ones before it)
include "flatwire/reader.pxi"
include "flatwire/decode.pxi"
include "flatwire/writer.pxi"
include "flatwire/encode.pxi"
