"""``fedmeta simulate``: the main job - a federation run locally in Flower's simulation engine.

``fedmeta simulate [--config FILE] [--set key=value ...] [--out DIR] [--resume]``. With no arguments
it runs a private sinusoid federation on the embedded default configuration. ``register`` imports
nothing heavy; torch, Flower and Ray are imported inside the handler.

``main(config, out_dir=None, resume=False) -> RunResult`` is the programmatic entry point (smoke
tests).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

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
        help="run a federation locally (Flower simulation engine)",
        description="Run a differentially private federated meta-learning job locally. With no "
        "arguments: a private sinusoid federation on the embedded default configuration.",
    )
    p.add_argument("--config", type=Path, default=None, help="TOML configuration file")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override one key, e.g. --set privacy.epsilon_budget=4 (repeatable)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="output directory (default output.dir)")
    p.add_argument("--resume", action="store_true", help="continue the run checkpointed in --out")
    p.set_defaults(func=_handle)


def _handle(args: argparse.Namespace) -> int:
    for k, v in _QUIET_ENV.items():
        os.environ.setdefault(k, v)
    from fedmeta.config import ConfigError, load_config

    try:
        cfg = _resume_config(args) if args.resume else load_config(args.config, args.overrides)
    except ConfigError as error:
        print(f"fedmeta simulate: {error}", file=sys.stderr)
        return 2
    from server.round import FederationError

    try:
        result = main(cfg, out_dir=args.out, resume=args.resume)
    except KeyboardInterrupt:
        print("interrupted; resume with --resume", file=sys.stderr)
        return 130
    except FederationError as error:
        print(f"fedmeta simulate: {error}", file=sys.stderr)
        return 2
    return 0 if result is not None else 1


def _resume_config(args: argparse.Namespace) -> Any:
    """Return the configuration of a resumed run: the checkpoint's.

    Only ``rounds`` (and output/metrics keys) may be overridden, so a resumed run cannot silently
    change its privacy parameters.
    """
    from fedmeta.config import ConfigError, apply_overrides, config_from_dict, load_config
    from server.checkpoint import load_checkpoint

    base = load_config(args.config, args.overrides)
    out = Path(args.out or base.output.dir)
    ckpt = load_checkpoint(out)
    if ckpt is None:
        return base
    allowed = ("rounds", "output.", "metrics.", "federation.round_timeout_s", "federation.backend")
    bad = [o for o in args.overrides if not o.split("=", 1)[0].strip().startswith(allowed)]
    if bad:
        raise ConfigError(f"--resume uses the checkpoint's configuration; cannot override {bad}")
    return config_from_dict(apply_overrides(ckpt["config"], args.overrides))


def main(config: Any = None, *, out_dir: str | Path | None = None, resume: bool = False) -> Any:
    """Run one simulated federation and return its ``RunResult`` (summary, rows, out_dir)."""
    for k, v in _QUIET_ENV.items():
        os.environ.setdefault(k, v)
    from fedmeta.config import Config

    cfg = config if config is not None else Config()
    out = Path(out_dir or cfg.output.dir)
    from server.round import refuse_to_overwrite_run

    refuse_to_overwrite_run(out, resume)  # before Ray starts, so the error is the first thing seen
    if cfg.federation.backend == "inprocess":
        from server.app import execute
        from server.local_grid import InProcessGrid

        return execute(cfg, InProcessGrid(cfg.federation.participants), out_dir=out, resume=resume)
    return _run_ray(cfg, out, resume)


def _run_ray(cfg: Any, out: Path, resume: bool) -> Any:
    import logging

    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from client.app import app as client_app
    from server.app import execute

    holder: dict[str, Any] = {}
    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        holder["result"] = execute(cfg, grid, out_dir=out, resume=resume)

    logging.getLogger("flwr").setLevel(logging.WARNING)
    import warnings

    warnings.filterwarnings("ignore", message=".*run_simulation.*deprecated.*")
    backend_config = {
        "client_resources": {
            "num_cpus": cfg.federation.client_num_cpus,
            "num_gpus": cfg.federation.client_num_gpus,
        },
        "init_args": {"logging_level": "ERROR", "log_to_driver": False},
    }
    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=cfg.federation.participants,
        backend_config=backend_config,
    )
    return holder.get("result")
