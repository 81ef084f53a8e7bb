"""The individual filter: who takes part in each round, and the figures a private run publishes.

Nothing a private run releases may depend on which of its participants' items an earlier run
recorded (issue 52, item 6; docs/privacy.md, "Overlap and the individual filter"). So:

* **Allowances, fixed at the start.** Each participant's allowance ``k_p`` is computed once, from
  the ledger without this run's own spends and the run's public schedule (the plan's event,
  ``rounds``): accounting/fedmeta/accounting/ledger/allowance.py (the theorem: Zhu, Dong and Wang
  2022 composition of dominating pairs fixed before round 1; Feldman and Zrnic 2021 individual
  accounting; Rogers et al. 2016 for why no filter theorem is needed, nothing being decided from
  the outputs). A resumed run recomputes them the same way (no checkpoint field).
* **Taking part.** ``p`` takes part in the run's first ``k_p`` spends. In later rounds it is sampled
  and sent its requests exactly as before (stage 1 and 2 unchanged), and its replies are discarded
  before the sum (server/fedmeta/server/round.py): an empty request would tell ``p`` it is excluded.
  Each round is charged in the ledger to the participants taking part, or to nobody.
* **What is published** is the mechanism's own: the composition of this run's recorded events
  (plan.py ``run_epsilons``), what a participant with no earlier spend has, and the rounds the
  run's own composition still affords within its plan; never the ledger's maximum over participants.
* **Who is excluded, and from when,** goes to the operator log alone (server/fedmeta/server/
  operator_log.py) and ``fedmeta ledger show --participants``: never a file, metric, progress line
  or exit status.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from fedmeta.accounting import Ledger
from fedmeta.accounting.levels import AnyRound
from fedmeta.config import Config
from fedmeta.server.budget_keys import BudgetKey, budget_key, ledger_participants, use_round_cohort
from fedmeta.server.operator_log import log_failures
from fedmeta.server.plan import PrivatePlan
from fedmeta.server.transport import Registered

#: The operator log's reason for a participant whose data's budget ends its part in a run.
REASON_ALLOWANCE = "allowance spent"


@dataclass(frozen=True)
class IndividualFilter:
    """Each participant's allowance (participant id -> ``k_p``, in the run's spends): operator-only.

    ``allowances`` is fixed at the start for everyone registered then; a participant first seen
    later (a node that joined mid-run) gets its own when it first becomes eligible.
    """

    allowances: dict[str, int]
    run_id: str
    event: AnyRound  # the plan's: the schedule the allowances are computed for
    rounds: int  # the run's planned rounds

    def taking_part(self, eligible: Collection[str], spent: int) -> frozenset[str]:
        """Who of ``eligible`` takes part in the run's next spend (``spent`` of its own so far)."""
        return frozenset(p for p in eligible if self.allowances.get(p, 0) > spent)

    def apply(
        self, ledger: Ledger, key: BudgetKey, members: Mapping[str, Registered],
        eligible: Collection[str],
    ) -> frozenset[str]:  # fmt: skip
        """Charge the next spend to who takes part; the ids whose replies the round discards."""
        spent = sum(count for _, count in ledger.run_rounds(self.run_id))
        self._admit(ledger, key, members, [p for p in eligible if p not in self.allowances], spent)
        taking = self.taking_part(eligible, spent)
        use_round_cohort(ledger, key, members, taking)  # an empty cohort: charged to nobody
        return frozenset(eligible) - taking

    def _admit(
        self, ledger: Ledger, key: BudgetKey, members: Mapping[str, Registered], new: list[str],
        spent: int,
    ) -> None:  # fmt: skip
        """Allowances of participants first seen after ``spent`` of the run's spends.

        From the ledger as it stands, this run's spends included (they may be charged to records
        the newcomer's items are in): it takes part in the next ones its data affords.
        """
        if not new:
            return
        who = ledger_participants(key, members, new)
        left = ledger.allowances(who, self.event, max(self.rounds - spent, 0), run_id="")
        for pid, k in left.items():
            self.allowances[pid] = spent + k
        _log_short(self.run_id, {pid: spent + k for pid, k in left.items()},
                   _fresh(ledger, self.event, self.rounds))  # fmt: skip


def round_cohort(
    individual: IndividualFilter | None, ledger: Ledger | None, cfg: Config,
    members: Mapping[str, Registered], eligible: Collection[str],
) -> frozenset[str]:  # fmt: skip
    """Charge the round to who takes part (a public run: nothing); whose replies it discards."""
    key = budget_key(cfg.dataset.name, cfg.seed)
    if individual is None or ledger is None:
        use_round_cohort(ledger, key, members, eligible)
        return frozenset()
    return individual.apply(ledger, key, members, eligible)


def fix_allowances(
    cfg: Config, plan: PrivatePlan | None, ledger: Ledger | None,
    members: Mapping[str, Registered], run_id: str,
) -> IndividualFilter | None:  # fmt: skip
    """The run's allowances, from the ledger without its own spends (allowance.py's theorem).

    None for a public run (no plan's privacy, no ledger): everyone takes part, nothing is charged.

    Those below the run's planned rounds are written to the operator log (as "round N" = the first
    of the run's spends the participant no longer takes part in); nothing else says so.
    """
    if plan is None or ledger is None:
        return None
    participants = ledger_participants(budget_key(cfg.dataset.name, cfg.seed), members, members)
    allowed = ledger.allowances(participants, plan.event, cfg.rounds, run_id=run_id)
    _log_short(run_id, allowed, _fresh(ledger, plan.event, cfg.rounds))
    return IndividualFilter(dict(allowed), run_id, plan.event, cfg.rounds)


def _fresh(ledger: Ledger, event: AnyRound, rounds: int) -> int:
    """The allowance of data nothing spent on: the run's rounds, or fewer its own budget affords."""
    return min(rounds, ledger.run_rounds_affordable("", event))  # "": no run, no spend


def _log_short(run_id: str, allowed: Mapping[str, int], fresh: int) -> None:
    """The operator log's line for each participant whose data's earlier spends cut its part.

    Only below ``fresh``: a run whose own budget ends it earlier ends everyone's part there.
    """
    for pid, k in sorted(allowed.items()):
        if k >= fresh:
            continue
        detail = (f"its data's earlier spends allow {k} of the run's rounds (data nothing spent "
                  f"on: {fresh}); its replies are discarded from then on (`fedmeta ledger show "
                  "--participants`)")
        log_failures(run_id, k + 1, [(pid, REASON_ALLOWANCE, detail)])
