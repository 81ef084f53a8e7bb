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
from typing import TypeAlias

from fedmeta.accounting.adaptive import gradient_noise_multiplier
from fedmeta.accounting.calibration import calibrate_noise_multiplier
from fedmeta.accounting.composition import (
    DEFAULT_DISCRETIZATION,
    Method,
    epsilon,
)
from fedmeta.accounting.plan_request import (
    Candidate,
    Design,
    Federation,
    Plan,
    PlanRequest,
    PlanRow,
    checked_integer,
    expected_lot,
)
from fedmeta.accounting.schemes import (
    GaussianRound,
    TwoStageFixedScheme,
    TwoStagePoissonScheme,
)

#: Screening calibrations: a coarser pessimistic PLD grid (still an upper bound) and 1% tolerance.
SCREEN_DISCRETIZATION = 1e-3
SCREEN_TOLERANCE = 1e-2
#: Significant digits of a planned Poisson rate (rounded down: the lot stays within the caps).
RATE_DIGITS = 4


# ------------------------------------------------------------------------------------ inputs


# ------------------------------------------------------------------------------------ outputs


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
    checked_integer("top", top, minimum=1, maximum=10_000)
    checked_integer("workers", workers, minimum=1, maximum=1024)
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
