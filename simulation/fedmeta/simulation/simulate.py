"""``fedmeta simulate``: the main job - a federation run locally.

By default (``federation.backend = "inprocess"``) the ServerApp's run talks to the participants
through a Flower ``Grid`` that calls the same ClientApp in this process: Flower's Message API
without Ray, and faster on the default job (docs/benchmarks.md, "Simulation backend"). With
``"ray"`` it goes through Flower's Ray simulation engine, whose Python entry ``run_simulation`` is
deprecated in Flower 1.41 in favour of ``flwr run`` (which runs these same apps: ``flwr run .``).

``fedmeta simulate [--config FILE] [--set key=value ...] [--out DIR] [--resume]``. With no arguments
it runs a private sinusoid federation on the embedded default configuration. ``register`` imports
nothing heavy; torch, Flower and Ray are imported inside the handler.

``main(config, out_dir=None, resume=False) -> RunResult`` is the programmatic entry point (smoke
tests). This harness wires the server and the client together in one process; it lives outside
``server/`` so that nothing in the server imports the client.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedmeta.workload import Workload

_QUIET_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def register(subparsers: Any) -> None:
    """Add the ``simulate`` sub-command."""
    p = subparsers.add_parser(
        "simulate",
        help="run a federation locally (in-process Flower grid, or Ray)",
        description="Run a differentially private federated meta-learning job locally. With no "
        "arguments: a private sinusoid federation on the embedded default configuration.",
    )
    p.add_argument("--config", type=Path, default=None, help="TOML configuration file")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        type=key_value, help="override one key, e.g. --set privacy.epsilon_budget=4 (repeatable)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="output directory (default output.dir)")
    p.add_argument("--resume", action="store_true", help="continue the run checkpointed in --out")
    p.add_argument(
        "--experiment", metavar="NAME", type=_experiment_override, dest="experiment",
        help="an experiment on public benchmark data (sweeps, ablations): a ledger of its own "
        "(experiments/NAME.sqlite in the state directory), outputs marked as an experiment, "
        "default --out runs/NAME; the same as --set privacy.experiment=NAME",
    )  # fmt: skip
    p.add_argument("--print-config", action="store_true",
                   help="print the validated configuration as TOML and exit")  # fmt: skip
    p.add_argument("--dry-run", action="store_true",
                   help="print the privacy plan (noise, rounds, epsilon at the end) and exit; "
                   "nothing runs and nothing is recorded")  # fmt: skip
    p.add_argument("--tensorboard", type=Path, metavar="DIR", default=None,
                   help="also log the run's public values (epsilon, loss, validation) to a "
                   "TensorBoard directory (needs the tensorboard package)")  # fmt: skip
    p.set_defaults(func=_handle)


def _experiment_override(text: str) -> str:
    """``--experiment NAME`` as the override it stands for (the configuration checks the name)."""
    return f"privacy.experiment={text}"


def key_value(text: str) -> str:
    """``--set``'s argument: ``key=value`` in one word (argparse type: one line when it is not)."""
    key, sep, _ = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(
            f"expects key=value in one word, e.g. --set rounds=20; got {text!r}"
        )
    return text


def _handle(args: argparse.Namespace) -> int:
    for k, v in _QUIET_ENV.items():
        os.environ.setdefault(k, v)
    from fedmeta import exitcodes
    from fedmeta.config import load_config

    if args.experiment:
        args.overrides = [*args.overrides, args.experiment]
    if args.print_config or args.dry_run:
        return _preview(args)
    stop = threading.Event()
    restore = _stop_on_signals(stop)
    try:
        cfg = _resume_config(args) if args.resume else load_config(args.config, args.overrides)
        observers = _tensorboard(cfg, args.tensorboard)
        result = main(cfg, out_dir=args.out, resume=args.resume, stop=stop, observers=observers)
    except KeyboardInterrupt:
        print("fedmeta simulate: aborted; the ledger holds every spent round: --resume continues",
              file=sys.stderr)  # fmt: skip
        return exitcodes.INTERRUPTED
    except Exception as error:  # noqa: BLE001 - every failure becomes one line and an exit status
        return _report(error)
    finally:
        restore()
    summary = result.summary
    if summary["stopped_reason"] == "interrupted":
        print(f"interrupted: checkpoint written; continue with --resume --out {result.out_dir}",
              file=sys.stderr)  # fmt: skip
        return exitcodes.INTERRUPTED
    if summary["stopped_reason"] == "budget_exhausted" and result.rounds_run == 0:
        print(f"fedmeta simulate: {_no_round_hint(cfg)}", file=sys.stderr)
        return exitcodes.BUDGET_EXHAUSTED
    return exitcodes.OK


def _no_round_hint(cfg: Any) -> str:
    """Why a run could not afford one round, and the fix, in one line."""
    z = cfg.privacy.noise_multiplier
    if z is not None:
        return (
            f"not one round fits the budget at privacy.noise_multiplier={z:g}: one round's "
            "epsilon exceeds what is left. Leave privacy.noise_multiplier unset to calibrate it "
            "to the rounds, or pick one with `fedmeta privacy calibrate`"
        )
    return (
        "the budget of these participants' data is spent (`fedmeta ledger show` says how); an "
        "experiment on public benchmark data keeps a ledger of its own (--experiment NAME); a "
        "separate budget for this data starts only with `fedmeta ledger new-budget`"
    )


