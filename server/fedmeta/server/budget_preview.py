"""What a fresh run of a configuration would find in the ledger, read before any data is loaded.

``fedmeta simulate`` refuses a run whose own rounds the budget cannot afford before it spends
minutes loading Omniglot, and ``--dry-run`` prints the plan and the exit status of the run it
previews. Both read the ledger as the run will (the data's recorded budget and spends, the run's
target; what its participants' data spent before decides only who takes part, never a refusal or a
figure: server/fedmeta/server/individual_filter.py), without writing anything: the ledger is opened
read-only, and data with no budget yet is forecast against a fresh budget in a throw-away ledger.

The preview stands in for the registration the run does later: every configured participant
registers (as the simulation's participants do) under the data's declared identity. Where the
registered data would change the plan, a fixed-size stage 2 under the replace-one relation (its
bound is the smallest registered task count), no preview is made and the run decides alone.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fedmeta.accounting import BudgetLedger, DataItems
from fedmeta.config import Config
from fedmeta.server.budget_keys import (
    CONTENT_IDENTITY,
    BudgetKey,
    budget_key,
    ledger_participants,
    recorded_terms,
)
from fedmeta.server.data_budget import adopt_data_budget, ledger_file
from fedmeta.server.plan import (
    BudgetForecast,
    PrivatePlan,
    RunPlan,
    build_plan,
    forecast,
    private_requested,
)
from fedmeta.server.transport import Registered


@dataclass(frozen=True)
class BudgetPreview:
    """A fresh run's plan and forecast against the ledger; ``refusal``: why it would not start."""

    cfg: Config  # the configuration with the data's recorded budget
    plan: RunPlan
    forecast: BudgetForecast | None  # None: a non-private run
    recorded: bool  # whether the ledger holds a budget for this data already
    refusal: str | None = None  # the run's one-line refusal (exit 3), or None: it starts


def previewable(cfg: Config) -> bool:
    """Whether the configuration alone decides the plan (see the module docstring)."""
    return not (cfg.sampling.stage2 == "fixed" and cfg.privacy.neighbouring == "replace_one")


def configured_participants(cfg: Config) -> list[Registered]:
    """The participants a simulation registers: ids 0..N-1, the configured task count each."""
    count = cfg.dataset.tasks_per_participant
    return [Registered(str(i), i, count, "") for i in range(cfg.federation.participants)]


def preview_budget(cfg: Config, registered: Sequence[Registered] | None = None) -> BudgetPreview:
    """Plan a fresh run of ``cfg`` against the ledger it would spend from; writes nothing.

    ``registered``: the participants as they would register, their items included (``--dry-run``
    on image data, whose budget is found by its items' overlap with the ledger's records); None:
    the configured participants without items (the check before the data is loaded).
    ``BudgetMismatch`` when the configuration names a budget other than the data's recorded one
    (the run refuses that too).
    """
    registered = list(registered) if registered is not None else configured_participants(cfg)
    counts = {r.participant_id: r.task_count for r in registered}
    if not private_requested(cfg.privacy):
        return BudgetPreview(cfg, build_plan(cfg, counts), None, recorded=False)
    path = ledger_file(cfg)
    cfg = adopt_data_budget(cfg, registered, path)
    plan = build_plan(cfg, counts)
    private = plan.privacy
    if private is None:  # not with privacy.enabled; the plan, not the configuration, says so
        return BudgetPreview(cfg, plan, None, recorded=False)
    key = budget_key(cfg.dataset.name, cfg.seed)
    terms = recorded_terms(path, key)
    if terms is not None and not _named_by_what_it_holds(key, registered):
        terms = None  # image data without its items: only the registered data can say
    if terms is None or terms.epsilon_budget is None:
        fresh = _fresh_forecast(cfg, private)
        refusal = _fresh_refusal(cfg, private, fresh)
        return BudgetPreview(cfg, plan, fresh, recorded=False, refusal=refusal)
    with BudgetLedger.open_readonly(path, terms.federation_id) as ledger:
        members = {r.participant_id: r for r in registered}
        ledger.use_cohort(ledger_participants(key, members, members))
        predicted = forecast(private, ledger, cfg.rounds)
        refusal = _refusal(cfg, private, ledger, predicted)
    return BudgetPreview(cfg, plan, predicted, recorded=True, refusal=refusal)


def _named_by_what_it_holds(key: BudgetKey, registered: Sequence[Registered]) -> bool:
    """Whether the ledger can tell which records ``registered`` overlap.

    The sinusoid by its spec; image data only by the items its participants declare
    (budget_keys.py).
    """
    if key.identity != CONTENT_IDENTITY:
        return True
    return all(DataItems.from_text(r.data_fingerprint) is not None for r in registered)


def _fresh_forecast(cfg: Config, plan: PrivatePlan) -> BudgetForecast:
    """The forecast against a budget nothing has spent from yet (a throw-away ledger)."""
    with tempfile.TemporaryDirectory() as tmp:
        ledger = BudgetLedger.open(
            Path(tmp) / "preview.sqlite", "preview", epsilon_budget=cfg.privacy.epsilon_budget,
            delta=cfg.privacy.delta, neighbouring=cfg.privacy.neighbouring, mode="insecure",
        )  # fmt: skip
        try:
            return forecast(plan, ledger, cfg.rounds)
        finally:
            ledger.close()


def _fresh_refusal(cfg: Config, plan: PrivatePlan, predicted: BudgetForecast) -> str | None:
    """Why a fresh budget affords not one round of this run (a configured noise multiplier)."""
    if predicted.rounds_to_run:
        return None
    return (
        f"the budget affords no round: one round at noise multiplier "
        f"{plan.noise_multiplier:g} costs more than the whole budget, epsilon "
        f"{cfg.privacy.epsilon_budget:g} at delta {cfg.privacy.delta:g}; raise "
        "privacy.noise_multiplier or leave it unset to calibrate it; nothing was run or written"
    )


def _refusal(
    cfg: Config, plan: PrivatePlan, ledger: BudgetLedger, predicted: BudgetForecast
) -> str | None:
    """The run's own refusal (server/fedmeta/server/startup.py ``check_target_fits``), or None."""
    from fedmeta.server.startup import NoRoundAffordable, check_target_fits

    try:
        check_target_fits(cfg, plan, ledger, predicted)
    except NoRoundAffordable as refused:
        return str(refused)
    return None
