"""Whose budget a run spends: the data, named by its content, whatever loader, path or key.

The budget belongs to each participant's data (docs/ledger.md, "Per-participant budgets"; issues
18 and 39). Image data (Omniglot, image folders) is named by its items: each participant sends
the content digests of its items at source resolution (metalearning/items.py), and the ledger
charges it to every data record those items overlap (accounting/fedmeta/accounting/ledger/
overlap.py). All image data of a ledger shares one budget family (``CONTENT_IDENTITY``): the same
drawings from the npz, the official zips or a folder of PNGs, read as ``omniglot`` or as
``image_folder``, through any path, under any node key or none, are the same records. A node key
authenticates a node; it never names a budget, so enabling node authentication or replacing a key
keeps the data's budget, and a new key brings no budget of its own: its data is charged by
overlap.

The synthetic sinusoid has no items: it is named by its generator and seed plus the participant's
index (``fedmeta.workload.declared_identity``), since that *is* its data.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from fedmeta.accounting import (
    BudgetTerms,
    DataItems,
    Ledger,
    LedgerMode,
    Participant,
    current_budget,
    resolve_federation,
)
from fedmeta.server.transport import Registered
from fedmeta.workload import declared_identity

#: The identity and label of the one content-keyed budget family of a ledger.
CONTENT_IDENTITY = "items-v1"
CONTENT_LABEL = "images"
#: Labels of the budgets image data had before it was named by content: inherited (inherit.py).
NAME_KEYED_LABELS = ("omniglot", "image_folder")


@dataclass(frozen=True)
class BudgetKey:
    """How the ledger names a run's data, from the dataset's name and the public seed alone.

    Node keys and who registered name no budget (module docstring), so one key serves the whole
    run: built once by :func:`budget_key`.
    """

    identity: str  # the federation's key: image data by content (one family), the sinusoid by spec
    label: str  # the label of the federation id (logs, metrics): ``images`` for all image data
    inherited: tuple[str, ...]  # older name-keyed budgets a new content-keyed one inherits
    declared: str  # the data's declared identity: with an index, a participant without items


def budget_key(dataset_name: str, seed: int) -> BudgetKey:
    """The key of the data ``dataset.name`` names under the public ``seed``."""
    declared = declared_identity(dataset_name, seed)
    if dataset_name == "sinusoid":
        return BudgetKey(declared, dataset_name, (), declared)
    return BudgetKey(CONTENT_IDENTITY, CONTENT_LABEL, NAME_KEYED_LABELS, declared)


def recorded_terms(path: Path, key: BudgetKey) -> BudgetTerms | None:
    """The terms of the data's current budget in the ledger at ``path`` (None: none); read-only."""
    return current_budget(path, key.identity, label=key.label)


def federation_of(path: Path, key: BudgetKey, mode: LedgerMode) -> str:
    """The federation id of the data's current budget, created (or inherited) on first use."""
    return resolve_federation(path, key.identity, label=key.label, mode=mode,
                              inherit=key.inherited)  # fmt: skip


def participant_identity(key: BudgetKey, member: Registered) -> str:
    """The identity of a participant that declares no items (the sinusoid): spec plus index."""
    return f"{key.declared}#participant={member.participant_id}"


def ledger_participant(key: BudgetKey, member: Registered) -> Participant:
    """One participant as the ledger charges it: by its items when it declared them."""
    items = DataItems.from_text(member.data_fingerprint)
    if items is None:
        return Participant(participant_identity(key, member), member.participant_id,
                           member.data_fingerprint)  # fmt: skip
    return Participant(f"items:{items.set_digest}", member.participant_id, items.set_digest, items)


def ledger_participants(
    key: BudgetKey, members: Mapping[str, Registered], eligible: Iterable[str]
) -> list[Participant]:
    """The participants a round may sample, as the ledger charges them."""
    return [ledger_participant(key, members[pid]) for pid in sorted(eligible) if pid in members]


def use_round_cohort(
    ledger: Ledger | None, key: BudgetKey, members: Mapping[str, Registered],
    eligible: Iterable[str],
) -> None:  # fmt: skip
    """Charge the next spends to the participants this round may sample (None: a public run)."""
    if ledger is not None:
        ledger.use_cohort(ledger_participants(key, members, eligible))
