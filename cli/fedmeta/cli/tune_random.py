"""``fedmeta tune --trials random``: a random number of trials, only the best released, one record.

Papernot and Steinke (2022; accounting/fedmeta/accounting/tuning.py): the number of trials ``K`` is
drawn from a public law (Poisson, or the truncated negative binomial) with the OS CSPRNG, each
trial trains one candidate drawn uniformly (a data-independent choice), and only the trial with
the best validation metric is released. Its price is one RDP curve, computed before any trial
from the candidates' plans alone, and recorded in the data's ledger as one tuning release
(ledger/appending.py) **before the first trial**: a tuning that stops part way has still paid, and
nothing of it is released unpaid.

**What stays private.** The bound covers the best trial's output alone: ``K``, the other trials'
models and scores, which trial won and anything timed by them are not released. So the trials run
in a scratch directory inside ``--out`` (removed when the tuning ends, whatever the outcome), their
rounds are counted on a scratch ledger per trial that only checks that the trial kept to its plan
(the data's ledger already holds the whole tuning's price), their printed output goes to a
scratch log (logging silenced), and ``tune.json`` names the chosen candidate, its validation
metric and the ledger's epsilon, nothing about the other trials or how many there were. The
chosen trial's run directory is moved to ``--out/chosen`` (its own summary accounts its own rounds
on its scratch ledger; the data's epsilon is the one in ``tune.json``). No released file, path,
name or time says how many trials ran or which one won (issue 52): every trial runs at the same
path, so the chosen run's files name ``.trials/trial`` whatever its index; its run-directory lock
(its process and day) is removed; and ``--out``, ``tune.json`` and every file under ``chosen`` get
the time the tuning started as their modification and access times. The tuning's duration grows
with ``K``: keep it as private as the trials (docs/privacy.md).

**Kept to its plan.** A trial's scratch ledger has as budget the PLD epsilon of its candidate's
planned rounds, so it refuses a round beyond them; after the trial, every recorded round must be
the candidate's planned event, no more of them than planned, else the tuning stops with nothing
released (the release stays recorded: the price of what ran).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedmeta.accounting import LedgerMode

#: The scratch directory, inside --out, that holds the trials until the choice (then removed).
SCRATCH = ".trials"
#: Every trial runs at the same path (its scratch ledger and log beside it), and the best so far
#: waits under ``BEST``: no path a released file names depends on a trial's index (issue 52).
TRIAL = "trial"
BEST = "best"



class TrialOffPlan(RuntimeError):
    """A trial recorded rounds other than its candidate's plan: nothing is released."""


def _mode(cfg: Any) -> LedgerMode:
    """A test-seeded run's ledgers are insecure ones (they never mix with secure ones)."""
    return "secure" if cfg.privacy.insecure_test_seed is None else "insecure"


def open_data_ledger(cfg: Any) -> Any:
    """The data's ledger for spending, as a run opens it, with no cohort (every participant)."""
    from fedmeta.accounting import BudgetLedger
    from fedmeta.accounting.ledger import ensure_directory
    from fedmeta.server.budget_keys import budget_key, federation_of, recorded_terms
    from fedmeta.server.data_budget import ledger_file
    from fedmeta.server.ledger_witness import refuse_second_ledger, watch_ledger
    from fedmeta.simulation.dry_run import registered_as_run

    mode = _mode(cfg)
    path = ledger_file(cfg)
    key = budget_key(cfg.dataset.name, cfg.seed)
    refuse_second_ledger(cfg.privacy, key, path, registered_as_run(cfg))  # image data: by its items
    ensure_directory(path)
    recorded = recorded_terms(path, key)
    federation = federation_of(path, key, mode)
    terms = (None, None) if recorded is not None else (cfg.privacy.epsilon_budget,
                                                       cfg.privacy.delta)  # fmt: skip
    ledger = BudgetLedger.open(path, federation, *terms, neighbouring=cfg.privacy.neighbouring,
                               mode=mode)  # fmt: skip
    try:
        watch_ledger(ledger, cfg.privacy)
    except BaseException:
        ledger.close()
        raise
    return ledger


def spend_release(cfg: Any, run: Any) -> dict[str, Any]:
    """Record the tuning's release in the data's ledger (refused there if it does not fit)."""
    from fedmeta.accounting.tuning import describe, release_of

    with open_data_ledger(cfg) as ledger:
        before = ledger.epsilon()
        run_id = f"tune-{uuid.uuid4().hex[:12]}"
        record = ledger.spend_release(release_of(run, describe(run)), run_id)
        return {"epsilon_before": before, "epsilon_after": ledger.epsilon(),
                "epsilon_budget": ledger.epsilon_budget, "delta": ledger.delta,
                "ledger_record": record.position, "tuning_run_id": record.run_id}  # fmt: skip


def _trial_opener(path: Path, candidate: Any, delta: float) -> Callable[[Any, Any], Any]:
    """The scratch ledger a trial's run counts its rounds on (its plan's epsilon as budget)."""
    from fedmeta.accounting import BudgetLedger, epsilon

    budget = epsilon([(candidate.event, candidate.rounds)], delta) * (1.0 + 1e-9)

    def opener(cfg: Any, registered: Any) -> Any:
        del registered
        relation = cfg.privacy.neighbouring
        return BudgetLedger.open(path, "tuning-trial", budget, delta, neighbouring=relation,
                                 mode=_mode(cfg))  # fmt: skip

    return opener


