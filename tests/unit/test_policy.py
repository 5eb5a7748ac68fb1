"""The pressure policy (issue 3): every rule of the EWMA + hysteresis controller, pinned."""

from __future__ import annotations

import dataclasses
import math
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.errors import ConfigError, InvalidArgument, KvdError
from kvd.policy import Level, Policy, PolicyConfig

pytestmark = pytest.mark.backend_independent  # the pressure policy: no kernel, no compiled module

# Dyadic settings so that thresholds, margins and boundaries are exact in binary floating point; with
# alpha = 1 the EWMA equals the last sample, which lets a test put s exactly on a boundary.
EXACT = dict(q8_threshold=0.5, q4_threshold=0.875, hysteresis=0.125, ewma_alpha=1.0)


def below(x: float) -> float:
    """The largest float strictly below x."""
    return float(np.nextafter(x, -math.inf))


def feed(policy: Policy, pressures: list[float]) -> list[Level]:
    return [policy.observe(p) for p in pressures]


# ----------------------------------------------------------------------------------------------- Level


def test_level_tags_factors_and_order() -> None:
    assert [lv.tag for lv in Level] == ["fp16", "q8", "fp8", "q4"]
    assert [lv.memory_factor for lv in Level] == [1.0, 0.5, 0.5, 0.25]
    assert [lv.value for lv in Level] == [0, 1, 2, 3]
    assert Level.FP16 < Level.Q8 < Level.FP8 < Level.Q4
    assert Level.Q4 > Level.FP8 >= Level.FP8 > Level.Q8 > Level.FP16
    assert sorted([Level.Q4, Level.FP16, Level.FP8, Level.Q8]) == [Level.FP16, Level.Q8, Level.FP8, Level.Q4]
    assert max(Level.Q8, Level.FP8) is Level.FP8


def test_level_is_not_an_int() -> None:
    # A Level must go on the wire as its tag, never silently as a number.
    assert Level.Q8 != 1
    with pytest.raises(TypeError):
        _ = Level.Q8 < 2  # type: ignore[operator]


def test_level_from_tag_and_parse() -> None:
    for lv in Level:
        assert Level.from_tag(lv.tag) is lv
        assert Level.from_tag(lv.tag.upper()) is lv
        assert Level.parse(lv) is lv
        assert Level.parse(lv.tag) is lv


@pytest.mark.parametrize("bad", ["q2", "", "fp8_e4m3", "int8"])
def test_level_from_tag_unknown_names_it(bad: str) -> None:
    with pytest.raises(InvalidArgument, match=repr(bad)):
        Level.from_tag(bad)
    with pytest.raises(InvalidArgument, match=repr(bad)):
        Level.parse(bad)


@pytest.mark.parametrize("bad", [1, None, 0.5])
def test_level_parse_rejects_non_strings(bad: object) -> None:
    with pytest.raises(InvalidArgument, match=type(bad).__name__):
        Level.parse(bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ PolicyConfig


def test_config_defaults() -> None:
    cfg = PolicyConfig()
    assert (cfg.q8_threshold, cfg.q4_threshold, cfg.hysteresis, cfg.ewma_alpha) == (0.80, 0.95, 0.05, 0.20)
    assert (cfg.min_level, cfg.max_level, cfg.eight_bit) == (Level.FP16, Level.Q4, Level.Q8)
    assert PolicyConfig.default() == cfg
    assert cfg.rungs == (Level.FP16, Level.Q8, Level.Q4)
    assert cfg.levels == (Level.FP16, Level.Q8, Level.Q4)


def test_config_is_frozen_and_slotted() -> None:
    cfg = PolicyConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.q8_threshold = 0.5  # type: ignore[misc]
    assert not hasattr(cfg, "__dict__")


def test_profiles() -> None:
    fp16 = PolicyConfig.fp16_only()
    assert (fp16.min_level, fp16.max_level) == (Level.FP16, Level.FP16)
    assert fp16.levels == (Level.FP16,)
    agg = PolicyConfig.aggressive()
    assert (agg.q8_threshold, agg.q4_threshold, agg.hysteresis, agg.ewma_alpha) == (0.50, 0.80, 0.05, 0.30)
    assert (agg.min_level, agg.max_level) == (Level.Q8, Level.Q4)
    assert PolicyConfig.profile("default") == PolicyConfig()
    assert PolicyConfig.profile("fp16_only") == fp16
    assert PolicyConfig.profile("aggressive") == agg


@pytest.mark.parametrize("bad", ["turbo", "", "Default", None])
def test_unknown_profile_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match=repr(bad)):
        PolicyConfig.profile(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["q8_threshold", "q4_threshold", "hysteresis", "ewma_alpha"])
