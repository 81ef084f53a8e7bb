r"""``fedmeta tune``: choose among candidate configurations on private data, and pay for it.

    fedmeta tune --config base.toml --candidate "training.meta_lr=0.001" \\
                 --candidate "training.meta_lr=0.003 training.inner_steps=3" --out runs/tune

In the ``each`` mode every candidate is trained once on the same data (``fedmeta simulate``'s
run, one after another), each round charged to the data's ledger like any run, so the tuning
composes with the runs before it and after it by the ledger's own (PLD) accounting. The
candidates are compared by the validation metric of the model each released (the server's
validation classes, which no participant owns); test tasks never enter the choice. ``tune.json``
names the chosen candidate and its run directory.

**Refused before any trial** (``each``). Every candidate's planned rounds (its plan, as
``simulate --dry-run`` builds it) are composed with what the data's ledger already holds; if the
whole tuning would take any participant over the data's budget, nothing runs, and one line says
how many of the candidates, in the order given, fit. The check plans as ``simulate --dry-run``
does (every configured participant with ``dataset.tasks_per_participant`` tasks); each trial's
rounds are still checked one by one by the ledger when they are spent, so a plan that was too
hopeful stops a trial, never the budget.

**Two modes, priced before any trial** (``--trials``). ``each``: every candidate trained once, its
rounds spent as ordinary rounds (above). ``random``: Papernot and Steinke's (2022) tuner
(cli/fedmeta/cli/tune_random.py): ``K`` trials, ``K`` drawn from a public law of mean
``--mean-trials`` (``--distribution poisson``, or ``negbin`` with ``--eta``), each of a candidate
drawn uniformly, only the best released, its price one RDP curve recorded in the data's ledger
as one tuning release before the first trial. Both prices come from the candidates' plans and the
ledger's records alone, never from the data, so the default ``--trials cheaper`` (the cheaper of
the two; ``each`` on a tie) is a data-independent choice; the plan prints both prices. A mode
whose price exceeds the budget is refused before any trial, in one line saying what fits.

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
        description="Choose among candidates on private data, paid in the data's ledger: each "
        "candidate once (every round spent), or a random number of trials with only the best "
        "released (one tuning release, Papernot and Steinke 2022); by default the cheaper.",
    )
    p.add_argument("--config", type=Path, default=None, help="base TOML configuration")
    p.add_argument("--set", dest="overrides", action="append", default=[], type=key_value,
                   metavar="KEY=VALUE", help="override for every candidate")  # fmt: skip
    p.add_argument("--candidate", dest="candidates", action="append", default=[],
                   metavar="'KEY=VALUE ...'", help="a candidate's overrides (>= 2)")  # fmt: skip
    p.add_argument("--out", type=Path, required=True, help="directory for the trials and tune.json")
    p.add_argument("--dry-run", action="store_true", help="check and price; run nothing")
    p.add_argument("--trials", choices=("each", "random", "cheaper"), default="cheaper",
                   help="each candidate once, a random number of trials (only the best "
                   "released), or the cheaper of the two for these candidates (default)")
    p.add_argument("--mean-trials", type=float, default=None, metavar="MU",
                   help="random mode: the mean number of trials (default: the candidates' count)")
    p.add_argument("--distribution", choices=("poisson", "negbin"), default="poisson",
                   help="random mode: the law of the number of trials")
    p.add_argument("--eta", type=float, default=1.0,
                   help="negbin: the shape (0 logarithmic, 1 geometric; default 1)")
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


def main(args: argparse.Namespace, source: Any = None) -> dict[str, Any]:
    """Price both modes, refuse or run the chosen one; the JSON-ready result.

    ``source``: where the random mode draws ``K`` and the candidates (default the OS CSPRNG).
    """
    from fedmeta.accounting import SystemRandomSource

    candidates = _candidates(args)
    price = price_modes(args, candidates)
    if args.dry_run:
        return {"dry_run": True, **price}
    higher = candidates[0][1].dataset.name != "sinusoid"
    if price["mode"] == "random":
        from fedmeta.cli.tune_random import run_random

        return run_random(args, candidates, random_run(args, candidates),
                          source or SystemRandomSource(), higher=higher, prices=price)  # fmt: skip
    return {**price, **_run_each(args, candidates, higher=higher)}


def _run_each(args: argparse.Namespace, candidates: list[tuple[str, Any]], *, higher: bool
              ) -> dict[str, Any]:  # fmt: skip
    """Train every candidate once, each round an ordinary spend; choose on validation."""
    from fedmeta.simulation.simulate import main as simulate

    trials = []
    for i, (label, cfg) in enumerate(candidates):
        result = simulate(cfg, out_dir=Path(args.out) / f"trial-{i + 1}")
        trials.append({"candidate": label, "run_dir": str(result.out_dir),
                       "validation_metric": validation_score(result.summary, result.outcomes),
                       "epsilon_spent": result.summary.get("epsilon_spent")})  # fmt: skip
    chosen = _best(trials, higher=higher)
    out = {"mode": "each", "trials": trials, "chosen": chosen,
           "choice": "best validation metric of each candidate's released model (server-held "
           "validation classes; test tasks never compared)"}  # fmt: skip
    (Path(args.out) / "tune.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    return out


def _candidates(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """Each candidate's label and configuration (base, ``--set``, then its own overrides)."""
    from fedmeta.config import ConfigError
    from fedmeta.config_io import load_config

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


