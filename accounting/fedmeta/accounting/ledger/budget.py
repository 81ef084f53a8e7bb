"""Budget rules: ``BudgetLedger`` (check, then commit) and the affordable-rounds search."""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from fedmeta.accounting.composition import MAX_ROUNDS_LIMIT, Method, epsilon
from fedmeta.accounting.ledger.anchor import (
    check_anchor,
    check_witness,
    current_anchor,
)
from fedmeta.accounting.ledger.chain import (
    canonical_json,
    cohort_id,
)
from fedmeta.accounting.ledger.cohorts import (
    participant_key,
    participant_rows,
    record_cohort,
)
from fedmeta.accounting.ledger.epsilon_cache import EpsilonCache, composition_key
from fedmeta.accounting.ledger.individual import LedgerIndividual
from fedmeta.accounting.ledger.participants import Multiset, multiset
from fedmeta.accounting.ledger.projection import Exposures, SpendProjection
from fedmeta.accounting.ledger.public import PublicDataUse, record_public_use
from fedmeta.accounting.ledger.records import (
    SPEND_ATTEMPTS,
    BudgetExhausted,
    LedgerError,
    LedgerMode,
    Participant,
    ParticipantExposure,
    SpendRecord,
)
from fedmeta.accounting.ledger.registration import check_registration, register_federation
from fedmeta.accounting.ledger.storage import (
    absolute_path,
    check_federation_id,
    check_mode,
    check_neighbouring,
    classify_error,
    closed_on_error,
    connect_writable,
    ensure_schema,
    file_identity,
    immediate_transaction,
    read_transaction,
)
from fedmeta.accounting.levels import AnyRound, check_round
from fedmeta.accounting.schemes import (
    GaussianRound,
    Neighbouring,
    Unit,
    check_delta,
    check_unit,
)
from fedmeta.accounting.tuning_release import Recorded


def _base(counts: Mapping[Recorded, int], event: AnyRound) -> tuple[Any, ...]:
    """The recorded rounds other than ``event``: what its affordable total depends on."""
    return tuple(sorted(((e, c) for e, c in counts.items() if e != event), key=repr))


