"""Task-level epsilon in every round's record, computed ahead of the rounds in a background thread.

The enforced epsilon after a round is a PLD composition: 0.01-0.45 s for the default job, 0.01-1.1 s
for configs/omniglot-5way-cpu.toml's scheme, 0.5-1.9 s for a fixed stage 2 (means on a loaded core,
docs/benchmarks.md "Epsilon every round"), too slow to compute inside every round. But it is a
function of the ledger's exposures alone (accounting/fedmeta/accounting/ledger/projection.py), and a
run's next spends
are known before they happen: the same event, charged to the same cohort. So before each round the
run asks the ledger for its :class:`SpendProjection` and :class:`EpsilonCurve` computes, in a
background thread, the epsilon of the exposures after this and the next few rounds. After the spend
the run reads the ledger's *actual* exposures and looks up their epsilon: when the guess held
(nothing else was spent, the cohort stayed) the value is already there; when it did not, the actual
exposures are computed next. Either way the value is ``Exposures.epsilon``, the function
``BudgetLedger.epsilon`` evaluates on the same exposures: the same float, never a guess, and a
pessimistic PLD bound that errs high (accounting/fedmeta/accounting/composition.py).

A round whose value is not computed yet when the round ends waits for it (its record is made after):
whether a value were ready would depend on how long the round's work took, which depends on its
stage-2 sample, so "not yet" in a record or progress line would publish that. The wait is one
composition at most and usually none: the thread computes each round's value while the round runs
(no wait in 600 rounds of the default job, docs/benchmarks.md). The values are public (the event,
the ledger's counts), so computing them ahead releases nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from fedmeta.accounting import Exposures, SpendProjection
from fedmeta.accounting.ledger.projection import GroupCache

log = logging.getLogger("fedmeta.server")

#: Rounds computed ahead of the one in progress (values of rounds a run never reaches are wasted:
#: at most this many compositions).
AHEAD = 3


class EpsilonCurve:
    """Epsilons of exposures, computed by one background thread: needed ones first, then guesses.

    ``guess`` replaces the exposures the next rounds will probably want; ``get`` answers without
    waiting; ``wait`` puts its exposures first and waits. A failed composition is logged and leaves
    its value absent; nothing here raises into the run.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._values: dict[Exposures, float] = {}
        self._failed: set[Exposures] = set()
        self._needed: list[Exposures] = []
        self._guesses: list[Exposures] = []
        self._busy: Exposures | None = None
        self._closed = False
        self._groups: GroupCache = {}  # the worker's alone
        self._thread = threading.Thread(target=self._work, name="fedmeta-epsilon", daemon=True)
        self._thread.start()

    def guess(self, exposures: Sequence[Exposures]) -> None:
        """Compute these next, in order, once nothing is needed (replaces the earlier guesses)."""
        with self._cond:
            self._guesses = list(exposures)
            self._cond.notify_all()

    def get(self, exposures: Exposures) -> float | None:
        """The value if computed, else None."""
        with self._cond:
            return self._values.get(exposures)

    def wait(self, exposures: Exposures, timeout: float | None = None) -> float | None:
        """The value, waiting up to ``timeout`` seconds (None: until computed or failed)."""
        with self._cond:
            if exposures not in self._values and exposures not in self._failed:
                if exposures not in self._needed and exposures != self._busy:
                    self._needed.append(exposures)
                    self._cond.notify_all()
            self._cond.wait_for(
                lambda: exposures in self._values or exposures in self._failed or self._closed,
                timeout,
            )
            return self._values.get(exposures)

    def close(self) -> None:
        """Stop the thread (a composition in progress finishes first; its value is dropped)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _next(self) -> Exposures | None:
        """The next exposures to compute (under the lock): needed ones, then guesses, in order."""
        for queue in (self._needed, self._guesses):
            while queue:
                exposures = queue.pop(0)
                if exposures not in self._values and exposures not in self._failed:
                    return exposures
        return None

    def _work(self) -> None:
        while True:
            with self._cond:
                job = None
                while not self._closed and (job := self._next()) is None:
                    self._cond.wait()
                if job is None:
                    return
                self._busy = job
            try:
                value: float | None = job.epsilon(self._groups)
            except Exception:  # noqa: BLE001 - a reporting failure must never stop a private run
                log.exception("epsilon for a round's record could not be computed")
                value = None
            with self._cond:
                self._busy = None
                if value is None:
                    self._failed.add(job)
                else:
                    self._values[job] = value
                self._cond.notify_all()


class RoundEpsilons:
    """Each round's task-level epsilon: guessed ahead from the ledger's projection, looked up after.

    ``wanted(round)`` (1-based) says which rounds' records carry epsilon (``privacy.report_every``).
    """

    def __init__(self, wanted: Callable[[int], bool], ahead: int = AHEAD) -> None:
        self.curve = EpsilonCurve()
        self.wanted = wanted
        self.ahead = ahead

    def before_round(self, projection: SpendProjection, round_: int) -> None:
        """Guess, from the ledger's projection before ``round_``, the values of the next rounds."""
        ahead = range(round_, round_ + self.ahead)
        self.curve.guess([projection.after(r - round_ + 1) for r in ahead if self.wanted(r)])

    def after_spend(self, exposures: Exposures) -> float | None:
        """The epsilon of the ledger's ``exposures`` (read after a spend), waiting for it.

        Waiting, not answering "not yet": whether a value is ready when a round ends depends on
        how long the round's work took, so a record or progress line that showed it would publish
        the round's duration, a function of its stage-2 sample. None only if the composition
        failed (logged).
        """
        return self.curve.wait(exposures)

    def close(self) -> None:
        """Stop the background thread."""
        self.curve.close()
