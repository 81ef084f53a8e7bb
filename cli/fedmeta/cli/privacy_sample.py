"""``fedmeta privacy epsilon|calibrate|max-rounds --level sample``: sample-level DP-MAML (issue 53).

The guarantee is per example of one participant's data (add or remove one example):
``accounting.sample_level`` (the round) and ``accounting.sample_level_bound`` (epsilon, rounds,
calibration). Each command prints the valid epsilon and, beside it, DP-MAML's own reading of its
setting (``accounting.dpmaml_reading``), labelled NOT A GUARANTEE. Flags of the other level are
refused in one line naming the flag, never silently ignored.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, TypeAlias

from fedmeta.accounting.composition import MAX_ROUNDS_LIMIT
from fedmeta.accounting.dpmaml_reading import (
    NOT_A_GUARANTEE,
    dpmaml_moments_epsilon,
    dpmaml_per_update_epsilon,
)
from fedmeta.accounting.sample_level import ORDERS, ExampleSampling, SampleLevelRound, gdp_mu
from fedmeta.accounting.sample_level_bound import (
    calibrate_sample_level,
    sample_level_epsilon,
    sample_level_max_rounds,
)
from fedmeta.accounting.schemes import ADD_REMOVE
from fedmeta.cli.arguments import FLAGS, UsageError, emit, eps_text, json_eps

#: Flags of the task-level scheme, refused at sample level (``dest``, flag).
TASK_ONLY = (
    ("noise_multiplier", "--noise-multiplier"),
    ("task_rate", "--task-rate"),
    ("tasks_per_round", "--tasks-per-round"),
    ("min_tasks", "--min-tasks"),
    ("flat_poisson_rate", "--flat-poisson-rate"),
    ("sample_size", "--sample-size"),
    ("population", "--population"),
    ("max_tasks_per_participant", "--max-tasks-per-participant"),
)
#: Flags of the sample level, refused at task level (``dest``, flag).
SAMPLE_ONLY = (
    ("example_rate", "--example-rate"),
    ("inner_noise_multiplier", "--inner-noise-multiplier"),
    ("outer_noise_multiplier", "--outer-noise-multiplier"),
    ("inner_steps", "--inner-steps"),
    ("max_appearances", "--max-appearances"),
    ("order", "--order"),
    ("query_cap", "--query-cap"),
    ("dpmaml_tasks_per_lot", "--dpmaml-tasks-per-lot"),
    ("dpmaml_tasks", "--dpmaml-tasks"),
)
#: The flag each accountant field is set by (an error ``<field> must ...`` names it).
SAMPLE_FLAGS = {
    **FLAGS,
    **{dest: flag for dest, flag in SAMPLE_ONLY},
    "event": "--inner-noise-multiplier/--outer-noise-multiplier",
    "effective noise multiplier 1/mu": "--inner-noise-multiplier/--outer-noise-multiplier",
    "tasks_per_lot": "--dpmaml-tasks-per-lot",
    "tasks": "--dpmaml-tasks",
}
NOT_A_GUARANTEE_LABEL = "NOT A GUARANTEE"
#: A table: (label, value) rows.
Rows: TypeAlias = list[tuple[str, str]]


def add_sample_args(parser: argparse.ArgumentParser, *, noise: bool) -> None:
    """The sample-level flags (used with ``--level sample``)."""
    group = parser.add_argument_group(
        "sample level (--level sample: one example of one participant, add/remove); "
        "--participants and --participants-per-round give a first stage"
    )
    group.add_argument("--example-rate", type=float, help="q, Poisson rate of each example")
    if noise:
        group.add_argument("--inner-noise-multiplier", type=float, help="z_in, inner loop")
        group.add_argument("--outer-noise-multiplier", type=float, help="z_out, outer loop")
    group.add_argument("--inner-steps", type=int, help="K, noisy inner steps per task")
    group.add_argument("--max-appearances", type=int, help="m, most slots of one example a round")
    group.add_argument("--order", choices=ORDERS, help="first (default) or second order")
    group.add_argument("--query-cap", type=int, help="most query examples a task (second order)")
    group.add_argument(
        "--dpmaml-tasks-per-lot", type=int, help="L, for DP-MAML's reading (not a guarantee)"
    )
    group.add_argument("--dpmaml-tasks", type=int, help="N tasks, for DP-MAML's reading")


def check_level_flags(args: argparse.Namespace) -> None:
    """Refuse flags of the other level (one line naming the flag and the fix)."""
    if args.level == "task":
        for dest, flag in SAMPLE_ONLY:
            if getattr(args, dest, None) is not None:
                raise UsageError(f"{flag} is a sample-level flag; add --level sample or drop it")
        return
    for dest, flag in TASK_ONLY:
        if getattr(args, dest, None) is not None:
            raise UsageError(
                f"{flag} is a task-level flag; at --level sample give --example-rate, "
                "--inner-noise-multiplier, --outer-noise-multiplier, --inner-steps, "
                "--max-appearances instead"
            )
    if args.unit != "task":
        raise UsageError("--unit must be task at --level sample (the unit is one example)")
    if args.neighbouring != ADD_REMOVE:
        raise UsageError("--neighbouring must be add_remove at --level sample (one example)")


def _event(args: argparse.Namespace, z_in: float, z_out: float) -> SampleLevelRound:
    for dest, flag in (("example_rate", "--example-rate"), ("inner_steps", "--inner-steps"),
                       ("max_appearances", "--max-appearances")):  # fmt: skip
        if getattr(args, dest) is None:
            raise UsageError(f"{flag} must be given at --level sample")
    if (args.participants is None) != (args.participants_per_round is None):
        raise UsageError("--participants and --participants-per-round must be given together")
    p, n1 = args.participants or 1, args.participants_per_round or 1
    return SampleLevelRound(
        ExampleSampling(p, n1, args.example_rate), z_in, z_out, args.inner_steps,
        args.max_appearances, args.order or "first", args.query_cap,
    )  # fmt: skip


def _noises(args: argparse.Namespace) -> tuple[float, float]:
    for dest, flag in (("inner_noise_multiplier", "--inner-noise-multiplier"),
                       ("outer_noise_multiplier", "--outer-noise-multiplier")):  # fmt: skip
        if getattr(args, dest) is None:
            raise UsageError(f"{flag} must be given at --level sample")
    return float(args.inner_noise_multiplier), float(args.outer_noise_multiplier)


def _describe(event: SampleLevelRound) -> str:
    s = event.sampling
    if s.participants_per_round == s.participants:
        return f"single stage: Poisson examples q={s.example_rate:g}"
    return (
        f"two-stage: {s.participants_per_round} of {s.participants} participants, "
        f"Poisson examples q2={s.example_rate:g}"
    )


def _dpmaml(args: argparse.Namespace, z: float, rounds: int) -> dict[str, Any] | None:
    """DP-MAML's reading at its lot of tasks and ``z`` (NOT a guarantee), or None if not asked."""
    lot, tasks = args.dpmaml_tasks_per_lot, args.dpmaml_tasks
    if lot is None and tasks is None:
        return None
    if lot is None or tasks is None:
        raise UsageError("--dpmaml-tasks-per-lot and --dpmaml-tasks must be given together")
    if rounds < 1:
        return {"note": NOT_A_GUARANTEE, "moments_epsilon": None, "per_update_epsilon": None,
                "moments_refused": "no rounds"}  # fmt: skip
    try:
        moments: float | None = dpmaml_moments_epsilon(lot, tasks, z, rounds, args.delta)
        refused = None
    except ValueError as error:  # outside Lemma 3's hypotheses: the paper has no number there
        moments, refused = None, str(error)
    per_update = dpmaml_per_update_epsilon(lot, tasks, z, rounds, args.delta)
    return {"note": NOT_A_GUARANTEE, "moments_epsilon": moments, "moments_refused": refused,
            "per_update_epsilon": json_eps(per_update)}  # fmt: skip


