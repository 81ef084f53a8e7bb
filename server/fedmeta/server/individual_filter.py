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

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from fedmeta.accounting import Ledger
from fedmeta.accounting.levels import AnyRound
from fedmeta.config import Config
from fedmeta.server.budget_keys import BudgetKey, budget_key, ledger_participants, use_round_cohort
from fedmeta.server.operator_log import log_failures
from fedmeta.server.plan import PrivatePlan
from fedmeta.server.transport import Registered

#: The operator log's reason for a participant whose data's budget ends its part in a run.
REASON_ALLOWANCE = "allowance spent"


@dataclass
class IndividualFilter:
    """Who takes part in each of a run's spends (operator-only state, never saved or released).

    ``since``: the ledger's records when the run started or resumed, the earlier history its
    decisions read; ``excluded``: who did not take part in the last spend decided (so the operator
    log names each participant once a time it stops taking part).
    """

    run_id: str
    since: int
    excluded: set[str] = field(default_factory=set)

    def apply(
        self, ledger: Ledger, key: BudgetKey, members: Mapping[str, Registered],
        eligible: Collection[str], event: AnyRound,
    ) -> frozenset[str]:  # fmt: skip
        """Charge the next spend of ``event`` to who takes part; whose replies it discards."""
        who = ledger_participants(key, members, eligible)
        taking = ledger.affording(who, event, run_id=self.run_id, since=self.since)
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


def start_filter(private: bool, ledger: Ledger | None, run_id: str) -> IndividualFilter | None:
    """The run's filter, reading the ledger as it stands now (start or resume): allowance.py.

    None for a public run (no plan's privacy, no ledger): everyone takes part, nothing is charged.
    """
    if not private or ledger is None:
        return None
    return IndividualFilter(run_id, ledger.position())


def _log_excluded(run_id: str, spend: int, pids: list[str]) -> None:
    """The operator log's line for each participant whose data's earlier spends end its part.

    ``spend``: the run's spend (its count, from 1) it first does not take part in.
    """
    detail = ("its data's earlier spends do not afford this round beside the run's rounds it took "
              "part in; its replies are discarded while that holds (`fedmeta ledger show "
              "--participants`)")  # fmt: skip
    log_failures(run_id, spend, [(pid, REASON_ALLOWANCE, detail) for pid in pids])
