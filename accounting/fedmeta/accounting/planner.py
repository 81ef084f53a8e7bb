"""Choose sampling, rounds and noise for accuracy at a privacy budget (``fedmeta privacy plan``).

What the planner optimises
--------------------------
Every private round releases ``sum(clip_C(g_i)) + N(0, (z C)^2 I)`` divided by the public expected
lot ``L = E[tasks per round]``, so the noise on the *averaged* gradient has standard deviation

    sigma_avg = z_grad * C / L          (per coordinate; ``z_grad = z`` without adaptive clipping)

Accuracy at a budget is driven by this number: at a fixed number of steps, DP-SGD's accuracy is
(nearly) a function of the noise on the averaged gradient alone (Sander, Stock, Sablayrolles 2023,
"TAN without a burn: scaling laws of DP-SGD", section 3; De et al. 2022, "Unlocking high-accuracy
differentially private image classification through scale", section 3: larger lots at a fixed
number of steps help). Rounds matter too: for non-convex SGD whose gradient noise has variance
``s^2``, the best step size gives ``min_t E|grad f|^2 = O(sqrt(s^2 / T))`` once the noise dominates
(Ghadimi and Lan 2013, "Stochastic first- and zeroth-order methods for nonconvex stochastic
programming", Corollary 2.2), and with DP noise ``s^2 = d sigma_avg^2``. The planner therefore ranks
by

    proxy = sigma_avg / sqrt(T)         (smaller is better)

What it ignores, and which way that errs: the optimisation term ``O(1/T)`` of the same bound (a
model needs enough rounds to converge, whatever the noise), the sampling variance of the gradient
(small beside the DP noise for any real model) and the bias of clipping. At an equal compute budget
the proxy therefore prefers fewer rounds with larger lots; give it the rounds your model needs
(``rounds``) when that matters. The proxy ranks configurations; it does not predict accuracy
(the signal-to-noise proxy below tries to, as a heuristic).

The signal-to-noise proxy (optional)
------------------------------------
``sigma_avg`` is noise per coordinate; what moved accuracy in the runs of issue 19 is the noise's
whole norm against the gradient it hides: the averaged noise has norm about
``sigma_avg sqrt(d)`` (``d`` trained parameters), the signal is ``G = ||E[clip_C(g_i)]||``, the
norm of the mean clipped per-task gradient (measured on public or synthetic tasks, ``python
bench/signal_norm.py``). Given ``d`` (``dimension``) and ``G`` (``signal_norm``, measured at the
same clip bound ``C``), the planner ranks by

    round_snr = G / sqrt(d sigma_avg^2 + (C^2 - G^2) / E[lot])
    run_snr   = round_snr * sqrt(T)           (larger is better)

The second term under the root is the sampling variance of the averaged gradient,
``E||clip_C(g_i) - mean||^2 / lot``, with ``E||clip_C(g_i)||^2 <= C^2``: exact when every task's
gradient is clipped (at initialisation task norms are several times ``C = 1``), an over-estimate of
the sampling noise otherwise. ``round_snr * sqrt(T)`` is the SNR of the sum of ``T`` steps when the
signal keeps its direction and the noise is independent across rounds (the same ``sqrt(T)`` as the
default proxy's Ghadimi-Lan argument). Because ``G`` depends on ``C``, the SNR puts plans at
different clip bounds on one scale (the default proxy is in units of ``C``); it also counts clipping
bias only as far as clipping shortens the mean. It is a heuristic for ranking designs, fitted to
nothing and checked on the sinusoid in docs/results.md; it is not a privacy quantity and changes no
noise multiplier and no epsilon. It ignores how ``G`` shrinks as the model trains, the optimiser
(Adam rescales every coordinate) and the variance of a Poisson lot around its mean.

Search space
------------
* designs: ``flat_poisson`` (every participant contacted every round, each task included with
  probability ``q``: the two-stage scheme with ``n1 = P``, accounted as Poisson-subsampled
  Gaussian), ``two_stage_poisson`` (``n1 < P`` participants, Poisson ``q2`` inside) and
  ``two_stage_fixed`` (``n1`` participants, ``n2`` tasks each without replacement);
* ``n1``: ``P``, then halving (``ceil(n/2)``) down to 1, within ``max_participants_per_round``;
* rounds ``T``: the given candidates, else a grid around ``T* = max_task_gradients /
  max_tasks_per_round`` (``T*/4 .. 4 T*``), the point where both compute caps bind;
* the lot: for each ``(design, n1, T)`` the largest the compute allows, ``min(max_tasks_per_round,
  max_task_gradients / T)``, up to every task (at the same ``T``, ``z`` grows more slowly than the
  lot, as the two papers above observe and every case in docs/privacy.md computes, so the largest
  lot has the least noise per averaged gradient);
* ``z``: the smallest meeting (epsilon, delta) after ``T`` rounds, from the accountant's own
  ``calibrate_noise_multiplier`` (PLD, enforced).

For each ``(design, n1)`` the rounds are chosen by a local search over the grid (the proxy is
unimodal in ``T`` when both caps bind: more rounds at the cap's lot, then smaller lots) on screening
calibrations (PLD grid 1e-3, 1% tolerance); the best rows are then calibrated exactly (the enforced
accountant at its default grid and tolerance) and ranked on those values.

Adaptive clipping
-----------------
Estimating the clip bound privately (Andrew et al. 2021, "Differentially private learning with
adaptive clipping", Theorem 1) releases a noisy count of tasks under the bound, with noise standard
deviation ``sigma_b`` on bits centred to ``+-1/2``. Releasing the count with noise ``sigma_b`` and
the gradient sum with noise multiplier ``z_grad`` is the Gaussian mechanism with
``z = (z_grad^-2 + (2 sigma_b)^-2)^(-1/2)``. The accountant calibrates that total ``z``; the
gradient keeps ``z_grad = (z^-2 - (2 sigma_b)^-2)^(-1/2)``, which exists only when
``2 sigma_b > z``.
"""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import InvalidStateError, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Literal, TypeAlias

