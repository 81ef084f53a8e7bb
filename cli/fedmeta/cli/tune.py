r"""``fedmeta tune``: choose among candidate configurations on private data, and pay for it.

    fedmeta tune --config base.toml --candidate "training.meta_lr=0.001" \\
                 --candidate "training.meta_lr=0.003 training.inner_steps=3" --out runs/tune

Every candidate is trained once on the same data (``fedmeta simulate``'s run, one after another),
each round charged to the data's ledger like any run, so the tuning composes with the runs before
it and after it by the ledger's own (PLD) accounting. The candidates are compared by the validation
metric of the model each released (the server's validation classes, which no participant owns);
test tasks never enter the choice. ``tune.json`` names the chosen candidate and its run directory.

**Refused before any trial.** Every candidate's planned rounds (its plan, as ``simulate --dry-run``
builds it) are composed with what the data's ledger already holds; if the whole tuning would take
any participant over the data's budget, nothing runs, and one line says how many of the candidates,
in the order given, fit. The check plans as ``simulate --dry-run`` does (every configured
participant with ``dataset.tasks_per_participant`` tasks); each trial's rounds are still checked one
by one by the ledger when they are spent, so a plan that was too hopeful stops a trial, never the
budget.

**Why every candidate once, not a random number of trials.** Papernot and Steinke (2022) bound a
tuner that runs a random number of trials and releases only the best
(accounting/fedmeta/accounting/tuning.py). Their bound is in RDP; at this project's scale it costs
more than composing the same number of trials exactly (docs/privacy.md, "Tuning on private data":
at the Omniglot CPU configuration's 300 rounds and (1.5, 1e-6) per run, 5 trials cost epsilon 2.03
composed by PLD, 2.96 with the Poisson tuner of mean 5). The plan prints both.

``main(args) -> dict`` is the programmatic entry point; ``register`` imports nothing heavy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fedmeta import exitcodes

#: Keys a candidate may not change: they decide whose data and which budget the trials spend.
_SAME_DATA = ("dataset.", "seed", "federation.participants", "privacy.ledger_path",
              "privacy.experiment", "privacy.epsilon_budget", "privacy.delta",
              "privacy.neighbouring", "privacy.insecure_test_seed", "privacy.enabled")  # fmt: skip


class TuneRefused(ValueError):
    """The tuning would not fit the data's budget: refused before any trial."""


def register(subparsers: Any) -> None:
    """Add ``fedmeta tune``."""
    from fedmeta.simulation.simulate import key_value

    p = subparsers.add_parser(
        "tune",
        help="train candidate configurations on private data, choose on validation, pay for all",
        description="Train each candidate once on the same data, every round charged to the "
        "data's ledger; release the one with the best validation metric.",
    )
    p.add_argument("--config", type=Path, default=None, help="base TOML configuration")
    p.add_argument("--set", dest="overrides", action="append", default=[], type=key_value,
                   metavar="KEY=VALUE", help="override for every candidate")  # fmt: skip
    p.add_argument("--candidate", dest="candidates", action="append", default=[],
                   metavar="'KEY=VALUE ...'", help="a candidate's overrides (>= 2)")  # fmt: skip
    p.add_argument("--out", type=Path, required=True, help="directory for the trials and tune.json")
    p.add_argument("--dry-run", action="store_true", help="check and price; run nothing")
    p.set_defaults(func=_handle)


def _handle(args: argparse.Namespace) -> int:
    from fedmeta.accounting import LedgerError
    from fedmeta.config import ConfigError

    try:
        result = main(args)
    except TuneRefused as error:
        print(f"fedmeta tune: {error}", file=sys.stderr)
        return exitcodes.BUDGET_EXHAUSTED
    except (ConfigError, LedgerError, ValueError) as error:
        print(f"fedmeta tune: {error}", file=sys.stderr)
        return exitcodes.BAD_INPUT
    except Exception as error:  # noqa: BLE001 - one line, never a traceback
        print(f"fedmeta tune: {type(error).__name__}: {error}", file=sys.stderr)
        return exitcodes.INTERNAL_ERROR
    print(json.dumps(result, indent=2))
    return exitcodes.OK


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Check, then train every candidate and choose on validation; the JSON-ready result."""
    candidates = _candidates(args)
    price = check_fits(candidates)
    if args.dry_run:
        return {"dry_run": True, **price}
    from fedmeta.simulation.simulate import main as simulate

    trials = []
    for i, (label, cfg) in enumerate(candidates):
        result = simulate(cfg, out_dir=Path(args.out) / f"trial-{i + 1}")
        trials.append({"candidate": label, "run_dir": str(result.out_dir),
                       "validation_metric": validation_score(result.summary, result.outcomes),
                       "epsilon_spent": result.summary.get("epsilon_spent")})  # fmt: skip
    chosen = _best(trials, higher=candidates[0][1].dataset.name != "sinusoid")
    out = {**price, "trials": trials, "chosen": chosen,
           "choice": "best validation metric of each candidate's released model (server-held "
           "validation classes; test tasks never compared)"}  # fmt: skip
    (Path(args.out) / "tune.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    return out


def _candidates(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """Each candidate's label and configuration (base, ``--set``, then its own overrides)."""
    from fedmeta.config import ConfigError, load_config

    if len(args.candidates) < 2:
        raise ConfigError(f"--candidate: give at least 2 candidates to choose among; got "
                          f"{len(args.candidates)}")  # fmt: skip
    out = []
    for text in args.candidates:
        sets = text.split()
        bad = [s for s in sets if "=" not in s or s.split("=", 1)[0].startswith(_SAME_DATA)]
        if bad:
            raise ConfigError(
                f"--candidate {text!r}: {bad[0]!r} is not a key=value a candidate may change "
                "(the data, the seed and the budget are the same for every trial; set them with "
                "--config or --set)"
            )
        cfg = load_config(args.config, [*args.overrides, *sets])
        if not cfg.privacy.enabled:
            raise ConfigError("fedmeta tune trains on private data: privacy.enabled must be true")
        out.append((text, cfg))
    return out


