"""The pressure policy: memory pressure in, precision level out.

Theory of operation
-------------------
The coordinator feeds :meth:`Policy.observe` one pressure sample per report interval (bytes used / bytes of
capacity, summed over the cluster). The policy answers with the :class:`Level` new pages should be sealed at;
the coordinator broadcasts a change with a new epoch and the shards re-compress cold pages when it rises.

The controller climbs a ladder of three *rungs*: 0 = fp16, 1 = the 8-bit rung, 2 = q4. The 8-bit rung is
``PolicyConfig.eight_bit``: :attr:`Level.Q8` (default) or :attr:`Level.FP8`. Both halve memory, so a separate
fp8 step would cost accuracy and free nothing; making the rung selectable is what makes fp8 reachable.

For each sample ``p``:

1. ``p`` is clamped into [0, 1] (NaN is refused and leaves the state untouched).
2. EWMA: ``s = p`` on the first sample, else ``s = alpha * p + (1 - alpha) * s``.
3. Raw target: q4 if ``s >= q4_threshold``, else the 8-bit rung if ``s >= q8_threshold``, else fp16.
4. Hysteresis (only on the way down): from q4 the level moves down only when
   ``s < q4_threshold - hysteresis``; from the 8-bit rung it moves to fp16 only when
   ``s < q8_threshold - hysteresis``. A move down from q4 lands on the 8-bit rung while
   ``s >= q8_threshold - hysteresis`` (the 8-bit band's margin holds on the way through, so a fall from q4
   into [q8_threshold - hysteresis, q8_threshold) does not overshoot to fp16 and bounce back), and goes straight
   to fp16 below that. Moving up has no margin.
5. **A step down must fit.** Pressure measured on compressed pages falls *because* of the compression a rise
   caused; read as a drop in demand, it stepped the level straight back down, new pages went back to fp16 and
   the level flapped (q8 -> fp16 0.41 s later, in the issue that brought this rule). So a move down to rung
   ``t`` is taken only when the data, re-counted at ``t``'s density (``at_rungs[t]``: what the bytes in use
   would be if every page more compact than ``t`` were stored at ``t``; smoothed like ``s``), stays under the
   same bound as in step 4: ``q8_threshold - hysteresis`` for fp16, ``q4_threshold - hysteresis`` for the
   8-bit rung. A step down that does not fit is tried one rung higher (q4 may still go to the 8-bit rung); if
   none fits the level holds. Without ``at_rungs`` (or right after a rise, when nothing is compressed yet) the
   re-count equals ``s`` and this is step 4 exactly: the seed policy's semantics where there is no conflict.
6. Clamp into [min_level, max_level] (on rungs, see :class:`PolicyConfig`).
7. **One step down per drop.** While pressure falls the EWMA passes through the bands in between, so a drop
   from q4 to nothing went q4 -> 8-bit -> fp16, two changes for one drop in demand. A step down is therefore
   taken only when the newest sample (with its raw re-counts) asks for the same rung as the smoothed values;
   while they disagree the level holds. The EWMA still decides *when* (noise does not move the level); the
   agreement decides *where* (one step, to where the data settles). With ``ewma_alpha = 1`` they always agree.

Every change of level counts one upgrade (more compact) or one downgrade (less compact), however many rungs
it spans, and :attr:`Policy.reason` says why in words. The level starts at ``min_level``. The policy is pure
(no Ray, no ZeroMQ) and thread-safe.
"""

from __future__ import annotations

import enum
import math
import numbers
import threading
from dataclasses import dataclass
from typing import Any

from kvd.errors import ConfigError, InvalidArgument

__all__ = ["Level", "PolicyConfig", "Policy", "PROFILES"]


