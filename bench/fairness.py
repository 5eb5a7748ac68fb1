"""One client does not starve the others: a polite client's latency, alone and while another client floods the
same shard (``python bench/wire.py --fairness``; issue 32, section 4).

A ShardServer (fp16, 256 MiB) in a process of its own; the polite client, in this process, sends one request at
a time: a decode step (a one-token append of the 7B-class layout, 32 layers x 8 KV heads x 128: 128 KiB) and a
``lengths`` of 64 ids, in turn. A flooder in another process, one of:

* **lengths**: keeps 1,500 ``lengths`` requests of 4,096 ids each in flight on one connection (it sends 1,500,
  then one more for every reply, Busy or not);
* **lengths, elsewhere**: the same ``lengths`` flood against a second shard server on this machine, not the
  polite client's: the baseline of the same run for what sharing the machine's cores costs (this machine has
  two, for the polite client, its server, the flooder and the server it floods), apart from how the polite
  client's own server serves its peers;
* **gets, leaving**: pipelines 1,000 gets of a 1 MiB sequence, closes its connection without reading, and does
  it again on a new one at once (its "answered" column counts the gets sent): a flood of messages as fast as
  one process sends them;
* **gets, leaving 1/s**: the same, once a second (the case issue 32 measured: a client that pipelines 1,000
  gets and leaves).

Rounds of ``seconds`` alternate quiet (the polite client alone) and loaded (with the flooder); each reports the
polite client's p50 / p99 / max over its requests, and the flooder's requests answered and refused (Busy). The
goal: the loaded p99 within 2x of the quiet p99 of the same run.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np
import zmq

from kvd.client import Client
from kvd.wire import protocol as p

NS = "fair"
LAYOUT = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128}
FLOOD_LENGTHS, LENGTHS_IDS = 1500, 4096
FLOOD_GETS, GET_TOKENS = 1000, 1024  # 1 MiB of keys and values: 2 layers x 1024 tokens x 8 heads x 128 x 2 B x 2
GET_NS = "fair-get"
GET_LAYOUT = {"num_layers": 2, "num_kv_heads": 8, "head_dim": 128}


def _server(conn: Any, variant: str | None = None) -> None:
    from kvd.store import Store
    from kvd.wire.server import ShardServer

    if variant is not None:  # "N[-rule...]": N messages read a turn (the loop reads the constant every turn), and
        import kvd.wire.server.admission as admission  # "rotation": a peer that had nothing queued joins the back
        import kvd.wire.server.loop as loop  # of the rotation; "sliceK": lookups in slices of K ids (4096: whole);
        import kvd.wire.server.shard as shard

        batch, *rules = variant.split("-")  # "whileK": K messages read a turn while a lookup runs in slices
        loop.DRAIN_BATCH = int(batch)
        for rule in rules:
            if rule.startswith("slice") and rule[5:].isdigit():
                shard.LOOKUP_SLICE = int(rule[5:])
            elif rule.startswith("while") and rule[5:].isdigit():
                loop.DRAIN_WHILE_SLICING = int(rule[5:])
            elif rule == "rotation":
                def behind(self: Any, ahead: Any = admission.Admission.take) -> Any:
                    while self._fresh:
                        self._turns.append(self._fresh.popleft())
                    return ahead(self)

                admission.Admission.take = behind
            else:
                raise SystemExit(f"unknown loop variant {variant!r}")

    server = ShardServer(Store(256 << 20, eviction="lru", max_level="fp16"), shard_id="fair")
    conn.send(server.start())
    conn.recv()
    conn.send(server.metrics())
    server.stop()


def _flood(endpoint: str, kind: str, stop: Any, out: Any) -> None:
    ctx = zmq.Context()
    answered = busy = 0
    try:
        if kind == "lengths":
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            frames = p.encode_request(p.LengthsRequest(request_id=1, namespace=NS,
                                                       seq_ids=tuple(f"x{j}" for j in range(LENGTHS_IDS))))
            for _ in range(FLOOD_LENGTHS):
                sock.send_multipart(frames)
            while not stop.is_set():
                if not sock.poll(100):
                    continue
                reply = p.decode_reply(sock.recv_multipart())
                answered += 1
                busy += isinstance(reply, p.ErrorReply)
                sock.send_multipart(frames)
            sock.close(0)
        else:
            frames = p.encode_request(p.GetRequest(request_id=1, namespace=GET_NS, seq_id="big"))
            while not stop.is_set():
                started = time.monotonic()
                once = zmq.Context()
                sock = once.socket(zmq.DEALER)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.connect(endpoint)
                for _ in range(FLOOD_GETS):
                    sock.send_multipart(frames)
                sock.close(linger=5000)
                once.term()  # returns once the requests have left; then the connection is gone
                answered += FLOOD_GETS
                if kind == "gets1":
                    stop.wait(max(0.0, 1.0 - (time.monotonic() - started)))
    finally:
        ctx.destroy(linger=0)
        out.send((answered, busy))


def _polite(client: Client, seconds: float) -> list[float]:
    one = np.ones((LAYOUT["num_layers"], 1, LAYOUT["num_kv_heads"], LAYOUT["head_dim"]), np.float16)
    ids = [f"d{i}" for i in range(64)]
    lat: list[float] = []
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        t0 = time.perf_counter()
        if i % 2:
            client.lengths(NS, ids)
        else:
            client.append(NS, f"d{(i // 2) % 64}", one, one)
        lat.append(time.perf_counter() - t0)
        i += 1
        if i % 2048 == 0:
            for seq in ids:
                client.drop(NS, seq)
    return lat


# (the table's name, the flooder's kind, whether it floods the second server)
FLOODS = (("lengths", "lengths", False), ("lengths, elsewhere", "lengths", True),
          ("gets, leaving 1/s", "gets1", False), ("gets, leaving", "gets", False))


def fairness_only(seconds: float, rounds: int) -> int:
    ctx = mp.get_context("spawn")
    servers, endpoints = [], []
    for _ in range(2):  # the polite client's, and the one the "elsewhere" flood hits
        parent, child = ctx.Pipe()
        server = ctx.Process(target=_server, args=(child,), daemon=True)
        server.start()
        servers.append((server, parent))
        endpoints.append(parent.recv())
    endpoint, elsewhere = endpoints
    rows: list[tuple[str, str, list[float], tuple[int, int]]] = []
    try:
        with Client(elsewhere, timeout_s=60) as other:
            other.register(NS, **LAYOUT)
        with Client(endpoint, timeout_s=60) as client:
            client.register(NS, **LAYOUT)
            client.register(GET_NS, **GET_LAYOUT)
            rng = np.random.default_rng(0)
            big = rng.standard_normal((2, GET_TOKENS, 8, 128), dtype=np.float32).astype(np.float16)
            client.append(GET_NS, "big", big, big)
            _polite(client, 1.0)  # warm up
            # in turn, so that the host's slower and faster minutes fall on each; the continuous gets flood last,
            # all its rounds: the backlog it leaves in ZeroMQ outlasts it (the quiet rounds after it say how long)
            order = [f for _ in range(rounds) for f in FLOODS[:-1]] + [FLOODS[-1]] * rounds
            for kind, flood, away in order:
                rows.append((kind, "quiet", _polite(client, seconds), (0, 0)))
                stop, (rx, tx) = ctx.Event(), ctx.Pipe(duplex=False)
                flooder = ctx.Process(target=_flood, args=(elsewhere if away else endpoint, flood, stop, tx),
                                      daemon=True)
                flooder.start()
                time.sleep(0.5)  # the flood is under way before the polite client's round starts
                lat = _polite(client, seconds)
                stop.set()
                counts = rx.recv() if rx.poll(30) else (-1, -1)
                flooder.join(10)
                if flooder.is_alive():  # the next quiet round must be quiet
                    print(f"{kind}: the flooder did not end in 10 s: killed")
                    flooder.kill()
                    flooder.join(10)
                rows.append((kind, "loaded", lat, counts))
    finally:
        metrics = {}
        for i, (server, parent) in enumerate(servers):
            parent.send("stop")
            got = parent.recv() if parent.poll(30) else {}
            if i == 0:
                metrics = got
            server.join(10)
    _report(rows, metrics, seconds)
    return 0


def _ms(lat: list[float], q: float) -> float:
    return float(np.quantile(np.asarray(lat), q)) * 1e3


def _report(rows: list[tuple[str, str, list[float], tuple[int, int]]], metrics: dict[str, Any],
            seconds: float) -> None:
    print(f"\npolite client (decode-step append 128 KiB / lengths of 64 ids, one at a time), "
          f"{seconds:.0f} s rounds")
    print(f"{'flooder':<20}{'round':<8}{'requests':>9}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}"
          f"{'flood answered':>16}{'flood busy':>12}")
    for kind, phase, lat, (answered, busy) in rows:
        flood = f"{answered:>16}{busy:>12}" if phase == "loaded" else f"{'':>16}{'':>12}"
        print(f"{kind:<20}{phase:<8}{len(lat):>9}{_ms(lat, 0.5):>9.2f}{_ms(lat, 0.99):>9.2f}"
              f"{max(lat) * 1e3:>9.1f}{flood}")
    print(f"\n{'flooder':<20}{'median quiet p99':>17}{'median loaded p99':>18}{'ratio':>7}")
    for kind in dict.fromkeys(r[0] for r in rows):
        quiet = statistics.median(_ms(r[2], 0.99) for r in rows if r[0] == kind and r[1] == "quiet")
        loaded = statistics.median(_ms(r[2], 0.99) for r in rows if r[0] == kind and r[1] == "loaded")
        print(f"{kind:<20}{quiet:>17.2f}{loaded:>18.2f}{loaded / quiet:>7.2f}")
    keys = ("busy", "busy_share", "requests_abandoned", "replies_dropped", "queue_peak")
    print("server: " + ", ".join(f"{k} {metrics.get(k)}" for k in keys))


def loop_variants(batches: list[str], seconds: float, rounds: int) -> int:
    """Variants of the loop's scheduling against the ``lengths`` flood: ``N`` messages read a turn
    (``DRAIN_BATCH``), with rules added (see :func:`_server`): ``-rotation``, a peer that had nothing queued at
    the back of the rotation instead of ahead of it; ``-sliceK``, lookups in slices of K ids (4096: whole);
    ``-whileK``, K messages read a turn while a lookup runs in slices. For each variant in turn, a fresh server,
    a quiet and a loaded round of the polite client; ``rounds`` times over, alternating."""
    ctx = mp.get_context("spawn")
    rows: list[tuple[str, list[float], list[float], tuple[int, int]]] = []
    for _ in range(rounds):
        for batch in batches:
            parent, child = ctx.Pipe()
            server = ctx.Process(target=_server, args=(child, batch), daemon=True)
            server.start()
            endpoint = parent.recv()
            try:
                with Client(endpoint, timeout_s=60) as client:
                    client.register(NS, **LAYOUT)
                    _polite(client, 0.5)  # warm up
                    quiet = _polite(client, seconds)
                    stop, (rx, tx) = ctx.Event(), ctx.Pipe(duplex=False)
                    flooder = ctx.Process(target=_flood, args=(endpoint, "lengths", stop, tx), daemon=True)
                    flooder.start()
                    time.sleep(0.5)
                    loaded = _polite(client, seconds)
                    stop.set()
                    counts = rx.recv() if rx.poll(30) else (-1, -1)
                    flooder.join(10)
                    if flooder.is_alive():
                        flooder.kill()
                        flooder.join(10)
            finally:
                parent.send("stop")
                parent.recv() if parent.poll(30) else None
                server.join(10)
            rows.append((batch, quiet, loaded, counts))
    print(f"\npolite client against a lengths flood, by the loop's scheduling, {seconds:.0f} s rounds")
    print(f"{'variant':>22}{'quiet p50':>11}{'quiet p99':>11}{'loaded n':>10}{'loaded p50':>12}{'loaded p99':>12}"
          f"{'flood answered':>16}{'flood busy':>12}")
    for batch, quiet, loaded, (answered, busy) in rows:
        print(f"{batch:>22}{_ms(quiet, 0.5):>11.2f}{_ms(quiet, 0.99):>11.2f}{len(loaded):>10}"
              f"{_ms(loaded, 0.5):>12.2f}{_ms(loaded, 0.99):>12.2f}{answered:>16}{busy:>12}")
    print(f"\n{'variant':>22}{'median loaded p50 ms':>22}{'median loaded p99 ms':>22}"
          f"{'median polite requests':>24}")
    for batch in batches:
        mine = [r for r in rows if r[0] == batch]
        print(f"{batch:>22}{statistics.median(_ms(r[2], 0.5) for r in mine):>22.2f}"
              f"{statistics.median(_ms(r[2], 0.99) for r in mine):>22.2f}"
              f"{statistics.median(len(r[2]) for r in mine):>24.0f}")
    return 0
