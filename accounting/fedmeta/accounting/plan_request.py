"""What the planner is asked and what it answers: budget, federation, caps, candidates, rows.

Small frozen dataclasses validated on construction (each error names the field and what it must
be); the search over them is ``planner``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, TypeAlias

from fedmeta.accounting.composition import (
    MAX_ROUNDS_LIMIT,
)
from fedmeta.accounting.schemes import (
    ADD_REMOVE,
    NEIGHBOURING_RELATIONS,
    GaussianRound,
    Neighbouring,
)

Design: TypeAlias = Literal["flat_poisson", "two_stage_poisson", "two_stage_fixed"]


DESIGNS: tuple[Design, ...] = ("flat_poisson", "two_stage_poisson", "two_stage_fixed")


def _number(name: str, value: object, *, low: float, high: float, open_low: bool = True) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    v = float(value) if ok else math.nan  # type: ignore[arg-type]
    if not (ok and math.isfinite(v) and (v > low if open_low else v >= low) and v <= high):
        bracket = "(" if open_low else "["
        raise ValueError(f"{name} must be a number in {bracket}{low:g}, {high:g}]; got {value!r}")
    return v


def checked_integer(
    name: str, value: object, *, minimum: int, maximum: int = MAX_ROUNDS_LIMIT
) -> int:
    """``value`` if it is an integer in ``[minimum, maximum]``, else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ValueError(f"{name} must be an integer in [{minimum}, {maximum}]; got {value!r}")
    return value


def _integers(name: str, values: object, *, minimum: int) -> tuple[int, ...]:
    if not isinstance(values, tuple) or not values:
        raise ValueError(f"{name} must be a non-empty tuple of integers; got {values!r}")
    for v in values:
        checked_integer(name, v, minimum=minimum)
    return values


@dataclass(frozen=True)
class PlanBudget:
    """The privacy budget a plan must meet: task-level (epsilon, delta) under ``neighbouring``."""

    epsilon: float
    delta: float
    neighbouring: Neighbouring = ADD_REMOVE

    def __post_init__(self) -> None:
        _number("epsilon", self.epsilon, low=0.0, high=1000.0)
        if isinstance(self.delta, bool) or not isinstance(self.delta, int | float):
            raise ValueError(f"delta must be a number in (0, 1); got {self.delta!r}")
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"delta must be a number in (0, 1); got {self.delta!r}")
        if self.neighbouring not in NEIGHBOURING_RELATIONS:
            raise ValueError(
                f"neighbouring must be one of {NEIGHBOURING_RELATIONS}; got {self.neighbouring!r}"
            )


@dataclass(frozen=True)
class Federation:
    """``participants`` and their task counts: one count (every participant holds it) or ``P``.

    Under add/remove the counts are private: give the public lower bound (one count) or the counts
    the plan may assume. The smallest decides a fixed-size stage 2's rate; the total decides a
    Poisson design's expected lot.
    """

    participants: int
    tasks_per_participant: tuple[int, ...]

    def __post_init__(self) -> None:
        checked_integer("participants", self.participants, minimum=1, maximum=10_000_000)
        counts = _integers("tasks_per_participant", self.tasks_per_participant, minimum=1)
        if len(counts) not in (1, self.participants):
            raise ValueError(
                f"tasks_per_participant must hold one count or one per participant "
                f"({self.participants}); got {len(counts)} counts"
            )

    @property
    def min_tasks(self) -> int:
        """The smallest participant's task count."""
        return min(self.tasks_per_participant)

    @property
    def total_tasks(self) -> int:
        """Every task of the federation."""
        counts = self.tasks_per_participant
        return counts[0] * self.participants if len(counts) == 1 else sum(counts)

    @property
    def uniform(self) -> bool:
        """Whether every participant holds the same number of tasks."""
        return len(set(self.tasks_per_participant)) == 1


@dataclass(frozen=True)
class ComputeBudget:
    """What a run may cost: the expected lot per round, all task-gradients, participants contacted.

    ``max_tasks_per_round`` caps the *expected* lot (a Poisson lot varies around it);
    ``max_task_gradients`` caps ``rounds * expected lot``; ``max_participants_per_round`` caps
    ``n1`` (communication). None = no cap.
    """

    max_tasks_per_round: float | None = None
    max_task_gradients: float | None = None
    max_participants_per_round: int | None = None

    def __post_init__(self) -> None:
        if self.max_tasks_per_round is not None:
            _number("max_tasks_per_round", self.max_tasks_per_round, low=1.0, high=1e12,
                    open_low=False)  # fmt: skip
        if self.max_task_gradients is not None:
            _number("max_task_gradients", self.max_task_gradients, low=1.0, high=1e15,
                    open_low=False)  # fmt: skip
        if self.max_participants_per_round is not None:
            checked_integer("max_participants_per_round", self.max_participants_per_round,
                            minimum=1, maximum=10_000_000)  # fmt: skip

    def lot_cap(self, rounds: int) -> float:
        """The largest expected lot these caps allow in each of ``rounds`` rounds."""
        cap = math.inf if self.max_tasks_per_round is None else self.max_tasks_per_round
        if self.max_task_gradients is not None:
            cap = min(cap, self.max_task_gradients / rounds)
        return cap


