"""The fedmeta ServerApp (Flower Message API) and ``execute``, the run shared by every entry point.

Thin glue: ``@app.main()`` turns Flower's ``context.run_config`` (``config-file``, the typed keys
of ``protocol.RUN_CONFIG_TYPED``, ``set``, ``out``, ``resume``; see pyproject
``[tool.flwr.app.config]``) into the typed configuration once, wraps the
Grid in a :class:`~server.transport.GridTransport` and calls :func:`execute`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedmeta import protocol as P
from fedmeta.checkpoint import CHECKPOINT_NAME
from fedmeta.config import Config
from fedmeta.config_io import load_config
from fedmeta.server.report import RunObserver
from fedmeta.server.run import RunResult, run_federation
from fedmeta.server.superlink_watch import watching
from fedmeta.server.transport import GridTransport
from fedmeta.workload import Workload

for _key, _value in (
    ("FLWR_TELEMETRY_ENABLED", "0"),
    ("FLWR_DISABLE_UPDATE_CHECK", "1"),
    ("RAY_USAGE_STATS_ENABLED", "0"),
):
    os.environ.setdefault(_key, _value)

# Ray's tip that a future version stops hiding GPUs from actors with num_gpus=0 (this version still
# hides them, which fedmeta relies on): a FutureWarning in every `flwr run .` log, about nothing the
# user can act on. Set here, at import, before Flower's simulation starts Ray.
warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)

log = logging.getLogger("fedmeta.server")


def make_observers(cfg: Config, progress: bool | None = None) -> list[RunObserver]:
    """The progress bar, plus the Prometheus observer when ``metrics.port`` is set."""
    from fedmeta.server.progress import ProgressBar

    observers: list[RunObserver] = []
    if cfg.output.progress if progress is None else progress:
        observers.append(ProgressBar())
    if cfg.metrics.port is not None:
        from fedmeta.server.monitoring.live import make_observer  # the only prometheus_client user

        observers.append(make_observer(cfg))
    return observers


def execute(
    cfg: Config,
    grid: Grid,
    *,
    out_dir: str | Path | None = None,
    resume: bool = False,
    observers: list[RunObserver] | None = None,
    echo: bool = True,
    open_ledger: Callable[[Config, Any], Any] | None = None,
    stop: threading.Event | None = None,
    workload: Workload | None = None,
    test_when_interrupted: bool = True,
) -> RunResult:
    """Run the federation over ``grid``; write summary.json, rounds.csv and plots.

    ``workload``: ``cfg``'s, when the caller built it already (``fedmeta simulate`` checks the
    data with it); else the run builds it once. ``test_when_interrupted``: see
    ``run_federation``.
    """
    from fedmeta.server.outputs import format_summary, write_all
    from fedmeta.server.plots import PLOT_FILES, PLOTS_MISSING

    out = Path(out_dir or cfg.output.dir)
    transport = GridTransport(
        grid,
        register_timeout_s=cfg.federation.register_timeout_s,
        round_timeout_s=cfg.federation.round_timeout_s,
    )
    result = run_federation(
        cfg,
        transport,
        out_dir=out,
        resume=resume,
        observers=make_observers(cfg) if observers is None else observers,
        announce=(lambda text: print(text, flush=True)) if echo else (lambda text: None),
        open_ledger=open_ledger,
        stop=stop,
        workload=workload,
        test_when_interrupted=test_when_interrupted,
    )
    # A run stopped to end quickly leaves its plots, like its test evaluation, to the resumed run's
    # end: drawing them takes seconds (matplotlib), and they would stop at the interruption.
    stopped = result.summary["stopped_reason"] == "interrupted" and not test_when_interrupted
    plots = cfg.output.plots and not stopped
    written = write_all(out, result.summary, result.outcomes, diagnostics=result.diagnostics,
                        plots=plots)  # fmt: skip
    if (out / CHECKPOINT_NAME).exists():
        written.append(CHECKPOINT_NAME)
    if echo:
        print(format_summary(result.summary), flush=True)
        if plots and not set(PLOT_FILES) <= set(written):
            print(PLOTS_MISSING, flush=True)
        print(f"outputs: {out}/{', '.join(written)}", flush=True)
    return result


def typed_overrides(run_config: dict[str, Any]) -> list[str]:
    """``key=value`` overrides from Flower's typed keys (``num-server-rounds = 20``, ...).

    One place maps them (``protocol.RUN_CONFIG_TYPED``); 0 or "" leaves the configuration's value.
    """
    out = []
    for flower_key, dotted in P.RUN_CONFIG_TYPED.items():
        value = run_config.get(flower_key)
        if value is None or value == "" or (not isinstance(value, str) and value == 0):
            continue
        text = json.dumps(value)  # a TOML value: a quoted string, or a number
        out.append(f"{dotted}={text}")
    return out


def config_from_run_config(run_config: dict[str, Any]) -> tuple[Config, str | None, bool]:
    """Flower run_config -> (Config, out dir, resume).

    Applied in order: ``config-file`` (else the embedded default), the typed keys, then ``set``
    (``;``-separated ``key=value``, the escape hatch for every other key).
    """
    path = str(run_config.get(P.RUN_CONFIG_FILE, "") or "") or None
    raw_set = str(run_config.get(P.RUN_CONFIG_SET, "") or "")
    overrides = typed_overrides(run_config)
    overrides += [s.strip() for s in raw_set.split(";") if s.strip()]
    cfg = load_config(path, overrides)
    out = str(run_config.get(P.RUN_CONFIG_OUT, "") or "") or None
    return cfg, out, bool(run_config.get(P.RUN_CONFIG_RESUME, False))


#: Libraries whose INFO lines are noise in a run's log (httpx logs every HTTP request).
NOISY_LOGGERS = ("httpx", "httpcore", "urllib3", "matplotlib", "PIL", "ray")


def quiet_logging() -> None:
    """Fedmeta's own INFO lines on stderr; the libraries' only from WARNING up.

    Flower's logger keeps its own handler (INFO and up) and level (DEBUG): passed on to the root
    handler as well, every DEBUG record of it would be printed again (``DEBUG:flwr:...``).
    """
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("flwr").propagate = False
    logging.getLogger("fedmeta").setLevel(logging.INFO)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """``flwr run .`` entry point."""
    quiet_logging()
    cfg, out, resume = config_from_run_config(dict(context.run_config))
    # A SuperLink that restarts or forgets the run ends it here, truthfully (superlink_watch.py).
    with watching(grid, cfg.federation.superlink_timeout_s) as stop:
        execute(cfg, grid, out_dir=out, resume=resume, stop=stop)
