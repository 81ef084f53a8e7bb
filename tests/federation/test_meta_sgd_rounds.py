"""Meta-SGD through a federation: participants send rate gradients, the rounds move the rates.

The learned inner rates (``training.meta_sgd``) are meta-parameters like any other: a participant's
row covers them, the one clip bounds the whole row, the server's noise and optimizer move them, and
the checkpoint carries them. A subset of ``trained_parameters`` holds no rate, so it is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedmeta.client.gradients import gradient_reply
from fedmeta.client_config import client_config
from fedmeta.config import ConfigError
from fedmeta.config_io import load_config
from fedmeta.protocol import GradientRequest
from fedmeta.workload import build_model, initial_params

from .fakes import fake_ledger
from .test_round import run, small


@pytest.mark.integration
def test_a_participants_row_covers_the_rates_under_one_clip() -> None:
    cfg = load_config(None, ["dataset.tasks_per_participant=8", "training.meta_sgd=true",
                             "training.optimizer=sgd"])  # fmt: skip
    params = initial_params(cfg, build_model(cfg)).numpy().astype(np.float32)
    d = params.size // 2
    sent = client_config(cfg).model_dump_json()
    reply = gradient_reply(GradientRequest("r", 0, (0, 1, 2), None, params, sent), "0")
    assert reply.grads is not None and reply.grads.shape == (3, 2 * d)
    assert (np.abs(reply.grads[:, d:]).sum(axis=1) > 0).all()  # every task moves the rates
    clipped = gradient_reply(GradientRequest("r", 0, (0, 1, 2), 1e-3, params, sent), "0")
    assert clipped.grads is not None
    assert np.linalg.norm(clipped.grads, axis=1).max() <= 1e-3 * (1 + 1e-5)


@pytest.mark.integration
def test_private_rounds_move_the_rates_and_the_summary_says_they_are_learned(
    tmp_path: Path,
) -> None:
    cfg = small("rounds=3", "privacy.insecure_test_seed=3", "training.meta_sgd=true",
                "training.inner_lr=0.1")  # fmt: skip
    result = run(cfg, tmp_path, fake_ledger(100.0, 0.1))
    start = initial_params(cfg, build_model(cfg))
    final = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["params"]
    d = start.numel() // 2
    assert bool((start[d:] == torch.tensor(0.1)).all())
    assert int((final[d:] != start[d:]).sum()) == d  # the server's update reaches every rate
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["adaptation"]["learned_inner_rates"] is True
    assert result.rounds_run == 3


@pytest.mark.integration
def test_a_subset_run_with_learned_rates_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"needs training.trained_parameters = 'all'"):
        small("training.meta_sgd=true", "training.trained_parameters=head")
