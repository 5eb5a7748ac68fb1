"""A store applying namespaces' calibrations (kvd.store.calibrated): per-head rungs in the pages it seals and
re-encodes, levels a calibration turns off, require_calibration with and without raw fallback, quarantine of a
calibration that does not fit, explain's reasons, the counters, and calibrations kept by the disk tier."""

from __future__ import annotations

import numpy as np
import pytest

from kvd import pages
from kvd.calibration import Calibration, LevelPlan
from kvd.store import Store

NS = "m"
L, H, D, P = 3, 4, 32, 16
MiB = 1 << 20


def kv(t: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((L, t, H, D)) * 2).astype(np.float16), rng.standard_normal((L, t, H, D)).astype(
        np.float16)


def plan(level: str, heads: list[tuple[list[str], list[str]]] | None, off: str = "") -> LevelPlan:
    rows = None if heads is None else tuple((tuple(k), tuple(v)) for k, v in heads)
    return LevelPlan(level, 0.05, rows, 0.04, 0.05, 5.5, off)


# keys of head 1 of layer 0 at q8, values of head 2 of layer 0 fp16; layer 1 untouched; layer 2 all keys q8
Q4 = [(["q4", "q8", "q4", "q4"], ["q4", "q4", "fp16", "q4"]),
      (["q4"] * 4, ["q4"] * 4),
      (["q8"] * 4, ["q4"] * 4)]
EIGHT = [(["q8"] * 4, ["q8", "q8", "q8", "fp16"]), (["q8"] * 4, ["q8"] * 4), (["q8"] * 4, ["q8"] * 4)]


def calibration(q4: list | None = Q4, eight: list | None = EIGHT, layout: tuple[int, int, int] = (L, H, D),
                q4_off: str = "", eight_off: str = "") -> Calibration:
    head = ((0.0, 0.01, 0.05), (0.0, 0.01, 0.05))
    errors = tuple(tuple(head for _ in range(layout[1])) for _ in range(layout[0]))
    plans = {"q4": plan("q4", q4, q4_off), "8bit": plan("8bit", eight, eight_off)}
    return Calibration("test-model", layout, "float16", 256, P, 4, "q8", "0", errors, plans).sealed()


def store(**opts) -> Store:
    s = Store(64 * MiB, page_tokens=P, **opts)
    s.register(NS, num_layers=L, num_kv_heads=H, head_dim=D)
    return s


def expected(x: np.ndarray, layer: int, role: str, fmt: str, protect: list | None) -> np.ndarray:
    """x [T, H, D] of one layer as the store gives it back: the sink page raw, or q8 at q4 without a calibration
    in force; full pages at fmt with the calibration's heads, the rest (hot tail)
    raw."""
    out = x.copy()
    if protect is None and x.shape[0] >= P:
        if fmt == "q4":
            out[:P] = pages.decode(pages.encode(x[:P], "q8", role=role))
    for a in range(P, x.shape[0] - x.shape[0] % P, P):
        kw = {}
        if protect is not None:
            row = protect[layer][0 if role == "key" else 1]
            kw = {"raw_heads": [j for j, f in enumerate(row) if f == "fp16"],
                  "held_heads": [j for j, f in enumerate(row) if f not in ("fp16", fmt)]}
            kw["held_level"] = "q8" if kw["held_heads"] else None
        out[a : a + P] = pages.decode(pages.encode(x[a : a + P], fmt, role=role, **kw))
    return out


def check_readback(s: Store, seq: int, k: np.ndarray, v: np.ndarray, fmt: str, protect: list | None) -> None:
    gk, gv = s.get(NS, seq)
    for i in range(L):
        np.testing.assert_array_equal(gk[i].view(np.uint16),
                                      expected(k[i], i, "key", fmt, protect).view(np.uint16))
        np.testing.assert_array_equal(gv[i].view(np.uint16),
                                      expected(v[i], i, "value", fmt, protect).view(np.uint16))