class Level(enum.Enum):
    """Precision of a sealed page, ordered by compactness: ``FP16 < Q8 < FP8 < Q4``.

    ``value`` is the compactness rank (0..3). Comparisons (``<``, ``<=``, ...) follow it; a Level never
    compares equal to an int, and it is sent on the wire as its :attr:`tag`.
    """

    FP16 = 0
    Q8 = 1
    FP8 = 2
    Q4 = 3

    @property
    def tag(self) -> str:
        """The stable lower-case name used in stats, config and on the wire: ``"fp16"``, ``"q8"``, ..."""
        return self.name.lower()

    @property
    def rung(self) -> int:
        """The policy's ladder step: 0 fp16, 1 the 8-bit rung (Q8 and FP8 alike: same memory), 2 q4."""
        return _RUNG[self]

    @property
    def memory_factor(self) -> float:
        """Nominal bytes per element relative to fp16 (headers and scales not counted)."""
        return _MEMORY_FACTOR[self]

    @classmethod
    def from_tag(cls, tag: str) -> Level:
        """The level named ``tag`` (case-insensitive). Raises :class:`InvalidArgument` for anything else."""
        if not isinstance(tag, str):
            raise InvalidArgument(f"level tag must be a str, got {type(tag).__name__} {tag!r}")
        level = _BY_TAG.get(tag.lower())
        if level is None:
            raise InvalidArgument(f"unknown level tag {tag!r}; expected one of {sorted(_BY_TAG)}")
        return level

    @classmethod
    def parse(cls, level_or_tag: Level | str) -> Level:
        """A :class:`Level` as is, or a tag via :meth:`from_tag`. Raises :class:`InvalidArgument` otherwise."""
        if isinstance(level_or_tag, Level):
            return level_or_tag
        return cls.from_tag(level_or_tag)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Level):
            return NotImplemented
        return self.value < other.value

    def __le__(self, other: object) -> bool:
        if not isinstance(other, Level):
            return NotImplemented
        return self.value <= other.value

    def __gt__(self, other: object) -> bool:
        if not isinstance(other, Level):
            return NotImplemented
        return self.value > other.value

    def __ge__(self, other: object) -> bool:
        if not isinstance(other, Level):
            return NotImplemented
        return self.value >= other.value


_MEMORY_FACTOR: dict[Level, float] = {Level.FP16: 1.0, Level.Q8: 0.5, Level.FP8: 0.5, Level.Q4: 0.25}
_BY_TAG: dict[str, Level] = {level.tag: level for level in Level}

# Rung index of each level: Q8 and FP8 both name the 8-bit rung.
_RUNG: dict[Level, int] = {Level.FP16: 0, Level.Q8: 1, Level.FP8: 1, Level.Q4: 2}
_EIGHT_BIT_CHOICES = (Level.Q8, Level.FP8)
_UNIT_FIELDS = ("q8_threshold", "q4_threshold", "hysteresis", "ewma_alpha")


def _config_level(name: str, value: object) -> Level:
    try:
        return Level.parse(value)  # type: ignore[arg-type]
    except InvalidArgument as exc:
        raise ConfigError(f"{name}: {exc}") from None


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Settings of the pressure policy. Invalid values raise :class:`~kvd.errors.ConfigError` naming them.

    Thresholds, hysteresis and alpha are fractions in [0, 1] (pressure is bytes used / bytes of capacity);
    ``q4_threshold >= q8_threshold``. Level fields accept a :class:`Level` or its tag and are stored as Levels.

    ``eight_bit`` picks the 8-bit rung: :attr:`Level.Q8` (default) or :attr:`Level.FP8`.
    ``min_level`` / ``max_level`` clamp on *rungs*: ``Q8`` and ``FP8`` there both mean "the 8-bit rung",
    whichever level ``eight_bit`` selects, so ``min_level=Level.Q8`` with ``eight_bit=Level.FP8`` starts the
    policy at FP8. ``min_level`` must not be more compact than ``max_level`` (by Level order, so
    ``min_level=FP8, max_level=Q8`` is refused as contradictory).
    """

    q8_threshold: float = 0.80
    q4_threshold: float = 0.95
    hysteresis: float = 0.05
    ewma_alpha: float = 0.20
    min_level: Level = Level.FP16
    max_level: Level = Level.Q4
    eight_bit: Level = Level.Q8

    def __post_init__(self) -> None:
        for name in _UNIT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise ConfigError(f"{name} must be a number in [0, 1], got {type(value).__name__} {value!r}")
            number = float(value)
            if not 0.0 <= number <= 1.0:  # also false for NaN
                raise ConfigError(f"{name} must be in [0, 1], got {value!r}")
            object.__setattr__(self, name, number)
        if self.q4_threshold < self.q8_threshold:
            raise ConfigError(
                f"q4_threshold ({self.q4_threshold!r}) must be >= q8_threshold ({self.q8_threshold!r})"
            )
        for name in ("min_level", "max_level", "eight_bit"):
            object.__setattr__(self, name, _config_level(name, getattr(self, name)))
        if self.eight_bit not in _EIGHT_BIT_CHOICES:
            raise ConfigError(f"eight_bit must be q8 or fp8, got {self.eight_bit.tag!r}")
        if self.min_level > self.max_level:
            raise ConfigError(
                f"min_level {self.min_level.tag!r} is more compact than max_level {self.max_level.tag!r}"
            )

    @property
    def rungs(self) -> tuple[Level, Level, Level]:
        """The ladder the policy climbs: ``(FP16, eight_bit, Q4)``, indexed by rung."""
        return (Level.FP16, self.eight_bit, Level.Q4)

    @property
    def levels(self) -> tuple[Level, ...]:
        """The levels this configuration can produce, least compact first."""
        return self.rungs[_RUNG[self.min_level] : _RUNG[self.max_level] + 1]

    @classmethod
    def default(cls) -> PolicyConfig:
        """fp16 below 0.80, the 8-bit rung from 0.80, q4 from 0.95; hysteresis 0.05, alpha 0.20."""
        return cls()

    @classmethod
    def fp16_only(cls) -> PolicyConfig:
        """Never quantize: min = max = fp16."""
        return cls(min_level=Level.FP16, max_level=Level.FP16)

    @classmethod
    def aggressive(cls) -> PolicyConfig:
        """Always at least 8-bit; q4 from 0.80: thresholds 0.50 / 0.80, hysteresis 0.05, alpha 0.30."""
        return cls(
            q8_threshold=0.50,
            q4_threshold=0.80,
            hysteresis=0.05,
            ewma_alpha=0.30,
            min_level=Level.Q8,
            max_level=Level.Q4,
        )

    @classmethod
    def profile(cls, name: str) -> PolicyConfig:
        """The named profile: ``"default"``, ``"fp16_only"`` or ``"aggressive"``; ConfigError otherwise."""
        factory = PROFILES.get(name) if isinstance(name, str) else None
        if factory is None:
            raise ConfigError(f"unknown policy profile {name!r}; expected one of {sorted(PROFILES)}")
        return factory()


PROFILES = {
    "default": PolicyConfig.default,
    "fp16_only": PolicyConfig.fp16_only,
    "aggressive": PolicyConfig.aggressive,
}


def _unit(value: object, name: str) -> float:
    """A real number clamped into [0, 1]; InvalidArgument for NaN or a non-number."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise InvalidArgument(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    x = float(value)
    if math.isnan(x):
        raise InvalidArgument(f"{name} must not be NaN, got {value!r}")
    return min(1.0, max(0.0, x))


