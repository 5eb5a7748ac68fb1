"""What a namespace's calibration (:mod:`kvd.calibration`) does to the pages a store seals.

A :class:`Protection` is attached to a namespace when the store has a calibration for it, or requires one and
has none. It answers two questions for the store's sealing paths:

* :meth:`Protection.seal_fmt`: the format a page is sealed at when the level in force asks for ``fmt``. A
  calibration whose plan turns q4 off (no protection met its budget cheaply enough) seals the 8-bit format
  instead, and one that turns the 8-bit rung off seals fp16; a namespace that requires a calibration and has
  none, with raw fallback allowed, seals everything fp16 ("calibration missing").
* :meth:`Protection.layer`: a layer's page sizes and encoder arguments at a format: the calibration's raw
  (fp16) and held (8-bit) heads of that layer's keys and of its values, with the store's own ``raw_heads``.

A calibration whose layout is not the namespace's is *quarantined*: kept and reported, never applied. States
(:attr:`Protection.state`): ``active``, ``quarantined``, ``missing`` (required, none: raw fallback) and
``needed`` (required, none, fallback off: pages are compressed without it, and every append says so).

Pure: no Ray, no ZeroMQ.
"""

from __future__ import annotations

import bisect
import glob
import itertools
import logging
import os
from typing import Any

import msgpack
import xxhash

from kvd.calibration import Calibration
from kvd.codec import pages
from kvd.errors import InvalidArgument
from kvd.store import pool as sp
from kvd.store.disk import files

log = logging.getLogger("kvd.store")
STATS_NAMESPACES = 256  # namespaces whose calibration state stats lists by name (the rest are counted)
CAL_SUFFIX = ".kvdcal"  # a namespace's calibration in a disk tier's directory (beside its spill files)
MAX_CAL_FILE_BYTES = 4 << 20

RAW = "fp16"

Encode = dict[str, Any]  # keyword arguments of kvd.pages.encode_into for one page
# key page bytes, value page bytes, record bytes, key page args, value page args, held
Layer = tuple[int, int, int, Encode, Encode, bool]


