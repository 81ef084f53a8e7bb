"""A private run releases the same bytes whether stage 2 drew no task or every task (issue 18).

The sampler's randomness is forced through the run's own injection point (the test mode's
``InsecureSeededSource``, replaced by a source of constant bytes): with all-zero bytes every
Poisson draw includes its task (the cap: every task of every participant), with all-one bytes none
does (the minimum: no task at all). Stage 1 samples every participant either way (``n1 = P``), and
the noise is the test mode's, keyed by (seed, round), so it is the same in both runs. Everything
the run releases is compared byte for byte: ``summary.json``, ``rounds.csv``, the checkpoint's
round records, the live metrics page, the exporter's page over the run's ledger and run directory,
the printed plan and summary, the progress lines and the log lines. Masked, and only these: what is
computed from the noisy model (loss, validation and test metrics; the clip bound and noise scale
under adaptive clipping, which follow the noisy count released with it), wall-clock timestamps
(the timing argument is the padding's, tested in test_round.py), and the per-run random ids and
salted federation ids.
"""

from __future__ import annotations

import csv
import json
import logging
import re
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import generate_latest

from fedmeta.client.app import app as client_app
from fedmeta.config_io import load_config
from fedmeta.server import run as run_mod
from fedmeta.server.app import execute
from fedmeta.server.monitoring.ledger import exporter_registry
from fedmeta.server.monitoring.live import PrometheusRunObserver
from fedmeta.server.outputs import implemented_guarantee
from fedmeta.server.progress import ProgressBar
from fedmeta.simulation.local_grid import InProcessGrid

from . import test_release_invariance as invariance

pytestmark = pytest.mark.integration

# The same model-derived fields as the neighbouring-datasets test, from one list.
MODEL_DERIVED_COLUMNS = tuple(sorted(invariance.MODEL_DERIVED_COLUMNS))
MODEL_DERIVED_SUMMARY = tuple(sorted(invariance.MODEL_DERIVED_SUMMARY))
MODEL_DERIVED_METRICS = ("fedmeta_train_loss", "fedmeta_validation_metric", "fedmeta_final_metric",
                         "fedmeta_clip_bound", "fedmeta_noise_std",
                         "fedmeta_last_run_final_metric")  # fmt: skip
CLOCK_METRICS = ("_timestamp_seconds", "fedmeta_exporter_scrape_duration_seconds")


class ConstantBytes:
    """A sampler source of constant bytes: all-zero words include every Poisson draw, 0xff none."""

    def __init__(self, byte: int) -> None:
        self.byte = byte

    @property
    def secure(self) -> bool:
        return False

    def random_bytes(self, n: int) -> bytes:
        return bytes([self.byte]) * n

    def randbelow(self, n: int) -> int:
        return 0


def _forced(byte: int) -> Any:
    return lambda seed, stream=0: ConstantBytes(byte)


@dataclass
class Capture:
    """pytest's fixtures that one run needs."""

    monkeypatch: pytest.MonkeyPatch
    capsys: pytest.CaptureFixture[str]
    caplog: pytest.LogCaptureFixture


def private_run(out: Path, byte: int, fx: Capture) -> dict[str, Any]:
    """One private run with stage 2 forced; every channel it releases, as text."""
    state = out.parent / f"state-{out.name}"
    fx.monkeypatch.setenv("FEDMETA_STATE_DIR", str(state))
    fx.monkeypatch.setattr(run_mod, "InsecureSeededSource", _forced(byte))
    cfg = load_config(None, [
        "federation.participants=3", "sampling.participants_per_round=3", "sampling.task_rate=0.5",
        "dataset.tasks_per_participant=4", "dataset.validation_tasks=8", "dataset.test_tasks=16",
        "dataset.probe_tasks=4", "training.eval_every=3", "privacy.report_every=2", "rounds=6",
        "privacy.noise_multiplier=2.0", "privacy.insecure_test_seed=11", "output.plots=false",
    ])  # fmt: skip
    live = PrometheusRunObserver()
    progress = StringIO()
    fx.caplog.clear()
    with fx.caplog.at_level(logging.INFO, logger="fedmeta"):
        execute(cfg, InProcessGrid(3, client_app), out_dir=out,
                observers=[live, ProgressBar(progress, every=1)])  # fmt: skip
    printed = fx.capsys.readouterr().out.replace(str(out), "OUT")
    ledger = next(state.glob("*.sqlite"))
    registry, collector = exporter_registry(ledger, [out], affordable=False)
    try:
        exporter = generate_latest(registry).decode()
    finally:
        collector.close()
    checkpoint = torch.load(out / "checkpoint.pt", weights_only=False)
    return {
        "summary": _summary(out / "summary.json"),
        "rounds.csv": _csv(out / "rounds.csv"),
        "checkpoint records": _records(checkpoint["outcomes"]),
        "live metrics": _page(generate_latest(live.registry).decode()),
        "exporter metrics": _page(exporter),
        "printed": _mask_numbers_after(printed, ("test mse",)),
        "progress": _mask_numbers_after(progress.getvalue(), ("loss", "val mse")),
        "logs": _ids([r.getMessage().replace(str(out), "OUT") for r in fx.caplog.records]),
    }


