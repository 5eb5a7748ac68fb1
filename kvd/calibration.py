"""Calibration of a namespace: its model's measured attention error per layer and KV head at each level, and the
cheapest protection that keeps the error within a budget.

Theory of operation
-------------------
In grouped-query attention the output of the query heads of KV head ``h`` depends on that head's keys and values
only, so the attention error of a layer splits exactly over its KV heads, and, to within a fraction of a percent
on real KV (the key and value errors are nearly orthogonal), over the two roles::

    eps_O(layer)^2 ~ sum_(h, role) e[layer, h, role, rung(h, role)]^2
    e[l, h, role, r] = ||O_r[group h] - O[group h]|| / ||O||

where ``O_r`` is the output with that role's tensor stored at rung ``r`` (fp16, the 8-bit format, q4) the way a
store stores it (pages of ``page_tokens``, the rows holding the first ``sink_tokens`` kept fp16) and ``O`` the
output with the originals (:mod:`kvd.evaluate`: causal, last 256 queries). :func:`measure` computes ``e`` once
from a sample (five attention passes per layer); every protection's error then follows without re-encoding.

:func:`calibrate` chooses, per level, the rung of the keys and of the values of every (layer, head): all start
at the level's own rung, and while the mean over layers of ``eps_O`` exceeds the level's budget, the move (one
rung less compact, or straight to fp16) that lowers the mean most per bit it costs is taken. Keys and values
are separate pages, so holding one head's keys at 8 bits costs half of holding the head. The choice is then
measured through the page codec (:func:`verify`) and made again if that measurement exceeds the budget. A
level whose cheapest protection meeting the budget costs as many bits as the next less compact rung
unprotected buys nothing: it is *off* for the namespace (:attr:`LevelPlan.off` says why), and a store seals
its pages one rung less compact instead.

The result is a :class:`Calibration`: the errors, the protection, what it achieves on the sample, and a digest of
all of it with the model id, layout, dtype, sample size and kvd version. ``to_dict``/``from_dict`` carry it over
msgpack (the wire, the coordinator, the disk tier); ``from_dict`` checks every field and the digest.

Pure: numpy and the page codec only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import xxhash

from kvd import __version__
from kvd.codec import pages
from kvd.errors import InvalidArgument
from kvd.evaluate import N_QUERIES, attention

# Budgets on the mean eps_O over layers. 8-bit: 1% is q8's own error on the sample with the sink page (0.90%),
# so a model like the sample pays nothing and a model with outlier heads pays only for those. q4: 6% is the
# error at which q4 stays near the published 4-bit schemes on this model (KL ~ 2.9 eps^2 = 1e-2 at worst), for
# about a fifth of the heads held at 8 bits on the sample (BENCHMARKS.md "Calibration").
DEFAULT_BUDGETS = {"8bit": 0.01, "q4": 0.06}
MIN_TOKENS = 128  # a sample shorter than two default pages says little about pages sealed out of the sink
RUNGS = ("fp16", "8bit", "q4")
FORMAT_VERSION = 1


def rung_formats(eight_bit: str) -> tuple[str, str, str]:
    """The page format of each rung (fp16, the 8-bit format, q4)."""
    if eight_bit not in ("q8", "fp8_e4m3", "fp8_e5m2"):
        raise InvalidArgument(f"eight_bit must be q8, fp8_e4m3 or fp8_e5m2, got {eight_bit!r}")
    return ("fp16", eight_bit, "q4")


# ---------------------------------------------------------------------------------------------------------
# samples


@dataclass(frozen=True, slots=True)
class Sample:
    """A model's real KV: per layer ``(q [T, Hq, D], k [T, H, D], v [T, H, D])`` float16, keys post-RoPE."""

    layers: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]
    model: str
    dtype: str

    @property
    def layout(self) -> tuple[int, int, int]:
        _, k, _ = self.layers[0]
        return (len(self.layers), k.shape[1], k.shape[2])

    @property
    def tokens(self) -> int:
        return int(self.layers[0][1].shape[0])