def _check_on_plan(path: Path, candidate: Any) -> None:
    from fedmeta.accounting import BudgetLedger

    if not path.is_file():
        return
    with BudgetLedger.open_readonly(path, "tuning-trial") as ledger:
        events = [r.event for r in ledger.records()]
    if any(e != candidate.event for e in events) or len(events) > candidate.rounds:
        raise TrialOffPlan(
            f"a trial of candidate {candidate.label!r} recorded rounds outside its plan "
            f"({candidate.rounds} rounds of its planned event); nothing was released"
        )


@contextlib.contextmanager
def _no_logging() -> Iterator[None]:
    """Silence logging during a trial: its handlers hold the real stderr, which would count K."""
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def run_trial(cfg: Any, out: Path, candidate: Any, delta: float) -> tuple[float | None, Path]:
    """One trial: train ``cfg`` in ``out`` on a scratch ledger; its validation metric."""
    from fedmeta.capacity import check_round_fits
    from fedmeta.cli.tune import validation_score
    from fedmeta.server.app import execute
    from fedmeta.server.startup import NoRoundAffordable
    from fedmeta.simulation.batched import BatchedGrid
    from fedmeta.workload import check_data

    ledger = out.with_name(out.name + ".ledger.sqlite")
    log = out.with_name(out.name + ".log")
    with log.open("w") as sink, _no_logging(), contextlib.redirect_stdout(sink), \
            contextlib.redirect_stderr(sink):
        workload = check_data(cfg)
        check_round_fits(cfg, workload.trained_dim)  # as simulate refuses a round too large
        # In process (simulate's batched grid), whatever federation.backend says.
        try:
            result = execute(cfg, BatchedGrid(cfg.federation.participants), out_dir=out,
                             echo=False, observers=[], workload=workload,
                             open_ledger=_trial_opener(ledger, candidate, delta))  # fmt: skip
        except NoRoundAffordable:  # its first round is already beyond its plan's price
            raise TrialOffPlan(f"a trial of candidate {candidate.label!r} does not fit the "
                               "price of its plan; nothing was released") from None
    _check_on_plan(ledger, candidate)
    return validation_score(result.summary, result.outcomes), out


def run_random(
    args: Any, candidates: Sequence[tuple[str, Any]], run: Any, source: Any, *, higher: bool,
    prices: dict[str, Any],
) -> dict[str, Any]:
    """Spend the release, run ``K`` trials privately, release the best; ``tune.json``'s dict."""
    from fedmeta.accounting.tuning import draw_candidate, draw_trials
    from fedmeta.config import ConfigError
    from fedmeta.server.rundir import LOCK_NAME

    cfg = candidates[0][1]
    out = Path(args.out)
    scratch = out / SCRATCH
    if (out / "chosen").exists() or scratch.exists():
        raise ConfigError(f"--out {out}: it holds a tuning already; give a new directory")
    started = time.time()  # every released file gets this time (module docstring)
    spent = spend_release(cfg, run)  # before the first trial (module docstring)
    scratch.mkdir(parents=True)
    best: tuple[float, int] | None = None
    try:
        for _ in range(draw_trials(run.trials, source)):
            c = draw_candidate(len(candidates), source)
            _clear_trial(scratch)
            score, where = run_trial(candidates[c][1], scratch / TRIAL, run.candidates[c],
                                     spent["delta"])  # fmt: skip
            if score is not None and (best is None or (score > best[0] if higher
                                                       else score < best[0])):  # fmt: skip
                shutil.rmtree(scratch / BEST, ignore_errors=True)
                where.rename(scratch / BEST)
                best = (score, c)
        chosen = None
        if best is not None:
            shutil.move(str(scratch / BEST), str(out / "chosen"))
            (out / "chosen" / LOCK_NAME).unlink(missing_ok=True)  # the trial's process and day
            chosen = {"candidate": candidates[best[1]][0], "run_dir": str(out / "chosen"),
                      "validation_metric": best[0]}  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result = {"prices": prices, "mode": "random", "trials": run.trials.__class__.__name__,
              "mean_trials": run.trials.mean, **spent, "chosen": chosen,
              "released": "the best trial only (validation metric, server-held classes); the "
              "number of trials and the other trials stay private"}  # fmt: skip
    (out / "tune.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    _date_released(out, started)
    return result


def _clear_trial(scratch: Path) -> None:
    """Remove the last trial's files (its run, scratch ledger and log), keeping the best so far."""
    for entry in scratch.iterdir():
        if entry.name == BEST:
            continue
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _date_released(out: Path, started: float) -> None:
    """Give ``out``, ``tune.json`` and every file under ``chosen`` the tuning's start time.

    A file's modification time would otherwise say when the winning trial ran, so how many
    trials ran after it (and the directory's, when the last one ended).
    """
    for path in sorted(out.rglob("*"), reverse=True):  # files before their folders
        os.utime(path, (started, started), follow_symlinks=False)
    os.utime(out, (started, started))