@pytest.mark.parametrize("value", [-0.01, 1.01, -1.0, 2.0, math.nan, math.inf, -math.inf])
def test_config_numbers_outside_unit_interval_refused(name: str, value: float) -> None:
    kwargs = {name: value}
    if name == "q8_threshold" and value > 1:
        kwargs["q4_threshold"] = 1.0  # isolate the range check from the ordering check
    with pytest.raises(ConfigError, match=name) as info:
        PolicyConfig(**kwargs)
    assert repr(value) in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, KvdError)


@pytest.mark.parametrize("name", ["q8_threshold", "q4_threshold", "hysteresis", "ewma_alpha"])
@pytest.mark.parametrize("value", ["0.5", None, True])
def test_config_numbers_must_be_numbers(name: str, value: object) -> None:
    with pytest.raises(ConfigError, match=name):
        PolicyConfig(**{name: value})


@pytest.mark.parametrize("name", ["q8_threshold", "q4_threshold", "hysteresis", "ewma_alpha"])
def test_config_unit_interval_ends_accepted(name: str) -> None:
    # Keep q8_threshold <= q4_threshold while pushing one field to an end of [0, 1].
    low = {"q8_threshold": 0.0, name: 0.0}
    high = {"q4_threshold": 1.0, name: 1.0}
    assert getattr(PolicyConfig(**low), name) == 0.0
    assert getattr(PolicyConfig(**high), name) == 1.0


def test_config_numbers_normalised_to_float() -> None:
    cfg = PolicyConfig(q8_threshold=np.float32(0.5), q4_threshold=1, hysteresis=0, ewma_alpha=np.float64(0.25))
    assert all(
        type(getattr(cfg, n)) is float for n in ("q8_threshold", "q4_threshold", "hysteresis", "ewma_alpha")
    )
    assert (cfg.q8_threshold, cfg.q4_threshold, cfg.hysteresis, cfg.ewma_alpha) == (0.5, 1.0, 0.0, 0.25)


def test_q4_threshold_below_q8_threshold_refused() -> None:
    with pytest.raises(ConfigError, match="q4_threshold") as info:
        PolicyConfig(q8_threshold=0.9, q4_threshold=0.85)
    assert "0.85" in str(info.value) and "0.9" in str(info.value)
    assert PolicyConfig(q8_threshold=0.9, q4_threshold=0.9).q4_threshold == 0.9  # equal is allowed


@pytest.mark.parametrize(
    ("min_level", "max_level"),
    [(Level.Q4, Level.FP16), (Level.Q4, Level.Q8), (Level.Q8, Level.FP16), (Level.FP8, Level.Q8), ("q4", "fp8")],
)
def test_min_level_more_compact_than_max_refused(min_level: Level | str, max_level: Level | str) -> None:
    with pytest.raises(ConfigError, match="min_level") as info:
        PolicyConfig(min_level=min_level, max_level=max_level)  # type: ignore[arg-type]
    assert Level.parse(min_level).tag in str(info.value) and Level.parse(max_level).tag in str(info.value)