from fedmeta.accounting.adaptive import gradient_noise_multiplier
from fedmeta.accounting.calibration import calibrate_noise_multiplier
from fedmeta.accounting.composition import (
    DEFAULT_DISCRETIZATION,
    MAX_ROUNDS_LIMIT,
    Method,
    epsilon,
)
from fedmeta.accounting.schemes import (
    ADD_REMOVE,
    NEIGHBOURING_RELATIONS,
    GaussianRound,
    Neighbouring,
    TwoStageFixedScheme,
    TwoStagePoissonScheme,
)

Design: TypeAlias = Literal["flat_poisson", "two_stage_poisson", "two_stage_fixed"]
DESIGNS: tuple[Design, ...] = ("flat_poisson", "two_stage_poisson", "two_stage_fixed")
#: Screening calibrations: a coarser pessimistic PLD grid (still an upper bound) and 1% tolerance.
SCREEN_DISCRETIZATION = 1e-3
SCREEN_TOLERANCE = 1e-2
#: Significant digits of a planned Poisson rate (rounded down: the lot stays within the caps).
RATE_DIGITS = 4


def _number(name: str, value: object, *, low: float, high: float, open_low: bool = True) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    v = float(value) if ok else math.nan  # type: ignore[arg-type]
    if not (ok and math.isfinite(v) and (v > low if open_low else v >= low) and v <= high):
        bracket = "(" if open_low else "["
        raise ValueError(f"{name} must be a number in {bracket}{low:g}, {high:g}]; got {value!r}")
    return v


