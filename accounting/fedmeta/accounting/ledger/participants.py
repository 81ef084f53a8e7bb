"""Per-participant composition: which recorded rounds each participant's data was exposed to.

The budget belongs to a participant's data (privacy-accounting note, section 4, "Budgets across
runs belong to participants"). Under task-level DP the differing task lives in one participant
``p``; a round that could not have sampled ``p`` does not depend on ``p``'s tasks. So the privacy
loss of any task of ``p`` is at most the composition of the events of the rounds that could have
sampled ``p`` (adaptive composition, Dwork and Roth 2014, Theorem 3.20 for the (eps, delta) form;
the ledger composes PLDs, Koskela et al. 2020 / Doroshenko et al. 2022), and the guarantee of the
whole history is the maximum over participants.

Each recorded round names its *cohort*: the participants it could have sampled (every participant
registered for the run). A record with no cohort (written before per-participant budgets, or by a
caller that names none) is charged to *every* participant: conservative.

Participants with the same set of cohorts have the same multiset of events: they are composed
once (the cache key is the multiset). Enforcement needs only the *maximal* sets: if participant
``a``'s cohorts are a subset of ``b``'s, ``a``'s rounds are a sub-multiset of ``b``'s, and the
composition of a part is post-processing of the composition of the whole (drop the other
outputs), so ``eps(a) <= eps(b)`` for the true guarantee; the ledger's PLD numbers are
pessimistic upper bounds of the true ones, so checking ``b`` against the budget also covers ``a``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from fedmeta.accounting.tuning_release import Recorded

#: A multiset of events, canonically ordered: the composition's input and its cache key.
Multiset = tuple[tuple[Recorded, int], ...]
Signature = frozenset[str]


def multiset(counts: Counter[Recorded]) -> Multiset:
    """The canonical (sorted, positive) form of ``counts``."""
    return tuple(sorted(((e, c) for e, c in counts.items() if c > 0), key=lambda ec: repr(ec[0])))


def maximal(signatures: Iterable[Signature]) -> list[Signature]:
    """The signatures that are not a strict subset of another (the ones enforcement needs)."""
    distinct = sorted(set(signatures), key=lambda s: (-len(s), sorted(s)))
    out: list[Signature] = []
    for sig in distinct:
        if not any(sig < kept for kept in out):
            out.append(sig)
    return out


@dataclass
class Exposure:
    """Recorded rounds by cohort, and which cohorts each participant was in (in memory)."""

    everyone: Counter[Recorded] = field(default_factory=Counter)
    by_cohort: dict[str, Counter[Recorded]] = field(default_factory=dict)
    members: dict[str, frozenset[str]] = field(default_factory=dict)
    _of: dict[str, Signature] | None = None  # participant -> its cohorts (rebuilt on a new cohort)

    def add_cohort(self, cohort_id: str, participants: Collection[str]) -> None:
        """Make a cohort known (idempotent)."""
        if cohort_id not in self.members:
            self.members[cohort_id] = frozenset(participants)
            self.by_cohort.setdefault(cohort_id, Counter())
            self._of = None

    def add(self, event: Recorded, cohort_id: str | None) -> None:
        """Count one recorded round against its cohort (``None``: against every participant)."""
        if cohort_id is None:
            self.everyone[event] += 1
        else:
            self.by_cohort[cohort_id][event] += 1

    def signature_of(self) -> dict[str, Signature]:
        """Every known participant's set of cohorts."""
        if self._of is None:
            of: dict[str, set[str]] = {}
            for cohort_id, people in self.members.items():
                for p in people:
                    of.setdefault(p, set()).add(cohort_id)
            self._of = {p: frozenset(s) for p, s in of.items()}
        return self._of

    def signatures(self, among: Collection[str] | None) -> list[Signature]:
        """The maximal signatures of the participants ``among`` (``None``: every participant).

        A participant never seen has the empty signature (only the rounds charged to everyone).
        """
        of = self.signature_of()
        if among is None:
            found = set(of.values()) or {frozenset()}
        else:
            found = {of.get(p, frozenset()) for p in among} or {frozenset()}
        return maximal(found)

    def counts(self, signature: Signature) -> Counter[Recorded]:
        """The rounds charged to a participant whose cohorts are ``signature``."""
        total = Counter(self.everyone)
        for cohort_id in signature:
            total.update(self.by_cohort[cohort_id])
        return total
