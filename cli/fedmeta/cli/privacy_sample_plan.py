"""``fedmeta privacy plan --level sample``: rank sample-level designs (issue 53).

The search and its ranking are ``fedmeta.accounting.sample_level_plan``'s (docs/privacy.md,
"Planning commands"): every (participants per round, example rate, rounds) of the given lists,
calibrated to the budget with the valid example-level bound, rows over the inner-noise cap
dropped, the rest ranked by the outer noise on the averaged gradient over sqrt(rounds). Flags of
the task-level plan are refused in one line naming the flag.
"""

from __future__ import annotations

import argparse
from typing import Any

from fedmeta.accounting.levels import LEVELS
from fedmeta.accounting.sample_level_plan import SamplePlanRequest, SamplePlanRow, plan_sample_level
from fedmeta.accounting.schemes import ADD_REMOVE
from fedmeta.cli.arguments import DEFAULT_DELTA, UsageError, emit, eps_text, json_eps

#: ``privacy plan`` flags of the task level, refused at ``--level sample`` (``dest``, flag).
TASK_PLAN_ONLY = (
    ("tasks_per_participant", "--tasks-per-participant"),
    ("max_tasks_per_round", "--max-tasks-per-round"),
    ("max_task_gradients", "--max-task-gradients"),
    ("max_participants_per_round", "--max-participants-per-round"),
    ("designs", "--designs"),
    ("adaptive_count_noise", "--adaptive-count-noise"),
    ("dimension", "--dimension"),
    ("signal_norm", "--signal-norm"),
    ("baseline", "--baseline"),
    ("base_config", "--base-config"),
)
#: ``privacy plan`` flags of the sample level, refused at task level (``dest``, flag).
SAMPLE_PLAN_ONLY = (
    ("examples_per_participant", "--examples-per-participant"),
    ("example_rate", "--example-rate"),
    ("inner_steps", "--inner-steps"),
    ("max_appearances", "--max-appearances"),
    ("max_inner_noise_multiplier", "--max-inner-noise-multiplier"),
)
#: Request field -> the flag a user should fix (an error ``<field> must ...`` names it).
SAMPLE_PLAN_FLAGS = {
    **{dest: flag for dest, flag in SAMPLE_PLAN_ONLY},
    "example_rates": "--example-rate",
    "participants_per_round": "--participants-per-round",
    "rounds": "--rounds",
    "participants": "--participants",
    "epsilon": "--epsilon",
    "delta": "--delta",
    "clip": "--clip",
}


def add_sample_plan_args(p: argparse.ArgumentParser) -> None:
    """``--level`` and the ``--level sample`` flags of ``privacy plan``."""
    p.add_argument("--level", choices=LEVELS, default="task",
                   help="task (default): one task; sample: one example (issue 53)")  # fmt: skip
    group = p.add_argument_group(
        "sample level (--level sample: one example of one participant, add/remove; "
        "docs/privacy.md, 'Planning commands')"
    )
    group.add_argument("--examples-per-participant", type=int, metavar="N",
                       help="examples (drawings) each participant holds")  # fmt: skip
    group.add_argument("--example-rate", metavar="Q[,Q...]", help="candidate example rates q")
    group.add_argument("--inner-steps", type=int, metavar="K", help="noisy inner steps a task")
    group.add_argument("--max-appearances", type=int, metavar="M",
                       help="m, most slots of one example a round")  # fmt: skip
    group.add_argument("--max-inner-noise-multiplier", type=float, metavar="Z",
                       help="rows whose calibrated z_in exceeds Z are not feasible (required: "
                       "the outer ranking rewards more inner noise)")  # fmt: skip


def check_plan_level_flags(args: argparse.Namespace) -> None:
    """Refuse ``privacy plan`` flags of the other level (one line naming the flag and the fix)."""
    if args.level == "task":
        for dest, flag in SAMPLE_PLAN_ONLY:
            if getattr(args, dest) is not None:
                raise UsageError(f"{flag} is a sample-level flag; add --level sample or drop it")
        return
    for dest, flag in TASK_PLAN_ONLY:
        if getattr(args, dest) is not None:
            raise UsageError(f"{flag} is a task-level flag of privacy plan; drop it at --level "
                             "sample")  # fmt: skip
    if args.write_config:
        raise UsageError(
            "--write-config is task level only; at --level sample set rounds, "
            "sampling.participants_per_round, privacy.sample.example_rate, "
            "privacy.sample.inner_noise_multiplier and privacy.noise_multiplier from the row"
        )
    if args.neighbouring != ADD_REMOVE:
        raise UsageError("--neighbouring must be add_remove at --level sample (one example)")


def _list(flag: str, text: str | None, kind: type[int] | type[float]) -> tuple[Any, ...]:
    if text is None:
        raise UsageError(f"{flag} must be given at --level sample")
    try:
        return tuple(kind(v) for v in text.split(","))
    except ValueError:
        raise UsageError(f"{flag} must be numbers separated by commas; got {text!r}") from None


def _request(args: argparse.Namespace) -> SamplePlanRequest:
    for dest, flag in SAMPLE_PLAN_ONLY:
        if dest != "example_rate" and getattr(args, dest) is None:
            raise UsageError(f"{flag} must be given at --level sample")
    p = args.participants
    halving = sorted({p >> i for i in range(p.bit_length())}, reverse=True)  # P, P/2, ..., 1
    n1 = (_list("--participants-per-round", args.participants_per_round, int)
          if args.participants_per_round else tuple(halving))  # fmt: skip
    return SamplePlanRequest(
        epsilon=args.epsilon, delta=DEFAULT_DELTA if args.delta is None else args.delta,
        participants=p, examples_per_participant=args.examples_per_participant,
        inner_steps=args.inner_steps, max_appearances=args.max_appearances,
        example_rates=_list("--example-rate", args.example_rate, float),
        participants_per_round=n1, rounds=_list("--rounds", args.rounds, int),
        max_inner_noise_multiplier=args.max_inner_noise_multiplier, clip=args.clip,
    )  # fmt: skip


def _row_json(row: SamplePlanRow) -> dict[str, Any]:
    e = row.event
    return {
        "participants_per_round": e.sampling.participants_per_round,
        "example_rate": e.sampling.example_rate, "rounds": row.rounds,
        "expected_examples": row.expected_examples,
        "inner_noise_multiplier": e.inner_noise_multiplier,
        "outer_noise_multiplier": e.outer_noise_multiplier, "noise_std": row.noise_std,
        "proxy": row.proxy, "epsilon": json_eps(row.epsilon), "event": e.to_dict(),
    }  # fmt: skip


def sample_plan(args: argparse.Namespace) -> int:
    """``privacy plan --level sample``: the ranked rows, and a note per row over the cap."""
    request = _request(args)
    result = plan_sample_level(request, top=args.top)
    r = request
    payload = {
        "level": "sample", "neighbouring": ADD_REMOVE, "epsilon": r.epsilon, "delta": r.delta,
        "participants": r.participants, "examples_per_participant": r.examples_per_participant,
        "inner_steps": r.inner_steps, "max_appearances": r.max_appearances, "clip": r.clip,
        "max_inner_noise_multiplier": r.max_inner_noise_multiplier,
        "ranked_by": "proxy = noise_std / sqrt(rounds), noise_std = outer_noise_multiplier * "
        "clip / expected_examples, expected_examples = participants_per_round * "
        "examples_per_participant * example_rate",
        "rows": [_row_json(row) for row in result.rows], "notes": list(result.notes),
    }  # fmt: skip
    lines = [
        ("level", "sample (add or remove one example of one participant)"),
        ("budget", f"epsilon {r.epsilon:g}, delta {r.delta:g}; K = {r.inner_steps}, "
                   f"m = {r.max_appearances}, C_out = {r.clip:g}, z_in <= "
                   f"{r.max_inner_noise_multiplier:g}"),
        ("ranked by", "z_out*C/E[examples] / sqrt(T), E[examples] = n1*N*q (outer loop only)"),
    ]  # fmt: skip
    for i, row in enumerate(result.rows, 1):
        e = row.event
        lines.append((
            f"{i}", f"n1/P {e.sampling.participants_per_round}/{r.participants}  q "
            f"{e.sampling.example_rate:g}  E[examples] {row.expected_examples:.4g}  T "
            f"{row.rounds}  z_in {e.inner_noise_multiplier:.4f}  z_out "
            f"{e.outer_noise_multiplier:.4f}  noise std {row.noise_std:.4g}  std/sqrtT "
            f"{row.proxy:.3g}  epsilon {eps_text(row.epsilon)}",
        ))  # fmt: skip
    if not result.rows:
        lines.append(("rows", "none feasible: raise --max-inner-noise-multiplier, or lower "
                              "--example-rate, --participants-per-round or --rounds"))  # fmt: skip
    lines += [("not feasible", note) for note in result.notes]
    emit(args, payload, lines)
    return 0
