"""What the run's own test evaluation scores that the model has seen (issue 42, item 1).

The rule is core/fedmeta/seen.py's, as ``fedmeta evaluate`` applies it: the test classes' items are
compared by content digest with every item the model was trained, selected or warm-started on, and
``summary.json`` reports ``seen_fraction`` and ``held_out`` (the test metrics over unseen classes),
flagged when seen, never refused; ``null`` with ``seen_note`` when unknown, never 0.

**Whose items.** The server compares with what it knows: the item digests each participant
declared when it registered (the digests that name its budget, docs/ledger.md "Keys by
content"), the server's validation classes when model selection chose on them, and the public
warm-start classes.

**Released only where it is no private fact** (docs/privacy.md, "Everything a private run
releases"). How many test items equal some participant's item is a function of the participants'
private item sets, computed exactly, outside the accountant: in a private run it is released only
when those items are public data (``privacy.experiment``: every item belongs to a known public
release and the split is the configuration's) or as a private diagnostic
(``metrics.private_diagnostics = true``, off by default). Otherwise ``seen_fraction`` is ``null``
and ``seen_note`` says why. A non-private run has nothing to protect and always reports it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from fedmeta.accounting import DataItems
from fedmeta.config import Config
from fedmeta.seen import combined, part_of_test_classes, trained_or_note, unknown
from fedmeta.workload import Workload

#: ``seen_note`` of a private run that does not release the participants' overlap with the test.
PRIVATE_NOTE = (
    "not released by a private run: how many test items equal a participant's item is a fact of "
    "the participants' private data, not covered by the accountant (docs/privacy.md); an "
    "experiment on public data (--experiment) or metrics.private_diagnostics = true reports it"
)
RESUMED_NOTE = (
    "compared with the participants registered in the last session of this resumed run: one of "
    "an earlier session that did not register again is not counted"
)
NOT_TESTED_NOTE = "the test evaluation did not run (the run was interrupted)"


def releasable(private: bool, *, experiment: str | None, private_diagnostics: bool) -> bool:
    """Whether this run's outputs may say how the test items overlap the participants' items.

    ``experiment``: ``privacy.experiment`` (public data); ``private_diagnostics``: the
    ``metrics`` switch of that name.
    """
    return not private or experiment is not None or private_diagnostics


def declared_items(fingerprints: Iterable[str]) -> np.ndarray | None:
    """Every item the participants declared (None: one declared no item digests, or none came)."""
    sets = [DataItems.from_text(text) for text in fingerprints]
    if not sets or any(s is None for s in sets):
        return None
    return np.unique(np.concatenate([s.array() for s in sets if s is not None]))


def seen_fields(
    cfg: Config,
    workload: Workload,
    *,
    private: bool,
    fingerprints: Iterable[str],
    resumed: bool = False,
    final: Any,
    evaluate_tasks: Callable[[Any], Any],
) -> dict[str, Any]:
    """``summary.json``'s ``seen_fraction``, ``held_out`` (and ``seen_note`` or ``seen_warning``).

    ``fingerprints``: the data fingerprints of every participant admitted in this session
    (``resumed``: a resumed run, whose earlier sessions' participants are not all known here);
    ``final``: the test evaluation (None: not run); ``evaluate_tasks(tasks)`` scores the released
    model on other test tasks (the unseen classes' when some items were seen).
    """
    if final is None:
        return unknown(NOT_TESTED_NOTE)
    participants = declared_items(fingerprints)  # whether there are items: the data's kind
    if participants is None:
        return unknown("the participants declared no item digests (data without items, such as "
                       "the sinusoid): seen_fraction unknown")  # fmt: skip
    if not releasable(private, experiment=cfg.privacy.experiment,
                      private_diagnostics=cfg.metrics.private_diagnostics):  # fmt: skip
        return unknown(PRIVATE_NOTE)
    trained, note = trained_or_note(cfg.training, workload, participants)
    if trained is None:
        return unknown(note or "seen_fraction unknown")
    overall = {"mean": final.mean, "ci95": [final.ci95_low, final.ci95_high],
               "median": final.median, "tasks": final.n_tasks}  # fmt: skip
    parts, items = part_of_test_classes(trained, workload, evaluate_tasks, overall)
    fields = combined(parts, [items] if len(items) else [], trained)
    if resumed and fields["seen_fraction"] is not None:
        fields["seen_note"] = RESUMED_NOTE
    return fields
