"""A tuning release as the ledger records it: an RDP curve, composed with Gaussian rounds by RDP.

A private tuning run (accounting/tuning.py: a random number of trials, only the best released;
Papernot and Steinke 2022, Theorems 2 and 6) has no dominating pair the PLD accountant could
compose: its guarantee is an RDP curve. :class:`TuningRelease` holds that curve (its orders and
values, at task level and, where every candidate caps a participant's tasks per round, at
participant level), and the ledger records it as one spend beside its Gaussian rounds.

**Composition.** Wherever a multiset of recorded events holds a tuning release, its epsilon is
the RDP conversion of the sum of every event's RDP curve (RDP composes by addition, Mironov 2017,
Proposition 1; adaptive composition included), converted once at delta with dp-accounting's
``compute_epsilon`` (Canonne, Kamath, Steinke 2020 conversion: an upper bound). That errs high
against the PLD the ledger uses for Gaussian rounds alone, never low. A multiset without one is
composed exactly as before (composition.py: PLD).

**Orders.** A release's curve is read on ``RDP_ORDERS`` at the smallest recorded order at or above
each one (RDP is non-decreasing in the order, van Erven and Harremoes 2014, Theorem 3, so that
value bounds the order asked for; infinite where none is recorded): a release recorded on another
grid still composes, erring high.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from fedmeta.accounting.levels import check_one_level, lowered
from fedmeta.accounting.pairs import round_components
from fedmeta.accounting.rdp import RDP_ORDERS, rdp_curve
from fedmeta.accounting.sample_level import KIND as SAMPLE_LEVEL_KIND
from fedmeta.accounting.sample_level import SampleLevelRound
from fedmeta.accounting.schemes import (
    NEIGHBOURING_RELATIONS,
    GaussianRound,
    Neighbouring,
    Unit,
    check_delta,
    check_unit,
)

_Floats: TypeAlias = npt.NDArray[np.float64]
#: The ``kind`` a recorded event's JSON carries when it is a tuning release (rounds carry none).
KIND = "tuning_release"
#: Largest count of one event an affordability search tries (composition's MAX_ROUNDS_LIMIT).
_SEARCH_LIMIT = 10**9


def _curve(name: str, values: object, length: int) -> tuple[float, ...]:
    if not isinstance(values, tuple) or len(values) != length:
        raise ValueError(f"{name} must be a tuple of {length} RDP values; got {values!r}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v) or v < 0:
            raise ValueError(f"{name} must hold RDP values >= 0 (inf allowed); got {v!r}")
    return values


@dataclass(frozen=True)
class TuningRelease:
    """The RDP curve of one tuning release (its best trial), as recorded in the ledger.

    ``orders`` strictly increasing, all > 1; ``task`` the task-level curve at them;
    ``participant`` the participant-level one, or ``None`` where no bound exists (a candidate
    without a per-participant cap); ``max_tasks_per_participant``: the largest cap among the
    candidates (``None`` with ``participant``); ``description``: the public plan (law of the
    number of trials, candidates' rounds), for the operator.
    """

    orders: tuple[float, ...]
    task: tuple[float, ...]
    participant: tuple[float, ...] | None
    max_tasks_per_participant: int | None
    neighbouring: Neighbouring
    description: str

    def __post_init__(self) -> None:
        a = self.orders
        if not isinstance(a, tuple) or not a or any(
            isinstance(x, bool) or not isinstance(x, int | float) or not x > 1 for x in a
        ):
            raise ValueError(f"orders must be a non-empty tuple of numbers > 1; got {a!r}")
        if any(y <= x for x, y in zip(a, a[1:], strict=False)):
            raise ValueError("orders must be strictly increasing")
        _curve("task", self.task, len(a))
        if (self.participant is None) != (self.max_tasks_per_participant is None):
            raise ValueError("participant and max_tasks_per_participant are given together")
        if self.participant is not None:
            _curve("participant", self.participant, len(a))
        if self.neighbouring not in NEIGHBOURING_RELATIONS:
            raise ValueError(f"neighbouring must be one of {NEIGHBOURING_RELATIONS}; got "
                             f"{self.neighbouring!r}")  # fmt: skip
        if not isinstance(self.description, str):
            raise ValueError(f"description must be a string; got {self.description!r}")

    @property
    def participant_cap(self) -> int | None:
        """The most tasks one participant contributed per round in any trial, when known."""
        return self.max_tasks_per_participant

    def curve(self, unit: Unit) -> _Floats:
        """The curve on ``RDP_ORDERS`` (module docstring, "Orders"); infinite where unbounded."""
        check_unit(unit)
        values = self.task if unit == "task" else self.participant
        if values is None:
            return np.full(len(RDP_ORDERS), np.inf)
        stored = np.asarray(self.orders)
        at = np.searchsorted(stored, np.asarray(RDP_ORDERS), side="left")
        padded = np.append(np.asarray(values, dtype=np.float64), np.inf)
        return np.asarray(padded[at], dtype=np.float64)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (infinite values as ``None``); ``TuningRelease.from_dict`` inverts it."""
        def spell(values: tuple[float, ...] | None) -> list[float | None] | None:
            return None if values is None else [v if math.isfinite(v) else None for v in values]

        return {"kind": KIND, "orders": list(self.orders), "task": spell(self.task),
                "participant": spell(self.participant), "neighbouring": self.neighbouring,
                "max_tasks_per_participant": self.max_tasks_per_participant,
                "description": self.description}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TuningRelease:
        """Rebuild (and re-validate) a release from ``to_dict`` output."""
        def read(values: list[float | None] | None) -> tuple[float, ...] | None:
            return None if values is None else tuple(
                math.inf if v is None else float(v) for v in values
            )

        if data.get("kind") != KIND:
            raise ValueError(f"kind must be {KIND!r}; got {data.get('kind')!r}")
        task = read(data["task"])
        if task is None:
            raise ValueError("task must hold the task-level curve; got null")
        return cls(tuple(float(a) for a in data["orders"]), task, read(data["participant"]),
                   data["max_tasks_per_participant"], data["neighbouring"],
                   data["description"])  # fmt: skip


#: What a ledger record's event is: a Gaussian round, a tuning release or a sample-level round.
Recorded: TypeAlias = GaussianRound | TuningRelease | SampleLevelRound


def recorded_from_dict(data: dict[str, Any]) -> Recorded:
    """A recorded event from its JSON: by its ``kind`` if it has one, else a task-level round."""
    if isinstance(data, dict) and data.get("kind") == SAMPLE_LEVEL_KIND:
        return SampleLevelRound.from_dict(data)
    if isinstance(data, dict) and "kind" in data:
        return TuningRelease.from_dict(data)
    return GaussianRound.from_dict(data)


def holds_release(rounds: Sequence[Any]) -> bool:
    """Whether a list of ``(event, count)`` holds a tuning release (so composes by RDP)."""
    return any(isinstance(item, tuple) and item and isinstance(item[0], TuningRelease)
               for item in rounds)  # fmt: skip


def recorded_rdp(rounds: Sequence[tuple[Recorded, int]], unit: Unit) -> _Floats:
    """RDP on ``RDP_ORDERS`` of ``(event, count)`` pairs composed (the module docstring)."""
    total = np.zeros(len(RDP_ORDERS))
    relations = set()
    for item in rounds:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ValueError(f"rounds must be a sequence of (event, count); got {item!r}")
        event, count = item
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an integer >= 0; got {count!r}")
        if not count:
            continue
        relations.add(event.neighbouring)
        if isinstance(event, TuningRelease):
            curve = event.curve(unit)
        elif isinstance(event, GaussianRound | SampleLevelRound):
            curve = np.asarray(rdp_curve(round_components(lowered(event), unit)))
        else:
            raise ValueError(f"rounds entries must start with a round or release; got {event!r}")
        with np.errstate(invalid="ignore"):
            total = total + count * curve
    if len(relations) > 1:
        raise ValueError(f"neighbouring must be the same for all rounds; got {sorted(relations)}")
    check_one_level(item[0] for item in rounds if item[1])
    return np.where(np.isnan(total), np.inf, total)


def rdp_to_epsilon(total: _Floats, delta: float) -> float:
    """Epsilon at ``delta`` of an RDP curve on ``RDP_ORDERS`` (dp-accounting; errs high)."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    if not np.any(total):
        return 0.0
    if np.all(np.isinf(total)):
        return math.inf
    eps, _ = rdp_lib.compute_epsilon(np.asarray(RDP_ORDERS), total, float(delta))
    return float(eps)


def release_epsilon(rounds: Sequence[tuple[Recorded, int]], delta: float, unit: Unit) -> float:
    """Epsilon of rounds and tuning releases composed by RDP (the module docstring)."""
    check_delta(delta)
    return rdp_to_epsilon(recorded_rdp(rounds, unit), delta)


def release_affordable(
    groups: Sequence[tuple[Recorded, int]], event: GaussianRound | SampleLevelRound,
    epsilon_budget: float,
    delta: float, unit: Unit,
) -> int:  # fmt: skip
    """How many more rounds like ``event`` fit beside ``groups`` (RDP; gallop then bisect)."""
    check_delta(delta)
    base = recorded_rdp(groups, unit)
    step = recorded_rdp([(event, 1)], unit)

    def fits(n: int) -> bool:
        with np.errstate(invalid="ignore"):  # 0 * inf: no rounds add nothing
            total = base + np.where(np.isinf(step) & (n == 0), 0.0, n * step)
        return rdp_to_epsilon(total, delta) <= epsilon_budget

    if not fits(0):
        return 0
    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > _SEARCH_LIMIT:
            return _SEARCH_LIMIT if fits(_SEARCH_LIMIT) else lo
    while hi - lo > 1:  # epsilon grows with n: fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo

