"""Kernel backend dispatch (placeholder until the compiled extension lands: reference only)."""

from __future__ import annotations

from kvd import kernels_ref as _ref

BACKEND = "reference"
for _name in _ref.KERNELS:
    globals()[_name] = getattr(_ref, _name)
