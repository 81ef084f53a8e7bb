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
        "in runs/NAME unless --out is given (whatever output.dir says); the same ledger as "
        "--set privacy.experiment=NAME",
    )  # fmt: skip
    p.add_argument("--print-config", action="store_true",
                   help="print the validated configuration as TOML and exit")  # fmt: skip
    p.add_argument("--dry-run", action="store_true",
                   help="print the privacy plan (noise, rounds, epsilon at the end) against the "
                   "data's recorded budget and ledger, and exit with the status the run would "
                   "have (3: refused); nothing runs and nothing is recorded")  # fmt: skip
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
    from fedmeta.config_io import load_config

    if args.experiment:  # its outputs in runs/NAME, whatever the configuration file's output.dir
        runs = f'output.dir="runs/{args.experiment.partition("=")[2]}"'  # --out, --set still win
        args.overrides = [runs, *args.overrides, args.experiment]
    if args.print_config or args.dry_run:
        return _preview(args)
    stop, rounds = threading.Event(), threading.Event()
    restore = _stop_on_signals(stop, rounds)  # stdout: the CLI's ReaderMayLeave (a run goes on)
    try:
        cfg = _resume_config(args) if args.resume else load_config(args.config, args.overrides)
        observers = [*_observers(cfg, args.tensorboard), RoundsStarted(rounds)]
        result = main(cfg, out_dir=args.out, resume=args.resume, stop=stop, observers=observers,
                      test_when_interrupted=False)  # a Ctrl-C ends the run in seconds
    except KeyboardInterrupt:
        print("fedmeta simulate: " + ("aborted; the ledger holds every spent round: --resume "
              "continues" if rounds.is_set() else "stopped before its first round: nothing was "
              "spent"), file=sys.stderr)  # fmt: skip
        return exitcodes.INTERRUPTED
    except Exception as error:  # noqa: BLE001 - every failure becomes one line and an exit status
        return _report(error)
    finally:
        restore()
    summary = result.summary
    if summary["stopped_reason"] == "interrupted":
        print(_interrupted_line(result.out_dir), file=sys.stderr)
        return exitcodes.INTERRUPTED
    if summary["stopped_reason"] == "budget_exhausted" and result.rounds_run == 0:
        print(f"fedmeta simulate: {_no_round_hint(cfg)}", file=sys.stderr)
        return exitcodes.BUDGET_EXHAUSTED
    return exitcodes.OK


def _interrupted_line(out: Path) -> str:
    """What an interrupted run left and the two ways on (the test evaluation did not run)."""
    return (
        f"interrupted: checkpoint written in {out}; continue with `fedmeta simulate --resume --out "
        f"{out}` (the test evaluation runs when the run ends), or score the model as it is with "
        f"`fedmeta evaluate --checkpoint {out}`"
    )


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
    from fedmeta.config import ConfigError
    from fedmeta.config_io import load_config

    try:
        cfg = _resume_config(args) if args.resume else load_config(args.config, args.overrides)
        if args.print_config:
            from fedmeta.config_io import to_toml

            print(to_toml(cfg.to_dict()), end="")
        if args.dry_run:
            from fedmeta.simulation.dry_run import dry_run

            return dry_run(cfg, args.resume)
    except ConfigError as error:
        print(f"fedmeta simulate: {error}", file=sys.stderr)
        return exitcodes.BAD_INPUT
    except Exception as error:  # noqa: BLE001 - every failure becomes one line and an exit status
        return _report(error)
    return exitcodes.OK






def _observers(cfg: Any, logdir: Path | None) -> list[Any]:
    """The default observers, and a TensorBoard writer with a directory."""
    from fedmeta.server.app import make_observers

    return make_observers(cfg) + ([] if logdir is None else _tensorboard(logdir))


def _tensorboard(logdir: Path) -> list[Any]:
    from fedmeta.server.progress import TensorBoardLog

    return [TensorBoardLog(logdir)]


