"""The individual filter: who takes part in each round, and the figures a private run publishes.

Nothing a private run releases may depend on which of its participants' items an earlier run
recorded (issue 52, item 6; docs/privacy.md, "Overlap and the individual filter"). So:

* **Who takes part, round by round.** Before each spend, a participant takes part when every data
  record its items are charged to affords one more round of *that round's* event (its eligible
  population's: a smaller one is a costlier event) beside the record's rounds in the ledger as the
  run found it (``since``: its start, or its resume) and the run's own charged to it since
  (accounting/fedmeta/accounting/ledger/allowance.py, the theorem: Zhu, Dong and Wang 2022
  composition of dominating pairs fixed before round 1; Feldman and Zrnic 2021 individual
  accounting; Rogers et al. 2016 for why no filter theorem is needed, nothing being decided from
  the outputs). So the ledger's own check of the spend never refuses for a participant's earlier
  spends: it is the last safety (a concurrent run's spends, which the decision does not read).
* **Not taking part.** The participant is sampled and sent its requests exactly as before (stage 1
  and 2 unchanged), and its replies are discarded before the sum (server/fedmeta/server/round.py):
  an empty request would tell it that it is excluded. Each round is charged in the ledger to the
  participants taking part, or to nobody.
* **What is published** is the mechanism's own: the composition of this run's recorded events
  (plan.py ``run_epsilons``), what a participant with no earlier spend has, and the rounds the
  run's own composition still affords within its plan; never the ledger's maximum over participants.
* **Who is excluded, and from when,** goes to the operator log alone (server/fedmeta/server/
  operator_log.py) and ``fedmeta ledger show --participants``: never a file, metric, progress line
  or exit status.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from fedmeta.accounting import Hold, Ledger
from fedmeta.accounting.levels import AnyRound
from fedmeta.config import Config
from fedmeta.server.budget_keys import BudgetKey, budget_key, ledger_participants, use_round_cohort
from fedmeta.server.operator_log import log_failures
from fedmeta.server.plan import PrivatePlan, build_scheme
from fedmeta.server.startup import RunPosition
from fedmeta.server.transport import Registered

#: The operator log's reason for a participant whose data's budget ends its part in a run.
REASON_ALLOWANCE = "allowance spent"


@dataclass
class IndividualFilter:
    """Who takes part in each of a run's spends (operator-only state, never saved or released).

    ``holds``: per participant, what its decisions read (accounting/.../ledger/reservations.py
    ``Hold``): the ledger when the run started or resumed and the runs then in progress, or, for
    a participant first seen later, when it was first seen; ``reserve``: the run's reservation,
    renewed when a newcomer joins; ``excluded``: who did not take part in the last spend decided
    (so the operator log names each participant once each time it stops taking part).
    """

    run_id: str
    reserve: Callable[[Collection[str]], Hold]
    holds: dict[str, Hold]
    excluded: set[str] = field(default_factory=set)

    def apply(
        self, ledger: Ledger, key: BudgetKey, members: Mapping[str, Registered],
        eligible: Collection[str], event: AnyRound,
    ) -> frozenset[str]:  # fmt: skip
        """Charge the next spend of ``event`` to who takes part; whose replies it discards."""
        new = [p for p in eligible if p not in self.holds]
        if new:  # renew the reservation with them, and decide for them as from a start now
            hold = self.reserve([*self.holds, *new])
            self.holds.update(dict.fromkeys(new, hold))
        taking: set[str] = set()
        for hold in set(self.holds[p] for p in eligible):
            who = ledger_participants(key, members, [p for p in eligible if self.holds[p] == hold])
            taking |= ledger.affording(who, event, run_id=self.run_id, hold=hold)
        use_round_cohort(ledger, key, members, taking)  # an empty cohort: charged to nobody
        excluded = frozenset(eligible) - taking
        # A round the run's own rounds cannot afford is not run (budget_exhausted, public):
        # nobody's part ends there for their data's sake, so the log says nothing of it.
        if ledger.run_rounds_affordable(self.run_id, event) >= 1:
            spent = sum(count for _, count in ledger.run_rounds(self.run_id))
            _log_excluded(self.run_id, spent + 1, sorted(excluded - self.excluded))
        self.excluded = set(excluded)
        return excluded


def round_cohort(
    individual: IndividualFilter | None, ledger: Ledger | None, cfg: Config,
    members: Mapping[str, Registered], eligible: Collection[str], privacy: PrivatePlan | None,
) -> frozenset[str]:  # fmt: skip
    """Charge the round to who takes part (a public run: nothing); whose replies it discards.

    ``privacy``: the plan over the round's eligible population (its event), None if public.
    """
    key = budget_key(cfg.dataset.name, cfg.seed)
    if individual is None or ledger is None or privacy is None:
        use_round_cohort(ledger, key, members, eligible)
        return frozenset()
    return individual.apply(ledger, key, members, eligible, privacy.event)


def start_filter(
    cfg: Config, privacy: PrivatePlan | None, ledger: Ledger | None,
    members: Mapping[str, Registered], position: RunPosition,
) -> IndividualFilter | None:  # fmt: skip
    """The run's filter: it reserves its remaining rounds and reads the ledger as it stands now.

    At its start or resume (accounting/fedmeta/accounting/ledger/reservations.py, allowance.py).
    None for a public run (no plan's privacy, no ledger): everyone takes part, nothing is charged.
    The reservation is at the costliest event a round of the run can have: its population at its
    smallest (``n1``, every stage-1 draw certain), each participant at the public floor of tasks.
    """
    if privacy is None or ledger is None:
        return None
    key = budget_key(cfg.dataset.name, cfg.seed)
    smallest = {str(i): cfg.min_tasks for i in range(cfg.n1)}
    costliest = privacy.over(build_scheme(cfg, smallest)).event
    rounds = max(cfg.rounds - position.next_round, 0)

    def reserve(pids: Collection[str]) -> Hold:
        who = ledger_participants(key, members, pids)
        return ledger.reserve(who, costliest, rounds, run_id=position.run_id)

    hold = reserve(members)
    return IndividualFilter(position.run_id, reserve, dict.fromkeys(members, hold))


def end_of_run(ledger: Ledger | None, run_id: str, *, resumable: bool) -> None:
    """The run will not spend again unless ``resumable``: its reservation ends (reservations.py).

    Then the figures ``fedmeta ledger show`` prints are composed, to keep (issue 54).
    """
    if ledger is None:
        return
    if not resumable:
        ledger.end_reservation(run_id)
    ledger.keep_figures()


def _log_excluded(run_id: str, spend: int, pids: list[str]) -> None:
    """The operator log's line for each participant whose data's earlier spends end its part.

    ``spend``: the run's spend (its count, from 1) it first does not take part in.
    """
    detail = ("its data's earlier spends do not afford this round beside the run's rounds it took "
              "part in; its replies are discarded while that holds (`fedmeta ledger show "
              "--participants`)")  # fmt: skip
    log_failures(run_id, spend, [(pid, REASON_ALLOWANCE, detail) for pid in pids])
