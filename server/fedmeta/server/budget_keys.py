"""Whose budget a run spends: the data set's declared identity and each participant's own.

The budget belongs to each participant's data (docs/ledger.md, "Per-participant budgets"; issue
18). A participant's identity must survive other participants joining or leaving and its own data
being edited (an edit adds or removes tasks, which the task-level add/remove relation covers):

* in simulation, and in a deployment without node authentication, the data set's declared
  identity (``fedmeta.workload.declared_identity``) plus the participant's id (its index);
* in a deployment with node authentication, the node's registered key fingerprint: a node cannot
  take another's budget, and a node that renames itself keeps its own.

The content digest each participant reports is recorded with it and a change is shown to the
operator (``fedmeta ledger show --participants``); it is never part of a key.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from fedmeta.accounting import Ledger, Participant
from fedmeta.config import Config
from fedmeta.server.transport import Registered
from fedmeta.workload import declared_identity


def budget_identity(cfg: Config, registered: Sequence[Registered]) -> str:
    """The federation's key: the declared data set, kept apart when nodes are keyed by node key."""
    if any(r.node_key for r in registered):
        return f"{declared_identity(cfg)}:node-keys"
    return declared_identity(cfg)


def participant_identity(cfg: Config, member: Registered) -> str:
    """One participant's stable identity (see the module docstring)."""
    if member.node_key:
        return f"node:{member.node_key}"
    return f"{declared_identity(cfg)}#participant={member.participant_id}"


def ledger_participants(
    cfg: Config, members: Mapping[str, Registered], eligible: Iterable[str]
) -> list[Participant]:
    """The participants a round may sample, as the ledger charges them."""
    return [
        Participant(participant_identity(cfg, members[pid]), pid, members[pid].data_fingerprint)
        for pid in sorted(eligible)
        if pid in members
    ]


def use_round_cohort(
    ledger: Ledger | None, cfg: Config, members: Mapping[str, Registered], eligible: Iterable[str]
) -> None:
    """Charge the next spends to the participants this round may sample (None: a public run)."""
    if ledger is not None:
        ledger.use_cohort(ledger_participants(cfg, members, eligible))