@dataclass(frozen=True)
class Candidate:
    """One configuration before calibration: a design, ``n1``, the stage-2 rate or size, ``T``."""

    design: Design
    participants_per_round: int
    rounds: int
    task_rate: float | None = None
    tasks_per_round: int | None = None

    def __post_init__(self) -> None:
        if self.design not in DESIGNS:
            raise ValueError(f"design must be one of {DESIGNS}; got {self.design!r}")
        checked_integer("participants_per_round", self.participants_per_round, minimum=1,
                        maximum=10_000_000)  # fmt: skip
        checked_integer("rounds", self.rounds, minimum=1)
        fixed = self.design == "two_stage_fixed"
        if fixed and (self.tasks_per_round is None or self.task_rate is not None):
            raise ValueError(f"tasks_per_round must be set (and task_rate not) for {self.design}")
        if not fixed and (self.task_rate is None or self.tasks_per_round is not None):
            raise ValueError(f"task_rate must be set (and tasks_per_round not) for {self.design}")
        if self.task_rate is not None:
            _number("task_rate", self.task_rate, low=0.0, high=1.0)
        if self.tasks_per_round is not None:
            checked_integer("tasks_per_round", self.tasks_per_round, minimum=1)


@dataclass(frozen=True)
class PlanRequest:
    """Everything ``plan`` searches over. ``rounds`` None: a grid from the compute caps.

    ``clip`` is ``C`` (the noise column is in its units); ``adaptive_count_noise`` is the count
    noise ``sigma_b`` of adaptive clipping (None = a fixed clip bound); ``baseline`` is a
    configuration to compare against (e.g. the one used before), evaluated and shown beside it.
    """

    budget: PlanBudget
    federation: Federation
    compute: ComputeBudget = ComputeBudget()
    rounds: tuple[int, ...] | None = None
    participants_per_round: tuple[int, ...] | None = None
    designs: tuple[Design, ...] = DESIGNS
    clip: float = 1.0
    adaptive_count_noise: float | None = None
    baseline: Candidate | None = None
    dimension: int | None = None
    signal_norm: float | None = None

    def __post_init__(self) -> None:
        for name, kind in (("budget", PlanBudget), ("federation", Federation),
                           ("compute", ComputeBudget)):  # fmt: skip
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name} must be a {kind.__name__}; got {getattr(self, name)!r}")
        self._check_search_space()
        if not self.designs or any(d not in DESIGNS for d in self.designs):
            raise ValueError(f"designs must be a non-empty subset of {DESIGNS}; got {self.designs}")
        _number("clip", self.clip, low=0.0, high=1e6)
        if self.adaptive_count_noise is not None:
            _number("adaptive_count_noise", self.adaptive_count_noise, low=0.0, high=1e9)
        if self.baseline is not None and not isinstance(self.baseline, Candidate):
            raise ValueError(f"baseline must be a Candidate; got {self.baseline!r}")
        self._check_signal()

    def _check_signal(self) -> None:
        """``dimension`` and ``signal_norm`` come together; ``G <= C`` (a mean of clipped rows)."""
        if (self.dimension is None) != (self.signal_norm is None):
            name = "signal_norm" if self.signal_norm is None else "dimension"
            raise ValueError(
                f"{name} must be given too: the signal-to-noise proxy needs both dimension and "
                "signal_norm (or neither, for the default proxy)"
            )
        if self.dimension is not None:
            checked_integer("dimension", self.dimension, minimum=1, maximum=10**12)
        if self.signal_norm is not None:
            g = _number("signal_norm", self.signal_norm, low=0.0, high=1e6)
            if g > self.clip:
                raise ValueError(
                    f"signal_norm must be at most the clip bound C={self.clip:g} (it is the norm "
                    f"of a mean of gradients clipped to C; measure it at this clip); got {g:g}"
                )

    def _check_search_space(self) -> None:
        if self.rounds is not None:
            _integers("rounds", self.rounds, minimum=1)
        elif self.compute.max_tasks_per_round is None or self.compute.max_task_gradients is None:
            raise ValueError(
                "rounds must be given unless both max_tasks_per_round and max_task_gradients are "
                "(they set the grid of rounds); got None"
            )
        if self.participants_per_round is not None:
            for n1 in _integers("participants_per_round", self.participants_per_round, minimum=1):
                if n1 > self.federation.participants:
                    raise ValueError(
                        f"participants_per_round must be <= participants "
                        f"({self.federation.participants}); got {n1}"
                    )

    def rounds_grid(self) -> tuple[int, ...]:
        """The candidate rounds: as given, or ``T*/4 .. 4 T*`` around the caps' knee ``T*``."""
        if self.rounds is not None:
            return tuple(sorted(set(self.rounds)))
        g, lot = self.compute.max_task_gradients, self.compute.max_tasks_per_round
        assert g is not None and lot is not None  # __post_init__
        knee = g / lot
        return tuple(sorted({min(MAX_ROUNDS_LIMIT, max(1, round(knee * f)))
                             for f in (0.25, 0.5, 1.0, 2.0, 4.0)}))  # fmt: skip

    def stage_one_grid(self) -> tuple[int, ...]:
        """Candidate ``n1``: as given, else ``P`` halving to 1; within the communication cap."""
        p = self.federation.participants
        grid = set(self.participants_per_round or ())
        n = p
        while not self.participants_per_round:
            grid.add(n)
            if n == 1:
                break
            n = math.ceil(n / 2)
        cap = self.compute.max_participants_per_round or p
        return tuple(sorted((n for n in grid if n <= cap), reverse=True))


