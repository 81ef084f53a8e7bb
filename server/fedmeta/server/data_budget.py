"""The data's budget and a run's target, kept apart.

A budget belongs to a participant's data (docs/ledger.md): its (epsilon, delta) are set when a run
first spends on that data (``privacy.epsilon_budget``/``privacy.delta``) or by the operator
(``fedmeta ledger new-budget --epsilon --delta``), and recorded. A run then asks for its own
*target* (``privacy.target_epsilon``, calibrated to) and is allowed only when the target fits what
every participant it may sample has left. A value of the budget given in a run's configuration
that differs from the recorded one is refused, never applied: a budget is not raised by a run.

Experiments on public benchmark data (``privacy.experiment``) keep a ledger of their own, so a
sweep composes within the experiment and never touches the data's production budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedmeta.accounting import BudgetTerms, DataItems, Ledger, ledger_holds
from fedmeta.config import Config
from fedmeta.item_identity import EVALUATION_TOLERANCE
from fedmeta.paths import default_ledger_path, experiment_ledger_path
from fedmeta.server.budget_keys import budget_key, recorded_terms
from fedmeta.server.plan import BudgetForecast, PrivatePlan
from fedmeta.server.transport import Registered
from fedmeta.workload import Workload


class BudgetMismatch(ValueError):
    """A run's configuration names a budget other than the data's recorded one."""


class NotPublicData(BudgetMismatch):
    """An experiment (``privacy.experiment``) on data not proven public: refused, nothing spent."""


def ledger_file(cfg: Config) -> Path:
    """The ledger a run spends from: its own path, its experiment's, or the state directory's."""
    secure = cfg.privacy.insecure_test_seed is None
    if cfg.privacy.ledger_path:
        path = Path(cfg.privacy.ledger_path)
    elif cfg.privacy.experiment:
        path = experiment_ledger_path(cfg.privacy.experiment, secure=secure)
    else:
        path = default_ledger_path(secure=secure)
    return path.expanduser().resolve()


def adopt_data_budget(cfg: Config, registered: Sequence[Registered], path: Path) -> Config:
    """``cfg`` with the data's recorded budget in ``privacy.epsilon_budget``/``privacy.delta``.

    ``path``: the ledger the run spends from (on resume, the one its checkpoint recorded). A
    read-only look (nothing is created): data with no budget yet keeps the configuration's
    values, which the run's first spend records. A value left unset takes the recorded one; a
    value set to anything else is refused (``BudgetMismatch``, one line with the fix). Only for
    a run the plan will make private (``plan.private_requested``): its callers ask.
    """
    check_experiment_data(cfg, registered)
    terms = recorded_terms(path, budget_key(cfg.dataset.name, cfg.seed))
    if terms is None or terms.epsilon_budget is None or terms.delta is None:
        return cfg
    given = cfg.privacy.model_fields_set
    for name, recorded in (("epsilon_budget", terms.epsilon_budget), ("delta", terms.delta)):
        value = float(getattr(cfg.privacy, name))
        if name in given and value != recorded:
            raise BudgetMismatch(_mismatch(cfg, name, value, terms, path))
    privacy = cfg.privacy.model_copy(
        update={"epsilon_budget": terms.epsilon_budget, "delta": terms.delta}
    )
    return cfg.model_copy(update={"privacy": privacy})


def check_experiment_data(cfg: Config, registered: Sequence[Registered]) -> None:
    """Refuse an experiment unless every item of its data is in one known public release.

    The items: every item of the configured source (``fedmeta.workload.source_items``) and every
    item a participant declared (its own data in a deployment). The generated sinusoid family is
    public by construction (metalearning/public_releases.py). One line naming the data and the fix.
    """
    name = cfg.privacy.experiment
    if name is None or cfg.dataset.name == "sinusoid":
        return
    from fedmeta.metalearning.public_releases import PUBLIC_RELEASES, not_public
    from fedmeta.workload import source_items

    declared = [DataItems.from_text(r.data_fingerprint) for r in registered]
    parts = [source_items(cfg.dataset, cfg.seed)] + [d.array() for d in declared if d is not None]
    items = np.unique(np.concatenate([p for p in parts if p is not None] or [np.zeros(0)]))
    outside, release = not_public(items) if len(items) else (0, None)
    if outside == 0 and release is not None:
        return
    known = "; ".join(description for description, _ in PUBLIC_RELEASES.values())
    raise NotPublicData(
        f"--experiment {name}: {outside} of the {len(items)} items of dataset.path "
        f"{cfg.dataset.path} (and the participants' declared data) are in no known public "
        f"release ({known}; the generated sinusoid family), so this is not public benchmark data "
        "and an experiment ledger cannot hold its spends: run without --experiment, on this "
        "data's own budget; nothing was spent"
    )


class EvaluationDataPrivate(BudgetMismatch):
    """Validation or test items a ledger records as participants' private data (issue 52)."""