class Protection:
    """A namespace's calibration state and what it implies (module docstring)."""

    __slots__ = ("calibration", "state", "reason", "_layers", "_heads", "_layout", "_page_tokens", "_raw_heads",
                 "_map")

    def __init__(self, calibration: Calibration | None, *, layout: tuple[int, int, int], page_tokens: int,
                 raw_heads: tuple[int, ...], eight_bit: str, required: bool, fallback: bool) -> None:
        self.calibration = calibration
        self._layout, self._page_tokens, self._raw_heads = layout, page_tokens, raw_heads
        self._layers: dict[tuple[int, str], Layer] = {}
        self._heads: dict[str, Any] = {}
        self._map: dict[str, str] = {}
        why = calibration.mismatch(layout) if calibration is not None else ""
        if calibration is not None and not why:
            self.state, self.reason = "active", f"calibration {calibration.digest[:16]} active"
            q4, eight = calibration.plan("q4"), calibration.plan("8bit")
            if eight is not None and eight.heads is None:
                self._map.update(dict.fromkeys(("q8", "fp8_e4m3", "fp8_e5m2"), RAW))
            if q4 is not None and q4.heads is None:
                self._map["q4"] = self._map.get(eight_bit, eight_bit)
            for fmt, plan in (("q4", q4), (calibration.eight_bit, eight)):
                if plan is not None and plan.heads is not None:
                    self._heads[fmt] = plan
        elif calibration is not None:
            self.state, self.reason = "quarantined", f"quarantined: {why}"
        if calibration is None or why:
            if not required:
                self.state = self.state if calibration is not None else "none"
                self.reason = self.reason if calibration is not None else ""
            elif fallback:
                self.state = "missing" if calibration is None else self.state
                self._map.update(dict.fromkeys(("q8", "fp8_e4m3", "fp8_e5m2", "q4"), RAW))
                self.reason = ("calibration missing: pages kept fp16" if calibration is None
                               else f"{self.reason}; pages kept fp16 until a matching calibration arrives")
            else:
                self.state = "needed" if calibration is None else self.state
                self.reason = ("needs calibration: pages compressed with the default protection"
                               if calibration is None else f"{self.reason}; needs calibration")

    @property
    def applies(self) -> bool:
        """Whether sealing differs from a namespace without calibration (formats mapped or heads protected)."""
        return bool(self._map or self._heads)

    @property
    def needs(self) -> bool:
        """Whether appends should report that the namespace needs a calibration."""
        return self.state == "needed" or (self.state == "quarantined" and "needs calibration" in self.reason)

    def seal_fmt(self, fmt: str) -> str:
        return self._map.get(fmt, fmt)

    def layer(self, i: int, fmt: str) -> Layer:
        """``(key page bytes, value page bytes, record bytes, key encode args, value encode args, held)`` of
        layer ``i`` sealed at ``fmt``; ``held`` says whether the calibration protects anything in it."""
        got = self._layers.get((i, fmt))
        if got is not None:
            return got
        _, h, d = self._layout
        p = self._page_tokens
        plan = self._heads.get(fmt)
        args: list[Encode] = []
        held_any = False
        for role in pages.ROLES:
            raw: tuple[int, ...] = () if fmt == RAW else self._raw_heads
            kw: Encode = {"raw_heads": raw}
            if plan is not None:
                c_raw, held, held_fmt = plan.page(i, role, fmt)
                raw = tuple(sorted(set(raw) | set(c_raw)))
                held = tuple(x for x in held if x not in raw)
                kw = {"raw_heads": raw, "held_heads": held, "held_level": held_fmt if held else None}
                held_any |= bool(held) or len(raw) > len(self._raw_heads)
            args.append(kw)
        kb = pages.nbytes(fmt, p, h, d, role="key", **args[0])
        vb = pages.nbytes(fmt, p, h, d, role="value", **args[1])
        got = self._layers[(i, fmt)] = (kb, vb, kb + vb + sp.TRAILER_BYTES, args[0], args[1], held_any)
        return got

    def reasons(self, rec: Any, fmt: str) -> list[str]:
        """What :meth:`kvd.store.Store.explain` says about a page: the namespace's calibration state, and, for
        the sealed record ``rec`` (None: the hot tail) at ``fmt``, the heads its own page headers keep fp16
        beyond the store's ``raw_heads`` or hold at a less compact level (a page sealed before the calibration
        arrived has none)."""
        out = [self.reason] if self.reason else []
        if rec is None or fmt == RAW:
            return out
        kb, vb = record_sizes(rec)
        mv = memoryview(rec)
        for role, page in zip(pages.ROLES, (mv[:kb], mv[kb:kb + vb]), strict=True):
            head = pages.header(page)
            raw = [j for j in head.raw_heads if j not in self._raw_heads]
            if raw:
                out.append(f"{role} heads {raw} kept fp16 by the calibration")
            if head.held_heads:
                out.append(f"{role} heads {list(head.held_heads)} held at {head.held_level} by the calibration")
        return out

    def describe(self) -> dict[str, Any]:
        """The state as ``kvd status`` and ``stats`` show it."""
        cal = self.calibration
        out: dict[str, Any] = {"state": self.state, "reason": self.reason}
        if cal is not None:
            out["digest"] = cal.digest
            out["model"] = cal.model
            out["levels"] = {lv: {"budget": p.budget, "mean": p.mean, "worst": p.worst, "bits": p.bits,
                                  "met": p.heads is not None and p.mean <= p.budget, "off": p.off,
                                  "protected": p.protected}
                             for lv, p in sorted(cal.plans.items())}
        return out