def check_sample(layers: Sequence[tuple[Any, Any, Any]], *, model: str = "", dtype: str = "float16",
                 min_tokens: int = MIN_TOKENS) -> Sample:
    """A :class:`Sample` from per-layer ``(q, k, v)``; InvalidArgument naming what is wrong (no layers, a shape
    that is not ``[T, Hq, D]`` / ``[T, H, D]``, layers that disagree, ``Hq`` not a multiple of ``H``, fewer
    than ``min_tokens`` tokens, NaN or Inf)."""
    if not layers:
        raise InvalidArgument("the sample has no layers")
    out = []
    ref: tuple[int, ...] | None = None
    for i, trio in enumerate(layers):
        if len(trio) != 3:
            raise InvalidArgument(f"layer {i} of the sample must be (queries, keys, values)")
        arrs = []
        for name, a in zip(("queries", "keys", "values"), trio, strict=True):
            a = np.asarray(a)
            if a.ndim != 3:
                raise InvalidArgument(f"layer {i} {name} must be [tokens, heads, head_dim], got shape {a.shape}")
            if a.dtype.kind != "f":
                raise InvalidArgument(f"layer {i} {name} must be floating point, got {a.dtype}")
            if not np.isfinite(a).all():
                bad = tuple(int(x) for x in np.argwhere(~np.isfinite(a))[0])
                raise InvalidArgument(f"layer {i} {name}{list(bad)} is {float(a[bad])}: the sample must be finite")
            arrs.append(pages.as_f16(a.astype(np.float32) if a.dtype == np.float64 else a, f"layer {i} {name}"))
        q, k, v = arrs
        if k.shape != v.shape:
            raise InvalidArgument(f"layer {i}: keys {k.shape} and values {v.shape} differ in shape")
        if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
            raise InvalidArgument(
                f"layer {i}: queries {q.shape} do not fit keys {k.shape} (same tokens and head_dim, query heads "
                "a multiple of kv heads)"
            )
        shape = (q.shape[1], *k.shape)
        if ref is None:
            ref = shape
        elif shape != ref:
            raise InvalidArgument(f"layer {i} has shapes {shape[1:]} / {shape[0]} query heads, layer 0 {ref}")
        out.append((q, k, v))
    assert ref is not None
    if ref[1] < min_tokens:
        raise InvalidArgument(f"the sample has {ref[1]} tokens; a calibration needs at least {min_tokens}")
    return Sample(tuple(out), model, dtype)


def load_sample(path: str | Path, *, min_tokens: int = MIN_TOKENS) -> Sample:
    """A sample from an ``.npz`` with ``L{i}_q``, ``L{i}_k``, ``L{i}_v`` per layer and an optional ``meta``
    string (its text up to the first comma is the model id), as :func:`kvd.evaluate.load_sample` reads."""
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read the sample {str(path)!r}: {exc}") from None
    with data:
        names = set(data.files)
        n = 0
        while f"L{n}_k" in names:
            n += 1
        if n == 0:
            raise InvalidArgument(
                f"the sample {str(path)!r} has no L0_k array (expected L{{i}}_q, L{{i}}_k, L{{i}}_v)"
            )
        missing = [f"L{i}_{x}" for i in range(n) for x in "qkv" if f"L{i}_{x}" not in names]
        if missing:
            raise InvalidArgument(f"the sample {str(path)!r} lacks {', '.join(missing[:4])}")
        layers = [(data[f"L{i}_q"], data[f"L{i}_k"], data[f"L{i}_v"]) for i in range(n)]
        meta = str(data["meta"]) if "meta" in names else ""
        dtype = str(data["L0_k"].dtype)
    return check_sample(layers, model=meta.split(",")[0].strip(), dtype=dtype, min_tokens=min_tokens)


# ---------------------------------------------------------------------------------------------------------
# measurement


def _stored(x: np.ndarray, fmt: str, role: str, page_tokens: int, sink_rows: int,
            protect: tuple[tuple[int, ...], tuple[int, ...], str | None] = ((), (), None)) -> np.ndarray:
    """``x`` [T, H, D] as a store gives it back at ``fmt``: full pages encoded (the first ``sink_rows`` raw),
    the partial last page raw (the hot tail); ``protect`` = (raw heads, held heads, held format)."""
    out = x.copy()
    full = x.shape[0] // page_tokens
    raw, held, held_fmt = protect
    for r in range(sink_rows, full):
        a = r * page_tokens
        page = pages.encode(x[a : a + page_tokens], fmt, role=role, raw_heads=raw, held_heads=held,
                            held_level=held_fmt)
        out[a : a + page_tokens] = pages.decode(page)
    return out


