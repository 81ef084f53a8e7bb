"""What the ``privacy`` and ``ledger`` commands share: one-line errors naming the flag, and flags.

Bad input is reported as one line naming the flag and what it must be, with exit status 2
(argparse's convention), never a traceback. ``--epsilon`` takes the range
``privacy.epsilon_budget`` accepts; ``--db`` defaults to fedmeta's ledger (or an experiment's).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedmeta.accounting.ledger import (
    LedgerError,
)

#: The CLI's default delta: the configuration's default (``privacy.delta``), so a plan printed here
#: matches what a run with the default configuration enforces (a test keeps them equal).
DEFAULT_DELTA = 1e-5


# Dataclass field / argument name -> the flag a user should fix.
FLAGS = {
    "participants": "--participants",
    "participants_per_round": "--participants-per-round",
    "task_rate": "--task-rate",
    "tasks_per_round": "--tasks-per-round",
    "min_tasks": "--min-tasks",
    "rate": "--flat-poisson-rate",
    "sample_size": "--sample-size",
    "population": "--population",
    "noise_multiplier": "--noise-multiplier",
    "max_tasks_per_participant": "--max-tasks-per-participant",
    "delta": "--delta",
    "rounds": "--rounds",
    "round count": "--rounds",
    "target_epsilon": "--epsilon",
    "epsilon_budget": "--epsilon",
    "unit": "--unit",
    "neighbouring": "--neighbouring",
}


class UsageError(Exception):
    """A user error with the flag to fix; printed as one line, exit status 2."""


def flag_for(message: str, flags: dict[str, str] | None = None) -> str | None:
    """The flag to fix for an error message ``<field> must ...``, or None."""
    match = re.match(r"([a-z_ ]+?) must", message)
    return (flags or FLAGS).get(match.group(1)) if match else None


def handled(
    command: str,
    body: Callable[[argparse.Namespace], int],
    flags: dict[str, str] | None = None,
) -> Callable[[argparse.Namespace], int]:
    """``body`` as an argparse handler: a usage, value, ledger or OS error is one line, status 2."""

    def handler(args: argparse.Namespace) -> int:
        try:
            return body(args)
        except BrokenPipeError:
            raise  # the reader closed the pipe (`| head`): the dispatcher ends quietly
        except (UsageError, ValueError, LedgerError, OSError) as error:
            message = str(error)
            flag = flag_for(message, flags)
            prefix = f"{flag}: " if flag else ""
            print(f"fedmeta {command}: error: {prefix}{message}", file=sys.stderr)
            return 2

    return handler


def eps_text(value: float | None, digits: int = 4) -> str:
    """An epsilon for a table: ``digits`` decimals; unbounded and unknown said in words."""
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if math.isfinite(value) else "inf (no finite bound)"


def json_eps(value: float) -> float | None:
    """An epsilon for JSON, which has no infinity: an unbounded epsilon is null."""
    return value if math.isfinite(value) else None


def emit(args: argparse.Namespace, payload: dict[str, Any], rows: list[tuple[str, str]]) -> None:
    """A command's answer: ``payload`` as JSON with ``--json``, else ``rows`` as aligned lines."""
    if args.json:
        print(json.dumps(payload, indent=2, sort_keys=True))
        return
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key.ljust(width)}  {value}")


def epsilon_value(text: str) -> float:
    """``--epsilon``: a number in (0, 1000], the range ``privacy.epsilon_budget`` accepts."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number; got {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= 1000):
        raise argparse.ArgumentTypeError(
            f"must be in (0, 1000], as privacy.epsilon_budget; got {text}"
        )
    return value


def add_epsilon_arg(p: Any, help_text: str, old: str | None = None) -> None:
    """``--epsilon`` on every command that takes one; ``old`` is an earlier spelling, hidden."""
    p.add_argument("--epsilon", type=epsilon_value, required=old is None, help=help_text)
    if old is not None:  # either spelling, the handler checks that one was given
        p.add_argument(old, dest="old_epsilon", type=epsilon_value, help=argparse.SUPPRESS)


@dataclass(frozen=True)
class LedgerLocations:
    """Where fedmeta keeps ledgers (``accounting`` cannot know): the default one, experiments'."""

    default: Path
    experiment: Callable[[str], Path]


def add_db_arg(p: Any, help_text: str, where: LedgerLocations | None) -> None:
    """``--db``: required unless the caller knows the default ledger (fedmeta's state dir).

    With it, ``--experiment NAME`` names an experiment's own ledger instead.
    """
    if where is None:
        p.add_argument("--db", required=True, help=help_text)
        return
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--db", default=str(where.default), help=f"{help_text} (default: %(default)s)"
    )
    group.add_argument(
        "--experiment", dest="db", metavar="NAME", type=lambda name: str(where.experiment(name)),
        help="the ledger of experiment NAME (fedmeta simulate --experiment NAME)",
    )  # fmt: skip


def no_experiments(name: str) -> Path:
    """``--experiment`` without fedmeta's state directory: refused, naming ``--db``."""
    raise argparse.ArgumentTypeError("experiments need fedmeta's state directory; use --db")
