"""The cluster's namespaces and their calibrations, pure (no Ray, no ZeroMQ, no lock of its own: the coordinator's
:class:`~kvd.cluster.membership.Membership` calls it under its lock).

A namespace is registered once per cluster (the first layout wins) and never removed; a calibration is the
latest record of a namespace (kvd.calibration), and a namespace may have its own ``require_calibration`` (kept
and versioned with the calibrations: both are the namespace's calibration policy). Namespaces and calibrations
are each counted by a version that grows with every addition or change, so what a shard lacks is what came
after its version (:meth:`NamespaceRegistry.sync`); a shard whose version this registry cannot place (from
before a coordinator restart that lost the state) is sent everything.
"""

from __future__ import annotations

from typing import Any

from kvd.errors import InvalidArgument, LayoutMismatch, UnknownNamespace

__all__ = ["NamespaceRegistry"]


class NamespaceRegistry:
    """Namespaces (``{name: (layers, kv_heads, head_dim)}``), calibration records and each namespace's own
    ``require_calibration`` (``required``), versioned. ``namespaces`` / ``calibrations`` / ``required`` and their
    versions: what a previous coordinator persisted; ``max_namespaces`` bounds how many namespaces there may be
    (None: no bound)."""

    def __init__(self, *, namespaces: dict[str, Any] | None = None, namespaces_version: int = 0,
                 calibrations: dict[str, Any] | None = None, calibrations_version: int = 0,
                 required: dict[str, bool] | None = None, max_namespaces: int | None = None) -> None:
        self._layouts: dict[str, tuple[int, int, int]] = {}
        for name, layout in (namespaces or {}).items():
            self._layouts[str(name)] = layout_of(name, layout)
        self.version = max(int(namespaces_version), len(self._layouts))
        # every name in the order added (recovered ones first): the names after the first _recovered were added
        # by this process, one version each from _base, so what a shard lacks is a slice of this list
        self._order: list[str] = list(self._layouts)
        self._recovered, self._base = len(self._order), self.version
        self._max = max_namespaces
        # calibration records by namespace (Calibration.to_dict()) and the version each was set at; recovered
        # ones at the recovered version, so a shard at that version or later is not sent them again
        self._calibrations: dict[str, dict[str, Any]] = dict(calibrations or {})
        self._required: dict[str, bool] = {str(k): bool(v) for k, v in (required or {}).items()}
        named = {*self._calibrations, *self._required}
        self.calibrations_version = max(int(calibrations_version), len(named))
        self._cal_base = self.calibrations_version
        self._cal_set: dict[str, int] = dict.fromkeys(named, self._cal_base)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, name: object) -> bool:
        return name in self._layouts

    def add(self, namespace: str, layout: Any) -> bool:
        """Register ``namespace`` with ``layout``. True if it is new; False if known with this layout;
        :class:`LayoutMismatch` if known with another; :class:`InvalidArgument` past ``max_namespaces``."""
        if not namespace or not isinstance(namespace, str):
            raise InvalidArgument(f"namespace must be a non-empty str, got {namespace!r}")
        new = layout_of(namespace, layout)
        old = self._layouts.get(namespace)
        if old == new:
            return False
        if old is not None:
            raise LayoutMismatch(
                f"namespace {namespace!r} is registered in this cluster as (layers={old[0]}, "
                f"kv_heads={old[1]}, head_dim={old[2]}), not (layers={new[0]}, kv_heads={new[1]}, "
                f"head_dim={new[2]})"
            )
        if self._max is not None and len(self._layouts) >= self._max:
            raise InvalidArgument(
                f"namespace {namespace!r} was not registered: this cluster holds {len(self._layouts)} "
                f"namespaces, its limit (cluster.max_namespaces = {self._max}). A namespace is one model's KV "
                "layout and is never removed; reuse one, or raise cluster.max_namespaces"
            )
        self._add(namespace, new)
        return True

    def adopt(self, namespaces: dict[str, Any], calibrations: dict[str, Any],
              required: dict[str, Any] | None = None) -> None:
        """What a registering shard holds: each namespace, calibration and own ``require_calibration`` added
        where the cluster has none of that name (no limit: the shard already serves them)."""
        for name, layout in namespaces.items():
            if name not in self._layouts:
                self._add(str(name), layout_of(name, layout))
        for name, record in calibrations.items():
            if name in self._layouts and name not in self._calibrations:
                self._set_calibration(str(name), record, None)
        for name, require in (required or {}).items():
            if name in self._layouts and name not in self._required and isinstance(require, bool):
                self._set_calibration(str(name), None, require)

    def set_calibration(self, namespace: str, record: dict[str, Any] | None, require: bool | None = None) -> bool:
        """Keep ``record`` (a checked :meth:`kvd.calibration.Calibration.to_dict`; None: the namespace keeps its
        own) as ``namespace``'s calibration and ``require`` (None: unchanged) as its own
        ``require_calibration``. True if either changed; False if the namespace has a calibration of the same
        digest and that setting already. :class:`UnknownNamespace` for a namespace the cluster does not know,
        :class:`InvalidArgument` for neither."""
        if record is not None and (not isinstance(record, dict) or not isinstance(record.get("digest"), str)):
            raise InvalidArgument(f"a calibration record must be a map with a digest, got {type(record).__name__}")
        if require is not None and not isinstance(require, bool):
            raise InvalidArgument(f"require must be a bool or None, got {require!r}")
        if record is None and require is None:
            raise InvalidArgument("a calibration needs a record, require, or both: it has neither")
        if namespace not in self._layouts:
            raise UnknownNamespace(f"namespace {namespace!r} is not registered in this cluster: register it "
                                   "before giving it a calibration")
        old = self._calibrations.get(namespace)
        if record is not None and old is not None and old.get("digest") == record["digest"]:
            record = None  # held already
        if require is not None and self._required.get(namespace) is require:
            require = None
        if record is None and require is None:
            return False
        self._set_calibration(namespace, record, require)
        return True

    def calibrations(self) -> dict[str, dict[str, Any]]:
        """``{namespace: calibration record}`` of every calibrated namespace."""
        return dict(self._calibrations)

    def required(self) -> dict[str, bool]:
        """``{namespace: require_calibration}`` of every namespace with a setting of its own."""
        return dict(self._required)

    def part(self, index: int, size: int) -> dict[str, list[int]]:
        """Namespaces ``index * size`` to ``(index + 1) * size - 1`` in the order added: ``{name: [L, H, D]}``."""
        return {k: list(self._layouts[k]) for k in self._order[index * size:(index + 1) * size]}

    def layouts(self) -> dict[str, tuple[int, int, int]]:
        return dict(self._layouts)

    def sync(self, namespaces_version: int, calibrations_version: int) -> dict[str, Any]:
        """What a shard at these versions lacks: ``namespaces`` (``{name: [L, H, D]}``, with ``namespaces_from``
        when they are the ones added after its version) and ``calibrations`` (``{name: record}``) with
        ``required`` (``{name: bool}``), likewise with ``calibrations_from``, each only when the shard's version
        differs."""
        out: dict[str, Any] = {}
        if namespaces_version != self.version:
            if self._base <= namespaces_version < self.version:
                names = self._order[self._recovered + namespaces_version - self._base:]
                out["namespaces_from"] = namespaces_version
            else:
                names = self._order
            out["namespaces"] = {k: list(self._layouts[k]) for k in names}
        have = calibrations_version
        if have != self.calibrations_version:
            if self._cal_base <= have < self.calibrations_version:
                out["calibrations"] = {k: r for k, r in self._calibrations.items() if self._cal_set[k] > have}
                out["required"] = {k: r for k, r in self._required.items() if self._cal_set[k] > have}
                out["calibrations_from"] = have
            else:
                out["calibrations"] = dict(self._calibrations)
                out["required"] = dict(self._required)
        return out

    def _add(self, name: str, layout: tuple[int, int, int]) -> None:
        self._layouts[name] = layout
        self._order.append(name)
        self.version += 1

    def _set_calibration(self, name: str, record: dict[str, Any] | None, require: bool | None) -> None:
        self.calibrations_version += 1
        if record is not None:
            self._calibrations[name] = record
        if require is not None:
            self._required[name] = require
        self._cal_set[name] = self.calibrations_version


def layout_of(namespace: Any, layout: Any) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` from a sequence of three positive ints; InvalidArgument otherwise."""
    try:
        values = tuple(layout)
    except TypeError:
        values = ()
    if len(values) != 3 or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in values):
        raise InvalidArgument(f"the layout of namespace {namespace!r} must be 3 positive ints, got {layout!r}")
    return values[0], values[1], values[2]
