"""The simulation's batched round (simulation/batched.py) against each participant's own call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedmeta import protocol as P
from fedmeta.client.gradients import gradient_reply
from fedmeta.client_config import client_config
from fedmeta.config import Config
from fedmeta.config_io import load_config
from fedmeta.simulation.batched import BatchedGrid, batched_replies
from fedmeta.workload import build_model, initial_params

pytestmark = pytest.mark.integration

SMALL = ["federation.participants=4", "dataset.tasks_per_participant=12",
         "dataset.validation_tasks=4", "dataset.test_tasks=4", "dataset.probe_tasks=2"]  # fmt: skip
ASKED = {"0": (3, 1, 7), "1": (), "2": (0, 11), "3": (5,)}


def _requests(cfg: Config, clip: float | None) -> dict[int, P.GradientRequest]:
    params = initial_params(cfg, build_model(cfg)).numpy().astype(np.float32)
    sent = client_config(cfg).model_dump_json()
    return {int(pid): P.GradientRequest("run", 2, ids, clip, params, sent)
            for pid, ids in ASKED.items()}  # fmt: skip


@pytest.mark.parametrize("clip", [0.05, None])
@pytest.mark.parametrize("method", ["vmap", "loop"])
def test_batched_rows_are_bit_for_bit_the_per_participant_rows(
    clip: float | None, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU each task is computed alone whatever the batch: the same bits, bits and ids.

    The sinusoid MLP takes vmap on the CPU by default and the conv net the loop; both are pinned
    (``method`` forced). A bound of 0.05 clips most tasks, None clips none.
    """
    from fedmeta import metalearning

    real = metalearning.per_task_clipped_grads
    monkeypatch.setattr(metalearning, "per_task_clipped_grads",
                        lambda *a, **k: real(*a, **{**k, "method": method}))  # fmt: skip
    cfg = load_config(None, SMALL)
    requests = _requests(cfg, clip)
    batched = batched_replies(requests, {k: str(k) for k in requests})
    assert set(batched) == set(requests)
    for key, request in requests.items():
        alone = gradient_reply(request, str(key))
        together = batched[key]
        assert together.task_ids == alone.task_ids and together.clip_bits == alone.clip_bits
        assert alone.grads is not None and together.grads is not None
        assert together.grads.shape == alone.grads.shape
        assert np.array_equal(together.grads, alone.grads)  # bit for bit (no tolerance)


@pytest.mark.gpu
def test_on_cuda_batched_rows_agree_to_float32_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    """vmap over the whole round against one vmap per participant: float32 sums in another
    order, so each row within 1e-5 of the bound (float32's 1.2e-7 times the depth of the
    reductions' partial sums, with room)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cfg = load_config(None, [*SMALL, "federation.client_device=cuda"])
    requests = _requests(cfg, 0.05)
    batched = batched_replies(requests, {k: str(k) for k in requests})
    for key, request in requests.items():
        alone, together = gradient_reply(request, str(key)), batched[key]
        assert isinstance(together.grads, torch.Tensor) and together.grads.is_cuda  # device lane
        assert alone.grads is not None
        got = together.grads.cpu().numpy()
        assert np.allclose(got, alone.grads, rtol=0, atol=1e-5 * 0.05)


def test_requests_that_differ_in_more_than_their_tasks_are_not_batched() -> None:
    cfg = load_config(None, SMALL)
    requests = _requests(cfg, 0.05)
    other = requests[2]
    requests[2] = P.GradientRequest("run", 3, (0,), 0.05, other.params, other.config_json)
    assert batched_replies(requests, {k: str(k) for k in requests}) == {}


def _two_batched_rounds(tmp_path: Path, *more: str) -> tuple[dict[str, Any], BatchedGrid]:
    """A private simulated run of 2 rounds through a BatchedGrid: (its summary, the grid)."""
    from fedmeta.server.app import execute

    cfg = load_config(None, [*SMALL, "rounds=2", "sampling.participants_per_round=3",
                             "privacy.noise_multiplier=1.0", "output.progress=false",
                             "output.plots=false", "privacy.insecure_test_seed=3",
                             "training.eval_every=100", *more])  # fmt: skip
    grid = BatchedGrid(cfg.federation.participants)
    result = execute(cfg, grid, out_dir=tmp_path / "run", observers=[], echo=False,
                     open_ledger=_ledger(tmp_path))  # fmt: skip
    return result.summary, grid


def test_a_simulated_run_batches_its_rounds(tmp_path: Path) -> None:
    summary, grid = _two_batched_rounds(tmp_path)
    assert summary["rounds_completed"] == 2
    assert grid.batched_rounds == 2 and grid.fallback_rounds == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_server_checks_the_rows_where_they_were_computed(
    device: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU the batched round's rows reach the server's re-check as tensors on that GPU (the
    device lane); on the CPU as host arrays. Either way the round completes."""
    from fedmeta.server import validation

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    where: list[str] = []
    real = validation.fused_row_sum

    def spy(grads, clip):  # type: ignore[no-untyped-def]
        where.append(grads.device.type if isinstance(grads, torch.Tensor) else "host")
        return real(grads, clip)

    monkeypatch.setattr(validation, "fused_row_sum", spy)
    summary, grid = _two_batched_rounds(tmp_path, f"federation.client_device={device}")
    assert summary["rounds_completed"] == 2 and grid.batched_rounds == 2
    assert where and set(where) == {"host" if device == "cpu" else "cuda"}


def _ledger(tmp_path: Path):  # type: ignore[no-untyped-def]
    from .fakes import fake_ledger, opener

    return opener(fake_ledger(100.0, 0.1))
