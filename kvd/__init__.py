"""kvd: a distributed, paged, adaptively quantized store for the attention KV cache of LLM inference."""

from kvd import _native

_native.install()  # before any compiled module is imported: KVD_PURE_PYTHON and stale builds (kvd._native)

from kvd.errors import KvdError, KvdWarning  # noqa: E402

__version__ = "0.1.0"
__all__ = ["KvdError", "KvdWarning", "__version__"]