@dataclass(frozen=True)
class PlanRow:
    """One calibrated configuration: what it samples, its noise, and what the noise costs accuracy.

    ``noise_multiplier`` is the total ``z`` the accountant composes (it meets the budget after
    ``rounds`` rounds); ``gradient_noise_multiplier`` is what remains for the gradient once adaptive
    clipping's count has its share (equal to ``z`` with a fixed clip bound). ``epsilon`` is
    recomputed from ``event`` with the enforced accountant.
    """

    candidate: Candidate
    event: GaussianRound
    expected_lot: float
    noise_multiplier: float
    gradient_noise_multiplier: float
    clip: float
    epsilon: float
    exact: bool
    dimension: int | None = None
    signal_norm: float | None = None

    @property
    def noise_std(self) -> float:
        """Noise standard deviation on the averaged gradient, ``z_grad * C / E[lot]``."""
        return self.gradient_noise_multiplier * self.clip / self.expected_lot

    @property
    def proxy(self) -> float:
        """The ranking key, ``noise_std / sqrt(T)`` (smaller is better; module docstring)."""
        return self.noise_std / math.sqrt(self.candidate.rounds)

    @property
    def round_snr(self) -> float | None:
        """``G / sqrt(d sigma_avg^2 + (C^2 - G^2) / E[lot])``; None without ``d`` and ``G``."""
        if self.dimension is None or self.signal_norm is None:
            return None
        g = self.signal_norm
        variance = self.dimension * self.noise_std**2 + (self.clip**2 - g**2) / self.expected_lot
        return g / math.sqrt(variance) if variance > 0 else math.inf

    @property
    def run_snr(self) -> float | None:
        """``round_snr * sqrt(T)``, the SNR of the sum of the rounds' steps (module docstring)."""
        snr = self.round_snr
        return None if snr is None else snr * math.sqrt(self.candidate.rounds)

    @property
    def rank_key(self) -> float:
        """What ranks rows (smaller is better): ``1 / run_snr`` when known, else ``proxy``."""
        snr = self.run_snr
        if snr is None:
            return self.proxy
        return 1.0 / snr if snr > 0 else math.inf

    @property
    def task_gradients(self) -> float:
        """Expected per-task gradients over the run, ``T * E[lot]``."""
        return self.candidate.rounds * self.expected_lot


@dataclass(frozen=True)
class Plan:
    """Feasible configurations, best first, the baseline's row and why any design has no row."""

    request: PlanRequest
    rows: tuple[PlanRow, ...]
    baseline: PlanRow | None
    notes: tuple[str, ...]


def expected_lot(c: Candidate, fed: Federation) -> float:
    """``E[tasks per round]``: ``n1 * n2``, or ``(n1 / P) * q2 * total tasks`` for Poisson."""
    if c.tasks_per_round is not None:
        return float(c.participants_per_round * c.tasks_per_round)
    assert c.task_rate is not None
    return c.participants_per_round / fed.participants * c.task_rate * fed.total_tasks