def _dpmaml_rows(reading: dict[str, Any] | None) -> Rows:
    if reading is None:
        return [(f"DP-MAML's reading ({NOT_A_GUARANTEE_LABEL})",
                 "give --dpmaml-tasks-per-lot and --dpmaml-tasks")]  # fmt: skip
    moments = reading["moments_epsilon"]
    shown = eps_text(moments) if moments is not None else f"n/a: {reading['moments_refused']}"
    return [
        (f"DP-MAML's reading, moments accountant ({NOT_A_GUARANTEE_LABEL})", shown),
        (f"DP-MAML's per-update event, exact ({NOT_A_GUARANTEE_LABEL})",
         eps_text(reading["per_update_epsilon"])),
        ("  why not a guarantee", NOT_A_GUARANTEE),
    ]  # fmt: skip


def _common(event: SampleLevelRound, args: argparse.Namespace) -> tuple[dict[str, Any], Rows]:
    payload: dict[str, Any] = {
        "level": "sample", "neighbouring": ADD_REMOVE, "sampling": _describe(event),
        "event": event.to_dict(), "delta": args.delta,
    }  # fmt: skip
    rows = [
        ("level", "sample (add or remove one example of one participant)"),
        ("sampling", payload["sampling"]),
        ("inner / outer noise", f"z_in={event.inner_noise_multiplier:.4g}, "
                                f"z_out={event.outer_noise_multiplier:.4g}"),
        ("inner steps K, cap m", f"{event.inner_steps}, {event.max_appearances}"),
        ("order", event.order + (f" (query cap {event.query_cap})" if event.query_cap else "")),
        ("mu of a sampled round (GDP)", f"{gdp_mu(event):.6g}"),
        ("delta", f"{args.delta:g}"),
    ]  # fmt: skip
    return payload, rows