def measure(sample: Sample, *, eight_bit: str = "q8", page_tokens: int = 64, sink_tokens: int = 4,
            n_queries: int = N_QUERIES) -> np.ndarray:
    """``e[layer, head, role, rung]`` (roles key, value; rungs fp16, 8-bit, q4): see the module docstring."""
    fmts = rung_formats(eight_bit)
    sink_rows = -(-sink_tokens // page_tokens)
    if sample.tokens < (sink_rows + 1) * page_tokens:
        raise InvalidArgument(
            f"the sample has {sample.tokens} tokens: no page of {page_tokens} tokens lies beyond the sink"
        )
    n_layers, h, _ = sample.layout
    e = np.zeros((n_layers, h, 2, len(fmts)))
    for i, (q, k, v) in enumerate(sample.layers):
        o = attention(q, k, v, n_queries)  # [n, Hq, D]
        norm = float(np.linalg.norm(o)) or 1.0
        g = q.shape[1] // h
        for r, fmt in enumerate(fmts):
            if fmt == "fp16":
                continue
            for role, kk, vv in ((0, _stored(k, fmt, "key", page_tokens, sink_rows), v),
                                 (1, k, _stored(v, fmt, "value", page_tokens, sink_rows))):
                d = (attention(q, kk, vv, n_queries) - o).reshape(o.shape[0], h, g, -1)
                e[i, :, role, r] = np.sqrt((d**2).sum(axis=(0, 2, 3))) / norm
    return e


def head_bits(fmt: str, role: str, page_tokens: int, head_dim: int) -> float:
    """Bits per value of one head's keys or values at ``fmt`` in a page of ``page_tokens`` (header excluded)."""
    n = pages.nbytes(fmt, page_tokens, 1, head_dim, role=role) - pages.HEADER_BYTES
    return 8 * n / (page_tokens * head_dim)


# ---------------------------------------------------------------------------------------------------------
# choice


@dataclass(frozen=True, slots=True)
class LevelPlan:
    """The protection of one level: ``heads[layer][role][head]`` is the page format of each head's keys (role 0)
    and values (role 1), ``None`` when the level is off; ``mean``/``worst`` the eps_O over layers on the sample,
    ``bits`` per value (pages, headers excluded), ``off`` why the level is off ('' when on)."""

    level: str
    budget: float
    heads: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] | None
    mean: float
    worst: float
    bits: float
    off: str = ""

    def page(self, layer: int, role: str, main: str) -> tuple[tuple[int, ...], tuple[int, ...], str | None]:
        """``(raw heads, held heads, held format)`` of ``layer``'s pages of ``role`` sealed at ``main``."""
        assert self.heads is not None
        row = self.heads[layer][pages.ROLES.index(role)]
        raw = tuple(j for j, f in enumerate(row) if f == "fp16")
        held = tuple(j for j, f in enumerate(row) if f not in ("fp16", main))
        return raw, held, row[held[0]] if held else None

    @property
    def protected(self) -> int:
        """Head tensors (one head's keys, or its values) not at the level's own format."""
        if self.heads is None:
            return 0
        return sum(f == "fp16" or (self.level == "q4" and f != "q4")
                   for layer in self.heads for row in layer for f in row)


def _errors(e: np.ndarray, r: np.ndarray) -> np.ndarray:
    """eps_O per layer of the rung choice ``r[layer, head, role]``."""
    return np.sqrt((np.take_along_axis(e, r[..., None], axis=3)[..., 0] ** 2).sum(axis=(1, 2)))


