"""kvd: a distributed, paged, adaptively quantized store for the attention KV cache of LLM inference."""

from kvd.errors import KvdError

__version__ = "0.1.0"
__all__ = ["KvdError", "__version__"]
