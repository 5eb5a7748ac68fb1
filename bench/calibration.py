"""What a calibration buys on text it was not measured on: attention error and bits per value of KV stored in a
kvd store at each level, with the default protection and with the protection a calibration chose.

    .venv-engines/bin/python bench/calibration.py capture [--tokens 1024] [--out /var/tmp/kvd-heldout]
    python bench/calibration.py measure [--heldout /var/tmp/kvd-heldout] [--q4-budget 0.06] [--q8-budget 0.01]

capture (engine venv: torch, transformers): the offline SmolLM2-135M-Instruct's queries, keys (post-RoPE) and
values over the first ``--tokens`` tokens of each of five real texts found on every Debian machine (two
licenses that are not the calibration sample's, three chapters of Python's reference), one ``.npz`` per text
(kept if already there), through :func:`kvd.integrations.capture.capture_sample`.

measure: the calibration is made from the shared sample (``$KVD_SAMPLE`` or ``shared/data``: 512 tokens of
another license text) with the budgets given; each held-out text is then appended as one sequence to a store
(64-token pages, first page fp16, the level set before the append) and read back. Reported per level and
protection: eps_O mean and worst over layers and texts (last 256 queries, causal, grouped-query; the
yardstick of kvd.evaluate), bits per value as the store counts them (``used_bytes`` per stored value: the fp16
sink page, the hot tail, page headers and metadata included) and tokens per GiB at that rate.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvd import calibration as cal  # noqa: E402
from kvd.evaluate import attention, sample_path  # noqa: E402
from kvd.store import Store  # noqa: E402

NS = "heldout"


def capture(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.engines import texts
    from kvd.integrations.capture import capture_sample
    from kvd.integrations.model import build_model_folder

    torch.set_num_threads(1)
    folder = build_model_folder()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import pydoc_data.topics as topics

    found = {n: t for n, t in texts().items() if n != "GPL-3"}  # the shared sample is the start of a license
    for name in ("specialnames", "types", "formatstrings"):  # more of Python's reference, to make five
        if len(found) < 5 and name in topics.topics:
            found[f"python:{name}"] = topics.topics[name]
    for name, text in list(found.items())[:5]:
        path = out / (name.replace(":", "_") + ".npz")
        if path.exists():
            continue
        capture_sample(model, tok, [text], tokens=args.tokens, path=path, model_id="SmolLM2-135M-Instruct")
        print(f"captured {name}: {path}")


def stored(samples: list[cal.Sample], refs: list[list[np.ndarray]], level: str,
           calibration: cal.Calibration | None) -> tuple[list[float], int, int]:
    """eps_O of every layer of every sample stored at ``level`` (with ``calibration`` if given; ``refs`` the
    attention outputs over the originals), the store's used bytes and the values stored."""
    n, h, d = samples[0].layout
    s = Store(4 << 30)
    s.register(NS, num_layers=n, num_kv_heads=h, head_dim=d)
    if calibration is not None:
        s.calibrate(NS, calibration)
    s.set_level(level, 1)
    errs, values = [], 0
    base = s.stats()["used_bytes"]
    for i, smp in enumerate(samples):
        k = np.stack([x[1] for x in smp.layers])
        v = np.stack([x[2] for x in smp.layers])
        s.append(NS, i, k, v)
        values += k.size + v.size
        gk, gv = s.get(NS, i)
        if level == "fp16":  # stored as is: no error to compute
            assert np.array_equal(gk.view(np.uint16), k.view(np.uint16))
            assert np.array_equal(gv.view(np.uint16), v.view(np.uint16))
            errs += [0.0] * n
            continue
        for j, (q, _, _) in enumerate(smp.layers):
            o = refs[i][j]
            errs.append(float(np.linalg.norm(attention(q, gk[j], gv[j]) - o) / np.linalg.norm(o)))
    return errs, s.stats()["used_bytes"] - base, values


def measure(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    sample = cal.load_sample(args.sample or sample_path())
    saved = Path(args.errors) if args.errors else None
    if saved is not None and saved.exists():
        e = np.load(saved)
    else:
        e = cal.measure(sample)
        if saved is not None:
            np.save(saved, e)
    cals = {b: cal.calibrate(sample, budgets={"8bit": args.q8_budget, "q4": b}, model="SmolLM2-135M-Instruct",
                             errors=e) for b in args.q4_budget}
    print(f"calibrations on {sample.tokens} tokens of the shared sample ({time.perf_counter() - t0:.0f} s)")
    for c in cals.values():
        for name, p in sorted(c.plans.items()):
            print(f"  {c.digest[:16]} {name}: budget {100 * p.budget:.2f}%, on the sample eps_O mean "
                  f"{100 * p.mean:.2f}% worst {100 * p.worst:.2f}%, {p.bits:.2f} bits per value of page payload, "
                  f"{p.protected} head tensors protected; {p.off or 'on'}")
    files = sorted(Path(args.heldout).glob("*.npz"))
    if not files:
        raise SystemExit(f"no held-out samples in {args.heldout}: run `bench/calibration.py capture` first")
    held = [cal.load_sample(f) for f in files]
    refs = [[attention(q, k, v) for q, k, v in smp.layers] for smp in held]
    print(f"held-out: {len(held)} texts x {held[0].tokens} tokens ({', '.join(f.stem for f in files)})\n")
    print(f"{'level':<7}{'protection':<15}{'eps_O mean':>11}{'eps_O worst':>13}{'bits/value':>12}"
          f"{'tokens/GiB':>12}{'vs q4 default' if args.q4_only else 'vs fp16':>14}")
    fp16_bits = None
    c = cals[args.q4_budget[0]]
    runs = [] if args.q4_only else [("fp16", "default", None), ("q8", "default", None), ("q8", "calibrated", c)]
    runs.append(("q4", "default", None))
    runs += [("q4", f"calib. {100 * b:.1f}%", x) for b, x in cals.items()]
    for level, label, calib in runs:
        errs, used, values = stored(held, refs, level, calib)
        bits = 8 * used / values
        fp16_bits = fp16_bits or bits
        per_token = used / (values / (2 * held[0].layout[0] * held[0].layout[1] * held[0].layout[2]))
        print(f"{level:<7}{label:<15}{100 * np.mean(errs):>10.2f}%{100 * np.max(errs):>12.2f}%{bits:>12.3f}"
              f"{(1 << 30) / per_token:>12,.0f}{fp16_bits / bits:>13.2f}x")
    if args.table:
        print("\n" + c.table())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("capture", help="capture held-out samples (engine venv)")
    a.add_argument("--tokens", type=int, default=1024)
    a.add_argument("--out", default="/var/tmp/kvd-heldout")
    m = sub.add_parser("measure", help="calibrate on the shared sample, measure on the held-out ones")
    m.add_argument("--heldout", default="/var/tmp/kvd-heldout")
    m.add_argument("--sample", type=Path, default=None)
    m.add_argument("--q4-budget", type=lambda x: [float(b) for b in x.split(",")],
                   default=[cal.DEFAULT_BUDGETS["q4"]],
                   help="the q4 budget, or several (comma-separated): one calibrated row each")
    m.add_argument("--q8-budget", type=float, default=cal.DEFAULT_BUDGETS["8bit"])
    m.add_argument("--table", action="store_true", help="also print the calibration's table")
    m.add_argument("--q4-only", action="store_true", help="only the q4 rows")
    m.add_argument("--errors", default=None, help="a .npy file to keep the sample's measured errors in (reused)")
    args = ap.parse_args(argv)
    (capture if args.cmd == "capture" else measure)(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