def choose(e: np.ndarray, level: str, budget: float, *, eight_bit: str = "q8", page_tokens: int = 64,
           head_dim: int = 64) -> LevelPlan:
    """The cheapest protection of ``level`` (``"8bit"`` or ``"q4"``) whose mean eps_O is within ``budget``."""
    if level not in RUNGS[1:]:
        raise InvalidArgument(f"level must be '8bit' or 'q4', got {level!r}")
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget >= 0):
        raise InvalidArgument(f"the budget of {level} must be a finite number >= 0, got {budget!r}")
    fmts = rung_formats(eight_bit)
    top = RUNGS.index(level)
    bits = np.array([[head_bits(f, role, page_tokens, head_dim) for f in fmts] for role in pages.ROLES])
    n_layers, h, _, _ = e.shape
    r = np.full((n_layers, h, 2), top)
    eps = _errors(e, r)
    while eps.mean() > budget and (r > 0).any():
        best, best_gain = None, 0.0
        for li, hj, role in zip(*np.nonzero(r > 0), strict=True):
            was = r[li, hj, role]
            for to in range(was):
                new = math.sqrt(max(eps[li] ** 2 - e[li, hj, role, was] ** 2 + e[li, hj, role, to] ** 2, 0.0))
                gain = (eps[li] - new) / max(bits[role, to] - bits[role, was], 1e-9)
                if best is None or gain > best_gain:
                    best, best_gain = (li, hj, role, to), gain
        assert best is not None
        r[best[:3]] = best[3]
        eps = _errors(e, r)
    cost = float(np.mean([bits[role][r[:, :, role]].mean() for role in range(2)]))
    plain = float(bits[:, top - 1].mean())
    heads = tuple((tuple(fmts[x] for x in layer[:, 0]), tuple(fmts[x] for x in layer[:, 1])) for layer in r)
    mean, worst = float(eps.mean()), float(eps.max())
    off = ""
    if cost >= plain:
        off = (f"no protection meets eps_O <= {100 * budget:.2f}% at {level} for fewer bits than {fmts[top - 1]} "
               f"({cost:.2f} >= {plain:.2f} bits per value): {level} is off for this namespace")
    return LevelPlan(level, float(budget), None if off else heads, mean, worst, cost, off)