def sample_epsilon(args: argparse.Namespace) -> int:
    """``privacy epsilon --level sample``."""
    event = _event(args, *_noises(args))
    eps = sample_level_epsilon(event, args.rounds, args.delta)
    eps_rdp = sample_level_epsilon(event, args.rounds, args.delta, "rdp")
    reading = _dpmaml(args, event.outer_noise_multiplier, args.rounds)
    payload, rows = _common(event, args)
    payload.update(rounds=args.rounds, epsilon=json_eps(eps), epsilon_rdp=json_eps(eps_rdp),
                   dpmaml_reading=reading)  # fmt: skip
    rows += [("rounds", str(args.rounds)), ("epsilon (PLD, enforced, valid)", eps_text(eps)),
             ("epsilon (RDP cross-check)", eps_text(eps_rdp)), *_dpmaml_rows(reading)]  # fmt: skip
    emit(args, payload, rows)
    return 0


def sample_calibrate(args: argparse.Namespace) -> int:
    """``privacy calibrate --level sample``: the least z_in and z_out meeting the target."""
    event = calibrate_sample_level(
        _event(args, 1.0, 1.0), args.rounds, args.target_epsilon, args.delta
    )
    eps = sample_level_epsilon(event, args.rounds, args.delta)
    reading = _dpmaml(args, event.outer_noise_multiplier, args.rounds)
    payload, rows = _common(event, args)
    payload.update(rounds=args.rounds, target_epsilon=args.target_epsilon, epsilon=eps,
                   inner_noise_multiplier=event.inner_noise_multiplier,
                   outer_noise_multiplier=event.outer_noise_multiplier,
                   dpmaml_reading=reading)  # fmt: skip
    rows += [("rounds", str(args.rounds)), ("target epsilon", f"{args.target_epsilon:g}"),
             ("epsilon (PLD, valid) at them", eps_text(eps)), *_dpmaml_rows(reading)]  # fmt: skip
    emit(args, payload, rows)
    return 0


def sample_max_rounds(args: argparse.Namespace) -> int:
    """``privacy max-rounds --level sample``."""
    event = _event(args, *_noises(args))
    rounds = sample_level_max_rounds(event, args.epsilon, args.delta)
    eps = sample_level_epsilon(event, rounds, args.delta) if rounds else 0.0
    capped = rounds >= MAX_ROUNDS_LIMIT
    reading = _dpmaml(args, event.outer_noise_multiplier, rounds)
    payload, rows = _common(event, args)
    payload.update(epsilon_budget=args.epsilon, rounds=rounds, rounds_at_limit=capped,
                   epsilon=eps if math.isfinite(eps) else None,
                   dpmaml_reading=reading)  # fmt: skip
    shown = f"{rounds} or more (the accountant's range ends there)" if capped else str(rounds)
    rows += [("epsilon budget", f"{args.epsilon:g}"), ("max rounds (PLD, exact)", shown),
             ("epsilon (PLD, valid) after them", eps_text(eps)),
             *_dpmaml_rows(reading)]  # fmt: skip
    emit(args, payload, rows)
    return 0
