"""One error tree for kvd.

Every error kvd raises is a :class:`KvdError`. Where a builtin fits, the class also subclasses it, so callers
that already catch ``ValueError`` or ``MemoryError`` keep working. Each class has a stable numeric ``code``:
the wire protocol sends the code and the message, and the client re-raises the same class
(:func:`error_for_code`). Codes are part of the protocol: never renumber one, only add.
"""

from __future__ import annotations


class KvdError(Exception):
    """Base of every kvd error. ``code`` is the stable wire code."""

    code = 1

    def __str__(self) -> str:  # KeyError would otherwise repr() its message
        return str(self.args[0]) if self.args else self.__class__.__name__


class InvalidArgument(KvdError, ValueError):
    """A value, shape, dtype or range the operation cannot take; the message names it."""

    code = 2


class NonFiniteError(InvalidArgument):
    """NaN or Inf in data to be stored (or a float32 value beyond float16 range). Nothing was written."""

    code = 3


class CorruptPage(KvdError, ValueError):
    """An encoded page whose header or checksum does not hold; it was not decoded."""

    code = 4


class UnknownNamespace(KvdError, KeyError):
    """The namespace was never registered."""

    code = 5


class UnknownSequence(KvdError, KeyError):
    """No such sequence in the namespace (never appended, dropped, evicted, or lost with its shard)."""

    code = 6


class LayoutMismatch(InvalidArgument):
    """Data or a registration that disagrees with the namespace's layout."""

    code = 7


class OutOfMemory(KvdError, MemoryError):
    """The store is full at its most compact level and eviction is off; nothing was written."""

    code = 8


class ProtocolError(KvdError):
    """A malformed message: bad msgpack, missing or mistyped field, frame/shape mismatch."""

    code = 10


class MessageTooLarge(ProtocolError):
    """A message or frame over the negotiated size limits."""

    code = 11


class UnsupportedVersion(ProtocolError):
    """A protocol or page format version this side does not speak."""

    code = 12


class Busy(KvdError):
    """The server cannot take the request now (queue full); retry later."""

    code = 13


class Timeout(KvdError, TimeoutError):
    """No reply within the call's timeout."""

    code = 14


class ShardUnavailable(KvdError, ConnectionError):
    """The shard owning the sequence is unreachable or restarted without its data."""

    code = 15


class ConfigError(KvdError, ValueError):
    """A bad setting: unknown key, wrong type, out-of-range value."""

    code = 16


class BackendUnavailable(KvdError, ImportError):
    """A forced kernel backend (``KVD_KERNELS``) that this build or CPU cannot run."""

    code = 17


class Conflict(KvdError):
    """The request's expectation about the sequence does not hold (an append whose ``offset`` is not the
    sequence's length, e.g. after an earlier pipelined append failed). Nothing was written."""

    code = 18


class WrongShard(KvdError):
    """The shard does not own the sequence by its topology (the message names the owner and the topology
    epoch), or is not the shard incarnation the request was meant for (it restarted: an ``append`` carrying
    another ``incarnation``). Nothing was done: refresh the topology and resend to the owner (protocol 1.3)."""

    code = 19


class DiskError(KvdError, OSError):
    """The shard's disk tier could not read or write (an I/O error, a full disk); the message names the file
    and the system's error. What the shard holds in memory is unaffected (protocol 1.5)."""

    code = 20


class KvdWarning(UserWarning):
    """Something a call succeeded despite, that its caller should act on: e.g. a client's append to a namespace
    that needs a calibration (protocol 1.8, the append reply's ``notice``). Not an error: no wire code."""


def _all_subclasses(cls: type[KvdError]) -> list[type[KvdError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


ERRORS_BY_CODE: dict[int, type[KvdError]] = {c.code: c for c in _all_subclasses(KvdError)}
if len(ERRORS_BY_CODE) != len(_all_subclasses(KvdError)):  # pragma: no cover - guards a programming error
    raise RuntimeError("two kvd error classes share a wire code")


def error_for_code(code: int, message: str) -> KvdError:
    """The exception for a wire error ``code``; an unknown code gives a plain :class:`KvdError`."""
    return ERRORS_BY_CODE.get(code, KvdError)(message)