@pytest.mark.parametrize("bad", [Level.FP16, Level.Q4, "q4", "fp16"])
def test_eight_bit_must_be_q8_or_fp8(bad: Level | str) -> None:
    with pytest.raises(ConfigError, match="eight_bit") as info:
        PolicyConfig(eight_bit=bad)  # type: ignore[arg-type]
    assert Level.parse(bad).tag in str(info.value)


@pytest.mark.parametrize("name", ["min_level", "max_level", "eight_bit"])
def test_config_level_fields_reject_unknown_tags(name: str) -> None:
    with pytest.raises(ConfigError, match=f"{name}.*'q3'"):
        PolicyConfig(**{name: "q3"})


def test_config_level_fields_accept_tags() -> None:
    cfg = PolicyConfig(min_level="q8", max_level="q4", eight_bit="fp8")  # type: ignore[arg-type]
    assert (cfg.min_level, cfg.max_level, cfg.eight_bit) == (Level.Q8, Level.Q4, Level.FP8)
    assert cfg.rungs == (Level.FP16, Level.FP8, Level.Q4)
    assert cfg.levels == (Level.FP8, Level.Q4)


def test_policy_rejects_non_config() -> None:
    with pytest.raises(ConfigError):
        Policy({"q8_threshold": 0.5})  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- Issue scenarios


def test_sustained_pressure_climbs_to_eight_bit_then_q4() -> None:
    policy = Policy()
    assert policy.level is Level.FP16
    seen = feed(policy, [0.85] * 20)
    assert seen[-1] is Level.Q8
    assert Level.Q4 not in seen
    seen = feed(policy, [0.98] * 50)
    assert seen[-1] is Level.Q4
    assert seen == sorted(seen)  # a sustained rise never steps back down
    assert policy.upgrades == 2 and policy.downgrades == 0


def test_drop_returns_to_fp16() -> None:
    policy = Policy()
    feed(policy, [0.98] * 30)
    assert policy.level is Level.Q4
    seen = feed(policy, [0.05] * 30)
    assert seen[-1] is Level.FP16
    assert policy.downgrades >= 1


def test_alternating_around_q8_threshold_does_not_flap() -> None:
    policy = Policy()
    feed(policy, [0.85] * 10)
    assert policy.level is Level.Q8
    before = policy.upgrades + policy.downgrades
    seen = feed(policy, [0.78, 0.82] * 20)
    transitions = sum(1 for a, b in zip([Level.Q8, *seen[:-1]], seen, strict=True) if a is not b)
    assert transitions < 10
    assert policy.upgrades + policy.downgrades - before == transitions
    # Stronger than the bound: the EWMA stays inside the margin, so the rung holds throughout.
    assert set(seen) == {Level.Q8}


def test_fp16_only_never_moves() -> None:
    policy = Policy(PolicyConfig.fp16_only())
    assert feed(policy, [1.0] * 100) == [Level.FP16] * 100
    assert policy.pressure == 1.0
    assert (policy.upgrades, policy.downgrades, policy.samples) == (0, 0, 100)


def test_aggressive_starts_at_eight_bit_and_reaches_q4() -> None:
    policy = Policy(PolicyConfig.aggressive())
    assert policy.level is Level.Q8
    seen = feed(policy, [0.95] * 20)
    assert seen[-1] is Level.Q4
    # and never below its floor, even at zero pressure
    assert set(feed(policy, [0.0] * 50)) <= {Level.Q8, Level.Q4}
    assert policy.level is Level.Q8


@pytest.mark.timeout(60)
def test_threads_count_every_sample() -> None:
    policy = Policy()
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            barrier.wait()
            rng = np.random.default_rng(seed)
            for p in rng.uniform(0.0, 1.0, size=100):
                assert policy.observe(float(p)) in PolicyConfig().levels
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    assert not any(t.is_alive() for t in threads)
    assert policy.samples == 800
    snap = policy.snapshot()
    assert snap["samples"] == 800
    # Each transition is counted once and the walk starts at fp16, so the net count is the final rung.
    rung = PolicyConfig().rungs.index(policy.level)
    assert snap["upgrades"] - snap["downgrades"] == rung


