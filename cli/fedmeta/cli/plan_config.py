"""``fedmeta privacy plan --write-config``: a plan row as a configuration for ``fedmeta simulate``.

The ``privacy`` commands know no configuration schema, so the fedmeta command line registers them
through :func:`register`, handing them :func:`write_config`. The file holds only the keys
the plan decides (rounds, participants, sampling, the run's target epsilon and delta, noise, clip
and normaliser, and the task count the plan assumed), on top of an optional base configuration; it
is validated with the configuration schema before it is written and read back after.
"""

from __future__ import annotations

import json
import os
import tempfile
import tomllib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fedmeta.accounting.plan_request import PlanRequest, PlanRow
from fedmeta.cli import privacy
from fedmeta.cli.privacy_plan import WrittenConfig
from fedmeta.config_io import to_toml
from fedmeta.server.rate_advice import HIGH_SNR, advise_rate

__all__ = ["plan_keys", "register", "write_config"]


def register(subparsers: Any) -> None:
    """Add ``privacy``, with the configuration writer and the delta of the recorded budget."""
    privacy.register(subparsers, config_writer=write_config, budget_delta=budget_delta)


def budget_delta(base_config: str | None) -> float | None:
    """The delta of the budget recorded for the data ``base_config`` (or the defaults) runs on.

    None when that data has no budget yet in the ledger the configuration spends from (the run
    then records the plan's). Read-only.
    """
    from fedmeta.config import Config
    from fedmeta.config_io import load_config
    from fedmeta.server.budget_keys import budget_key, recorded_terms
    from fedmeta.server.data_budget import ledger_file

    cfg = load_config(base_config) if base_config else Config()
    terms = recorded_terms(ledger_file(cfg), budget_key(cfg.dataset.name, cfg.seed))
    return None if terms is None else terms.delta


def plan_keys(row: PlanRow, request: PlanRequest) -> dict[str, Any]:
    """The dotted configuration keys the plan decides, for ``row``."""
    c, fed, budget = row.candidate, request.federation, request.budget
    keys: dict[str, Any] = {
        "rounds": c.rounds,
        "federation.participants": fed.participants,
        "sampling.participants_per_round": c.participants_per_round,
        "privacy.enabled": True,
        # The plan's epsilon is this run's target; the data's budget stays the one recorded for
        # it (or the base configuration's, for data not yet spent on): docs/ledger.md.
        "privacy.target_epsilon": budget.epsilon,
        "privacy.delta": budget.delta,
        "privacy.neighbouring": budget.neighbouring,
        "privacy.noise_multiplier": row.noise_multiplier,
        "privacy.clip": row.clip,
        # The expected lot the plan assumed: a public constant (never the realised count).
        "privacy.normaliser": row.expected_lot,
    }
    if c.tasks_per_round is not None:
        keys |= {
            "sampling.stage2": "fixed",
            "sampling.tasks_per_round": c.tasks_per_round,
            "sampling.min_tasks": fed.min_tasks,
        }
    else:
        keys |= {"sampling.stage2": "poisson", "sampling.task_rate": c.task_rate}
    if fed.uniform:
        keys["dataset.tasks_per_participant"] = fed.min_tasks
    return keys


def _merge(base: dict[str, Any], keys: dict[str, Any]) -> dict[str, Any]:
    out = _merge_keys(base, keys)
    # Keys of the base that would contradict the plan: the other stage 2's (a Poisson plan sets
    # neither, so removing them after the merge removes only the base's).
    if keys["sampling.stage2"] == "poisson":
        for stale in ("tasks_per_round", "min_tasks"):
            out["sampling"].pop(stale, None)
    return out


def _merge_keys(base: dict[str, Any], keys: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``base`` with each dotted key of ``keys`` set."""
    out: dict[str, Any] = json.loads(json.dumps(base))
    for dotted, value in keys.items():
        *sections, last = dotted.split(".")
        node = out
        for s in sections:
            node = node.setdefault(s, {})
        node[last] = value
    return out


def _header(row: PlanRow, request: PlanRequest) -> str:
    c = row.candidate
    stage2 = f"q2={c.task_rate:g}" if c.task_rate is not None else f"n2={c.tasks_per_round}"
    return (
        f"# Written by `fedmeta privacy plan` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC.\n"
        f"# {c.design}: {c.participants_per_round} of {request.federation.participants} "
        f"participants, {stage2}, {c.rounds} rounds, expected lot {row.expected_lot:.6g}, "
        f"z={row.noise_multiplier:.6g}\n"
        f"# epsilon {row.epsilon:.4f} <= {request.budget.epsilon:g} at delta "
        f"{request.budget.delta:g} ({request.budget.neighbouring}); noise std on the averaged "
        f"gradient {row.noise_std:.4g}\n"
    )


def write_config(
    path: str, row: PlanRow, request: PlanRequest, base_config: str | None
) -> WrittenConfig:
    """Write ``row`` over ``base_config`` (or the defaults) to ``path``.

    With the planner's run SNR (``--signal-norm`` and ``--dimension``) the file also gets the
    meta-learning rate and model selection that SNR calls for
    (server/fedmeta/server/rate_advice.py); each such
    choice is a note of the result and a comment in the file.
    """
    from fedmeta.config_io import config_from_dict, load_config

    if request.adaptive_count_noise is not None:
        raise ValueError(
            "adaptive_count_noise must be left out with --write-config: the configuration has no "
            "adaptive clipping keys yet (the table still shows its cost)"
        )
    base: dict[str, Any] = {}
    if base_config is not None:
        load_config(base_config)  # the base must be valid itself (one-line error otherwise)
        base = tomllib.loads(Path(base_config).read_text(encoding="utf-8"))
    merged, notes = _with_rate_advice(_merge(base, plan_keys(row, request)), row)
    config_from_dict(merged)  # validate before anything is written
    target = Path(path)
    text = _header(row, request) + "".join(f"# {note}\n" for note in notes) + to_toml(merged)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    load_config(target)  # what fedmeta simulate --config will read
    return WrittenConfig(str(target), notes)


def _with_rate_advice(
    merged: dict[str, Any], row: PlanRow
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``merged`` with the advised rate and selection for ``row``'s run SNR, and their notes."""
    from fedmeta.config import ConfigError
    from fedmeta.config_io import config_from_dict

    training = config_from_dict(merged).training  # the plan's keys over the base must be valid
    if row.run_snr is None:
        return merged, ()
    advice = advise_rate(row.run_snr, training.meta_lr)
    out = _merge_keys(merged, {"training.meta_lr": advice.rate})
    notes = [advice.describe(training.optimizer)]
    if advice.select_best_validation and training.model_selection != "best_validation":
        selected = _merge_keys(out, {"training.model_selection": "best_validation"})
        try:
            config_from_dict(selected)
        except ConfigError as exc:
            why = " ".join(str(exc).split())  # one line: each note is also a `# ` comment
            notes.append(f"kept training.model_selection = {training.model_selection!r}: {why}")
        else:
            out = selected
            notes.append(
                f"training.model_selection = 'best_validation': below run SNR {HIGH_SNR:g} a run "
                "can end below where it started; the best validated model is released (no "
                "privacy cost)"
            )
    return out, tuple(notes)