def check_fits(candidates: list[tuple[str, Any]]) -> dict[str, Any]:
    """The tuning's price against the data's ledger, or :class:`TuneRefused` in one line."""
    from fedmeta.accounting import epsilon

    events = [_planned_rounds(cfg) for _, cfg in candidates]
    groups, budget, delta = _prior(candidates[0][1])
    before = max(epsilon(list(g), delta) if g else 0.0 for g in groups)
    after = [max(epsilon([*g, *events[:k]], delta) for g in groups)
             for k in range(1, len(events) + 1)]  # fmt: skip
    if after[-1] > budget:
        fit = sum(1 for a in after if a <= budget)
        raise TuneRefused(
            f"tuning refused before any trial: {len(events)} candidates would take the data's "
            f"epsilon from {before:.4g} to {after[-1]:.4g} > budget {budget:g} (delta {delta:g}); "
            f"what fits: the first {fit} of them (epsilon "
            f"{after[fit - 1] if fit else before:.4g}), or fewer rounds or more noise per candidate"
        )
    return {"epsilon_before": before, "epsilon_after_all_trials": after[-1],
            "epsilon_budget": budget, "delta": delta,
            "random_count_tuner_epsilon": _random_count_price(events, delta, groups)}  # fmt: skip


def _planned_rounds(cfg: Any) -> tuple[Any, int]:
    """A candidate's round event and planned rounds, as ``simulate --dry-run`` plans them."""
    from fedmeta.server.plan import build_plan

    counts = {str(i): cfg.dataset.tasks_per_participant for i in range(cfg.federation.participants)}
    plan = build_plan(cfg, counts)
    assert plan.privacy is not None  # a private plan
    return plan.privacy.event, int(cfg.rounds)


def _prior(cfg: Any) -> tuple[list[Any], float, float]:
    """The data's ledger groups now, its budget and delta (a fresh budget if it has none yet)."""
    from fedmeta.accounting import BudgetLedger, current_budget
    from fedmeta.server.data_budget import ledger_file
    from fedmeta.workload import declared_identity

    path = ledger_file(cfg)
    terms = current_budget(path, declared_identity(cfg), label=cfg.dataset.name)
    if terms is None:
        return [()], float(cfg.privacy.epsilon_budget), float(cfg.privacy.delta)
    with BudgetLedger.open_readonly(path, terms.federation_id) as ledger:
        return list(ledger.exposures().groups) or [()], ledger.epsilon_budget, ledger.delta


def _random_count_price(events: list[tuple[Any, int]], delta: float, groups: list[Any]) -> float:
    """What Papernot and Steinke's Poisson tuner of the same mean would cost (for comparison)."""
    from fedmeta.accounting.tuning import Candidate, PoissonTrials, TuningRun, tuning_epsilon

    cands = tuple(Candidate(f"c{i}", e, r) for i, (e, r) in enumerate(events))
    return tuning_epsilon(TuningRun(cands, PoissonTrials(float(len(events)))), delta,
                          [list(g) for g in groups])  # fmt: skip


def validation_score(summary: dict[str, Any], outcomes: Any) -> float | None:
    """The validation metric of the model the run released (never its test metric)."""
    chosen = summary.get("model_selection") or {}
    if chosen.get("rule") == "best_validation":
        value = chosen.get("validation_metric")
        return None if value is None else float(value)
    done = [o for o in outcomes if o.status == "completed"]
    # The released model is the last one; a run stopped early may not have validated it.
    last = done[-1].validation_metric if done else None
    return None if last is None else float(last)


def _best(trials: list[dict[str, Any]], *, higher: bool) -> dict[str, Any] | None:
    """The trial with the best validation metric (ties: the earlier); None if none validated."""
    scored = [t for t in trials if t["validation_metric"] is not None]
    if not scored:
        return None
    key = max if higher else min
    return key(scored, key=lambda t: t["validation_metric"])
