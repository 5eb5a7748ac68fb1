"""The decode client of bench/cluster.py and bench/decode_tail.py: one-token appends of every layer, one at a time,
to a few sequences in rotation, each dropped and started again at a length (so a long run stays small); and the
pace of their prefill clients."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

SEQS = 8  # decode sequences appended to in rotation


def decode_steps(client: Any, ns: str, step: np.ndarray, lengths: dict[int, int], seconds: float,
                 max_tokens: int) -> list[float]:
    """Append ``step`` (keys and values ``[L, 1, H, D]``) to ``decode-0`` .. ``decode-{SEQS-1}`` in turn for
    ``seconds``; ``lengths`` (sequence index -> tokens stored) is updated in place. Returns each append's time
    in seconds."""
    lat: list[float] = []
    t_end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < t_end:
        s = i % SEQS
        i += 1
        if lengths.get(s, 0) >= max_tokens:
            client.drop(ns, f"decode-{s}")
            lengths[s] = 0
        t0 = time.perf_counter()
        client.append(ns, f"decode-{s}", step, step)
        lat.append(time.perf_counter() - t0)
        lengths[s] = lengths.get(s, 0) + 1
    return lat


class Pace:
    """Prefill client ``index`` of ``clients``'s schedule when they start ``rate`` chunks per second in all (0:
    back to back): one chunk every ``clients / rate`` seconds, the clients evenly out of phase. A chunk that is
    late starts at once and the next one an interval after it, so a slow spell is not followed by a burst."""

    def __init__(self, rate: float, clients: int, index: int, stop: Any) -> None:
        self.interval_s = clients / rate if rate else 0.0
        self.stop = stop  # an Event: set, it ends the wait
        self.next = time.perf_counter() + self.interval_s * index / clients

    def wait(self) -> bool:
        """Sleep until the next chunk is due; False if ``stop`` was set meanwhile."""
        if self.interval_s:
            delay = self.next - time.perf_counter()
            if delay > 0 and self.stop.wait(delay):
                return False
            self.next = max(self.next, time.perf_counter()) + self.interval_s
        return not self.stop.is_set()