class Policy:
    """The EWMA + hysteresis controller described in the module docstring. Thread-safe.

    ``Policy(config=None)`` uses :meth:`PolicyConfig.default`.
    """

    def __init__(self, config: PolicyConfig | None = None) -> None:
        if config is None:
            config = PolicyConfig.default()
        elif not isinstance(config, PolicyConfig):
            raise ConfigError(f"config must be a PolicyConfig, got {type(config).__name__}")
        self._config = config
        self._min_rung = _RUNG[config.min_level]
        self._max_rung = _RUNG[config.max_level]
        self._lock = threading.Lock()
        self._rung = self._min_rung
        self._ewma = 0.0
        self._ewma_at = [0.0, 0.0, 0.0]
        self._samples = 0
        self._upgrades = 0
        self._downgrades = 0
        self._reason = ""

    @property
    def config(self) -> PolicyConfig:
        return self._config

    @property
    def level(self) -> Level:
        """The current level; ``min_level`` (its rung) before the first sample and after :meth:`reset`."""
        with self._lock:
            return self._config.rungs[self._rung]

    @property
    def pressure(self) -> float:
        """The smoothed pressure (EWMA, in [0, 1]); 0.0 before the first sample (check ``samples``)."""
        with self._lock:
            return self._ewma

    @property
    def samples(self) -> int:
        """Pressure samples accepted since construction or the last :meth:`reset`."""
        with self._lock:
            return self._samples

    @property
    def upgrades(self) -> int:
        """Changes to a more compact level (one per change, however many rungs it spans)."""
        with self._lock:
            return self._upgrades

    @property
    def downgrades(self) -> int:
        """Changes to a less compact level (one per change, however many rungs it spans)."""
        with self._lock:
            return self._downgrades

    @property
    def reason(self) -> str:
        """Why the level last changed (or last held against a step down), in words; "" before that."""
        with self._lock:
            return self._reason

    def observe(self, pressure: float, at_rungs: tuple[float, float, float] | None = None) -> Level:
        """Feed one pressure sample (bytes used / capacity) and return the level now in force.

        ``at_rungs``: the same pressure re-counted at fp16, the 8-bit rung and q4 (module docstring, step 5);
        None means "as measured". Values outside [0, 1] (including +-inf; a re-count above 1 is a full store)
        are clamped. NaN or a non-number raises :class:`~kvd.errors.InvalidArgument` and changes nothing.
        """
        p = _unit(pressure, "pressure")
        at = (p, p, p) if at_rungs is None else tuple(_unit(x, "at_rungs") for x in at_rungs)
        if len(at) != 3:
            raise InvalidArgument(f"at_rungs must hold 3 pressures (fp16, 8-bit, q4), got {at_rungs!r}")
        cfg = self._config
        with self._lock:
            a = cfg.ewma_alpha
            if self._samples == 0:
                s = p
                self._ewma_at = list(at)
            else:
                s = a * p + (1.0 - a) * self._ewma
                self._ewma_at = [a * x + (1.0 - a) * e for x, e in zip(at, self._ewma_at, strict=True)]
            self._ewma = s
            self._samples += 1

            current = self._rung
            wanted, target = self._target(s, self._ewma_at, current)
            target = self._clamp(target)
            held = False
            if target < current and self._clamp(self._target(p, at, current)[1]) != target:
                held, target = True, current  # still moving: step once, where smoothed and newest agree
            names = ("fp16", cfg.eight_bit.tag, "q4")
            if target > current:
                self._upgrades += 1
                threshold = cfg.q4_threshold if target == 2 else cfg.q8_threshold
                self._reason = (
                    f"up to {names[target]}: smoothed pressure {s:.3f} >= {'q4' if target == 2 else 'q8'}"
                    f"_threshold {threshold:.2f}"
                )
            elif target < current:
                self._downgrades += 1
                self._reason = (
                    f"down to {names[target]}: smoothed pressure {s:.3f}, and the data re-counted at "
                    f"{names[target]} {self._ewma_at[target]:.3f} < {self._bounds()[target]:.2f}"
                )
            elif held:
                self._reason = (
                    f"held at {names[current]}: pressure still moving (smoothed {s:.3f}, newest {p:.3f}); one "
                    "step down once both point to the same level"
                )
            elif wanted < current and target == current:
                self._reason = (
                    f"held at {names[current]}: smoothed pressure {s:.3f} is low, but the data re-counted at "
                    f"{names[wanted]} {self._ewma_at[wanted]:.3f} would not stay under "
                    f"{self._bounds()[wanted]:.2f}"
                )
            self._rung = target
            return cfg.rungs[target]

    def _bounds(self) -> tuple[float, float]:
        """The pressure a rung must stay under to be stepped down to: fp16, the 8-bit rung."""
        cfg = self._config
        return cfg.q8_threshold - cfg.hysteresis, cfg.q4_threshold - cfg.hysteresis

    def _target(self, s: float, recounts: Any, current: int) -> tuple[int, int]:
        """(the rung ``s`` asks for with hysteresis, the rung taken once the re-counts must fit there)."""
        cfg = self._config
        target = 2 if s >= cfg.q4_threshold else 1 if s >= cfg.q8_threshold else 0
        # Hysteresis on the way down only: hold the current rung inside its margin below the threshold.
        if target < current:
            if current == 2 and s >= cfg.q4_threshold - cfg.hysteresis:
                target = 2
            elif s >= cfg.q8_threshold - cfg.hysteresis:
                target = 1  # from the 8-bit rung: hold; from q4: stop on the 8-bit rung inside its margin
        wanted, bounds = target, self._bounds()
        while target < current and not recounts[target] < bounds[target]:
            target += 1  # the data would not fit there: try one rung more compact, or hold
        return wanted, target

    def _clamp(self, rung: int) -> int:
        return min(self._max_rung, max(self._min_rung, rung))

    def reset(self) -> None:
        """Back to ``min_level``; counters, EWMA and samples to zero (the next sample is a first sample)."""
        with self._lock:
            self._rung = self._min_rung
            self._ewma = 0.0
            self._ewma_at = [0.0, 0.0, 0.0]
            self._samples = 0
            self._upgrades = 0
            self._downgrades = 0
            self._reason = ""

    def snapshot(self) -> dict[str, Any]:
        """A consistent plain dict for stats: ``level`` (tag), ``pressure``, ``pressure_at_rungs`` (smoothed
        re-counts), ``samples``, ``upgrades``, ``downgrades``, ``reason``."""
        with self._lock:
            return {
                "level": self._config.rungs[self._rung].tag,
                "pressure": self._ewma,
                "pressure_at_rungs": list(self._ewma_at),
                "reason": self._reason,
                "samples": self._samples,
                "upgrades": self._upgrades,
                "downgrades": self._downgrades,
            }

    def __repr__(self) -> str:
        snap = self.snapshot()
        return (
            f"Policy(level={snap['level']}, pressure={snap['pressure']:.4f}, samples={snap['samples']}, "
            f"upgrades={snap['upgrades']}, downgrades={snap['downgrades']})"
        )