# --------------------------------------------------------------------------------------------- EWMA


def test_first_sample_sets_ewma_directly() -> None:
    policy = Policy()
    assert policy.samples == 0
    assert policy.pressure == 0.0  # documented value before the first sample
    assert policy.observe(0.9) is Level.Q8  # s = 0.9, not 0.2 * 0.9
    assert policy.pressure == 0.9
    assert policy.samples == 1


def test_ewma_matches_hand_computed_sequence() -> None:
    policy = Policy()  # alpha 0.20
    # s1 = 0.5; s2 = 0.2*1.0 + 0.8*0.5 = 0.6; s3 = 0.2*0 + 0.8*0.6 = 0.48; s4 = 0.2*0.25 + 0.8*0.48 = 0.434
    # s5 = 0.2*0.9 + 0.8*0.434 = 0.5272
    expected = [0.5, 0.6, 0.48, 0.434, 0.5272]
    got = []
    for p in [0.5, 1.0, 0.0, 0.25, 0.9]:
        policy.observe(p)
        got.append(policy.pressure)
    assert got == pytest.approx(expected, abs=1e-12)


def test_ewma_alpha_from_config() -> None:
    policy = Policy(PolicyConfig(ewma_alpha=0.5))
    feed(policy, [0.2, 0.6, 1.0])
    # 0.2 -> 0.5*0.6 + 0.5*0.2 = 0.4 -> 0.5*1.0 + 0.5*0.4 = 0.7
    assert policy.pressure == pytest.approx(0.7, abs=1e-12)


def test_alpha_zero_freezes_ewma_at_first_sample() -> None:
    policy = Policy(PolicyConfig(ewma_alpha=0.0))
    feed(policy, [0.3, 1.0, 1.0, 1.0])
    assert policy.pressure == 0.3
    assert policy.level is Level.FP16


@pytest.mark.parametrize(("raw", "clamped"), [(1.7, 1.0), (math.inf, 1.0), (-0.5, 0.0), (-math.inf, 0.0)])
def test_pressure_clamped_into_unit_interval(raw: float, clamped: float) -> None:
    policy = Policy()
    policy.observe(raw)
    assert policy.pressure == clamped
    # and clamped before smoothing: s = 0.2 * clamped + 0.8 * 0.5
    policy = Policy()
    policy.observe(0.5)
    policy.observe(raw)
    assert policy.pressure == pytest.approx(0.2 * clamped + 0.4, abs=1e-12)


def test_numpy_and_int_pressures_accepted() -> None:
    policy = Policy()
    assert policy.observe(np.float32(0.5)) is Level.FP16
    assert policy.observe(1) is Level.FP16  # s = 0.6
    assert policy.pressure == pytest.approx(0.6, abs=1e-7)


def test_nan_pressure_refused_without_touching_state() -> None:
    policy = Policy()
    feed(policy, [0.85, 0.9])
    before = policy.snapshot()
    with pytest.raises(InvalidArgument, match="nan"):
        policy.observe(math.nan)
    with pytest.raises(InvalidArgument):
        policy.observe(np.float64("nan"))
    assert policy.snapshot() == before
    policy.observe(0.5)
    assert policy.pressure == pytest.approx(0.2 * 0.5 + 0.8 * before["pressure"], abs=1e-12)


@pytest.mark.parametrize("bad", ["0.5", None, True, [0.5]])
def test_non_number_pressure_refused(bad: object) -> None:
    policy = Policy()
    with pytest.raises(InvalidArgument, match=type(bad).__name__):
        policy.observe(bad)  # type: ignore[arg-type]
    assert policy.samples == 0


