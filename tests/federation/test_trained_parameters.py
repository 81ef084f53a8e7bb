"""Parameter-efficient private training, and the participants' inner loop as configured.

``training.trained_parameters`` names the meta-parameters the rounds update (the output layer, or
the per-layer normalisation scale and shift with it): a participant's rows hold only those, the
server's noise and optimizer act on only those, and the others keep their initial values. The
participants' inner loop is the configured one, guards included (core/fedmeta/adaptation.py).
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from fedmeta.client.gradients import gradient_reply
from fedmeta.client_config import client_config
from fedmeta.config import ConfigError
from fedmeta.config_io import load_config
from fedmeta.metalearning import ConvNet4, SinusoidMLP, param_spec, trained_coordinates
from fedmeta.protocol import GradientRequest
from fedmeta.server.outputs import format_summary
from fedmeta.server.startup import FederationError
from fedmeta.workload import build_model, initial_params

from .fakes import fake_ledger, opener
from .test_reliability import StopAfter
from .test_round import run, small


@pytest.mark.unit
def test_the_subsets_are_the_head_and_the_normalisation_scale_and_shift() -> None:
    net = ConvNet4(5)
    spec = param_spec(net)
    assert trained_coordinates(net, "all") is None
    head = trained_coordinates(net, "head")
    assert head is not None and head.numel() == 64 * 5 + 5
    both = trained_coordinates(net, "norm_and_head")
    assert both is not None and both.numel() == 4 * 2 * 64 + 64 * 5 + 5
    assert both.unique().numel() == both.numel() and int(both.max()) < spec.numel
    # The head is the flat vector's last block (named_parameters order).
    assert head.tolist() == list(range(spec.numel - 325, spec.numel))
    mlp = SinusoidMLP()
    sin_head = trained_coordinates(mlp, "head")
    assert sin_head is not None and sin_head.numel() == 41
    with pytest.raises(ValueError, match="no normalisation layers"):
        trained_coordinates(mlp, "norm_and_head")
    with pytest.raises(ValueError, match="no normalisation layers"):
        trained_coordinates(ConvNet4(5, norm="none"), "norm_and_head")


@pytest.mark.unit
def test_the_configuration_refuses_a_subset_the_model_lacks() -> None:
    with pytest.raises(ConfigError, match=r"training.trained_parameters = 'norm_and_head'"):
        load_config(None, ["training.trained_parameters=norm_and_head"])
    assert load_config(None, ["training.trained_parameters=head"]).training.trained_parameters


def _rows(*sets: str, clip: float | None = 1.0) -> np.ndarray:
    cfg = load_config(None, ["dataset.tasks_per_participant=8", *sets])
    params = initial_params(cfg, build_model(cfg)).numpy().astype(np.float32)
    sent = client_config(cfg).model_dump_json()
    reply = gradient_reply(GradientRequest("r", 0, (0, 1, 2), clip, params, sent), "0")
    assert reply.grads is not None
    return reply.grads


@pytest.mark.integration
def test_a_participant_trains_with_the_configured_inner_loop_guards() -> None:
    """The guards act at training as at test (a merge once dropped them from the participant)."""
    no_step = _rows("training.inner_steps=0")
    plain = _rows("training.inner_lr=10", "training.inner_step_check=false")
    checked = _rows("training.inner_lr=10")  # every step at rate 10 raises the support loss
    clipped = _rows("training.inner_grad_clip=1e-12", "training.inner_step_check=false")
    assert not np.allclose(plain, no_step, atol=1e-3)
    np.testing.assert_allclose(checked, no_step, atol=1e-6)  # each step refused: phi itself
    np.testing.assert_allclose(clipped, no_step, atol=1e-6)  # a step of 1e-11 at most


@pytest.mark.integration
def test_a_participant_sends_only_the_trained_coordinates() -> None:
    full = _rows(clip=None)
    head = _rows("training.trained_parameters=head", clip=None)
    assert head.shape == (3, 41)
    np.testing.assert_allclose(head, full[:, -41:], rtol=1e-5, atol=1e-7)
    clipped = _rows("training.trained_parameters=head", clip=1e-3)
    assert np.linalg.norm(clipped, axis=1).max() <= 1e-3 * (1 + 1e-5)  # C bounds the subset


@pytest.mark.integration
def test_rounds_move_only_the_trained_parameters_and_resume_exactly(tmp_path: Path) -> None:
    from fedmeta.server.app import execute
    from fedmeta.simulation.local_grid import InProcessGrid

    cfg = small("rounds=3", "training.checkpoint_every=100", "privacy.insecure_test_seed=7",
                "training.trained_parameters=head")  # fmt: skip
    straight = run(cfg, tmp_path / "straight", fake_ledger(100.0, 0.1))
    ledger, stop = fake_ledger(100.0, 0.1), threading.Event()
    execute(cfg, InProcessGrid(cfg.federation.participants), out_dir=tmp_path / "resumed",
            observers=[StopAfter(1, stop)], echo=False, open_ledger=opener(ledger),
            stop=stop)  # fmt: skip
    other = small("rounds=3", "training.checkpoint_every=100", "privacy.insecure_test_seed=7")
    with pytest.raises(FederationError, match=r"trained_parameters = 'head', this configuration"):
        run(other, tmp_path / "resumed", ledger, resume=True)  # Adam's state is the head's
    assert run(cfg, tmp_path / "resumed", ledger, resume=True).rounds_run == 2
    final = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)
    before = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=True)
    assert torch.equal(final["params"], before["params"])  # optimizer state of the subset resumed
    start = initial_params(cfg, build_model(cfg))
    moved = torch.nonzero(final["params"] != start).flatten()
    assert moved.numel() > 0 and int(moved.min()) >= start.numel() - 41  # the head alone
    summary = straight.summary
    assert summary["trained_parameters"] == {"which": "head", "count": 41, "of": start.numel()}
    assert f"head, 41 of {start.numel():,} meta-parameters" in format_summary(summary)
