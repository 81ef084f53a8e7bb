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

from collections.abc import Iterable, Mapping, Sequence

from fedmeta.accounting import DataItems, Ledger, Participant
from fedmeta.config import Config
from fedmeta.server.transport import Registered
from fedmeta.workload import declared_identity

#: The identity and label of the one content-keyed budget family of a ledger.
CONTENT_IDENTITY = "items-v1"
CONTENT_LABEL = "images"
#: Labels of the budgets image data had before it was named by content: inherited (inherit.py).
NAME_KEYED_LABELS = ("omniglot", "image_folder")


def budget_identity(cfg: Config, registered: Sequence[Registered] = ()) -> str:
    """The federation's key: image data by content (one family), the sinusoid by its spec."""
    del registered  # node keys name no budget (module docstring)
    if cfg.dataset.name == "sinusoid":
        return declared_identity(cfg.dataset.name, cfg.seed)
    return CONTENT_IDENTITY


def budget_label(cfg: Config) -> str:
    """The label of the federation id (logs, metrics): ``images`` for all image data."""
    return cfg.dataset.name if cfg.dataset.name == "sinusoid" else CONTENT_LABEL


def inherited_labels(cfg: Config) -> tuple[str, ...]:
    """Older name-keyed budgets a new content-keyed budget inherits (ledger/inherit.py)."""
    return () if cfg.dataset.name == "sinusoid" else NAME_KEYED_LABELS


def participant_identity(cfg: Config, member: Registered) -> str:
    """The identity of a participant that declares no items (the sinusoid): spec plus index."""
    return f"{declared_identity(cfg.dataset.name, cfg.seed)}#participant={member.participant_id}"


def ledger_participant(cfg: Config, member: Registered) -> Participant:
    """One participant as the ledger charges it: by its items when it declared them."""
    items = DataItems.from_text(member.data_fingerprint)
    if items is None:
        return Participant(participant_identity(cfg, member), member.participant_id,
                           member.data_fingerprint)  # fmt: skip
    return Participant(f"items:{items.set_digest}", member.participant_id, items.set_digest, items)


def ledger_participants(
    cfg: Config, members: Mapping[str, Registered], eligible: Iterable[str]
) -> list[Participant]:
    """The participants a round may sample, as the ledger charges them."""
    return [ledger_participant(cfg, members[pid]) for pid in sorted(eligible) if pid in members]


def use_round_cohort(
    ledger: Ledger | None, cfg: Config, members: Mapping[str, Registered], eligible: Iterable[str]
) -> None:
    """Charge the next spends to the participants this round may sample (None: a public run)."""
    if ledger is not None:
        ledger.use_cohort(ledger_participants(cfg, members, eligible))