# --------------------------------------------------------------------------------- Targets and hysteresis


def test_raw_target_thresholds_are_inclusive() -> None:
    policy = Policy(PolicyConfig(**EXACT))
    assert policy.observe(below(0.5)) is Level.FP16
    assert policy.observe(0.5) is Level.Q8  # s >= q8_threshold
    assert policy.observe(below(0.875)) is Level.Q8
    assert policy.observe(0.875) is Level.Q4  # s >= q4_threshold
    assert (policy.upgrades, policy.downgrades) == (2, 0)


def test_first_sample_can_jump_straight_to_q4() -> None:
    policy = Policy()
    assert policy.observe(0.98) is Level.Q4
    assert (policy.upgrades, policy.downgrades) == (1, 0)  # one transition, even across two rungs


def test_q4_hysteresis_boundary() -> None:
    policy = Policy(PolicyConfig(**EXACT))
    assert policy.observe(0.9) is Level.Q4
    assert policy.observe(0.75) is Level.Q4  # exactly q4_threshold - hysteresis: hold
    assert policy.observe(0.8) is Level.Q4  # inside the margin: hold
    assert policy.downgrades == 0
    assert policy.observe(below(0.75)) is Level.Q8  # just below the margin: q4 -> the 8-bit rung
    assert policy.downgrades == 1


def test_eight_bit_hysteresis_boundary() -> None:
    policy = Policy(PolicyConfig(**EXACT))
    assert policy.observe(0.6) is Level.Q8
    assert policy.observe(0.375) is Level.Q8  # exactly q8_threshold - hysteresis: hold
    assert policy.observe(0.45) is Level.Q8
    assert policy.downgrades == 0
    assert policy.observe(below(0.375)) is Level.FP16  # just below: step down
    assert policy.downgrades == 1


def test_no_hysteresis_on_the_way_up() -> None:
    policy = Policy(PolicyConfig(**EXACT))
    feed(policy, [0.6, 0.0])
    assert policy.level is Level.FP16
    assert policy.observe(0.45) is Level.FP16  # inside the 8-bit margin but below the threshold: no rise
    assert policy.observe(0.5) is Level.Q8


def test_fall_from_q4_below_the_8bit_margin_goes_to_fp16() -> None:
    policy = Policy(PolicyConfig(**EXACT))
    assert policy.observe(0.9) is Level.Q4
    assert policy.observe(0.3) is Level.FP16  # under q8_threshold - hysteresis = 0.375
    assert (policy.upgrades, policy.downgrades) == (1, 1)


def test_fall_from_q4_into_the_8bit_margin_stops_on_the_8bit_rung() -> None:
    # s in [q8_threshold - hysteresis, q8_threshold): the raw target is fp16, but the 8-bit band's margin holds
    # on the way down from q4 as it would from the 8-bit rung, so the level stops there instead of overshooting.
    policy = Policy(PolicyConfig(**EXACT))
    assert policy.observe(0.9) is Level.Q4
    assert policy.observe(below(EXACT["q8_threshold"])) is Level.Q8
    assert policy.observe(EXACT["q8_threshold"] - EXACT["hysteresis"]) is Level.Q8
    assert policy.observe(below(EXACT["q8_threshold"] - EXACT["hysteresis"])) is Level.FP16
    assert (policy.upgrades, policy.downgrades) == (1, 2)


def test_zero_hysteresis_steps_down_at_the_threshold() -> None:
    policy = Policy(PolicyConfig(q8_threshold=0.5, q4_threshold=0.875, hysteresis=0.0, ewma_alpha=1.0))
    feed(policy, [0.9])
    assert policy.observe(0.875) is Level.Q4
    assert policy.observe(below(0.875)) is Level.Q8
    assert policy.observe(0.5) is Level.Q8
    assert policy.observe(below(0.5)) is Level.FP16


# ------------------------------------------------------------------------------------------ Clamp, rung