def verify(sample: Sample, plan: LevelPlan, *, eight_bit: str = "q8", page_tokens: int = 64,
           sink_tokens: int = 4, n_queries: int = N_QUERIES) -> np.ndarray:
    """eps_O per layer of ``sample`` stored with ``plan``'s protection through the page codec (no
    approximation: what a store gives back)."""
    assert plan.heads is not None
    main = rung_formats(eight_bit)[RUNGS.index(plan.level)]
    sink_rows = -(-sink_tokens // page_tokens)
    out = []
    for i, (q, k, v) in enumerate(sample.layers):
        o = attention(q, k, v, n_queries)
        kh = _stored(k, main, "key", page_tokens, sink_rows, plan.page(i, "key", main))
        vh = _stored(v, main, "value", page_tokens, sink_rows, plan.page(i, "value", main))
        out.append(float(np.linalg.norm(attention(q, kh, vh, n_queries) - o) / (np.linalg.norm(o) or 1.0)))
    return np.array(out)


def choose_verified(sample: Sample, e: np.ndarray, level: str, budget: float, *, eight_bit: str = "q8",
                    page_tokens: int = 64, sink_tokens: int = 4) -> LevelPlan:
    """:func:`choose`, with the error of its choice measured through the page codec (:func:`verify`); where
    the measurement exceeds the budget (the key/value split is an approximation) the choice is made again
    against a budget lowered by the excess, at most three times. ``mean`` and ``worst`` are the measured ones."""
    target = budget
    d = sample.layout[2]
    for _ in range(4):
        plan = choose(e, level, target, eight_bit=eight_bit, page_tokens=page_tokens, head_dim=d)
        if plan.heads is None:
            return plan
        eps = verify(sample, plan, eight_bit=eight_bit, page_tokens=page_tokens, sink_tokens=sink_tokens)
        plan = LevelPlan(level, float(budget), plan.heads, float(eps.mean()), float(eps.max()), plan.bits)
        if plan.mean <= budget or target <= 0:
            return plan
        target = max(target * budget / plan.mean - 1e-6, 0.0)
    return LevelPlan(level, float(budget), None, plan.mean, plan.worst, plan.bits,
                     f"the protection chosen for {level} measured eps_O {100 * plan.mean:.2f}% above the budget "
                     f"{100 * budget:.2f}% after three corrections: {level} is off for this namespace")


# ---------------------------------------------------------------------------------------------------------
# the record


@dataclass(frozen=True, slots=True)
class Calibration:
    """A namespace's calibration (see the module docstring). ``errors[layer][head][rung]`` as measured;
    ``errors[layer][head][role][rung]`` as measured, ``plans`` by level (``"8bit"``, ``"q4"``); ``digest`` the
    xxh3-128 hex of everything else."""

    model: str
    layout: tuple[int, int, int]
    dtype: str
    tokens: int
    page_tokens: int
    sink_tokens: int
    eight_bit: str
    kvd_version: str
    errors: tuple[tuple[tuple[tuple[float, ...], ...], ...], ...]
    plans: Mapping[str, LevelPlan] = field(default_factory=dict)
    digest: str = ""

    def plan(self, level: str) -> LevelPlan | None:
        return self.plans.get(level)

    def fmt_plan(self, fmt: str) -> LevelPlan | None:
        """The plan of the level whose pages are ``fmt`` (None for fp16 or a format the calibration did not
        measure)."""
        if fmt == "q4":
            return self.plans.get("q4")
        if fmt == self.eight_bit:
            return self.plans.get("8bit")
        return None

    def body(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION, "model": self.model, "layout": list(self.layout), "dtype": self.dtype,
            "tokens": self.tokens, "page_tokens": self.page_tokens, "sink_tokens": self.sink_tokens,
            "eight_bit": self.eight_bit, "kvd_version": self.kvd_version,
            "errors": [[[list(r) for r in h] for h in layer] for layer in self.errors],
            "plans": {k: {"budget": p.budget,
                          "heads": None if p.heads is None else [[list(r) for r in x] for x in p.heads],
                          "mean": p.mean, "worst": p.worst, "bits": p.bits, "off": p.off}
                      for k, p in sorted(self.plans.items())},
        }  # fmt: skip

    def sealed(self) -> Calibration:
        """This record with its digest computed from its contents."""
        return Calibration(*(getattr(self, f) for f in _FIELDS[:-1]), digest=_digest(self.body()))  # type: ignore[misc]

    def to_dict(self) -> dict[str, Any]:
        return {**self.body(), "digest": self.digest}

    def table(self) -> str:
        """The errors and the protection chosen, as text (what ``kvd calibrate`` prints)."""
        fmts = rung_formats(self.eight_bit)
        lines = [f"calibration {self.digest[:16]} of {self.model or '(unnamed model)'}: layout {self.layout}, "
                 f"{self.tokens} tokens, pages of {self.page_tokens}, sink {self.sink_tokens}"]
        lines.append("eps_O per head (keys / values stored at that rung alone); protection: per head K/V formats")
        lines.append(f"{'layer':>5}  " + "  ".join(f"{f'h{j} ' + fmts[1] + ' K/V':>16}{'q4 K/V':>14}"
                                                   for j in range(self.layout[1])) + "   8bit | q4")
        for i, layer in enumerate(self.errors):
            cells = "  ".join(f"{100 * k8:>7.2f}/{100 * v8:.2f}%{100 * k4:>7.2f}/{100 * v4:.2f}%"
                              for (_, k8, k4), (_, v8, v4) in layer)
            prot = " | ".join(" ".join(f"{_short(k)}/{_short(v)}" for k, v in zip(*p.heads[i], strict=True))
                              if p.heads else "off" for _, p in sorted(self.plans.items()))
            lines.append(f"{i:>5}  {cells}   {prot}")
        for name, p in sorted(self.plans.items()):
            state = p.off or f"{p.protected} heads protected"
            lines.append(f"{name}: budget {100 * p.budget:.2f}%, eps_O mean {100 * p.mean:.2f}% worst "
                         f"{100 * p.worst:.2f}%, {p.bits:.2f} bits per value; {state}")
        return "\n".join(lines)

    def mismatch(self, layout: tuple[int, int, int]) -> str:
        """Why this calibration cannot apply to a namespace of ``layout`` ('' when it can)."""
        if tuple(layout) != tuple(self.layout):
            return (f"calibration {self.digest[:16]} was measured on layout (layers, kv_heads, head_dim) "
                    f"{tuple(self.layout)}, the namespace is {tuple(layout)}")
        return ""


def _tuples(a: Any) -> Any:
    if isinstance(a, (list, tuple, np.ndarray)):
        return tuple(_tuples(x) for x in a)
    return float(a)


def _short(fmt: str) -> str:
    return {"fp16": "16", "q8": "8", "fp8_e4m3": "e4", "fp8_e5m2": "e5", "q4": "4"}[fmt]


def _digest(body: dict[str, Any]) -> str:
    return xxhash.xxh3_128_hexdigest(msgpack.packb(body, use_bin_type=True))


def calibrate(sample: Sample, *, budgets: Mapping[str, float] | None = None, eight_bit: str = "q8",
              page_tokens: int = 64, sink_tokens: int = 4, model: str | None = None,
              errors: np.ndarray | None = None) -> Calibration:
    """Measure ``sample`` and choose each level's protection within ``budgets`` (default
    :data:`DEFAULT_BUDGETS`; keys ``"8bit"``, ``"q4"``). ``errors``: :func:`measure`'s result for this sample
    and these settings, if already at hand (several budgets, one measurement)."""
    b = dict(DEFAULT_BUDGETS if budgets is None else budgets)
    unknown = set(b) - set(RUNGS[1:])
    if unknown:
        raise InvalidArgument(f"unknown budget level {sorted(unknown)}; expected '8bit' and/or 'q4'")
    e = errors if errors is not None else measure(sample, eight_bit=eight_bit, page_tokens=page_tokens,
                                                  sink_tokens=sink_tokens)
    if e.shape != (*sample.layout[:2], 2, 3):
        raise InvalidArgument(f"errors of shape {e.shape} do not fit the sample's layout {sample.layout}")
    plans = {lv: choose_verified(sample, e, lv, bud, eight_bit=eight_bit, page_tokens=page_tokens,
                                 sink_tokens=sink_tokens) for lv, bud in b.items()}
    cal = Calibration(
        model if model is not None else sample.model, sample.layout, sample.dtype, sample.tokens, page_tokens,
        sink_tokens, eight_bit, __version__, _tuples(e),
        plans,
    )  # fmt: skip
    return cal.sealed()


_FIELDS = ("model", "layout", "dtype", "tokens", "page_tokens", "sink_tokens", "eight_bit", "kvd_version",
           "errors", "plans", "digest")


def from_dict(m: object) -> Calibration:
    """A :class:`Calibration` from :meth:`Calibration.to_dict` (msgpack-decoded); InvalidArgument for anything
    malformed or a digest that does not match."""
    try:
        return _from_dict(m)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        if isinstance(exc, InvalidArgument):
            raise
        raise InvalidArgument(f"malformed calibration: {type(exc).__name__}: {exc}") from None


def _from_dict(m: object) -> Calibration:
    if not isinstance(m, dict):
        raise InvalidArgument(f"a calibration must be a map, got {type(m).__name__}")
    if m.get("version") != FORMAT_VERSION:
        raise InvalidArgument(f"calibration format version {m.get('version')!r} is not {FORMAT_VERSION}")
    layout = tuple(int(x) for x in m["layout"])
    if len(layout) != 3 or min(layout) < 1:
        raise InvalidArgument(f"calibration layout must be 3 positive integers, got {m['layout']!r}")
    fmts = rung_formats(str(m["eight_bit"]))
    errors = _tuples(m["errors"])
    if np.shape(errors) != (layout[0], layout[1], 2, 3):
        raise InvalidArgument(f"calibration errors do not fit layout {layout}")
    plans = {}
    for lv, p in dict(m["plans"]).items():
        if lv not in RUNGS[1:]:
            raise InvalidArgument(f"calibration plan for unknown level {lv!r}")
        heads = None
        if p["heads"] is not None:
            heads = tuple((tuple(str(f) for f in x[0]), tuple(str(f) for f in x[1])) for x in p["heads"])
            allowed = set(fmts[: RUNGS.index(lv) + 1])
            if len(heads) != layout[0] or any(len(x) != 2 or any(len(r) != layout[1] or not set(r) <= allowed
                                                                  for r in x) for x in heads):
                raise InvalidArgument(f"calibration plan {lv} does not fit layout {layout} and formats {allowed}")
        plans[lv] = LevelPlan(lv, float(p["budget"]), heads, float(p["mean"]), float(p["worst"]),
                              float(p["bits"]), str(p["off"]))
    cal = Calibration(str(m["model"]), layout, str(m["dtype"]), int(m["tokens"]), int(m["page_tokens"]),  # type: ignore[arg-type]
                      int(m["sink_tokens"]), fmts[1], str(m["kvd_version"]), errors, plans, str(m["digest"]))
    if _digest(cal.body()) != cal.digest:
        raise InvalidArgument(f"calibration digest {cal.digest[:16]} does not match its contents")
    return cal


__all__ = ["Calibration", "DEFAULT_BUDGETS", "LevelPlan", "MIN_TOKENS", "Sample", "calibrate", "check_sample",
           "choose", "choose_verified", "from_dict", "head_bits", "load_sample", "measure", "rung_formats",
           "verify"]
