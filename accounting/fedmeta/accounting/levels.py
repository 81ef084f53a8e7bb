"""Privacy levels of recorded spends: task level and sample level (issue 53), never mixed.

A task-level round (``GaussianRound``) and a tuning release (``TuningRelease``) protect one task of
one participant (add/remove or replace one task); a sample-level round (``SampleLevelRound``)
protects one example of one participant (add/remove one example). The two relations are not
nested: a task is a group of examples (its support and query sets), and one example is in many
tasks (up to 276 per round in fedmeta's Omniglot configurations, docs/results.md). Converting one
guarantee into the other costs group privacy over that many neighbours, ``k``: epsilon becomes
``k epsilon`` (group privacy for pure DP, Dwork and Roth 2014, "The algorithmic foundations of
differential privacy") and delta ``sum_{i<k} e^{i epsilon} delta <= k e^{(k-1) epsilon} delta``
(chaining the definition k times; the group-privacy lemma of Vadhan 2017, "The complexity of
differential privacy", states the looser ``k e^{k epsilon} delta``),
which leaves nothing of either budget. So a composition never mixes levels (``check_one_level``,
as composition.py never mixes neighbouring relations) and the ledger refuses a spend whose level
differs from the level its data already recorded (ledger/appending.py, docs/ledger.md).

A sample-level round composes through its dominating task-level pair (``lowered``: the round of
``sample_level.dominating_round``, an accounting device that is never recorded).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, TypeAlias

from fedmeta.accounting.sample_level import SampleLevelRound, dominating_round
from fedmeta.accounting.schemes import GaussianRound

Level: TypeAlias = Literal["task", "sample"]
LEVELS: tuple[Level, ...] = ("task", "sample")
#: A round the ledger can spend: task level or sample level.
AnyRound: TypeAlias = GaussianRound | SampleLevelRound


def level_of(event: object) -> Level:
    """``"sample"`` for a sample-level round; ``"task"`` for a task round or tuning release."""
    return "sample" if isinstance(event, SampleLevelRound) else "task"


def check_round(event: object) -> AnyRound:
    """``event`` if it is a round the ledger spends (either level), else a ValueError."""
    if not isinstance(event, GaussianRound | SampleLevelRound):
        raise ValueError(f"round must be a GaussianRound or a SampleLevelRound; got {event!r}")
    return event


def lowered(event: AnyRound) -> GaussianRound:
    """The task-level round whose pair dominates ``event`` (``event`` itself at task level)."""
    return dominating_round(event) if isinstance(event, SampleLevelRound) else event


def check_one_level(events: Iterable[object]) -> None:
    """Refuse events of both levels in one composition (the module docstring says why)."""
    found = sorted({level_of(e) for e in events})
    if len(found) > 1:
        raise ValueError(
            "level must be the same for all rounds (task-level and sample-level guarantees "
            f"protect different neighbours and never compose); got {found}"
        )
