"""The fedmeta ServerApp (Flower Message API) and ``execute``, the run shared by every entry point.

Thin glue: ``@app.main()`` turns Flower's ``context.run_config`` (``config-file``, ``set``, ``out``,
``resume`` - see pyproject ``[tool.flwr.app.config]``) into the typed configuration once, then calls
:func:`execute`, which runs :class:`server.round.RoundLoop` over the Grid with the progress bar and
(optionally) the Prometheus observer, and writes the outputs.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedmeta import protocol as P
from fedmeta.config import Config, load_config

for _k, _v in (
    ("FLWR_TELEMETRY_ENABLED", "0"),
    ("FLWR_DISABLE_UPDATE_CHECK", "1"),
    ("RAY_USAGE_STATS_ENABLED", "0"),
):
    os.environ.setdefault(_k, _v)

log = logging.getLogger("fedmeta.server")


def make_observers(cfg: Config, progress: bool | None = None) -> list[Any]:
    """The progress bar, plus the Prometheus observer when ``metrics.port`` is set."""
    from server.progress import ProgressBar

    observers: list[Any] = []
    if cfg.output.progress if progress is None else progress:
        observers.append(ProgressBar())
    if cfg.metrics.port is not None:
        import importlib

        try:
            metrics = importlib.import_module(
                "server.monitoring.live"
            )  # lazy: the only prometheus_client user
        except ImportError as error:
            log.warning("metrics.port is set but server.monitoring.live is unavailable: %s", error)
        else:
            observers.append(metrics.make_observer(cfg))
    return observers


def execute(
    cfg: Config,
    grid: Grid,
    *,
    out_dir: str | Path | None = None,
    resume: bool = False,
    observers: list[Any] | None = None,
    echo: bool = True,
) -> Any:
    """Run the federation over ``grid``; write summary.json, rounds.csv, plots; return RunResult."""
    from server.outputs import format_summary, write_all
    from server.round import RoundLoop

    out = Path(out_dir or cfg.output.dir)
    obs = make_observers(cfg) if observers is None else observers
    loop = RoundLoop(cfg, grid, out_dir=out, resume=resume, observers=obs)
    loop.announce = (lambda text: print(text, flush=True)) if echo else (lambda text: None)
    result = loop.run()
    write_all(out, result.summary, result.rows, plots=cfg.output.plots)
    if echo:
        print(format_summary(result.summary), flush=True)
        print(f"outputs: {out}/summary.json, rounds.csv, *.png, checkpoint.pt", flush=True)
    return result


def config_from_run_config(run_config: dict[str, Any]) -> tuple[Config, str | None, bool]:
    """Flower run_config -> (Config, out dir, resume); ``set``: ``;``-separated ``key=value``."""
    path = str(run_config.get(P.RUN_CONFIG_FILE, "") or "") or None
    raw_set = str(run_config.get(P.RUN_CONFIG_SET, "") or "")
    overrides = [s.strip() for s in raw_set.split(";") if s.strip()]
    cfg = load_config(path, overrides)
    out = str(run_config.get(P.RUN_CONFIG_OUT, "") or "") or None
    return cfg, out, bool(run_config.get(P.RUN_CONFIG_RESUME, False))


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """``flwr run .`` entry point."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    cfg, out, resume = config_from_run_config(dict(context.run_config))
    execute(cfg, grid, out_dir=out, resume=resume)
