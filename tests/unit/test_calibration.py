"""Calibration (kvd.calibration): the protection chosen meets its budget on the sample as the page codec
stores it, a sensitive head is what gets protected, an unmeetable budget turns its level off, the record keeps
its digest, and bad samples get clear errors."""

from __future__ import annotations

from pathlib import Path

import msgpack
import numpy as np
import pytest

from kvd import calibration as cal
from kvd.codec import pages
from kvd.errors import InvalidArgument
from kvd.evaluate import eps_o

LAYERS, T, HQ, H, D = 3, 192, 4, 2, 32


def layers(seed: int = 0, outlier: tuple[int, int] = (1, 1)) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Random q/k/v; in layer ``outlier[0]`` head ``outlier[1]``'s keys vary by token along a few channels far
    more than elsewhere, and its queries look along them: q4 hurts that head most."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(LAYERS):
        q = rng.standard_normal((T, HQ, D))
        k = rng.standard_normal((T, H, D))
        v = rng.standard_normal((T, H, D))
        if i == outlier[0]:
            h = outlier[1]
            k[:, h, :4] *= 6
            k[:, h, 4:8] += 40 * rng.standard_normal((1, 4))
            q[:, h * (HQ // H) : (h + 1) * (HQ // H), :4] *= 3
        out.append(tuple(a.astype(np.float16) for a in (q, k, v)))
    return out  # type: ignore[return-value]


def stored_eps(sample: cal.Sample, plan: cal.LevelPlan) -> list[float]:
    """eps_O per layer with the plan's pages built here from kvd.pages (not through kvd.calibration)."""
    main = "q4" if plan.level == "q4" else "q8"
    errs = []
    for i, (q, k, v) in enumerate(sample.layers):
        dec = []
        for role, x in (("key", k), ("value", v)):
            raw, held, held_fmt = plan.page(i, role, main)
            y = x.copy()
            for a in range(64, T, 64):  # the first page holds the sink tokens: kept fp16
                y[a : a + 64] = pages.decode(pages.encode(x[a : a + 64], main, role=role, raw_heads=raw,
                                                          held_heads=held, held_level=held_fmt))
            dec.append(y)
        errs.append(eps_o(q, k, v, *dec))
    return errs


@pytest.fixture(scope="module")
def sample() -> cal.Sample:
    return cal.check_sample(layers(), model="synthetic")


@pytest.fixture(scope="module")
def errors(sample: cal.Sample) -> np.ndarray:
    return cal.measure(sample)


def test_the_sensitive_head_has_the_largest_q4_error(errors: np.ndarray) -> None:
    assert errors.shape == (LAYERS, H, 2, 3)
    assert (errors[..., 0] == 0).all()
    assert (errors[..., 1] < errors[..., 2]).all()  # 8 bits lose less than 4 everywhere
    assert np.unravel_index(np.argmax(errors[..., 0, 2]), errors.shape[:2]) == (1, 1)


def test_per_head_errors_add_up_to_the_layer_error(sample: cal.Sample, errors: np.ndarray) -> None:
    plain = cal.choose(errors, "q4", 1.0)  # met unprotected
    assert plain.protected == 0
    measured = stored_eps(sample, plain)
    np.testing.assert_allclose(plain.mean, np.mean(measured), rtol=0.02)


@pytest.mark.parametrize("level,budget_of_plain", [("q4", 0.7), ("8bit", 0.7)])
def test_the_protection_chosen_meets_its_budget_on_the_sample(sample: cal.Sample, errors: np.ndarray,
                                                             level: str, budget_of_plain: float) -> None:
    plain = np.mean(stored_eps(sample, cal.choose(errors, level, 1.0)))
    budget = budget_of_plain * plain
    plan = cal.choose_verified(sample, errors, level, budget)
    assert plan.heads is not None and not plan.off
    assert 0 < plan.protected < 2 * LAYERS * H
    measured = stored_eps(sample, plan)
    assert np.mean(measured) <= budget
    assert plan.mean == pytest.approx(np.mean(measured), rel=1e-9)
    own = cal.head_bits("q4" if level == "q4" else "q8", "key", 64, D)
    assert own < plan.bits < cal.head_bits("q8" if level == "q4" else "fp16", "key", 64, D)


def test_the_sensitive_head_is_protected_first(errors: np.ndarray) -> None:
    plan = cal.choose(errors, "q4", 0.999 * cal.choose(errors, "q4", 1.0).mean)
    assert plan.protected == 1
    assert plan.heads is not None and plan.heads[1][0][1] != "q4"  # layer 1, keys of head 1


def test_a_budget_that_cannot_be_met_turns_the_level_off(sample: cal.Sample, errors: np.ndarray) -> None:
    for level in ("q4", "8bit"):
        plan = cal.choose_verified(sample, errors, level, 0.0)
        assert plan.heads is None
        assert f"{level} is off for this namespace" in plan.off and "no protection meets" in plan.off


def test_the_record_round_trips_and_its_digest_guards_it(sample: cal.Sample) -> None:
    c = cal.calibrate(sample, budgets={"q4": 0.5 * cal.choose(cal.measure(sample), "q4", 1.0).mean, "8bit": 0.0})
    assert (c.model, c.layout, c.tokens, c.dtype) == ("synthetic", (LAYERS, H, D), T, "float16")
    assert len(c.digest) == 32
    assert c.plans["8bit"].heads is None and c.plans["q4"].heads is not None
    wire = msgpack.unpackb(msgpack.packb(c.to_dict(), use_bin_type=True), raw=False)
    back = cal.from_dict(wire)
    assert back == c
    assert c.fmt_plan("q4") is c.plans["q4"] and c.fmt_plan("q8") is c.plans["8bit"] and c.fmt_plan("fp16") is None
    wire["plans"]["q4"]["heads"][0][0][0] = "fp16"
    with pytest.raises(InvalidArgument, match="digest"):
        cal.from_dict(wire)
    with pytest.raises(InvalidArgument, match="malformed|version|map"):
        cal.from_dict({"version": 1})
    assert c.mismatch((LAYERS, H, D)) == ""
    assert "layout" in c.mismatch((LAYERS, H + 1, D))
    text = c.table()
    assert c.digest[:16] in text and "q4: budget" in text and "8bit is off" in text


@pytest.mark.parametrize("bad,match", [
    ([], "no layers"),
    ([(np.zeros((T, HQ, D)), np.zeros((T, H, D)), np.zeros((T, H, D + 1)))], "differ in shape"),
    ([(np.zeros((T, HQ, D)), np.zeros((T, H * D)), np.zeros((T, H * D)))], r"\[tokens, heads, head_dim\]"),
    ([(np.zeros((T, 3, D)), np.zeros((T, H, D)), np.zeros((T, H, D)))], "multiple of kv heads"),
    ([(np.zeros((T - 1, HQ, D)), np.zeros((T, H, D)), np.zeros((T, H, D)))], "do not fit"),
    ([(np.zeros((100, HQ, D)), np.zeros((100, H, D)), np.zeros((100, H, D)))], "at least 128"),
    ([(np.zeros((T, HQ, D)), np.full((T, H, D), np.nan), np.zeros((T, H, D)))], "finite"),
    ([(np.zeros((T, HQ, D), np.int32), np.zeros((T, H, D)), np.zeros((T, H, D)))], "floating point"),
])
def test_bad_samples_get_clear_errors(bad: list, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        cal.check_sample(bad)


def test_layers_that_disagree_are_refused() -> None:
    a, b = layers()[:2]
    with pytest.raises(InvalidArgument, match="layer 1"):
        cal.check_sample([a, (b[0], b[1][:, :1], b[2][:, :1])])


def test_samples_load_from_npz_files(tmp_path: Path) -> None:
    arrays = {f"L{i}_{x}": a for i, trio in enumerate(layers()) for x, a in zip("qkv", trio, strict=True)}
    good = tmp_path / "good.npz"
    np.savez(good, meta=np.array("Model-X, 3 layers"), **arrays)
    s = cal.load_sample(good)
    assert (s.model, s.layout, s.tokens) == ("Model-X", (LAYERS, H, D), T)
    no_q = tmp_path / "no_q.npz"
    np.savez(no_q, **{k: v for k, v in arrays.items() if k != "L1_q"})
    with pytest.raises(InvalidArgument, match="lacks L1_q"):
        cal.load_sample(no_q)
    with pytest.raises(InvalidArgument, match="no L0_k"):
        np.savez(tmp_path / "empty.npz", x=np.zeros(3))
        cal.load_sample(tmp_path / "empty.npz")
    with pytest.raises(InvalidArgument, match="cannot read"):
        cal.load_sample(tmp_path / "missing.npz")
    with pytest.raises(InvalidArgument, match="beyond the sink"):
        cal.measure(s, page_tokens=128)


def test_a_measurement_at_hand_serves_several_budgets(sample: cal.Sample, errors: np.ndarray) -> None:
    budgets = {"q4": 0.8 * cal.choose(errors, "q4", 1.0).mean, "8bit": 1.0}
    assert cal.calibrate(sample, budgets=budgets, errors=errors) == cal.calibrate(sample, budgets=budgets)
    with pytest.raises(InvalidArgument, match="do not fit"):
        cal.calibrate(sample, budgets=budgets, errors=errors[:1])