class BudgetLedger(LedgerIndividual):
    """A federation's privacy budget, enforced against its durable record of spends.

    Open with ``BudgetLedger.open(path, federation_id, epsilon_budget, delta)`` to spend, or
    ``BudgetLedger.open_readonly(path, federation_id)`` to read. Several runs over the same data
    share one ``federation_id`` (``resolve_federation``) and so compose. The enforced guarantee is
    the PLD epsilon at ``delta`` for ``unit`` (task level by default).
    """

    #: Composed epsilons kept between processes (``keep_epsilons``); None: composed every time.
    _epsilon_cache: EpsilonCache | None = None

    # ---------------------------------------------------------------------------------- opening

    @classmethod
    def open(
        cls,
        path: str | Path,
        federation_id: str,
        epsilon_budget: float | None = None,
        delta: float | None = None,
        *,
        unit: Unit = "task",
        create: bool = True,
        neighbouring: Neighbouring | None = None,
        mode: LedgerMode = "secure",
        participants: Sequence[Participant] | None = None,
    ) -> BudgetLedger:
        """Open (creating if needed) the ledger at ``path`` for ``federation_id`` and verify it.

        ``participants``: who the run's rounds may sample (``use_cohort``); ``None`` charges every
        round to every participant of the federation (conservative).

        An existing federation keeps the budget, delta, unit and neighbouring relation it was
        registered with; passing different ones is an error (a budget is never raised silently).
        ``epsilon_budget``/``delta`` may be ``None`` to use the stored ones; ``neighbouring=None``
        uses the stored relation (``add_remove`` for a new federation). ``mode`` is ``"insecure"``
        for runs with reproducible test noise: such runs never share a ledger with secure ones.
        """
        path = absolute_path(path)
        check_federation_id(federation_id)
        if epsilon_budget is not None and not (
            isinstance(epsilon_budget, int | float)
            and not isinstance(epsilon_budget, bool)
            and math.isfinite(epsilon_budget)
            and epsilon_budget > 0
        ):
            raise ValueError(f"epsilon_budget must be a finite number > 0; got {epsilon_budget!r}")
        if delta is not None:
            check_delta(delta)
        check_unit(unit)
        check_neighbouring(neighbouring)
        check_mode(mode)
        conn = connect_writable(path, create=create)
        with closed_on_error(conn, path):
            identity = file_identity(path)
            meta = ensure_schema(conn, path, mode)
            row = register_federation(
                conn, path, federation_id, epsilon_budget, delta, unit, neighbouring, create
            )
            check_registration(federation_id, row, epsilon_budget, delta, unit, neighbouring)
            ledger = cls(conn, path, meta, federation_id, row, readonly=False, identity=identity)
            ledger._inherit()
            ledger._catch_up()  # a damaged chain is reported as such before any anchor check
            with read_transaction(conn):
                check_anchor(conn, path, meta.get("ledger_id"))
            if participants is not None:
                ledger.use_cohort(participants)
        return ledger

    # ---------------------------------------------------------------------------------- reading

    def rounds(self) -> list[tuple[Recorded, int]]:
        """The rounds of the most exposed participant, ``[(event, count)]``, first seen first.

        With one cohort (or none) that is every record; with several, the participant whose
        composition has the largest epsilon (the one ``epsilon`` reports).
        """
        self._catch_up()
        counts = self._worst(self.unit, "pld")[0]
        order = {r.event: i for i, r in reversed(list(enumerate(self._records)))}
        return sorted(counts, key=lambda ec: order.get(ec[0], -1))

    def epsilon(self, unit: Unit | None = None, method: Method = "pld") -> float:
        """Epsilon spent so far at the ledger's delta: the maximum over participants.

        Recomputed from the records: each participant's rounds composed (PLD or RDP), once per
        distinct multiset of rounds (cached).
        """
        self._catch_up()
        return self._worst(unit or self.unit, method)[1]

    def exposures(self, unit: Unit | None = None) -> Exposures:
        """What ``epsilon`` maximises over now: each maximal participant group's rounds.

        ``exposures().epsilon()`` equals ``epsilon(unit)`` (projection.py), and is pure data.
        """
        self._catch_up()
        groups = tuple(multiset(self._exposure.counts(s)) for s in self._exposure.signatures(None))
        return Exposures(groups, self.delta, unit or self.unit)

    def projection(self, event: GaussianRound, unit: Unit | None = None) -> SpendProjection:
        """The exposures now and which groups this ledger's next spends of ``event`` reach.

        Those of the current cohort (``use_cohort``), or every group without one; a guess of the
        exposures to come (projection.py), never a substitute for reading them after a spend.
        """
        now = self.exposures(unit)
        cohort = None if self._cohort is None else self._cohort[0]
        charged = tuple(cohort is None or cohort in s for s in self._exposure.signatures(None))
        return SpendProjection(now, event, charged)

    def participants(self, unit: Unit | None = None) -> list[ParticipantExposure]:
        """Every participant of the federation with its own rounds and epsilon, by name.

        The operator's table: private like the ledger itself.
        """
        self._catch_up()
        rows = participant_rows(self._conn, self.federation_id)
        out = []
        for key, sig in sorted(self._exposure.signature_of().items()):
            counts = multiset(self._exposure.counts(sig))
            name, *digests = rows.get(key, [key])
            eps = self._composed(counts, unit or self.unit, "pld")
            out.append(ParticipantExposure(key, name, sum(c for _, c in counts), eps, len(digests),
                                           self._runs_charged(sig)))  # fmt: skip
        return sorted(out, key=lambda p: (p.name, p.key))

    def keep_epsilons(self, cache: EpsilonCache) -> None:
        """Look each composition up in ``cache`` first, and keep there what is composed here.

        Only under the hash of its whole input (epsilon_cache.py): what the records give now.
        """
        self._epsilon_cache = cache

    def keep_figures(self) -> None:
        """Compose what ``fedmeta ledger show`` prints: PLD and RDP by task, RDP by participant.

        With ``keep_epsilons`` set, the first show after a run reads them from the cache instead of
        importing the composition libraries (issue 54). Nothing is read from the cache here.
        """
        self.epsilon()
        self.epsilon(method="rdp")
        try:
            self.epsilon(unit="participant", method="rdp")
        except ValueError:  # no participants, or no recorded cap: ledger show prints none either
            pass

    def _composed(self, counts: Multiset, unit: Unit, method: Method) -> float:
        """Epsilon of one participant's rounds (cached per distinct multiset)."""
        key = (counts, unit, method)
        if key not in self._epsilons:
            self._epsilons[key] = self._recalled_or_composed(counts, unit, method)
        return self._epsilons[key]

    def _recalled_or_composed(self, counts: Multiset, unit: Unit, method: Method) -> float:
        kept = self._epsilon_cache
        if kept is None:
            return epsilon(list(counts), self.delta, unit, method)
        name = composition_key(counts, self.delta, unit, method)
        found = kept.get(name)
        if found is None:
            found = epsilon(list(counts), self.delta, unit, method)
            kept.put(name, found)
        return found

    def _worst(self, unit: Unit, method: Method) -> tuple[Multiset, float]:
        """The most exposed participant's rounds and epsilon, over every participant."""
        worst: tuple[Multiset, float] = ((), 0.0)
        for sig in self._exposure.signatures(None):
            counts = multiset(self._exposure.counts(sig))
            eps = self._composed(counts, unit, method)
            if eps > worst[1] or not worst[0]:
                worst = (counts, eps)
        return worst

    # -------------------------------------------------------------------------------- cohorts

    def use_cohort(self, participants: Sequence[Participant]) -> None:
        """Charge the following spends to ``participants`` (those the rounds may sample).

        Recorded (cohort, names and data digests) in the ledger at once, so a reader sees who
        the next spends are charged to. A participant that declares its items is charged to
        every data record they overlap (ledger/overlap.py). On a read-only ledger only the
        checks use it. An empty sequence: the spends are charged to nobody (a round of the
        individual filter in which every participant's allowance is spent, individual.py); it is
        recorded all the same, so the number of spends stays public.
        """
        if self.readonly:
            charged = self._charged(participants, write=False)
            keys = frozenset(participant_key(self._salt, p.identity) for p in charged)
            self._cohort = (cohort_id(self.federation_id, sorted(keys)), keys)
            return
        try:
            with immediate_transaction(self._conn):
                charged = self._charged(participants, write=True)
                cid, keys = record_cohort(self._conn, self.federation_id, self._salt, charged)
        except sqlite3.Error as error:
            raise classify_error(self.path, error) from error
        self._cohort = (cid, keys)
        self._catch_up()

    def record_public_use(self, use: PublicDataUse, run_id: str) -> None:
        """Declare, before the run's first spend, the public data it used (ledger/public.py).

        Spends nothing; recorded once per run (a resumed run's repeat is a no-op).
        """
        self._refuse_readonly("recording public data")
        if not isinstance(use, PublicDataUse):
            raise TypeError(f"use must be a PublicDataUse; got {type(use).__name__}")
        try:
            with immediate_transaction(self._conn):
                record_public_use(self._conn, self.federation_id, run_id, use)
        except sqlite3.Error as error:
            raise classify_error(self.path, error) from error

    # ---------------------------------------------------------------------------------- witness

    def watch(self, witness: Path) -> None:
        """Check the ledger against a witness outside its state directory, and keep it current.

        Refuses (``LedgerRolledBack``) a ledger behind it (anchor.py, ``check_witness``); from
        now on every spend writes the witness too, after the anchor beside the ledger.
        """
        try:
            with read_transaction(self._conn):
                check_witness(self._conn, self.path, self.ledger_id, witness)
        except sqlite3.Error as error:
            raise classify_error(self.path, error) from error
        self._witness = witness

    def anchor(self) -> dict[str, Any] | None:
        """Where the whole ledger stands (id, spend count, last spend's row and hash), or None.

        Released with every run's outputs (summary, checkpoints), so that a ledger restored to
        an older state is caught by anyone holding a later output.
        """
        if self.ledger_id is None:
            return None
        try:
            with read_transaction(self._conn):
                now = current_anchor(self._conn, self.ledger_id)
        except sqlite3.Error as error:
            raise classify_error(self.path, error) from error
        return None if now is None else now.to_dict()


    # ---------------------------------------------------------------------------------- budget

    def _checks(self, event: AnyRound) -> list[tuple[tuple[Any, ...], int]]:
        """Per most exposed group of the cohort: (its rounds but ``event``, its ``event`` count).

        Only maximal groups matter (participants.py: a subset composes to less).
        """
        among = None if self._cohort is None else self._cohort[1]
        if among is not None and not among:
            return []  # charged to nobody: no participant's composition changes
        out = []
        for sig in self._exposure.signatures(among):
            counts = self._exposure.counts(sig)
            out.append((_base(counts, event), counts.get(event, 0)))
        return out

    def rounds_affordable(self, event: AnyRound) -> int:
        """How many more rounds like ``event`` the budget allows (exact under PLD).

        The minimum over the participants the next rounds may sample: a round is refused when it
        would take any of them over the budget. ``LevelMismatch`` for a round of another level.
        Charged to nobody (an empty cohort): ``MAX_ROUNDS_LIMIT``, no participant limits it.
        """
        check_round(event)
        self._catch_up()
        self._check_level(event)
        left = [self._max_total(base, event) - count for base, count in self._checks(event)]
        return max(0, min(left, default=MAX_ROUNDS_LIMIT))

    def would_exceed(self, event: AnyRound) -> bool:
        """Dry run: return whether spending ``event`` now would take epsilon above the budget."""
        return self.rounds_affordable(event) < 1

    def _check_spend(self, event: AnyRound, run_id: str, round_index: int) -> None:
        self._refuse_readonly("spending")
        check_round(event)
        if not isinstance(run_id, str) or not run_id:
            raise ValueError(f"run_id must be a non-empty string; got {run_id!r}")
        if isinstance(round_index, bool) or not isinstance(round_index, int) or round_index < 0:
            raise ValueError(f"round_index must be an integer >= 0; got {round_index!r}")
        if event.neighbouring != self.neighbouring:
            raise LedgerError(
                f"neighbouring must match the federation's: {self.federation_id!r} composes "
                f"{self.neighbouring!r} rounds, this round is {event.neighbouring!r}; a "
                "composition never mixes relations"
            )

    def spend(self, event: AnyRound, run_id: str, round_index: int) -> SpendRecord:
        """Record one round, or raise ``BudgetExhausted`` having recorded nothing.

        Call before releasing the noisy update: when this returns, the record is durable and the
        main ledger file holds it. The affordability search runs before the write lock is taken;
        the lock is held for the catch-up, the re-check and the append (milliseconds).
        """
        self._check_spend(event, run_id, round_index)
        event_json = canonical_json(event.to_dict())
        for _ in range(SPEND_ATTEMPTS):
            self._catch_up()
            self._check_level(event)
            checks = self._checks(event)
            totals = [self._max_total(base, event) for base, _ in checks]  # outside the lock
            outcome = self._append_or_explain(
                event, event_json, run_id, round_index, checks, totals
            )
            if isinstance(outcome, SpendRecord):
                return outcome
            if outcome == "exhausted":
                raise self._exhausted(event)
        raise LedgerError(
            f"spend on federation {self.federation_id!r} gave up after {SPEND_ATTEMPTS} attempts: "
            "other processes kept recording other kinds of round meanwhile; nothing was recorded"
        )

    def _exhausted(self, event: AnyRound) -> BudgetExhausted:
        after = max(
            epsilon([*base, (event, count + 1)], self.delta, self.unit)
            for base, count in self._checks(event)
        )
        return BudgetExhausted(
            f"budget exhausted for federation {self.federation_id!r}: this round would take the "
            f"epsilon of a participant it may sample to {after:.4g} > budget "
            f"{self.epsilon_budget:g} (delta {self.delta:g}, {self.unit} level); nothing was "
            "recorded",
            epsilon_after=after,
            epsilon_budget=self.epsilon_budget,
        )

    def _append_or_explain(
        self,
        event: AnyRound,
        event_json: str,
        run_id: str,
        round_index: int,
        checks: list[tuple[tuple[Any, ...], int]],
        totals: list[int],
    ) -> SpendRecord | Literal["exhausted", "changed"]:
        """``_append``, with a file-system fault (full disk, read-only) turned into one line.

        The transaction was rolled back, so nothing was recorded, and the caller releases nothing.
        Should the commit have landed despite the error (SQLite reported it after its commit
        point), the record is read back and returned, so the round is released exactly when its
        spend is in the ledger.
        """
        known = len(self._records)
        try:
            return self._append(event, event_json, run_id, round_index, checks, totals)
        except sqlite3.Error as error:
            fault = classify_error(self.path, error)
            try:
                self._catch_up()
            except LedgerError:
                raise fault from error
            landed = self._records[known:]
            if landed and (landed[-1].run_id, landed[-1].round_index) == (run_id, round_index):
                return landed[-1]
            raise fault from error

    def _append(
        self,
        event: AnyRound,
        event_json: str,
        run_id: str,
        round_index: int,
        checks: list[tuple[tuple[Any, ...], int]],
        totals: list[int],
    ) -> SpendRecord | Literal["exhausted", "changed"]:
        """Under the write lock: catch up, re-check against ``total`` and append.

        Returns ``"changed"`` (nothing written) when records of other kinds arrived since
        ``totals`` were computed for ``checks``: the caller searches again outside the lock.
        """
        with immediate_transaction(self._conn):
            self._catch_up()
            self._check_level(event)  # the first spend of the other level may just have landed
            now = self._checks(event)
            if [base for base, _ in now] != [base for base, _ in checks]:
                return "changed"
            if any(count + 1 > total for (_, count), total in zip(now, totals, strict=True)):
                return "exhausted"
            done = self._insert(event, event_json, run_id, round_index)
        return self._committed(*done)