def test_max_level_caps_the_climb() -> None:
    policy = Policy(PolicyConfig(max_level=Level.Q8))
    assert set(feed(policy, [1.0] * 30)) == {Level.Q8}
    assert (policy.upgrades, policy.downgrades) == (1, 0)


def test_min_level_is_the_floor_and_the_start() -> None:
    policy = Policy(PolicyConfig(min_level=Level.Q4))
    assert policy.level is Level.Q4
    assert set(feed(policy, [0.0] * 30)) == {Level.Q4}
    assert (policy.upgrades, policy.downgrades) == (0, 0)


def test_min_equals_max_eight_bit_pins_the_rung() -> None:
    policy = Policy(PolicyConfig(min_level=Level.Q8, max_level=Level.Q8))
    assert set(feed(policy, [0.0, 1.0, 0.5, 0.97, 0.0])) == {Level.Q8}
    assert (policy.upgrades, policy.downgrades) == (0, 0)


def test_clamp_after_hysteresis_from_floor() -> None:
    # aggressive: floor q8; from q4 a drop below 0.75 wants fp16 and is clamped to the 8-bit rung.
    policy = Policy(PolicyConfig.aggressive())
    feed(policy, [0.9])
    assert policy.level is Level.Q4
    assert policy.observe(0.0) is Level.Q8  # s = 0.3*0 + 0.7*0.9 = 0.63 < 0.75: down, raw 8-bit
    assert (policy.upgrades, policy.downgrades) == (1, 1)


def test_fp8_eight_bit_rung() -> None:
    policy = Policy(PolicyConfig(eight_bit=Level.FP8))
    seen = feed(policy, [0.85] * 10)
    assert seen[-1] is Level.FP8
    assert Level.Q8 not in seen
    assert policy.snapshot()["level"] == "fp8"
    seen = feed(policy, [0.98] * 30)
    assert seen[-1] is Level.Q4 and Level.Q8 not in seen
    seen = feed(policy, [0.0] * 30)
    assert seen[-1] is Level.FP16 and Level.Q8 not in seen


def test_fp8_hysteresis_holds_the_fp8_rung() -> None:
    policy = Policy(PolicyConfig(**EXACT, eight_bit=Level.FP8))
    assert policy.observe(0.6) is Level.FP8
    assert policy.observe(0.375) is Level.FP8
    assert policy.observe(below(0.375)) is Level.FP16


@pytest.mark.parametrize("floor", [Level.Q8, Level.FP8])
def test_min_level_names_the_eight_bit_rung(floor: Level) -> None:
    # With eight_bit = fp8, min_level q8 (or fp8) means "the 8-bit rung", which is fp8.
    policy = Policy(PolicyConfig(min_level=floor, eight_bit=Level.FP8))
    assert policy.level is Level.FP8
    assert set(feed(policy, [0.0] * 10)) == {Level.FP8}
    assert feed(policy, [1.0] * 20)[-1] is Level.Q4
    # and with q8 as the rung, min_level fp8 means q8
    policy = Policy(PolicyConfig(min_level=floor, max_level=Level.FP8))
    assert set(feed(policy, [0.0, 1.0, 0.0])) == {Level.Q8}


# ----------------------------------------------------------------------------- a step down must fit


def test_compression_the_policy_caused_does_not_step_it_down() -> None:
    """The flapping this rule ends: at q8 the bytes in use fall to 0.55 because the pages were compressed, but
    the same data would take 1.1 of the memory at fp16, so the level holds, however long."""
    policy = Policy()
    feed(policy, [0.9] * 10)
    assert policy.level is Level.Q8
    for _ in range(50):
        assert policy.observe(0.55, (1.1, 0.55, 0.34)) is Level.Q8
    assert policy.downgrades == 0
    assert policy.reason.startswith("held at q8") and "re-counted at fp16 1.000" in policy.reason


