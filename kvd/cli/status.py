"""How kvd's status figures are shown: the per-shard table of ``kvd status`` and the live status line of
``kvd up`` (the same figures for Prometheus: kvd.cluster.metrics).

Inputs are the plain dicts the cluster hands out: a shard's ``stats()`` (``used_bytes``, ``capacity_bytes``,
``level``, ``bytes_by_level``, ...) and the coordinator's status (``level``, ``level_epoch``, ``pressure``, ...).
Missing figures print as ``-``; a shard that did not answer is ``None`` (or any non-dict) and shows as down.
Nothing here talks to the cluster; kvd.cli fetches the figures and decides when to draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvd.cluster.metrics import server_count
from kvd.config.settings import format_size

__all__ = ["calibration_table", "disk_table", "fmt_bytes", "imbalance", "serving_table", "shard_table",
           "status_line"]


# ------------------------------------------------------------------------------------------------ display


def fmt_bytes(n: Any) -> str:
    """A byte count without the space (``"1.50GiB"``), or ``"-"`` for None."""
    return "-" if n is None else format_size(float(n)).replace(" ", "")


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _by_level(stats: dict[str, Any]) -> str:
    parts = [f"{k}:{fmt_bytes(v)}" for k, v in sorted((stats.get("bytes_by_level") or {}).items()) if v]
    return " ".join(parts) or "-"


def _rate(stats: dict[str, Any]) -> str:
    for key in ("requests_per_s", "server_requests_per_s"):
        if isinstance(stats.get(key), (int, float)):
            return f"{stats[key]:.0f}"
    return "-"


def _level(stats: dict[str, Any]) -> str:
    level = str(stats.get("level", "-"))
    return f"{level}*" if stats.get("ahead") else level  # * = ahead of the cluster under its own pressure


def shard_table(shards: Sequence[tuple[str, dict[str, Any] | None]]) -> str:
    """The per-shard table of ``kvd status``: ``shards`` is ``[(shard_id, stats or None if down)]``; below it,
    each shard's reason for its level and how evenly routing fills the shards."""
    headers = ["shard", "level", "epoch", "pressure", "used", "capacity", "bytes by level", "tokens",
               "sequences", "compactions", "evictions", "refusals", "req/s"]
    rows, notes = [], []
    for sid, s in shards:
        if s is None:
            rows.append([sid, "DOWN", *["-"] * (len(headers) - 2)])
            continue
        rows.append([
            sid, _level(s), s.get("epoch", "-"), f"{float(s.get('pressure', 0.0)):.3f}",
            fmt_bytes(s.get("used_bytes")), fmt_bytes(s.get("capacity_bytes")), _by_level(s),
            s.get("tokens", "-"), s.get("sequences", "-"), s.get("recompressed_pages", "-"),
            s.get("evictions", "-"), s.get("refusals", "-"), _rate(s),
        ])
        if s.get("level_reason"):
            notes.append(f"  {sid}: {s['level_reason']}")
    out = _table(headers, rows)
    if any(isinstance(s, dict) and s.get("ahead") for _, s in shards):
        out += "\n* ahead of the cluster: the shard compressed its own pages to make room (kvd.store.compact)"
    good = [s for _, s in shards if isinstance(s, dict)]
    if good:
        balance = imbalance(good)
        out += "\nfullest shard / mean pressure: " + (
            f"{balance:.2f} (1.00 = routing fills the shards evenly)" if balance is not None else "- (empty)"
        )
    if notes:
        out += "\nwhy each level:\n" + "\n".join(notes)
    disk = disk_table(shards)
    if disk:
        out += "\n\ndisk tier (spilled sequences, counts since each shard started):\n" + disk
    serving = serving_table(shards)
    if serving:
        out += "\n\nserving (counts since each shard started):\n" + serving
    calibration = calibration_table(shards)
    if calibration:
        out += "\n\nnamespaces and their calibration (kvd calibrate):\n" + calibration
    return out


def calibration_table(shards: Sequence[tuple[str, dict[str, Any] | None]]) -> str:
    """Each namespace's calibration state (none, active, quarantined; missing / needed where
    ``require_calibration`` asks for one) as the shards report it (``mixed`` naming each shard's when they
    differ), whether it requires one (``yes`` / ``no``: its own setting; in parentheses: the shards'
    ``store.require_calibration``), and what each level's protection achieves against its budget on the
    sample; below it, why a calibration is not in force. Then the pages the calibrations kept raw or held at a
    less compact level. Empty when no shard reports a namespace."""
    states: dict[str, dict[str, str]] = {}
    budgets: dict[str, str] = {}
    reasons: dict[str, str] = {}
    required: dict[str, bool] = {}
    default: set[bool] = set()
    unlisted = 0
    held = raw = 0
    for sid, s in shards:
        if not isinstance(s, dict):
            continue
        for name, state in (s.get("calibration_states") or {}).items():
            states.setdefault(name, {})[sid] = str(state)
        budgets.update(s.get("calibration_budgets") or {})
        reasons.update(s.get("calibration_reasons") or {})
        required.update(s.get("calibration_required") or {})
        if isinstance(s.get("require_calibration"), bool):
            default.add(s["require_calibration"])
        unlisted = max(unlisted, int(s.get("calibration_unlisted") or 0))
        held += int(s.get("calibration_held_pages") or 0)
        raw += int(s.get("calibration_raw_pages") or 0)
    if not states:
        return ""
    rows = []
    for name in sorted(states):
        seen = states[name]
        kinds = set(seen.values())
        state = (kinds.pop() if len(kinds) == 1
                 else "mixed: " + ", ".join(f"{k} {v}" for k, v in sorted(seen.items())))
        rows.append([name, state, _requires(required.get(name), default), budgets.get(name, "-")])
    out = _table(["namespace", "calibration", "requires one", "eps_O on the sample vs budget"], rows)
    if unlisted:
        out += f"\n({unlisted} more namespaces not listed)"
    notes = [f"  {name}: {reasons[name]}" for name in sorted(reasons) if name in states]
    if notes:
        out += "\n" + "\n".join(notes)
    return out + f"\npages held back by calibrations: {held} at a less compact level, {raw} kept fp16"