def _refuse_each(candidates: list[tuple[str, Any]], groups: list[Any], budget: float,
                 delta: float, other: str) -> None:  # fmt: skip
    """:class:`TuneRefused` in one line saying how many candidates fit, if all would not."""
    from fedmeta.accounting import epsilon

    events = [_planned_rounds(cfg) for _, cfg in candidates]
    before = max(epsilon(list(g), delta) if g else 0.0 for g in groups)
    after = [max(epsilon([*g, *events[:k]], delta) for g in groups)
             for k in range(1, len(events) + 1)]  # fmt: skip
    if after[-1] > budget:
        fit = sum(1 for a in after if a <= budget)
        raise TuneRefused(
            f"tuning refused before any trial: {len(events)} candidates would take the data's "
            f"epsilon from {before:.4g} to {after[-1]:.4g} > budget {budget:g} (delta {delta:g}); "
            f"what fits: the first {fit} of them (epsilon "
            f"{after[fit - 1] if fit else before:.4g}), or fewer rounds or more noise per "
            f"candidate{other}"
        )


def _planned_rounds(cfg: Any) -> tuple[Any, int]:
    """A candidate's round event and planned rounds, as ``simulate --dry-run`` plans them."""
    from fedmeta.server.plan import build_plan

    counts = {str(i): cfg.dataset.tasks_per_participant for i in range(cfg.federation.participants)}
    plan = build_plan(cfg, counts)
    assert plan.privacy is not None  # a private plan
    return plan.privacy.event, int(cfg.rounds)


def _prior(cfg: Any) -> tuple[list[Any], float, float]:
    """The data's ledger groups now, its budget and delta (a fresh budget if it has none yet)."""
    from fedmeta.accounting import BudgetLedger
    from fedmeta.server.budget_keys import budget_key, recorded_terms
    from fedmeta.server.data_budget import ledger_file

    path = ledger_file(cfg)
    terms = recorded_terms(path, budget_key(cfg.dataset.name, cfg.seed))
    if terms is None:
        return [()], float(cfg.privacy.epsilon_budget), float(cfg.privacy.delta)
    with BudgetLedger.open_readonly(path, terms.federation_id) as ledger:
        return list(ledger.exposures().groups) or [()], ledger.epsilon_budget, ledger.delta


def random_run(args: argparse.Namespace, candidates: list[tuple[str, Any]]) -> Any:
    """The random mode's tuning run: the candidates' plans and the law of the number of trials."""
    from fedmeta.accounting.tuning import (
        Candidate,
        NegativeBinomialTrials,
        PoissonTrials,
        TuningRun,
    )

    mean = float(args.mean_trials if args.mean_trials is not None else len(candidates))
    try:
        trials = (PoissonTrials(mean) if args.distribution == "poisson"
                  else NegativeBinomialTrials.from_mean(float(args.eta), mean))  # fmt: skip
    except ValueError as error:
        raise ValueError(f"--mean-trials/--eta: {error}") from None
    cands = tuple(Candidate(label, *_planned_rounds(cfg)) for label, cfg in candidates)
    return TuningRun(cands, trials)


def price_modes(args: argparse.Namespace, candidates: list[tuple[str, Any]]) -> dict[str, Any]:
    """Both modes' epsilon after the tuning, the mode chosen, or :class:`TuneRefused`.

    Computed from the candidates' plans and the ledger's records alone (data-independent).
    """
    from fedmeta.accounting.tuning import TuningRefused, check_tuning_fits, tuning_epsilon

    run = random_run(args, candidates)
    groups, budget, delta = _prior(candidates[0][1])
    prior = [list(g) for g in groups]
    each = _each_price(candidates, groups, delta)
    random = tuning_epsilon(run, delta, prior)
    mode = args.trials if args.trials != "cheaper" else ("each" if each[1] <= random else "random")
    price = {"mode": mode, "epsilon_budget": budget, "delta": delta,
             "epsilon_before": each[0], "epsilon_after_each": each[1],
             "epsilon_after_random": random, "mean_trials": run.trials.mean}  # fmt: skip
    other = (f"; the {'random' if mode == 'each' else 'each'} mode would reach epsilon "
             f"{random if mode == 'each' else each[1]:.4g}")  # fmt: skip
    if mode == "each":
        _refuse_each(candidates, groups, budget, delta, other)
    else:
        try:
            check_tuning_fits(run, budget, delta, prior)
        except TuningRefused as error:
            raise TuneRefused(f"{error}{other}") from None
    return price


def _each_price(candidates: list[tuple[str, Any]], groups: list[Any], delta: float
                ) -> tuple[float, float]:  # fmt: skip
    """Epsilon before, and after every candidate once (PLD, the maximum over groups)."""
    from fedmeta.accounting import epsilon

    events = [_planned_rounds(cfg) for _, cfg in candidates]
    before = max(epsilon(list(g), delta) if g else 0.0 for g in groups)
    return before, max(epsilon([*g, *events], delta) for g in groups)


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