class Calibrating:
    """The store's side of calibration (a mixin of :class:`kvd.store.Store`): calibrations by namespace (one
    may arrive before its namespace is registered: it applies at registration), the policy options, and the
    counters of pages kept raw or held back."""

    require_calibration: bool
    allow_raw_fallback: bool
    page_tokens: int
    raw_heads: tuple[int, ...]
    eight_bit: str
    _lock: Any
    _ns: dict[str, Any]
    _cals: dict[str, Calibration]
    _cal_required: dict[str, bool]
    _cal_held_pages: int
    _cal_raw_pages: int

    def _init_calibrating(self, require: bool, fallback: bool) -> None:
        self.require_calibration, self.allow_raw_fallback = bool(require), bool(fallback)
        self._cals, self._cal_required = {}, {}
        self._cal_dir: str | None = None
        self._cal_held_pages = self._cal_raw_pages = 0
        # what stats lists without reading every namespace: the names with a calibration state attached
        # (ns.prot), and every registered name in order
        self._protected: set[str] = set()
        self._names: list[str] = []

    def _note_namespace(self, ns: Any) -> None:
        """(Under the lock) ``ns`` was just registered: named for stats and given its calibration state."""
        bisect.insort(self._names, ns.name)
        self._protect(ns)

    def _protect(self, ns: Any) -> None:
        """(Under the lock) attach ``ns``'s calibration state (:meth:`_protection`), or none."""
        ns.protect(self._protection(ns))
        if ns.prot is None:
            self._protected.discard(ns.name)
        else:
            self._protected.add(ns.name)

    def _protection(self, ns: Any) -> Protection | None:
        cal = self._cals.get(ns.name)
        required = self._cal_required.get(ns.name, self.require_calibration)
        if cal is None and not required:
            return None
        return Protection(cal, layout=(ns.layers, ns.heads, ns.head_dim), page_tokens=self.page_tokens,
                          raw_heads=self.raw_heads, eight_bit=self.eight_bit, required=required,
                          fallback=self.allow_raw_fallback)

    def _load_calibrations(self, directory: str, fresh: bool) -> None:
        """Calibrations a disk tier's directory keeps (``fresh``: remove them instead); a damaged file is
        removed with a warning."""
        for path in glob.glob(os.path.join(glob.escape(directory), "*" + CAL_SUFFIX)):
            try:
                if fresh:
                    raise ValueError("a fresh disk tier")
                with open(path, "rb") as f:
                    m = msgpack.unpackb(f.read(MAX_CAL_FILE_BYTES + 1), raw=False, strict_map_key=True,
                                        max_str_len=1 << 16, max_bin_len=0, max_ext_len=0,
                                        max_array_len=1 << 16, max_map_len=64)
                name, req = m["namespace"], m["require"]
                if not isinstance(name, str) or _cal_file(directory, name) != path or req not in (None, 1, 0):
                    raise ValueError("the file's name is not its namespace's")
                if m["calibration"] is not None:
                    from kvd.calibration import from_dict

                    self._cals[name] = from_dict(m["calibration"])
                if req is not None:
                    self._cal_required[name] = req
            except Exception as exc:  # noqa: BLE001 - any damage: the file goes, the store starts
                if not fresh:
                    log.warning("disk tier: removing calibration file %s: %s", path, exc)
                files.remove(path)
        self._cal_dir = directory

    def _save_calibration(self, namespace: str) -> None:
        directory = self._cal_dir
        if directory is None:
            return
        cal, require = self._cals.get(namespace), self._cal_required.get(namespace)
        if cal is None and require is None:  # nothing of its own left
            files.remove(_cal_file(directory, namespace))
            return
        body = msgpack.packb({"namespace": namespace, "calibration": cal.to_dict() if cal is not None else None,
                              "require": require}, use_bin_type=True)
        files.write_file(_cal_file(directory, namespace), [body])

    def calibrate(self, namespace: str, calibration: Calibration | dict[str, Any] | None, *,
                  require: bool | None = None) -> dict[str, Any]:
        """Give ``namespace`` a calibration (a :class:`~kvd.calibration.Calibration` or its ``to_dict``; None
        removes it) and, if ``require`` is not None, its own ``require_calibration``. Pages sealed from then on
        follow it; pages already stored keep their format until compaction re-encodes them. A calibration whose
        layout is not the namespace's is quarantined. Returns :meth:`calibration_state`."""
        from kvd.calibration import from_dict

        cal = calibration
        if cal is not None and not isinstance(cal, Calibration):
            cal = from_dict(cal)
        if not isinstance(namespace, str) or not namespace:
            raise InvalidArgument(f"namespace must be a non-empty str, got {namespace!r}")
        with self._lock:
            if cal is None:
                self._cals.pop(namespace, None)
            else:
                self._cals[namespace] = cal
            return self._apply_calibration(namespace, require)

    def require_calibration_of(self, namespace: str, require: bool | None) -> dict[str, Any]:
        """Set ``namespace``'s own ``require_calibration`` (None: the store's setting applies again), keeping
        its calibration, if any. Returns :meth:`calibration_state`."""
        if not isinstance(namespace, str) or not namespace:
            raise InvalidArgument(f"namespace must be a non-empty str, got {namespace!r}")
        with self._lock:
            if require is None:
                self._cal_required.pop(namespace, None)
            return self._apply_calibration(namespace, require)

    def _apply_calibration(self, namespace: str, require: bool | None) -> dict[str, Any]:
        """(Under the lock) ``require`` (if not None) as the namespace's own setting, then the namespace's
        calibration state saved (disk tier) and put in force for the pages sealed after it."""
        if require is not None:
            self._cal_required[namespace] = bool(require)
        self._save_calibration(namespace)
        ns = self._ns.get(namespace)
        if ns is not None:
            self._protect(ns)
        return self.calibration_state(namespace)

    def calibration_state(self, namespace: str) -> dict[str, Any]:
        """``{"state": none | active | quarantined | missing | needed, "reason", and with a calibration its
        "digest", "model" and per level "budget", "mean", "worst", "bits", "met", "off", "protected"}``;
        ``registered`` says whether the namespace is (a calibration waits for it otherwise), ``required``
        whether it requires a calibration (its own setting, else the store's)."""
        with self._lock:
            ns = self._ns.get(namespace)
            prot = ns.prot if ns is not None else None
            if prot is None:
                cal = self._cals.get(namespace)
                required = self._cal_required.get(namespace, self.require_calibration)
                state = "pending" if cal is not None else ("missing" if required else "none")
                out: dict[str, Any] = {"state": state, "reason": ""}
                if cal is not None:
                    out["digest"] = cal.digest
            else:
                out = prot.describe()
            out["registered"] = ns is not None
            out["required"] = self._cal_required.get(namespace, self.require_calibration)
            return out

    def calibrations(self) -> dict[str, dict[str, Any]]:
        """:meth:`calibration_state` of every namespace with a calibration or a requirement."""
        with self._lock:
            names = self._cals.keys() | self._protected
            return {n: self.calibration_state(n) for n in sorted(names)}

    def calibration_records(self) -> dict[str, dict[str, Any]]:
        """Every calibration this store holds, as records (:meth:`~kvd.calibration.Calibration.to_dict`) by
        namespace: what a shard hands its coordinator."""
        with self._lock:
            return {n: c.to_dict() for n, c in self._cals.items()}

    def calibration_required(self) -> dict[str, bool]:
        """Every namespace's own ``require_calibration`` (:meth:`require_calibration_of`): what a shard hands
        its coordinator with the calibrations."""
        with self._lock:
            return dict(self._cal_required)

    def needs_calibration(self, namespace: str) -> bool:
        """Whether appends to ``namespace`` should report "needs calibration"."""
        return self.calibration_notice(namespace) is not None

    def calibration_notice(self, namespace: str) -> str | None:
        """Why appends to ``namespace`` should report "needs calibration" (its calibration state's reason), or
        None when they should not. Lock-free: an append reply asks it (one dict lookup)."""
        ns = self._ns.get(namespace)
        prot = ns.prot if ns is not None else None
        return prot.reason if prot is not None and prot.needs else None

    def _calibration_stats(self) -> dict[str, Any]:
        """The counters, and by namespace (those with a calibration or a requirement first, then by name, at
        most ``STATS_NAMESPACES``; ``calibration_unlisted`` counts the rest): ``calibration_states`` (none,
        active, quarantined, missing, needed, pending), ``calibration_budgets`` (what each level's protection
        achieves on the sample against its budget), ``calibration_reasons`` (why, where not active) and
        ``calibration_required`` (the namespace's own ``require_calibration``, where it has one; the store's
        is ``require_calibration``)."""
        first = sorted(self._cals.keys() | self._protected)
        listed = first[:STATS_NAMESPACES]
        if len(listed) < STATS_NAMESPACES:
            others = (n for n in self._names if n not in self._protected and n not in self._cals)
            listed += itertools.islice(others, STATS_NAMESPACES - len(listed))
        names = len(self._names) + sum(1 for n in self._cals if n not in self._ns)
        states = {n: self.calibration_state(n) for n in listed}
        return {"calibration_held_pages": self._cal_held_pages, "calibration_raw_pages": self._cal_raw_pages,
                "require_calibration": self.require_calibration,
                "calibrated_namespaces": sum(1 for n in self._protected if self._ns[n].prot.state == "active"),
                "calibration_states": {n: s["state"] for n, s in states.items()},
                "calibration_budgets": {n: budget_text(s["levels"]) for n, s in states.items() if s.get("levels")},
                "calibration_reasons": {n: s["reason"] for n, s in states.items()
                                        if s["reason"] and s["state"] != "active"},
                "calibration_required": {n: self._cal_required[n] for n in listed if n in self._cal_required},
                "calibration_unlisted": names - len(listed)}


def budget_text(levels: dict[str, Any]) -> str:
    """A calibration state's ``levels`` in a few words: ``"8bit 0.90% <= 1.00%, q4 5.51% <= 6.00%"``, a level
    whose budget no protection meets cheaply enough ``"q4 off"``."""
    parts = []
    for name, lv in sorted(levels.items()):
        if lv.get("off"):
            parts.append(f"{name} off")
        else:
            sign = "<=" if lv.get("met") else ">"
            parts.append(f"{name} {100 * lv['mean']:.2f}% {sign} {100 * lv['budget']:.2f}%")
    return ", ".join(parts)


def _cal_file(directory: str, namespace: str) -> str:
    return os.path.join(directory, xxhash.xxh3_128_hexdigest(namespace.encode()) + CAL_SUFFIX)


def record_sizes(rec: Any) -> tuple[int, int]:
    """A record's key and value page sizes from the key page's own header (records of a calibrated namespace
    differ in size by layer and by the protection in force when they were sealed)."""
    mv = memoryview(rec)
    kb = pages.header(mv).nbytes
    return kb, len(rec) - kb - sp.TRAILER_BYTES


__all__ = ["Calibrating", "Protection", "budget_text", "record_sizes"]