def test_a_real_drop_in_demand_steps_down_once() -> None:
    policy = Policy()
    feed(policy, [0.9] * 10)
    for _ in range(50):
        policy.observe(0.3, (0.6, 0.3, 0.19))  # sequences were dropped: even at fp16 the data fits
    assert policy.level is Level.FP16 and policy.downgrades == 1
    assert policy.reason.startswith("down to fp16") and "< 0.75" in policy.reason


def test_from_q4_the_step_down_stops_where_the_data_fits() -> None:
    policy = Policy()
    feed(policy, [1.0] * 10)
    assert policy.level is Level.Q4
    levels = {policy.observe(0.5, (0.95, 0.7, 0.5)) for _ in range(60)}
    assert levels == {Level.Q4, Level.Q8} and policy.level is Level.Q8  # fp16 would not fit, the 8-bit rung does
    assert policy.downgrades == 1


def test_one_drop_in_demand_is_one_step_down() -> None:
    """Smoothed pressure falling from q4 passes through the 8-bit band; the level waits until the smoothed and
    the newest pressure agree, then steps once, straight to where demand settled."""
    policy = Policy()
    feed(policy, [1.0] * 20)
    levels = [policy.observe(0.05, (0.1, 0.05, 0.03)) for _ in range(30)]
    assert policy.level is Level.FP16 and policy.downgrades == 1
    assert Level.Q8 not in levels
    policy = Policy()
    feed(policy, [1.0] * 20)
    for _ in range(30):
        policy.observe(0.85, (1.0, 0.85, 0.6))  # demand fell to the 8-bit band and stays
    assert policy.level is Level.Q8 and policy.downgrades == 1


def test_noise_inside_a_bands_margin_does_not_step_down() -> None:
    """At q4, pressure noisy between 0.88 and 0.99: most samples under q4's threshold (0.95), one in five even
    under its hysteresis margin (0.90), but the smoothed pressure stays inside it: q4 holds at every sample."""
    policy = Policy()
    feed(policy, [1.0] * 20)
    rng = np.random.default_rng(3)
    samples = rng.uniform(0.88, 0.99, 200)
    assert (samples < 0.90).sum() >= 20
    levels = [policy.observe(float(p), (1.0, float(p), 0.6)) for p in samples]
    assert set(levels) == {Level.Q4} and policy.downgrades == 0


def test_noise_across_a_bands_margin_steps_down_once_and_stays() -> None:
    """Noise between 0.80 and 0.99 settles below q4's margin (mean 0.895 < 0.90) and inside the 8-bit band: one
    step down, to q8, and no flapping back up however long the noise goes on."""
    policy = Policy()
    feed(policy, [1.0] * 20)
    upgrades = policy.upgrades
    rng = np.random.default_rng(3)
    levels = [policy.observe(float(p), (1.0, float(p), 0.6)) for p in rng.uniform(0.80, 0.99, 200)]
    first = levels.index(Level.Q8)
    assert set(levels[:first]) == {Level.Q4} and set(levels[first:]) == {Level.Q8}
    assert policy.downgrades == 1 and policy.upgrades == upgrades


def test_without_a_recount_the_seed_rules_hold() -> None:
    """Passing the measured pressure as every re-count is the seed policy, sample for sample."""
    rng = np.random.default_rng(5)
    samples = list(rng.uniform(0, 1, 400))
    a, b = Policy(), Policy()
    assert [a.observe(p) for p in samples] == [b.observe(p, (p, p, p)) for p in samples]


def test_recounts_are_checked_like_pressure() -> None:
    policy = Policy()
    with pytest.raises(InvalidArgument, match="at_rungs"):
        policy.observe(0.5, (0.5, float("nan"), 0.5))
    with pytest.raises(InvalidArgument, match="3 pressures"):
        policy.observe(0.5, (0.5, 0.5))  # type: ignore[arg-type]
    assert policy.samples == 0
    policy.observe(0.5, (7.0, 0.5, 0.5))  # a re-count above 1 is a full store: clamped
    assert policy.snapshot()["pressure_at_rungs"] == [1.0, 0.5, 0.5]