def _preview(args: argparse.Namespace) -> int:
    """``--print-config`` / ``--dry-run``: the configuration, the plan; nothing runs."""
    from fedmeta import exitcodes
    from fedmeta.config import ConfigError, load_config

    try:
        cfg = _resume_config(args) if args.resume else load_config(args.config, args.overrides)
        if args.print_config:
            from fedmeta.config import to_toml

            print(to_toml(cfg.to_dict()), end="")
        if args.dry_run:
            print(dry_run_plan(cfg))
    except ConfigError as error:
        print(f"fedmeta simulate: {error}", file=sys.stderr)
        return exitcodes.BAD_INPUT
    except Exception as error:  # noqa: BLE001 - every failure becomes one line and an exit status
        return _report(error)
    return exitcodes.OK


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
    if plan.private:
        with tempfile.TemporaryDirectory() as tmp:
            ledger = BudgetLedger.open(
                Path(tmp) / "dry-run.sqlite", "dry-run", epsilon_budget=cfg.privacy.epsilon_budget,
                delta=cfg.privacy.delta, neighbouring=cfg.privacy.neighbouring, mode="insecure",
            )  # fmt: skip
            fc = forecast(plan, ledger, cfg.rounds)
            ledger.close()
    note = (
        "(dry run: nothing ran, nothing was recorded; the forecast assumes a fresh budget and "
        f"all {participants} participants with {cfg.dataset.tasks_per_participant} tasks)"
    )
    return f"{format_plan(plan, fc, cfg, participants)}\n{note}"


def _tensorboard(cfg: Any, logdir: Path | None) -> list[Any] | None:
    """The default observers and a TensorBoard writer; None (the defaults) without a directory."""
    if logdir is None:
        return None
    from fedmeta.server.app import make_observers
    from fedmeta.server.progress import TensorBoardLog

    return [*make_observers(cfg), TensorBoardLog(logdir)]


def _report(error: Exception) -> int:
    """One line on stderr and the exit status that says what kind of failure it was."""
    from fedmeta import exitcodes
    from fedmeta.config import ConfigError

    if isinstance(error, ConfigError):  # said before torch and Flower load for the other kinds
        print(f"fedmeta simulate: {error}", file=sys.stderr)
        return exitcodes.BAD_INPUT
    return _report_run_failure(error)


def _report_run_failure(error: Exception) -> int:
    from fedmeta import exitcodes
    from fedmeta.accounting import LedgerError
    from fedmeta.checkpoint import CheckpointError
    from fedmeta.metalearning import DataError
    from fedmeta.server.progress import TensorBoardError
    from fedmeta.server.round import TrainingDiverged
    from fedmeta.server.run import FederationError, NoRoundAffordable, PlanError
    from fedmeta.server.rundir import RunDirectoryBusy
    from fedmeta.server.transport import RegistrationError

    bad_input = (CheckpointError, DataError, LedgerError, FederationError, PlanError,
                 TrainingDiverged, TensorBoardError)  # fmt: skip
    if isinstance(error, bad_input):
        status, text = exitcodes.BAD_INPUT, str(error)
    elif isinstance(error, NoRoundAffordable):
        status, text = exitcodes.BUDGET_EXHAUSTED, str(error)
    elif isinstance(error, RegistrationError | RunDirectoryBusy):
        status, text = exitcodes.UNAVAILABLE, str(error)
    elif isinstance(error, OSError):
        status, text = exitcodes.BAD_INPUT, _resource_fault(error)
    else:
        status, text = exitcodes.INTERNAL_ERROR, f"internal error: {type(error).__name__}: {error}"
        if os.environ.get("FEDMETA_DEBUG"):
            traceback.print_exception(error)
        else:
            text += " (set FEDMETA_DEBUG=1 for the traceback)"
    print(f"fedmeta simulate: {text}", file=sys.stderr)
    return status


#: What to do about a write that failed, by its cause.
_FULL = (errno.ENOSPC, errno.EDQUOT)
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


def _resource_fault(error: OSError) -> str:
    """One line: the path that could not be written, the system's reason, and what to do."""
    where = f" {error.filename}" if error.filename else ""
    text = f"cannot write{where}: {error.strerror or error}"
    if error.errno in _FULL:
        return (f"{text}; free space on that file system (the ledger and the last checkpoint "
                "are intact) and continue with --resume --out DIR, or start again with --out on "
                "another file system")  # fmt: skip
    if error.errno in _READ_ONLY:
        return f"{text}; make that directory writable, or give --out a writable directory"
    return text