def check_evaluation_data(cfg: Config, workload: Workload, path: Path) -> None:
    """Refuse a private run whose validation or test items are recorded as private data.

    The server's validation and test metrics are released without the accountant, so they may
    only be computed on data that was never a participant's: under another seed or split the
    participants' items of an earlier run become held-out items (issue 52, item 8). An item counts
    when the ledger at ``path`` holds it in any budget, by digest or by a look within
    ``EVALUATION_TOLERANCE`` (fedmeta/item_identity.py says why it is narrower than charging's).
    Experiments run on public data and are not checked; with ``metrics.private_diagnostics`` the
    operator has made the run's metrics private diagnostics (off by default), and they may be
    computed on such items. One line naming the counts and the fix.
    """
    splits = workload.splits
    exempt = cfg.privacy.experiment is not None or cfg.metrics.private_diagnostics
    if splits is None or exempt or not path.is_file():
        return
    parts = [(name, split.item_ids, split.item_looks)
             for name, split in (("validation", splits.val), ("test", splits.test))]  # fmt: skip
    held = {
        name: ledger_holds(path, [DataItems.of(ids, looks)], tolerance=EVALUATION_TOLERANCE)
        for name, ids, looks in parts
        if ids is not None and len(ids)
    }
    if not any(held.values()):
        return
    counts = " and ".join(f"{n} {name} items" for name, n in held.items() if n)
    raise EvaluationDataPrivate(
        f"dataset.split {cfg.dataset.split!r} with seed {cfg.seed}: {counts} are recorded as "
        f"participants' private data in {path} (by content or as near-duplicates), and "
        "validation and test metrics are released without the accountant: use the seed and "
        "dataset.split the earlier runs on this data used, so that their participants' items "
        "stay out of validation and test (or metrics.private_diagnostics = true: the metrics "
        "become private diagnostics, not to be released); nothing was spent"
    )


def _mismatch(cfg: Config, name: str, value: float, terms: BudgetTerms, path: Path) -> str:
    fix = (
        "a run asks for its own epsilon with privacy.target_epsilon"
        if name == "epsilon_budget"
        else f"leave privacy.delta unset (or {terms.delta:g}): delta is fixed per budget"
    )
    return (
        f"privacy.{name}={value:g} is not the budget of this data (epsilon "
        f"{terms.epsilon_budget:g} at delta {terms.delta:g}, recorded in {path}): {fix}; "
        + other_budget_hint(cfg, path, terms.federation_id, _asked(cfg, name, value, terms))
    )


def _asked(cfg: Config, name: str, value: float, terms: BudgetTerms) -> tuple[float, float]:
    """The terms the configuration asked for: its value in place of the recorded one."""
    assert terms.epsilon_budget is not None and terms.delta is not None
    if name == "epsilon_budget":
        return (
            value,
            terms.delta if "delta" not in cfg.privacy.model_fields_set else cfg.privacy.delta,
        )
    return terms.epsilon_budget, value


def other_budget_hint(
    cfg: Config, path: Path, federation_id: str, terms: tuple[float, float] | None = None
) -> str:
    """The two ways to another budget: an experiment (public data), or the operator's command.

    ``terms``: the (epsilon, delta) to put in the command; else placeholders.
    """
    eps, delta = ("E", "D") if terms is None else (f"{terms[0]:g}", f"{terms[1]:g}")
    experiment = (
        "another --experiment NAME"
        if cfg.privacy.experiment
        else "an experiment on public benchmark data runs with --experiment NAME (a ledger of "
        "its own)"
    )
    if cfg.dataset.name == "image_folder":
        experiment = "this is the participants' own data, so no experiment ledger applies"
    return (
        f"{experiment}; a separate budget for this data starts only with `fedmeta ledger "
        f"new-budget --db {path} --federation {federation_id} --epsilon {eps} --delta {delta} "
        "--reason WHY` (recorded)"
    )


def no_fit_reason(cfg: Config, plan: PrivatePlan, ledger: Ledger, predicted: BudgetForecast) -> str:
    """One line: a run's target does not fit its budget (public values only), and the fixes.

    The run's own rounds alone (plan.py ``forecast``): what its participants' data spent before
    decides only who takes part (server/fedmeta/server/individual_filter.py), never a refusal.
    """
    assert cfg.privacy.target_epsilon is not None  # only a run with a target is refused this way
    target = cfg.privacy.target_epsilon
    return (
        f"privacy.target_epsilon={target:g} does not fit the budget: "
        f"{predicted.rounds_affordable} of this run's {cfg.rounds} rounds at noise multiplier "
        f"{plan.noise_multiplier:.4g} fit epsilon {ledger.epsilon_budget:g} (delta "
        f"{ledger.delta:g}); lower privacy.target_epsilon or rounds, or raise "
        "privacy.noise_multiplier; nothing was run or written"
    )
