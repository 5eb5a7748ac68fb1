"""Kernel backend dispatch: the 11 quantization kernels of kvd, bound to the fastest backend this machine runs.

Theory of operation
-------------------
The kernels are specified by :mod:`kvd.codec.reference` (pure numpy, the test oracle). The compiled extension
``kvd.codec._kernels`` carries several kernel sets of the same functions, bit-identical to the reference:
``"avx512"`` (AVX-512 F/BW/VL + F16C), ``"avx2"`` (AVX2 + F16C + FMA), ``"neon"`` (arm64 builds only) and
``"scalar"`` (portable C). At import this module picks the best set the CPU supports and binds the module-level
functions (``kernels.q8_encode_rows(...)`` etc.) to it; :data:`BACKEND` names the choice.

The environment variable ``KVD_KERNELS`` (read once, at import, by :func:`requested_backend`) forces one:
``reference`` | ``scalar`` | ``simd`` (the best SIMD set available) | a set's name. Forcing one this build or
CPU cannot run raises :class:`kvd.errors.BackendUnavailable` naming what is available. When the extension
was not built, the module falls back to the reference with a :class:`RuntimeWarning` (unless
``KVD_KERNELS=reference`` asked for it anyway).

Every function has the reference's signature and errors: inputs are 2-D float16 arrays whose rows are
contiguous (any row stride), outputs are C-contiguous arrays the caller allocated and the kernel fills.
NaN/Inf input raises :class:`kvd.errors.NonFiniteError` naming a non-finite position; with a compiled
backend the outputs of a quantizer may then be partly written (``f16_copy_rows`` writes nothing).

Bit-identity has no exception: even a q4 group holding both +0.0 and -0.0 has one minimum and maximum, because
the reference reduces on order-preserving integer keys (-0.0 below +0.0, IEEE 754-2019 minimum/maximum) exactly
as the compiled backends order them.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

from kvd.codec import reference as _ref
from kvd.errors import BackendUnavailable

ENV_VAR = "KVD_KERNELS"
SIMD_BACKENDS = ("avx512", "avx2", "neon")

_ext: ModuleType | None
_EXT_ERROR: ImportError | None
try:
    _ext = importlib.import_module("kvd.codec._kernels")
except ImportError as exc:  # not built (e.g. running from a source tree without build_ext)
    _ext, _EXT_ERROR = None, exc
else:
    _EXT_ERROR = None


def requested_backend() -> str | None:
    """The backend ``KVD_KERNELS`` asks for (lower-cased), or None when it is unset or empty."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    return value or None


def available() -> list[str]:
    """Backends this build and CPU can run, best first; always ends with ``"reference"``."""
    compiled = list(_ext.runnable_backends()) if _ext is not None else []
    return compiled + ["reference"]


def load(name: str) -> Any:
    """An object with the 11 kernels (and ``name``) bound to backend ``name``; for tests and benchmarks.

    Raises BackendUnavailable if this build or CPU cannot run it.
    """
    if name == "reference":
        return SimpleNamespace(name="reference", **{k: getattr(_ref, k) for k in _ref.KERNELS})
    if _ext is None or name not in available():
        why = "" if _ext is not None else f" (the compiled extension is not built: {_EXT_ERROR})"
        raise BackendUnavailable(f"kernel backend {name!r} is not available here{why}; available: {available()}")
    return _ext.Backend(name)


def _select() -> str:
    wanted = requested_backend()
    have = available()
    if wanted is None:
        if _ext is None:
            warnings.warn(
                f"kvd.codec._kernels is not built ({_EXT_ERROR}); using the slow numpy reference kernels",
                RuntimeWarning,
                stacklevel=3,
            )
        return have[0]
    if wanted == "simd":
        simd = [b for b in have if b in SIMD_BACKENDS]
        if not simd:
            raise BackendUnavailable(f"{ENV_VAR}=simd but no SIMD kernel backend is available; available: {have}")
        return simd[0]
    if wanted not in have:
        known = ("reference", "scalar", "simd", *SIMD_BACKENDS)
        what = "unknown" if wanted not in known else "not available here"
        raise BackendUnavailable(f"{ENV_VAR}={wanted!r} is {what}; available: {have}")
    return wanted


BACKEND: str = _select()
_active = load(BACKEND)



def compiled() -> Any:
    """The compiled kernel set in use (a ``kvd.codec._kernels.Backend``), or None when it is the reference."""
    return None if BACKEND == "reference" else _active


f16_copy_rows: Callable[..., None] = _active.f16_copy_rows
q8_encode_rows: Callable[..., None] = _active.q8_encode_rows
q8_decode_rows: Callable[..., None] = _active.q8_decode_rows
q8_encode_cols: Callable[..., None] = _active.q8_encode_cols
q8_decode_cols: Callable[..., None] = _active.q8_decode_cols
fp8_encode_rows: Callable[..., None] = _active.fp8_encode_rows
fp8_decode_rows: Callable[..., None] = _active.fp8_decode_rows
q4_encode_rows: Callable[..., None] = _active.q4_encode_rows
q4_decode_rows: Callable[..., None] = _active.q4_decode_rows
q4_encode_cols: Callable[..., None] = _active.q4_encode_cols
q4_decode_cols: Callable[..., None] = _active.q4_decode_cols

__all__ = ["BACKEND", "ENV_VAR", "available", "compiled", "load", "requested_backend", *_ref.KERNELS]