def _stop_on_signals(stop: threading.Event) -> Any:
    """First SIGINT/SIGTERM: stop and checkpoint. Second: abort at once.

    A round not yet spent is abandoned, one already spent finishes (server/fedmeta/server/round.py).
    """

    def handler(signum: int, _frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        print("\nstopping: a round not yet spent is abandoned, one spent finishes (signal again "
              "to abort at once)", file=sys.stderr)  # fmt: skip

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    return lambda: [signal.signal(sig, old) for sig, old in previous.items()]


#: Keys a resumed run may change: they do not touch what is accounted or how the model learns.
RESUMABLE_KEYS = ("rounds", "output.", "metrics.", "federation.round_timeout_s",
                  "federation.register_timeout_s", "federation.backend")  # fmt: skip


def _resume_config(args: argparse.Namespace) -> Any:
    """The configuration of a resumed run: the checkpoint's, with only harmless keys changed.

    A different ``--config`` or ``--set`` on anything else is refused with the keys that differ,
    so a resumed run can never silently change its privacy parameters.
    """
    from fedmeta.config import ConfigError, apply_overrides, config_from_dict, load_config

    given = load_config(args.config, args.overrides)
    out = Path(args.out or given.output.dir)
    from fedmeta.server.run import refuse_to_overwrite_run

    ckpt = refuse_to_overwrite_run(out, resume=True)
    assert ckpt is not None
    resumed = config_from_dict(apply_overrides(ckpt["config"], args.overrides))
    changed = _differences(ckpt["config"], given.to_dict()) if args.config else []
    # An override counts when it changes a value (``--experiment NAME`` names the same ledger).
    changed += _differences(config_from_dict(ckpt["config"]).to_dict(), resumed.to_dict())
    refused = sorted({k for k in changed if not k.startswith(RESUMABLE_KEYS)})
    if refused:
        raise ConfigError(
            f"--resume continues the run in {out} with the configuration it started with; these "
            f"keys differ and cannot change on resume: {', '.join(refused)} (start a new run "
            "with --out instead)"
        )
    return resumed


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested dicts."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return [] if a == b else [prefix.rstrip(".")]
    keys = set(a) | set(b)
    return [
        k for key in sorted(keys) for k in _differences(a.get(key), b.get(key), f"{prefix}{key}.")
    ]


def main(
    config: Any = None,
    *,
    out_dir: str | Path | None = None,
    resume: bool = False,
    stop: threading.Event | None = None,
    observers: list[Any] | None = None,
) -> Any:
    """Run one simulated federation and return its ``RunResult`` (summary, outcomes, out_dir)."""
    for k, v in _QUIET_ENV.items():
        os.environ.setdefault(k, v)
    from fedmeta.config import Config, ConfigError
    from fedmeta.server.run import refuse_to_overwrite_run
    from fedmeta.server.rundir import exclusive_run_directory
    from fedmeta.workload import check_data

    cfg = config if config is not None else Config()
    out = Path(out_dir or cfg.output.dir)
    # Everything that can be refused is refused here, once, before Ray or any participant starts.
    if cfg.federation.backend == "inprocess" and cfg.federation.ray_address:
        raise ConfigError(
            "federation.ray_address needs federation.backend = 'ray' (the in-process backend runs "
            "on this machine only); set backend = 'ray' or remove ray_address"
        )
    with exclusive_run_directory(out):
        refuse_to_overwrite_run(out, resume)
    workload = check_data(cfg)  # the run's workload: built once, here
    _check_round_fits(cfg, workload)
    if cfg.federation.backend == "inprocess":
        from fedmeta.server.app import execute
        from fedmeta.simulation.local_grid import InProcessGrid

        grid = InProcessGrid(cfg.federation.participants)
        return execute(cfg, grid, out_dir=out, resume=resume, stop=stop, workload=workload,
                       observers=observers)  # fmt: skip
    return _run_ray(cfg, out, resume, stop, workload, observers)


def _check_round_fits(cfg: Any, workload: Workload) -> None:
    """Refuse a configuration whose one round cannot fit in memory (core/fedmeta/capacity.py)."""
    from fedmeta.capacity import check_round_fits

    check_round_fits(cfg, workload.trained_dim)


def _run_ray(
    cfg: Any,
    out: Path,
    resume: bool,
    stop: threading.Event | None,
    workload: Workload,
    observers: list[Any] | None,
) -> Any:
    import logging

    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from fedmeta.client.app import app as client_app
    from fedmeta.server.app import execute

    holder: dict[str, Any] = {}
    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        holder["result"] = execute(cfg, grid, out_dir=out, resume=resume, stop=stop,
                                   workload=workload, observers=observers)  # fmt: skip

    logging.getLogger("flwr").setLevel(logging.WARNING)
    init_args: dict[str, Any] = {"logging_level": "ERROR", "log_to_driver": False}
    if cfg.federation.ray_address:
        # An existing cluster (docs/deploy.md): its nodes offer the resources; every node needs
        # this fedmeta installed. Flower's backend sizes its actor pool from the cluster's
        # resources and client_resources, so each participant's share is honoured cluster-wide.
        init_args["address"] = cfg.federation.ray_address
    backend_config = {
        "client_resources": {
            "num_cpus": cfg.federation.client_num_cpus,
            "num_gpus": cfg.federation.client_num_gpus,
        },
        "init_args": init_args,
    }
    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=cfg.federation.participants,
        backend_config=backend_config,
    )
    return holder.get("result")