def _integer(name: str, value: object, *, minimum: int, maximum: int = MAX_ROUNDS_LIMIT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ValueError(f"{name} must be an integer in [{minimum}, {maximum}]; got {value!r}")
    return value


def _integers(name: str, values: object, *, minimum: int) -> tuple[int, ...]:
    if not isinstance(values, tuple) or not values:
        raise ValueError(f"{name} must be a non-empty tuple of integers; got {values!r}")
    for v in values:
        _integer(name, v, minimum=minimum)
    return values


# ------------------------------------------------------------------------------------ inputs


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
        _integer("participants", self.participants, minimum=1, maximum=10_000_000)
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
            _integer("max_participants_per_round", self.max_participants_per_round, minimum=1,
                     maximum=10_000_000)  # fmt: skip

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
        _integer("participants_per_round", self.participants_per_round, minimum=1,
                 maximum=10_000_000)  # fmt: skip
        _integer("rounds", self.rounds, minimum=1)
        fixed = self.design == "two_stage_fixed"
        if fixed and (self.tasks_per_round is None or self.task_rate is not None):
            raise ValueError(f"tasks_per_round must be set (and task_rate not) for {self.design}")
        if not fixed and (self.task_rate is None or self.tasks_per_round is not None):
            raise ValueError(f"task_rate must be set (and tasks_per_round not) for {self.design}")
        if self.task_rate is not None:
            _number("task_rate", self.task_rate, low=0.0, high=1.0)
        if self.tasks_per_round is not None:
            _integer("tasks_per_round", self.tasks_per_round, minimum=1)


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
            _integer("dimension", self.dimension, minimum=1, maximum=10**12)
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


# ------------------------------------------------------------------------------------ outputs


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


def _gradient_share(z: float, count_noise: float | None) -> float:
    """``z_grad`` left for the gradient (``accounting.adaptive``); ``z`` without adaptive clipping.

    Raises, naming the planner's field, when ``2 sigma_b <= z``: the count alone would spend the
    whole budget.
    """
    if count_noise is None:
        return z
    try:
        return gradient_noise_multiplier(z, count_noise)
    except ValueError:
        raise ValueError(
            f"adaptive_count_noise must be > z/2 = {z / 2:.4g} (the count's share of the privacy "
            f"would exceed the whole budget); got {count_noise!r}"
        ) from None


def _scheme(c: Candidate, fed: Federation) -> TwoStagePoissonScheme | TwoStageFixedScheme:
    if c.tasks_per_round is not None:
        return TwoStageFixedScheme(
            fed.participants, c.participants_per_round, c.tasks_per_round, fed.min_tasks
        )
    assert c.task_rate is not None  # Candidate validates it
    return TwoStagePoissonScheme(fed.participants, c.participants_per_round, c.task_rate)


def expected_lot(c: Candidate, fed: Federation) -> float:
    """``E[tasks per round]``: ``n1 * n2``, or ``(n1 / P) * q2 * total tasks`` for Poisson."""
    if c.tasks_per_round is not None:
        return float(c.participants_per_round * c.tasks_per_round)
    assert c.task_rate is not None
    return c.participants_per_round / fed.participants * c.task_rate * fed.total_tasks


def _round_down(x: float, digits: int = RATE_DIGITS) -> float:
    if x >= 1.0:
        return 1.0
    scale = 10.0 ** (digits - 1 - math.floor(math.log10(x)))
    return math.floor(x * scale * (1 + 1e-12)) / scale


def _applies(design: Design, n1: int, participants: int) -> bool:
    """Flat Poisson contacts every participant, two-stage Poisson fewer; fixed-size any number."""
    return design == "two_stage_fixed" or (design == "flat_poisson") == (n1 == participants)


def design_candidate(
    request: PlanRequest, design: Design, n1: int, rounds: int
) -> Candidate | None:
    """The ``design`` at ``n1`` and ``rounds`` with the largest lot the compute allows, or None."""
    fed = request.federation
    p = fed.participants
    if not _applies(design, n1, p):
        return None
    cap = request.compute.lot_cap(rounds)
    if design == "two_stage_fixed":
        n2 = fed.min_tasks
        if math.isfinite(cap):
            n2 = min(n2, math.floor(cap / n1 + 1e-9))
        return Candidate(design, n1, rounds, tasks_per_round=n2) if n2 >= 1 else None
    reachable = n1 / p * fed.total_tasks  # the lot at q2 = 1
    q2 = _round_down(min(1.0, cap / reachable))
    return Candidate(design, n1, rounds, task_rate=q2) if q2 > 0 else None


# ------------------------------------------------------------------------------------ search


@dataclass(frozen=True)
class _Precision:
    """How one calibration is done: the accountant, its grid and tolerance; exact or screening."""

    method: Method
    discretization: float
    exact: bool

    def screening(self) -> _Precision:
        grid = max(self.discretization, SCREEN_DISCRETIZATION)
        return _Precision(self.method, grid, False)


def evaluate(request: PlanRequest, candidate: Candidate, precision: _Precision) -> PlanRow | str:
    """Calibrate ``candidate`` with the accountant: its row, or why it is infeasible."""
    fed, budget = request.federation, request.budget
    tolerance = 1e-3 if precision.exact else SCREEN_TOLERANCE
    try:
        scheme = _scheme(candidate, fed)  # a baseline may not fit the federation
        z = calibrate_noise_multiplier(
            scheme, candidate.rounds, budget.epsilon, budget.delta,
            neighbouring=budget.neighbouring, method=precision.method,
            relative_tolerance=tolerance, discretization=precision.discretization,
        )  # fmt: skip
        z_grad = _gradient_share(z, request.adaptive_count_noise)
    except ValueError as error:
        return str(error)
    # The same event the server records for this configuration (server/fedmeta/server/plan.py).
    event = GaussianRound(scheme, z, candidate.tasks_per_round, budget.neighbouring)
    eps = budget.epsilon
    if precision.exact:
        groups = [(event, candidate.rounds)]
        eps = epsilon(groups, budget.delta, method=precision.method,
                      discretization=precision.discretization)  # fmt: skip
    lot = expected_lot(candidate, fed)
    return PlanRow(candidate, event, lot, z, z_grad, request.clip, eps, precision.exact,
                   request.dimension, request.signal_norm)  # fmt: skip


def _key(row: PlanRow | str | None) -> float:
    return row.rank_key if isinstance(row, PlanRow) else math.inf


def _climb(request: PlanRequest, precision: _Precision, design: Design, n1: int) -> PlanRow | str:
    """The best rounds for ``(design, n1)``: a local search over the rounds grid (module docstring).

    Screening calibrations unless the grid has one value (then that one is calibrated exactly).
    """
    grid = request.rounds_grid()
    how = precision if len(grid) == 1 else precision.screening()
    seen: dict[int, PlanRow | str | None] = {}

    def at(i: int) -> PlanRow | str | None:
        if i not in seen:
            c = design_candidate(request, design, n1, grid[i])
            seen[i] = None if c is None else evaluate(request, c, how)
        return seen[i]

    g, lot = request.compute.max_task_gradients, request.compute.max_tasks_per_round
    knee = g / lot if g is not None and lot is not None else grid[len(grid) // 2]
    i = min(range(len(grid)), key=lambda j: abs(math.log(grid[j] / knee)))
    while True:
        near = [j for j in (i - 1, i + 1) if 0 <= j < len(grid)]
        best = min(near, key=lambda j: _key(at(j)), default=i)
        if _key(at(best)) >= _key(at(i)):
            break
        i = best
    if _key(at(i)) == math.inf:  # no feasible neighbour to climb from: try the whole grid
        i = min(range(len(grid)), key=lambda j: _key(at(j)))
    found = at(i)
    if found is None:
        return f"{design} with {n1} participants per round: the compute caps allow no task"
    return found


#: ``progress(stage, done, total)``: called when a stage starts (``done = 0``) and after each of
#: its calibrations finishes.
Progress: TypeAlias = Callable[[str, int, int], None]


def _worker_init() -> None:
    # Ctrl-C reaches the whole process group: a worker ends at once, without a traceback of its
    # own, and the parent reports the interruption once. Only where the parent turns SIGINT into
    # KeyboardInterrupt: a parent that ignores it (started under nohup or as a background job of
    # a script) must not lose its workers to a signal it will never report.
    handler = signal.getsignal(signal.SIGINT)
    if handler is signal.default_int_handler or getattr(handler, "_reports_interrupt", False):
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def _pool_map(fn: Callable[..., PlanRow | str], jobs: Sequence[tuple[object, ...]],
              workers: int, stage: str = "", progress: Progress | None = None,
              ) -> list[PlanRow | str]:  # fmt: skip
    done: list[PlanRow | str] = []
    if progress is not None:
        progress(stage, 0, len(jobs))
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            done.append(fn(*job))
            if progress is not None:
                progress(stage, len(done), len(jobs))
        return done
    _quiet_broken_pool()
    with _interrupt_noticed() as interrupted:
        try:
            with ProcessPoolExecutor(max_workers=min(workers, len(jobs)),
                                     initializer=_worker_init) as pool:  # fmt: skip
                for result in pool.map(fn, *zip(*jobs, strict=True)):
                    done.append(result)
                    if progress is not None:
                        progress(stage, len(done), len(jobs))
        except BrokenProcessPool:
            if interrupted.is_set():  # the workers died of the Ctrl-C the parent did not report
                raise KeyboardInterrupt from None
            raise
    return done


#: What the parent's SIGINT handler does after noting the signal (a test swaps it).
_default_interrupt = signal.default_int_handler


@contextmanager
def _interrupt_noticed() -> Iterator[threading.Event]:
    """An event set by any SIGINT the parent receives while the pool runs.

    The KeyboardInterrupt a Ctrl-C raises can be lost: raised while the pool forks a worker, it
    lands in an at-fork hook, which only prints it ("Exception ignored"); the workers still die
    of the signal, and the pool then reports them as a broken pool. With the event set, that is
    reported as the interruption it was. Installed only where SIGINT raises KeyboardInterrupt,
    in the main thread (the only one that may set a handler).
    """
    noticed = threading.Event()
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):  # fmt: skip
        yield noticed
        return

    def note(signum: int, frame: FrameType | None) -> None:
        noticed.set()
        _default_interrupt(signum, frame)

    note._reports_interrupt = True  # type: ignore[attr-defined]  # a worker forked now: dies
    signal.signal(signal.SIGINT, note)
    try:
        yield noticed
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _quiet_broken_pool() -> None:
    """Keep the pool's own thread from printing a traceback after Ctrl-C (installed once).

    The workers die on the signal (``_worker_init``); while the pool shuts down, its management
    thread may try to fail futures the shutdown already cancelled and raise InvalidStateError
    (a race inside concurrent.futures). That is the interruption, which the command reports once;
    InvalidStateError is raised by nothing else in a plan.
    """
    previous = threading.excepthook
    if getattr(previous, "_fedmeta_quiet_pool", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if not issubclass(args.exc_type, InvalidStateError):
            previous(args)

    hook._fedmeta_quiet_pool = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def plan(
    request: PlanRequest,
    *,
    top: int = 10,
    method: Method = "pld",
    discretization: float = DEFAULT_DISCRETIZATION,
    workers: int = 1,
    progress: Progress | None = None,
) -> Plan:
    """Search ``request``'s space and return the ``top`` feasible rows, best ``rank_key`` first.

    Every returned row is calibrated exactly with ``method`` (``"pld"``: the enforced accountant)
    on ``discretization``; ``workers > 1`` runs calibrations in that many processes;
    ``progress(stage, done, total)`` hears of each finished calibration.
    """
    _integer("top", top, minimum=1, maximum=10_000)
    _integer("workers", workers, minimum=1, maximum=1024)
    exact = _Precision(method, discretization, True)
    p = request.federation.participants
    pairs = [
        (d, n1) for d in request.designs for n1 in request.stage_one_grid() if _applies(d, n1, p)
    ]
    found = _pool_map(_climb, [(request, exact, d, n1) for d, n1 in pairs], workers,
                      "searching", progress)  # fmt: skip
    notes = tuple(f for f in found if isinstance(f, str))
    screened = sorted((f for f in found if isinstance(f, PlanRow)), key=_key)
    if screened:  # re-calibrate exactly the best, and any within screening error of the last
        last = screened[min(top, len(screened)) - 1].rank_key * (1 + 3 * SCREEN_TOLERANCE)
        screened = [r for i, r in enumerate(screened) if i < top or r.rank_key <= last]
    todo = [r.candidate for r in screened if not r.exact]
    if request.baseline is not None:
        todo.append(request.baseline)
    redone = iter(_pool_map(evaluate, [(request, c, exact) for c in todo], workers,
                            "calibrating exactly", progress))  # fmt: skip
    rows = [r if r.exact else next(redone) for r in screened]
    baseline = next(redone) if request.baseline is not None else None
    if isinstance(baseline, str):
        raise ValueError(f"baseline must fit the federation and meet the budget: {baseline}")
    notes += tuple(r for r in rows if isinstance(r, str))
    ranked = sorted(
        (r for r in rows if isinstance(r, PlanRow)),
        key=lambda r: (r.rank_key, r.candidate.participants_per_round, r.candidate.rounds),
    )
    if not ranked:
        raise ValueError(notes[0] if notes else "designs must leave a configuration to search")
    return Plan(request, tuple(ranked[:top]), baseline, tuple(dict.fromkeys(notes)))
