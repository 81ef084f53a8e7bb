"""The server's thin adapter over ``accounting/``: scheme, event, sampler, ledger and the plan.

All calls into the accounting package go through here, so the round loop reads as the protocol and
the exact accounting API is in one place. ``accounting`` owns every privacy number; nothing here
computes an epsilon itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedmeta.config import Config


@dataclass(frozen=True)
class Plan:
    """The privacy plan printed before training."""

    private: bool
    epsilon_budget: float | None
    delta: float | None
    noise_multiplier: float | None
    noise_calibrated: bool
    clip: float | None
    planned_rounds: int
    rounds_affordable: int | None
    ledger_rounds_before: int
    epsilon_spent_before: float
    epsilon_task_at_end: float | None
    epsilon_participant_at_end: float | None
    epsilon_tombs2022_published_at_end: float | None
    expected_tasks_per_round: float
    participants: int
    participants_per_round: int
    scheme: str


def _acc(name: str) -> Any:
    """``accounting.<name>``, falling back to its submodules while ``__init__`` is partial."""
    import importlib

    import accounting

    if hasattr(accounting, name):
        return getattr(accounting, name)
    for sub in ("schemes", "composition", "sampler", "ledger"):
        try:
            mod = importlib.import_module(f"accounting.{sub}")
        except ImportError:
            continue
        if hasattr(mod, name):
            return getattr(mod, name)
    raise AttributeError(f"accounting has no {name!r}")


def make_scheme(cfg: Config, task_counts: Mapping[str, int]) -> Any:
    """The two-stage scheme for the registered participants (counts are public)."""
    participants = len(task_counts)
    n1 = min(cfg.sampling.participants_per_round, participants)
    if cfg.sampling.stage2 == "fixed":
        assert cfg.sampling.tasks_per_round is not None
        return _acc("TwoStageFixedScheme")(
            participants=participants,
            participants_per_round=n1,
            tasks_per_round=cfg.sampling.tasks_per_round,
            min_tasks=min(task_counts.values()),
        )
    return _acc("TwoStagePoissonScheme")(
        participants=participants, participants_per_round=n1, task_rate=cfg.sampling.task_rate
    )


def expected_tasks(cfg: Config, task_counts: Mapping[str, int]) -> float:
    """The public normaliser: E[number of sampled tasks] (never the realised count)."""
    counts = list(task_counts.values())
    n1 = min(cfg.sampling.participants_per_round, len(counts))
    if cfg.sampling.stage2 == "fixed":
        return float(n1 * (cfg.sampling.tasks_per_round or 1))
    return n1 * cfg.sampling.task_rate * (sum(counts) / len(counts))


def max_tasks_per_participant(cfg: Config, task_counts: Mapping[str, int]) -> int:
    """Participant-level sensitivity in units of C: the most tasks a participant sends per round."""
    if cfg.sampling.stage2 == "fixed":
        return int(cfg.sampling.tasks_per_round or 1)
    return int(max(task_counts.values()))


#: Printed instead of the participant-level epsilon when it is not a meaningful guarantee.
PARTICIPANT_LEVEL_NOT_MEANINGFUL = (
    "not meaningful: no per-participant cap with Poisson stage 2 (the bound assumes a participant "
    "may send all its tasks in a round); use sampling.stage2=fixed for a participant-level "
    "guarantee"
)


def participant_level_note(cfg: Config) -> str | None:
    """Explain why the participant-level epsilon is not meaningful, or None when it is.

    With a Poisson stage 2 nothing caps a participant's tasks per round, so the only sound
    sensitivity is its whole task count times C: the resulting epsilon (~1e7 in the default run) is
    a valid but useless bound. A fixed-size stage 2 caps it at ``tasks_per_round``.
    """
    if cfg.sampling.stage2 == "fixed":
        return None
    return PARTICIPANT_LEVEL_NOT_MEANINGFUL


def make_event(cfg: Config, scheme: Any, z: float, task_counts: Mapping[str, int]) -> Any:
    """The per-round ``GaussianRound`` event."""
    return _acc("GaussianRound")(
        scheme=scheme,
        noise_multiplier=float(z),
        max_tasks_per_participant=max_tasks_per_participant(cfg, task_counts),
    )


def calibrate_z(cfg: Config, scheme: Any, rounds: int, target_epsilon: float) -> float:
    """Smallest z meeting ``target_epsilon`` after ``rounds`` rounds (task level)."""
    return float(
        _acc("calibrate_noise_multiplier")(
            scheme, int(rounds), float(target_epsilon), cfg.privacy.delta
        )
    )


def open_ledger(cfg: Config, out_dir: Path, federation_id: str) -> Any:
    """Open (or create) the durable budget ledger for this federation."""
    path = (
        Path(cfg.privacy.ledger_path)
        if cfg.privacy.ledger_path
        else Path(out_dir) / "ledger.sqlite"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    return _acc("BudgetLedger").open(
        path, federation_id, epsilon_budget=cfg.privacy.epsilon_budget, delta=cfg.privacy.delta
    )


def epsilon_for(events: list[tuple[Any, int]], delta: float, unit: str = "task") -> float:
    """Epsilon of a composition of (event, count) groups.

    Task level: PLD, the value that is enforced. Participant level: RDP (an upper bound on the PLD
    value; reported, not enforced). The participant-level sensitivity is up to hundreds of C, where
    a PLD grid needs gigabytes; RDP is exact enough for a reported number and costs milliseconds.
    """
    groups = [(e, int(n)) for e, n in events if n > 0]
    if not groups:
        return 0.0
    method = "pld" if unit == "task" else "rdp"
    return float(_acc("epsilon")(groups, delta, unit=unit, method=method))


def published_epsilon(event: Any, rounds: int, delta: float) -> float | None:
    """Tombs et al. (2022) Theorem 3 as published: reported only, never enforced."""
    try:
        fn = _acc("tombs2022_published_epsilon")
    except AttributeError:
        fn = None
    if fn is None or rounds <= 0:
        return None
    try:
        return float(fn(event, rounds, delta))
    except TypeError:
        try:
            return float(fn([(event, rounds)], delta))
        except Exception:  # noqa: BLE001 - a reporting-only number must not stop a run
            return None


def ledger_epsilon(ledger: Any, unit: str = "task") -> float:
    """Epsilon of everything the ledger holds for this federation (task: PLD; participant: RDP)."""
    return float(ledger.epsilon(unit=unit, method="pld" if unit == "task" else "rdp"))


def ledger_groups(ledger: Any) -> list[tuple[Any, int]]:
    """The ledger's spends as ``[(event, count)]`` groups."""
    return list(ledger.rounds())


def run_spends(ledger: Any, run_id: str) -> list[int]:
    """Sorted round indices this run has spent (from the ledger, the source of truth)."""
    out = []
    for rec in ledger.records():
        if str(getattr(rec, "run_id", "")) == run_id:
            out.append(int(rec.round_index))
    return sorted(out)


def make_sampler(scheme: Any, seed: int | None, state: Any = None) -> Any:
    """The sampler that executes ``scheme``: secret RNG unless a test seed is given."""
    if state is not None:
        return _acc("TwoStageSampler").from_state(scheme, state)
    rng = np.random.default_rng(seed) if seed is not None else None
    return _acc("TwoStageSampler")(scheme, rng)


def fmt_eps(x: float | None) -> str:
    """Format an epsilon for humans."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.3f}"


def budget_exhausted_error() -> type[BaseException]:
    """The exception ``ledger.spend`` raises when the budget would be exceeded."""
    return _acc("BudgetExhausted")  # type: ignore[no-any-return]
