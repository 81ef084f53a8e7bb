"""The server's validation and test evaluation run on the run's device (issue 38).

``federation.client_device`` (auto: CUDA when present) is where the participants' gradients are
computed; the server's held-out evaluation used to be pinned to the CPU. On a CPU-only machine
``auto`` and ``cpu`` are the same device, so the results are identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import fedmeta.metalearning as metalearning
from fedmeta.config_io import load_config
from fedmeta.simulation.simulate import main

from .test_round import SMALL

# The reproducible test mode: sampling and noise from the seed, so two runs differ only in device.
QUIET = ["rounds=3", "privacy.insecure_test_seed=5", "output.progress=false", "output.plots=false"]


def _run(tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[Any]]:
    """A run's summary and the device every server-side evaluation was asked to use."""
    original, devices = metalearning.evaluate, []

    def spy(*args: Any, **kwargs: Any) -> Any:
        devices.append(kwargs.get("device"))
        return original(*args, **kwargs)

    monkeypatch.setattr(metalearning, "evaluate", spy)
    cfg = load_config(None, [*SMALL, *QUIET, f"federation.client_device={device}",
                             f"privacy.ledger_path={tmp_path / device}.sqlite"])  # fmt: skip
    result = main(cfg, out_dir=tmp_path / device)
    monkeypatch.setattr(metalearning, "evaluate", original)
    return result, devices


@pytest.mark.integration
def test_evaluation_runs_on_the_runs_device_with_the_same_results_on_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    cpu, on_cpu = _run(tmp_path, "cpu", monkeypatch)
    assert on_cpu and set(on_cpu) == {"cpu"}  # validation, probe and test: never another device
    if torch.cuda.is_available():
        pytest.skip("auto is CUDA here: the results may differ in the last bits")
    auto, on_auto = _run(tmp_path, "auto", monkeypatch)
    assert set(on_auto) == {"auto"}
    assert auto.summary["final_metric"] == cpu.summary["final_metric"]
    assert auto.summary["starting_metric"] == cpu.summary["starting_metric"]
    assert [o.validation_metric for o in auto.outcomes] == [
        o.validation_metric for o in cpu.outcomes
    ]