@pytest.mark.parametrize("level,fmt,protect", [("q4", "q4", Q4), ("q8", "q8", EIGHT)])
def test_a_calibrated_namespace_seals_the_heads_its_calibration_protects(level: str, fmt: str,
                                                                        protect: list) -> None:
    s = store()
    state = s.calibrate(NS, calibration())
    assert state["state"] == "active" and state["registered"]
    s.set_level(level, 1)
    k, v = kv(70)
    s.append(NS, 1, k, v)
    check_readback(s, 1, k, v, fmt, protect)
    # the pages as stored (get(format="pages")): version 2 where heads are held, and they decode to the same
    entries = s.get_pages(NS, 1)
    by_layer = {}
    for layer, t0, kp, vp in entries:
        hk, hv = pages.header(kp), pages.header(vp)
        by_layer.setdefault(layer, []).append((t0, hk, hv))
        gk, gv = s.get(NS, 1, t0, min(t0 + P, 70), layers=[layer])
        np.testing.assert_array_equal(pages.decode(kp).view(np.uint16), gk[0].view(np.uint16))
        np.testing.assert_array_equal(pages.decode(vp).view(np.uint16), gv[0].view(np.uint16))
    _, hk, hv = by_layer[0][1]  # layer 0, first page past the sink
    if fmt == "q4":
        assert (hk.version, hk.held_heads, hk.held_level, hk.raw_heads) == (2, (1,), "q8", ())
        assert (hv.version, hv.held_heads, hv.raw_heads) == (1, (), (2,))
        assert by_layer[1][1][1].version == 1 and by_layer[1][1][1].raw_heads == ()
        assert by_layer[2][1][1].held_heads == (0, 1, 2, 3)
    else:
        assert (hk.raw_heads, hv.raw_heads) == ((), (3,))
    assert s.stats()["calibration_held_pages"] > 0
    reasons = s.explain(NS, 1, 0, 20)["reasons"]
    assert any("active" in r for r in reasons)
    assert any(("held at q8" if fmt == "q4" else "kept fp16 by the calibration") in r for r in reasons)


def test_explain_names_the_protection_a_page_holds_not_the_one_in_force_now() -> None:
    s = store()
    s.set_level("q4", 1)
    k, v = kv(3 * P, seed=5)
    s.append(NS, "before", k, v)
    s.calibrate(NS, calibration())
    s.append(NS, "after", k, v)
    after = s.explain(NS, "after", 0, P + 1)["reasons"]
    assert "key heads [1] held at q8 by the calibration" in after
    assert "value heads [2] kept fp16 by the calibration" in after
    before = s.explain(NS, "before", 0, P + 1)["reasons"]  # sealed before the calibration arrived
    assert before[-1] == f"calibration {calibration().digest[:16]} active"
    assert not any("by the calibration" in r for r in before)
    assert not any("by the calibration" in r for r in s.explain(NS, "after", 1, P + 1)["reasons"])


def test_calibration_states_are_listed_in_stats_by_namespace() -> None:
    s = store()
    s.register("plain", num_layers=L, num_kv_heads=H, head_dim=D)
    s.register("wrong", num_layers=L, num_kv_heads=H, head_dim=D)
    s.calibrate(NS, calibration())
    s.calibrate("wrong", calibration(layout=(L, H, D + 1)))
    stats = s.stats()
    assert stats["calibration_states"] == {NS: "active", "plain": "none", "wrong": "quarantined"}
    assert stats["calibration_budgets"][NS] == "8bit 4.00% <= 5.00%, q4 4.00% <= 5.00%"
    assert "plain" not in stats["calibration_budgets"]
    assert "the namespace is (3, 4, 32)" in stats["calibration_reasons"]["wrong"]
    assert NS not in stats["calibration_reasons"] and stats["calibration_unlisted"] == 0


def test_compaction_re_encodes_to_the_calibrated_q4_pages() -> None:
    s = store()
    s.calibrate(NS, calibration())
    s.set_level("q8", 1)
    k, v = kv(70, seed=3)
    s.append(NS, 1, k, v)
    s.set_level("q4", 2)
    assert s.compact(1 << 30) > 0
    gk, gv = s.get(NS, 1)
    for i in range(L):
        ek = expected(expected(k[i], i, "key", "q8", EIGHT), i, "key", "q4", Q4)
        np.testing.assert_array_equal(gk[i].view(np.uint16), ek.view(np.uint16))
    assert s.stats()["compaction_backlog_bytes"] == 0


def test_a_level_the_calibration_turns_off_seals_one_rung_less_compact() -> None:
    s = store()
    s.calibrate(NS, calibration(q4=None, q4_off="no protection meets eps_O <= 1% at q4"))
    s.set_level("q4", 1)
    k, v = kv(40)
    s.append(NS, 1, k, v)
    assert {pages.header(kp).level for _, t0, kp, _ in s.get_pages(NS, 1) if 0 < t0 < 32} == {"q8"}
    check_readback(s, 1, k, v, "q8", EIGHT)
    assert s.stats()["compaction_backlog_bytes"] == 0  # q8 pages are not q4 backlog for this namespace
    state = s.calibration_state(NS)
    assert state["levels"]["q4"]["met"] is False and "at q4" in state["levels"]["q4"]["off"]