class RoundsStarted:
    """A run observer that sets ``event`` once the plan is announced and the rounds begin."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def run_started(self, _event: Any) -> None:  # noqa: D102
        self.event.set()

    def round_finished(self, _report: Any) -> None:  # noqa: D102
        pass

    def run_finished(self, _event: Any) -> None:  # noqa: D102
        pass


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
    from fedmeta.server.rundir import RunDirectoryBusy
    from fedmeta.server.startup import FederationError, NoRoundAffordable, PlanError
    from fedmeta.server.transport import RegistrationError

    if isinstance(error, BrokenPipeError):
        raise error  # the reader closed stdout (`| head`): the CLI ends quietly with status 0
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


def _stop_on_signals(stop: threading.Event, rounds: threading.Event | None = None) -> Any:
    """First SIGINT/SIGTERM: stop and checkpoint. Second: abort at once.

    A round not yet spent is abandoned, one already spent finishes (server/fedmeta/server/round.py).
    ``rounds``: set when the rounds begin; before that (loading data, registering) nothing has
    been spent and no round is in flight, so the first signal aborts at once too.
    """

    def handler(signum: int, _frame: Any) -> None:
        if stop.is_set() or (rounds is not None and not rounds.is_set()):
            raise KeyboardInterrupt
        stop.set()
        print("\nstopping: a round not yet spent is abandoned, one spent finishes, then a "
              "checkpoint; the test evaluation is left to --resume or `fedmeta evaluate` (signal "
              "again to abort at once)", file=sys.stderr)  # fmt: skip

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
    from fedmeta.config import ConfigError
    from fedmeta.config_io import apply_overrides, config_from_dict, load_config
    from fedmeta.server.startup import refuse_to_overwrite_run

    given = load_config(args.config, args.overrides)
    out = Path(args.out or given.output.dir)
    ckpt = refuse_to_overwrite_run(out, resume=True)
    assert ckpt is not None
    recorded = ckpt.config.to_dict()
    resumed = config_from_dict(apply_overrides(recorded, args.overrides))
    changed = _differences(recorded, given.to_dict()) if args.config else []
    # An override counts when it changes a value (``--experiment NAME`` names the same ledger).
    changed += _differences(recorded, resumed.to_dict())
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
    test_when_interrupted: bool = True,
) -> Any:
    """Run one simulated federation and return its ``RunResult`` (summary, outcomes, out_dir).

    ``test_when_interrupted=False``: a run ``stop`` ends skips its test evaluation (the resumed
    run does it when it ends), so it ends within seconds of its last round.
    """
    for k, v in _QUIET_ENV.items():
        os.environ.setdefault(k, v)
    from fedmeta.config import Config, ConfigError
    from fedmeta.server.rundir import exclusive_run_directory
    from fedmeta.server.startup import refuse_to_overwrite_run
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
    if not resume:
        _check_budget_before_data(cfg)
    workload = check_data(cfg)  # the run's workload: built once, here
    _check_round_fits(cfg, workload)
    if cfg.federation.backend == "inprocess":
        from fedmeta.server.app import execute
        from fedmeta.simulation.batched import BatchedGrid

        # Every sampled participant's tasks in one gradient call (simulation/batched.py).
        grid = BatchedGrid(cfg.federation.participants)
        return execute(cfg, grid, out_dir=out, resume=resume, stop=stop, workload=workload,
                       observers=observers,
                       test_when_interrupted=test_when_interrupted)  # fmt: skip
    return _run_ray(cfg, out, resume, stop, workload, observers, test_when_interrupted)


def _check_budget_before_data(cfg: Any) -> None:
    """Refuse, before minutes of loading data, a run the data's recorded budget cannot take.

    The run's own refusal, read from the ledger without writing (budget_preview.py); the run
    checks again once its participants have registered.
    """
    from fedmeta.server.budget_preview import preview_budget, previewable
    from fedmeta.server.data_budget import BudgetMismatch
    from fedmeta.server.plan import private_requested
    from fedmeta.server.startup import FederationError, NoRoundAffordable

    if not private_requested(cfg.privacy) or not previewable(cfg):
        return
    try:
        preview = preview_budget(cfg)
    except BudgetMismatch as error:
        raise FederationError(str(error)) from None
    if preview.refusal is not None:
        raise NoRoundAffordable(preview.refusal)


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
    test_when_interrupted: bool,
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
                                   workload=workload, observers=observers,
                                   test_when_interrupted=test_when_interrupted)  # fmt: skip

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