def _ids(lines: list[str]) -> list[str]:
    return [re.sub(r"\b[0-9a-f]{12}\b", "RUN", line) for line in lines]


def _csv(path: Path) -> list[dict[str, str]]:
    return [{k: ("M" if k in MODEL_DERIVED_COLUMNS else v) for k, v in row.items()}
            for row in csv.DictReader(path.open())]  # fmt: skip


def _summary(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    data["adaptive_clipping"]["last_clip"] = "M"  # from the released noisy counts
    for key in MODEL_DERIVED_SUMMARY:
        data[key] = "M"
    data["run_id"] = data["federation_id"] = "ID"
    data["ledger"]["path"] = "PATH"
    witness = data["ledger"].get("witness")
    if witness:  # the ledger's random id and the chain head over it: identifiers, kept apart
        witness["ledger_id"] = witness["head"] = "ID"
    return data


def _records(outcomes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    model = ("train_loss", "validation_metric", "clip", "noise_std", "run_id", "federation_id")
    return [{k: ("M" if k in model else v) for k, v in o.items()} for o in outcomes]


def _page(text: str) -> list[str]:
    keep = []
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[-1 if line.startswith("#") else 0]
        if line.startswith("#") and len(line.split(" ")) > 2:
            name = line.split(" ")[2]
        if name.startswith(MODEL_DERIVED_METRICS) or any(c in name for c in CLOCK_METRICS):
            if not line.startswith("#"):
                line = line.rsplit(" ", 1)[0] + " M"
        keep.append(line)
    keep = [re.sub(r'run="[0-9a-f]+"', 'run="R"', line) for line in keep]
    keep = [re.sub(r'db="[^"]+"', 'db="DB"', line) for line in keep]
    return [re.sub(r'federation="[^"]+"', 'federation="F"', line) for line in keep]


def _mask_numbers_after(text: str, labels: tuple[str, ...]) -> list[str]:
    """Mask every number between one of ``labels`` and the next ``|`` (the noisy model's)."""
    out = []
    for line in _ids(text.splitlines()):
        for label in labels:
            line = re.sub(rf"{re.escape(label)}[^|]*", _numbers_masked, line)
        out.append(line)
    return out


def _numbers_masked(match: re.Match[str]) -> str:
    return re.sub(r"-?\d+\.\d+", "M", match.group(0))


def test_minimum_and_cap_of_stage_2_release_the_same_bytes(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    fx = Capture(monkeypatch, capsys, caplog)
    none = private_run(tmp_path / "none", 0xFF, fx)
    every = private_run(tmp_path / "every", 0x00, fx)
    for channel in none:
        assert none[channel] == every[channel], channel
    # The draws were forced where claimed: the models differ (the minimum saw no task at all; a
    # tasks_received column put in rounds.csv reads 0 and 12 per round).
    a = torch.load(tmp_path / "none" / "checkpoint.pt", weights_only=False)["params"]
    b = torch.load(tmp_path / "every" / "checkpoint.pt", weights_only=False)["params"]
    assert not torch.equal(a, b)
    summary = json.loads((tmp_path / "every" / "summary.json").read_text())
    assert summary["rounds_completed"] == 6 and summary["epsilon_spent"] > 0
    assert summary["wall_seconds"] is None  # whole-run wall time: a private diagnostic
    # The guarantee of the implementation folds in the floating-point residual, over every spend:
    # 1,761 parameters plus adaptive clipping's count per round.
    implemented = summary["implemented_guarantee"]
    assert implemented["released_coordinates"] == 1762 * 6
    assert (implemented["epsilon"], implemented["delta"]) == implemented_guarantee(
        summary["epsilon_spent"], summary["delta"], 1762 * 6
    )
    assert implemented["epsilon"] > summary["epsilon_spent"]
