"""`--dry-run`: the plan a run would print and the exit status it would have, with nothing run.

Read-only: the recorded budget and spends through server/fedmeta/server/budget_preview.py, or a
throw-away ledger where the registered data decides the plan. Image data is named by its items,
as the run names it: the dry run computes them with the participants' own registration code, and
checks the registry of ledgers and the ledger's anchor and witness as the run's open does.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def dry_run(cfg: Any, resume: bool) -> int:
    """``--dry-run``: the plan against the ledger and the exit status the real run would have.

    Read-only (server/fedmeta/server/budget_preview.py): the data's recorded budget, what its
    participants have spent and the run's target, as a fresh run reads them before any data is
    loaded. A resumed run, or one whose plan the registered data decides, gets the plan against
    a fresh budget (:func:`dry_run_plan`).
    """
    from fedmeta import exitcodes
    from fedmeta.server.budget_preview import preview_budget, previewable
    from fedmeta.server.data_budget import BudgetMismatch, ledger_file
    from fedmeta.server.outputs import format_plan

    if resume or not previewable(cfg):
        print(dry_run_plan(cfg))
        return exitcodes.OK
    registered = registered_as_run(cfg)
    try:
        preview = preview_budget(cfg, registered)
    except BudgetMismatch as error:
        print(f"fedmeta simulate: {error}", file=sys.stderr)
        return exitcodes.BAD_INPUT
    check_ledger_as_run(preview.cfg, registered)  # LedgerError: exit 2, as the run's open
    participants, tasks = cfg.federation.participants, cfg.dataset.tasks_per_participant
    read = (f"this data's budget and spends as recorded in {ledger_file(cfg)}" if preview.recorded
            else "a fresh budget (none is recorded for this data yet)")  # fmt: skip
    print(format_plan(preview.plan, preview.forecast, preview.cfg, participants))
    print(f"(dry run: nothing ran, nothing was recorded; the forecast reads {read}, with all "
          f"{participants} participants holding {tasks} tasks)")  # fmt: skip
    if preview.refusal is not None:
        print(f"fedmeta simulate: {preview.refusal}", file=sys.stderr)
        return exitcodes.BUDGET_EXHAUSTED
    return exitcodes.OK


def registered_as_run(cfg: Any) -> list[Any]:
    """The participants as the run's would register: image data with its items (issue 52).

    Image data's budget is found by the overlap of its items with the ledger's records, so the
    dry run asks each simulated participant's own registration code (it reads the data: the
    digests are cached), as the run does; the sinusoid is named by its spec alone.
    """
    from fedmeta.client.gradients import registration
    from fedmeta.client_config import client_config
    from fedmeta.protocol import RegisterRequest
    from fedmeta.server.budget_keys import CONTENT_IDENTITY, budget_key
    from fedmeta.server.budget_preview import configured_participants
    from fedmeta.server.plan import private_requested
    from fedmeta.server.transport import Registered

    configured = configured_participants(cfg)
    by_items = budget_key(cfg.dataset.name, cfg.seed).identity == CONTENT_IDENTITY
    if not private_requested(cfg.privacy) or not by_items:
        return configured
    request = RegisterRequest("dry-run", client_config(cfg).model_dump_json())
    return [Registered(r.participant_id, r.node_id, r.task_count,
                       registration(request, r.participant_id).data_fingerprint)
            for r in configured]  # fmt: skip


def check_ledger_as_run(cfg: Any, registered: list[Any]) -> None:
    """Refuse, reading only, what the run's open of its ledger refuses (startup.open_budget).

    Another remembered ledger recording this data (the account's or the shared registry), and a
    ledger behind its anchor or its witness (a restored state directory): the same identity,
    registry and witness as the run, nothing written (issue 52, item 5).
    """
    from fedmeta.accounting.ledger import check_rollback
    from fedmeta.server.budget_keys import budget_key
    from fedmeta.server.data_budget import ledger_file
    from fedmeta.server.ledger_witness import refuse_second_ledger, witness_file
    from fedmeta.server.plan import private_requested

    if not private_requested(cfg.privacy):
        return
    path = ledger_file(cfg)
    key = budget_key(cfg.dataset.name, cfg.seed)
    refuse_second_ledger(cfg.privacy, key, path, registered, writing=False)
    check_rollback(path, witness_file(path))


def dry_run_plan(cfg: Any) -> str:
    """The plan a run of ``cfg`` would print first, if every configured participant registers.

    The forecast is against a fresh budget in a throw-away ledger: the real ledger is not opened
    (it names the budget after the registered data, which a dry run never sees), so what this
    data has already spent is left out; ``fedmeta ledger show`` says that.
    """
    import tempfile

    from fedmeta.accounting import BudgetLedger
    from fedmeta.server.outputs import format_plan
    from fedmeta.server.plan import build_plan, forecast

    participants = cfg.federation.participants
    counts = {str(i): cfg.dataset.tasks_per_participant for i in range(participants)}
    plan = build_plan(cfg, counts)
    fc = None
    if plan.privacy is not None:
        with tempfile.TemporaryDirectory() as tmp:
            ledger = BudgetLedger.open(
                Path(tmp) / "dry-run.sqlite", "dry-run", epsilon_budget=cfg.privacy.epsilon_budget,
                delta=cfg.privacy.delta, neighbouring=cfg.privacy.neighbouring, mode="insecure",
            )  # fmt: skip
            fc = forecast(plan.privacy, ledger, cfg.rounds)
            ledger.close()
    note = (
        "(dry run: nothing ran, nothing was recorded; the forecast assumes a fresh budget and "
        f"all {participants} participants with {cfg.dataset.tasks_per_participant} tasks)"
    )
    return f"{format_plan(plan, fc, cfg, participants)}\n{note}"
