"""The kernel dispatch's public name: ``kvd.kernels.BACKEND``, ``kvd.kernels.available()``, the kernels.

The code lives in :mod:`kvd.codec.kernels` (the backend is chosen once, at import; ``KVD_KERNELS`` forces one).
"""

from kvd.codec.kernels import *  # noqa: F403
from kvd.codec.kernels import __all__  # noqa: F401
