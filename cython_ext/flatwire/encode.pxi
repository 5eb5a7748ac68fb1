# The typed wire fast path (kvd.wire._flatwire, included by cython_ext/_flatwire.pyx):
# the four messages to their frames (encode_request, encode_reply).

def encode_request(req, limits):
    """The frames of a get or an append request, as the generic encoder makes them; else None."""
    cdef unsigned char buf[HEADER_ROOM]
    cdef Wr w
    w.p, w.end, w.bad = buf, buf + HEADER_ROOM, False
    cls = type(req)
    if cls is _GetRequest:
        packed = req.packed
        if (packed is not False and packed is not True) or not w_envelope(&w, 9 + packed, req.request_id, b"get") \
                or not w_sequence(&w, req) or not w_uint_field(&w, b"start", req.start):
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
        if packed:
            w_key(&w, b"packed")
            w_byte(&w, 0xC3)
        return _message(&w, buf, limits, None, None)
    if cls is not _AppendRequest:
        return None
    keys, values, position, incarnation, packed = req.keys, req.values, req.position, req.incarnation, req.packed
    notices = req.notices
    if (packed is not False and packed is not True) or (notices is not False and notices is not True) \
            or req.parent is not None:  # a parent: the generic encoder
        return None
    if not w_envelope(&w, 8 + (position is not None) + (incarnation is not None) + notices + packed,
                      req.request_id, b"append") or not w_sequence(&w, req):
        return None
    w_key(&w, b"offset")
    if not w_opt_uint(&w, req.offset) or not w_str_field(&w, b"dtype", req.dtype):
        return None
    w_key(&w, b"shape")
    if not w_pyints(&w, keys.shape):
        return None
    if position is not None and not w_uint_field(&w, b"position", position):
        return None
    if incarnation is not None and not w_str_field(&w, b"incarnation", incarnation):
        return None
    if notices:
        w_key(&w, b"notices")
        w_byte(&w, 0xC3)
    if packed:
        w_key(&w, b"packed")
        w_byte(&w, 0xC3)
        return _message(&w, buf, limits, _packed_tensors(keys, values), None)
    return _message(&w, buf, limits, _tensor_view(keys), _tensor_view(values))


def encode_reply(reply, limits):
    """The frames of an fp16 get reply or an append reply, as the generic encoder makes them; else None."""
    cdef unsigned char buf[HEADER_ROOM]
    cdef Wr w
    w.p, w.end, w.bad = buf, buf + HEADER_ROOM, False
    cls = type(reply)
    if cls is not _GetReply and (cls is not _AppendReply or reply.notice is not None):  # a notice: the generic
        return None
    packed = reply.packed if cls is _GetReply else None
    if not w_envelope(&w, 5 if cls is _AppendReply else 10 if packed is None else 11, reply.request_id,
                      b"get" if cls is _GetReply else b"append"):
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
    if not w_pyints(&w, keys.shape):
        return None
    if packed is not None:
        w_key(&w, b"packed")
        w_byte(&w, 0xC3)
        return _message(&w, buf, limits, packed, None)
    return _message(&w, buf, limits, _tensor_view(keys), _tensor_view(values))