# ---------------------------------------------------------------------------------------- reset, snapshot


def test_reset_returns_to_start() -> None:
    policy = Policy(PolicyConfig.aggressive())
    feed(policy, [0.95] * 5 + [0.0] * 5)
    assert policy.samples == 10 and policy.upgrades == 1 and policy.downgrades == 1
    policy.reset()
    assert policy.level is Level.Q8
    assert (policy.samples, policy.upgrades, policy.downgrades, policy.pressure) == (0, 0, 0, 0.0)
    assert policy.snapshot() == {"level": "q8", "pressure": 0.0, "samples": 0, "upgrades": 0, "downgrades": 0,
                                 "pressure_at_rungs": [0.0, 0.0, 0.0], "reason": ""}
    policy.observe(0.4)  # a first sample again: s = p
    assert policy.pressure == 0.4


def test_snapshot_is_a_plain_dict() -> None:
    policy = Policy()
    feed(policy, [0.85, 0.98])
    snap = policy.snapshot()
    assert snap == {
        "level": policy.level.tag,
        "pressure": policy.pressure,
        "samples": 2,
        "upgrades": policy.upgrades,
        "downgrades": policy.downgrades,
        "pressure_at_rungs": [policy.pressure] * 3,  # no re-count given: as measured
        "reason": policy.reason,
    }
    assert policy.reason.startswith("up to q8: smoothed pressure 0.850 >= q8_threshold 0.80")
    assert all(type(v) in (str, int, float, list) for v in snap.values())
    assert policy.config == PolicyConfig()
    assert "samples=2" in repr(policy)


# ------------------------------------------------------------------------------------------- properties


@st.composite
def configs(draw: st.DrawFn) -> PolicyConfig:
    unit = st.floats(0.0, 1.0)
    q8, q4 = sorted((draw(unit), draw(unit)))
    lo, hi = sorted((draw(st.sampled_from(list(Level))), draw(st.sampled_from(list(Level)))))
    return PolicyConfig(
        q8_threshold=q8,
        q4_threshold=q4,
        hysteresis=draw(unit),
        ewma_alpha=draw(unit),
        min_level=lo,
        max_level=hi,
        eight_bit=draw(st.sampled_from([Level.Q8, Level.FP8])),
    )


@settings(max_examples=300, deadline=None)
@given(
    cfg=configs(),
    pressures=st.lists(
        st.floats(allow_nan=False, min_value=-2.0, max_value=2.0)
        | st.sampled_from([math.inf, -math.inf, 0.0, 1.0]),
        max_size=60,
    ),
)
def test_random_sequences_stay_in_bounds_and_count_transitions(cfg: PolicyConfig, pressures: list[float]) -> None:
    policy = Policy(cfg)
    rung = cfg.rungs.index
    lo, hi = rung(cfg.levels[0]), rung(cfg.levels[-1])
    prev = policy.level
    assert prev is cfg.levels[0]
    ups = downs = 0
    for p in pressures:
        level = policy.observe(p)
        s = policy.pressure
        assert level is policy.level
        assert level in cfg.rungs and lo <= rung(level) <= hi
        assert 0.0 <= s <= 1.0
        if level > prev:
            ups += 1
            # a rise is driven by the raw target, never by hysteresis
            assert s >= (cfg.q4_threshold if level is Level.Q4 else cfg.q8_threshold)
        elif level < prev:
            downs += 1
            # a fall only once s is below the margin of the rung left
            assert s < (cfg.q4_threshold if prev is Level.Q4 else cfg.q8_threshold) - cfg.hysteresis
        prev = level
    assert (policy.upgrades, policy.downgrades, policy.samples) == (ups, downs, len(pressures))
