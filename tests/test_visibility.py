"""What a run shows, and only what it may: progress lines, the metrics URL, TensorBoard scalars,
``evaluate``'s guarantee; and Flower's typed run config mapped onto the configuration tree.
"""

from __future__ import annotations

import io
import logging
import socket
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def _started(private: bool, padded: float = 0.0, diagnostics: bool = False) -> Any:
    from fedmeta.server.report import RunStarted

    return RunStarted("run", "fed", private, 8.0 if private else None, 1e-5, 1.0, 1.0, 4, 4, 0.0,
                      None, 20, "mse", diagnostics, round_min_seconds=padded)  # fmt: skip


def _round(r: int, eps: float | None) -> Any:
    from fedmeta.server.report import RoundOutcome

    return RoundOutcome("run", "fed", r, participants_sampled=20, participants_replied=20,
                        train_loss=0.5, validation_metric=0.4, epsilon_task=eps, noise_std=0.01,
                        clip=1.0)  # fmt: skip


@pytest.mark.unit
@pytest.mark.parametrize(
    ("private", "padded", "diagnostics", "timed"),
    [
        (True, 0.0, False, False),
        (False, 0.0, False, True),
        (True, 2.0, False, True),
        (True, 0.0, True, True),
    ],  # fmt: skip
    ids=["private", "non-private", "private-padded", "private-with-diagnostics"],
)
def test_progress_shows_time_only_where_it_is_not_a_release(
    private: bool, padded: float, diagnostics: bool, timed: bool
) -> None:
    from fedmeta.server.progress import ProgressBar

    stream = io.StringIO()
    bar = ProgressBar(stream=stream, every=1)
    bar.run_started(_started(private, padded, diagnostics))
    bar.round_finished(_round(1, 0.5))
    line = stream.getvalue()
    assert "round 1/4" in line
    assert ("eps 0.500/8" in line) == private
    # Elapsed time and rate: a non-private run, a padded private one (a round's end follows the
    # public minimum), or one that records private diagnostics (announced in its plan).
    assert (" r/s" in line) == timed


class _Writer:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float, int, float]] = []

    def add_scalar(self, tag: str, value: float, step: int, walltime: float) -> None:
        self.calls.append((tag, value, step, walltime))

    def close(self) -> None:
        pass


@pytest.mark.unit
@pytest.mark.parametrize("private", [True, False])
def test_tensorboard_log_writes_public_values_without_timings_in_a_private_run(
    private: bool,
) -> None:
    from fedmeta.server.progress import TensorBoardLog

    log = object.__new__(TensorBoardLog)  # the writer is a fake: the package may be absent
    writer = _Writer()
    log.writer, log.private, log.t0 = writer, True, 0.0
    log.run_started(_started(private))
    start = log.t0
    log.round_finished(_round(1, None))
    log.round_finished(_round(2, 0.7))
    tags = {(tag, step) for tag, _, step, _ in writer.calls}
    assert ("privacy/epsilon_task", 2) in tags and ("privacy/epsilon_task", 1) not in tags
    assert ("train/loss", 1) in tags and ("validation/metric", 2) in tags
    times = {walltime for *_, walltime in writer.calls}
    if private:
        assert times == {start}  # every event at the run's start: no round duration released
    else:
        assert all(t >= start for t in times)


@pytest.mark.unit
def test_metrics_url_is_printed_and_a_busy_port_is_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from fedmeta.server.monitoring.live import make_observer

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        obs = make_observer(SimpleNamespace(metrics=SimpleNamespace(port=port, bind="127.0.0.1")))
        assert obs.server is None
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert f"cannot bind 127.0.0.1:{port}" in err and "metrics.port = 0" in err
    free = make_observer(SimpleNamespace(metrics=SimpleNamespace(port=0, bind="127.0.0.1")))
    try:
        assert f"live metrics: http://127.0.0.1:{free.port}/metrics" in capsys.readouterr().err
    finally:
        free.server.shutdown()
        free.server.server_close()