def _requires(own: bool | None, default: set[bool]) -> str:
    """A namespace's ``requires one`` cell: its own setting, else the shards' in parentheses (``-``: unknown,
    ``mixed``: the shards differ)."""
    if own is not None:
        return "yes" if own else "no"
    if len(default) != 1:
        return "(mixed)" if default else "-"
    return "(yes)" if next(iter(default)) else "(no)"


def disk_table(shards: Sequence[tuple[str, dict[str, Any] | None]]) -> str:
    """Each shard's disk tier (docs/protocol.md §6.8): bytes used of its budget and by level, sequences and
    tokens there, spills (and those refused: memory then forgets), reads from disk, the disk's own LRU evictions,
    write errors with the last one. Empty when no shard has a disk tier."""
    headers = ["shard", "disk used", "disk", "by level", "sequences", "tokens", "spills", "refused", "reads",
               "evictions", "errors"]
    rows, notes = [], []
    for sid, s in shards:
        if not isinstance(s, dict) or not s.get("disk_capacity_bytes"):
            continue
        levels = " ".join(f"{k}:{fmt_bytes(v)}" for k, v in sorted((s.get("disk_bytes_by_level") or {}).items()))
        rows.append([sid, fmt_bytes(s.get("disk_used_bytes")), fmt_bytes(s.get("disk_capacity_bytes")),
                     levels or "-",
                     s.get("disk_sequences", "-"), s.get("disk_tokens", "-"), s.get("spills", "-"),
                     s.get("spill_refusals", "-"), s.get("disk_reads", "-"), s.get("disk_evictions", "-"),
                     s.get("disk_errors", "-")])
        if s.get("disk_last_error"):
            notes.append(f"  {sid}: last disk error: {s['disk_last_error']}")
    if not rows:
        return ""
    return _table(headers, rows) + ("\n" + "\n".join(notes) if notes else "")


def serving_table(shards: Sequence[tuple[str, dict[str, Any] | None]]) -> str:
    """How each shard's server copes (its ``server_*`` stats, docs/protocol.md §6.8): requests queued now and on
    the large-request lane, Busy replies (the queue was full: clients retried), error replies, replies dropped
    (peer gone or not reading), peers cut (oversize message, or holding a spent budget), the TCP buffer size
    each connection asks for. Empty when no shard reports them (a store without a server)."""
    headers = ["shard", "requests", "queued", "bulk now", "bulk", "busy", "errors", "dropped", "peers cut",
               "socket buffers"]
    rows = []
    for sid, s in shards:
        if not isinstance(s, dict) or "server_requests" not in s:
            continue
        counts = [server_count(s, key) for key in ("server_requests", "server_queue_depth", "server_bulk_depth",
                                             "server_bulk_requests", "server_busy", "server_errors",
                                             "server_replies_dropped", "server_peers_cut")]
        buffer = server_count(s, "server_socket_buffer_bytes")
        rows.append([sid, *("-" if n is None else n for n in counts),
                     "autotuned" if buffer == 0 else fmt_bytes(buffer)])
    return _table(headers, rows) if rows else ""


def imbalance(stats: Sequence[dict[str, Any]]) -> float | None:
    """The fullest shard's pressure over the mean (None without shards or data)."""
    pressures = [float(s.get("pressure", 0.0)) for s in stats]
    mean = sum(pressures) / len(pressures) if pressures else 0.0
    return max(pressures) / mean if mean > 0 else None


def status_line(cluster: dict[str, Any], shards: dict[str, Any]) -> str:
    """One line for `kvd up`: ``cluster`` is the coordinator's status, ``shards`` {shard_id: stats or error}."""
    up = sum(1 for s in shards.values() if isinstance(s, dict))
    good = [s for s in shards.values() if isinstance(s, dict)]
    pressure = cluster.get("pressure")
    rps = sum(float(s.get("server_requests_per_s") or 0.0) for s in good)
    return (
        f"level {cluster['level']} (epoch {cluster['level_epoch']}) | pressure "
        f"{'-' if pressure is None else f'{pressure:.3f}'} | used {fmt_bytes(cluster.get('used_bytes'))} of "
        f"{fmt_bytes(cluster.get('capacity_bytes'))} | shards {up}/{len(shards)} up | "
        f"{sum(int(s.get('sequences', 0)) for s in good)} seqs {sum(int(s.get('tokens', 0)) for s in good)} tokens"
        f" | {rps:.0f} req/s | evictions {sum(int(s.get('evictions', 0)) for s in good)}"
        f" refusals {sum(int(s.get('refusals', 0)) for s in good)}"
        + (f" | ahead {','.join(sid for sid, s in shards.items() if isinstance(s, dict) and s.get('ahead'))}"
           if any(s.get("ahead") for s in good) else "")
    )