def test_require_calibration_keeps_an_uncalibrated_namespace_raw_until_one_arrives() -> None:
    s = store(require_calibration=True)
    s.set_level("q4", 1)
    k, v = kv(70)
    s.append(NS, 1, k, v)
    assert s.calibration_state(NS)["state"] == "missing"
    assert {pages.header(e[2]).level for e in s.get_pages(NS, 1)} == {"fp16"}
    np.testing.assert_array_equal(s.get(NS, 1)[0].view(np.uint16), k.view(np.uint16))
    assert "calibration missing: pages kept fp16" in s.explain(NS, 1, 1, 40)["reasons"]
    assert s.stats()["calibration_raw_pages"] == 3 * L  # rows 1..3 of every layer
    assert not s.needs_calibration(NS)
    s.calibrate(NS, calibration())
    s.compact(1 << 30)
    check_readback(s, 1, k, v, "q4", Q4)


def test_require_calibration_without_fallback_compresses_and_says_it_needs_one() -> None:
    s = store(require_calibration=True, allow_raw_fallback=False)
    s.set_level("q4", 1)
    k, v = kv(40)
    s.append(NS, 1, k, v)
    assert s.needs_calibration(NS)
    assert s.calibration_state(NS)["state"] == "needed"
    check_readback(s, 1, k, v, "q4", None)
    assert any("needs calibration" in r for r in s.explain(NS, 1, 1, 20)["reasons"])


def test_require_per_namespace_overrides_the_store() -> None:
    s = store()
    s.calibrate(NS, None, require=True)
    s.set_level("q8", 1)
    k, v = kv(40)
    s.append(NS, 1, k, v)
    assert {pages.header(e[2]).level for e in s.get_pages(NS, 1)} == {"fp16"}


def test_the_append_notice_is_the_reason_a_namespace_needs_a_calibration_until_one_fits() -> None:
    s = store(require_calibration=True, allow_raw_fallback=False)
    assert s.calibration_notice(NS) == "needs calibration: pages compressed with the default protection"
    s.calibrate(NS, calibration(layout=(L, H, D + 1)))  # quarantined: it still needs one
    notice = s.calibration_notice(NS)
    assert notice is not None and notice.startswith("quarantined: ") and notice.endswith("; needs calibration")
    assert s.needs_calibration(NS)
    s.calibrate(NS, calibration())
    assert s.calibration_notice(NS) is None and not s.needs_calibration(NS)
    assert s.calibration_notice("unregistered") is None
    # kept raw instead (fallback), or not required: nothing to report on appends
    assert store(require_calibration=True).calibration_notice(NS) is None
    assert store(allow_raw_fallback=False).calibration_notice(NS) is None


def test_a_namespaces_own_require_is_set_alone_kept_beside_its_calibration_and_listed() -> None:
    s = store(allow_raw_fallback=False)
    s.register("other", num_layers=L, num_kv_heads=H, head_dim=D)
    state = s.require_calibration_of(NS, True)
    assert (state["state"], state["required"]) == ("needed", True)
    assert s.calibration_notice(NS) is not None and s.calibration_notice("other") is None
    assert s.calibration_state("other")["required"] is False  # the store's setting
    assert s.calibrate(NS, calibration())["required"] is True  # a calibration keeps the setting
    state = s.require_calibration_of(NS, False)  # and the setting keeps the calibration
    assert (state["state"], state["digest"], state["required"]) == ("active", calibration().digest, False)
    stats = s.stats()
    assert stats["calibration_required"] == {NS: False} and stats["require_calibration"] is False
    assert s.calibration_required() == {NS: False}
    s.calibrate(NS, None)  # no calibration and not required: nothing of its own but the setting
    assert s.calibration_state(NS)["state"] == "none"
    s.require_calibration_of(NS, None)  # the store's setting again
    assert s.calibration_required() == {} and s.stats()["calibration_required"] == {}
    with pytest.raises(ValueError, match="namespace must be a non-empty str"):
        s.require_calibration_of("", True)