@pytest.mark.unit
def test_evaluate_reports_the_guarantee_of_the_checkpoint() -> None:
    import torch

    from fedmeta.checkpoint import Checkpoint
    from fedmeta.cli.evaluate import privacy_of
    from fedmeta.config import Config

    cfg = Config()
    rounds = ({"round": 10, "epsilon_task": 2.0, "epsilon_participant": None},
              {"round": 11, "epsilon_task": None})  # fmt: skip

    def saved(private: bool, config: Config) -> Checkpoint:
        return Checkpoint("r", "f", torch.zeros(2), {}, 11, config, private, outcomes=rounds)

    got = privacy_of(saved(True, cfg), cfg.privacy)
    assert got == {"epsilon": 2.0, "epsilon_participant": None, "epsilon_at_round": 10,
                   "delta": 1e-5, "neighbouring": "add_remove", "experiment": None}  # fmt: skip
    assert privacy_of(saved(False, cfg), cfg.privacy)["epsilon"] is None
    marked = Config.model_validate({"privacy": {"experiment": "sweep-4"}})
    assert privacy_of(saved(False, marked), marked.privacy)["experiment"] == "sweep-4"


@pytest.mark.unit
def test_typed_run_config_keys_map_onto_the_tree() -> None:
    from fedmeta import protocol as P
    from fedmeta.server.app import config_from_run_config

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    defaults = pyproject["tool"]["flwr"]["app"]["config"]
    base = {P.RUN_CONFIG_FILE, P.RUN_CONFIG_SET, P.RUN_CONFIG_OUT, P.RUN_CONFIG_RESUME}
    assert set(defaults) == base | set(P.RUN_CONFIG_TYPED)
    # The pyproject's own values change nothing: the embedded default comes out.
    from fedmeta.config import Config

    cfg, out, resume = config_from_run_config(dict(defaults))
    assert cfg == Config() and out is None and resume is False
    given = {**defaults, "num-server-rounds": 20, "epsilon": 4.0, "noise-multiplier": 1.5,
             "dataset-path": "/data", "set": "training.meta_lr=0.01", "epsilon-budget": 6.0,
             "experiment": "sweep-4"}  # fmt: skip
    cfg, _, _ = config_from_run_config(given)
    # `epsilon` is the run's target; the data's budget is its own key (issue 22).
    assert cfg.rounds == 20 and cfg.privacy.target_epsilon == 4.0
    assert cfg.privacy.epsilon_budget == 6.0 and cfg.privacy.experiment == "sweep-4"
    assert cfg.privacy.noise_multiplier == 1.5 and cfg.dataset.path == "/data"
    assert cfg.training.meta_lr == 0.01
    # `set` comes last: it wins over a typed key.
    cfg, _, _ = config_from_run_config({**given, "set": "rounds=30"})
    assert cfg.rounds == 30


@pytest.mark.unit
def test_every_typed_key_names_a_real_configuration_key() -> None:
    from fedmeta import protocol as P
    from fedmeta.config import dotted_keys

    assert set(P.RUN_CONFIG_TYPED.values()) <= set(dotted_keys())


@pytest.mark.unit
def test_library_info_lines_are_kept_out_of_a_run_log() -> None:
    from fedmeta.server.app import NOISY_LOGGERS, quiet_logging

    quiet_logging()
    assert logging.getLogger("fedmeta").getEffectiveLevel() == logging.INFO
    for name in ("httpx", *NOISY_LOGGERS):
        assert not logging.getLogger(name).isEnabledFor(logging.INFO), name


@pytest.mark.unit
def test_a_run_that_affords_no_round_says_why() -> None:
    from fedmeta.config import Config
    from fedmeta.config_io import load_config
    from fedmeta.simulation.simulate import _no_round_hint

    tiny = _no_round_hint(load_config(None, ["privacy.noise_multiplier=0.0001"]))
    assert "privacy.noise_multiplier=0.0001" in tiny and "fedmeta privacy calibrate" in tiny
    spent = _no_round_hint(Config())
    assert "fedmeta ledger show" in spent and "--experiment NAME" in spent
    assert "fedmeta ledger new-budget" in spent