def test_a_namespaces_own_require_survives_a_restart_on_the_disk(tmp_path) -> None:
    def make() -> Store:
        return Store(64 * MiB, page_tokens=P, disk_path=str(tmp_path), disk_bytes=64 * MiB,
                     allow_raw_fallback=False)

    s = make()
    s.register(NS, num_layers=L, num_kv_heads=H, head_dim=D)
    s.require_calibration_of(NS, True)
    s.close()
    s2 = make()
    assert s2.calibration_required() == {NS: True}  # what a shard hands its coordinator at registration
    s2.register(NS, num_layers=L, num_kv_heads=H, head_dim=D)
    assert s2.calibration_state(NS)["state"] == "needed"
    s2.require_calibration_of(NS, None)  # nothing of its own left: its file goes
    s2.close()
    s3 = make()
    assert s3.calibration_required() == {} and s3.calibrations() == {}
    s3.close()


def test_a_calibration_of_another_layout_is_quarantined_never_applied() -> None:
    s = store()
    state = s.calibrate(NS, calibration(layout=(L, H, 2 * D)))
    assert state["state"] == "quarantined" and "layout" in state["reason"]
    assert state["digest"]
    s.set_level("q4", 1)
    k, v = kv(40)
    s.append(NS, 1, k, v)
    check_readback(s, 1, k, v, "q4", None)
    assert any("quarantined" in r for r in s.explain(NS, 1, 1, 20)["reasons"])
    r = store(require_calibration=True)  # quarantined and required: kept raw
    r.calibrate(NS, calibration(layout=(L + 1, H, D)))
    r.set_level("q4", 1)
    r.append(NS, 1, k, v)
    assert {pages.header(e[2]).level for e in r.get_pages(NS, 1)} == {"fp16"}


def test_a_calibration_given_before_its_namespace_applies_at_registration() -> None:
    s = Store(64 * MiB, page_tokens=P)
    assert s.calibrate(NS, calibration().to_dict())["state"] == "pending"
    s.register(NS, num_layers=L, num_kv_heads=H, head_dim=D)
    assert s.calibration_state(NS)["state"] == "active"
    assert s.calibrations() == {NS: s.calibration_state(NS)}


def test_a_damaged_calibration_is_refused() -> None:
    d = calibration().to_dict()
    d["model"] = "other"
    with pytest.raises(ValueError, match="digest"):
        store().calibrate(NS, d)


def test_calibrated_sequences_and_the_calibration_survive_a_restart_on_the_disk(tmp_path) -> None:
    def make() -> Store:
        return Store(64 * MiB, page_tokens=P, disk_path=str(tmp_path), disk_bytes=64 * MiB)

    s = make()
    s.register(NS, num_layers=L, num_kv_heads=H, head_dim=D)
    s.calibrate(NS, calibration())
    s.set_level("q4", 1)
    data = {i: kv(50 + 10 * i, seed=i) for i in range(3)}
    for i, (k, v) in data.items():
        s.append(NS, i, k, v)
    s.close()
    s2 = make()
    assert s2.calibration_state(NS)["state"] == "active"
    assert s2.calibration_state(NS)["digest"] == calibration().digest
    for i, (k, v) in data.items():
        check_readback(s2, i, k, v, "q4", Q4)
    s2.set_level("q4", 1)
    k, v = kv(40, seed=9)
    s2.append(NS, 9, k, v)
    check_readback(s2, 9, k, v, "q4", Q4)
    s2.close()
    s3 = Store(64 * MiB, page_tokens=P, disk_path=str(tmp_path), disk_bytes=64 * MiB, disk_fresh=True)
    assert s3.calibrations() == {}
    s3.close()


def test_require_calibration_reaches_the_store_from_toml_env_and_flags() -> None:
    from kvd.config.settings import load_config
    from kvd.errors import ConfigError

    assert load_config(env={}).store_kwargs()["require_calibration"] is False
    config = load_config(env={"KVD_STORE_REQUIRE_CALIBRATION": "1", "KVD_STORE_ALLOW_RAW_FALLBACK": "off"})
    kwargs = config.store_kwargs()
    assert kwargs["require_calibration"] is True and kwargs["allow_raw_fallback"] is False
    store = Store(1 << 20, **kwargs)
    store.register("m", num_layers=1, num_kv_heads=1, head_dim=8)
    assert store.calibration_state("m")["state"] == "needed"
    with pytest.raises(ConfigError, match="require_calibration: expected true or false"):
        load_config(env={}, overrides={"store.require_calibration": "maybe"})
