"""The meta-optimizers: DP-AdamBC's correction, the schedules, state through a checkpoint."""

from __future__ import annotations

import io

import pytest
import torch

from fedmeta.config_io import load_config
from fedmeta.server.optimizer import AdamBC, learning_rate
from fedmeta.server.round import TrainingState

pytestmark = pytest.mark.unit


def test_adam_bc_removes_the_noise_variance_from_the_second_moment() -> None:
    """Pure noise (no signal): DP-Adam's steps shrink to ~lr*m/sigma; a signal with the same noise
    keeps Adam's sign-like step only with the correction (Tang et al. 2024)."""
    gen = torch.Generator().manual_seed(0)  # test data only
    signal, sigma, steps = 0.05, 1.0, 3000
    moves = {}
    for name in ("adam", "adam_bc"):
        p = torch.zeros(200, requires_grad=True)
        opt = (torch.optim.Adam([p], lr=1e-3) if name == "adam"
               else AdamBC([p], lr=1e-3, phi=sigma**2, floor=1e-4))  # fmt: skip
        for _ in range(steps):
            p.grad = signal + sigma * torch.randn(200, generator=gen)
            opt.step()
        moves[name] = float(-p.detach().mean())
    # Adam's effective step is ~ lr * signal / sigma; corrected, ~ lr * signal / |signal|.
    assert moves["adam"] == pytest.approx(steps * 1e-3 * signal / sigma, rel=0.35)
    assert moves["adam_bc"] > 3 * moves["adam"]


def test_adam_bc_equals_adam_without_noise_and_validates() -> None:
    a = torch.ones(5, requires_grad=True)
    b = torch.ones(5, requires_grad=True)
    adam = torch.optim.Adam([a], lr=0.1, eps=0.0)
    bc = AdamBC([b], lr=0.1, phi=0.0, floor=1e-30)
    for g in (torch.tensor([1.0, -2, 3, 0.5, 4]), torch.tensor([0.3, 2, -1, 1, 1])):
        a.grad, b.grad = g.clone(), g.clone()
        adam.step()
        bc.step()
    assert torch.allclose(a, b, atol=1e-6)
    with pytest.raises(ValueError, match="floor > 0"):
        AdamBC([b], lr=0.1, phi=1.0, floor=0.0)


def test_schedules() -> None:
    sets = ["training.meta_lr=1.0", "training.lr_schedule=cosine", "training.warmup_rounds=4",
            "training.lr_min_factor=0.1"]  # fmt: skip
    cfg = load_config(None, sets).training
    rates = [learning_rate(cfg, t, 104) for t in range(104)]
    assert rates[:4] == [0.2, 0.4, 0.6, 0.8] and rates[4] == pytest.approx(1.0)
    assert rates[-1] == pytest.approx(0.1, abs=1e-3) and all(
        x >= y for x, y in zip(rates[4:], rates[5:], strict=False)
    )
    constant = load_config(None, ["training.meta_lr=0.5"]).training
    assert {learning_rate(constant, t, 10) for t in range(10)} == {0.5}


@pytest.mark.parametrize("name", ["adam", "adam_bc", "sgd", "adam_floor"])
def test_state_survives_a_checkpoint(name: str) -> None:
    cfg = load_config(None, [f"training.optimizer={name}"]).training
    one = TrainingState(torch.zeros(4), cfg, noise_variance=0.01, planned_rounds=10)
    for i in range(3):
        one.step(torch.full((4,), 0.1 * (i + 1)), i)
    buf = io.BytesIO()
    torch.save(one.optimizer.state_dict(), buf)
    buf.seek(0)
    two = TrainingState(one.params.detach(), cfg, noise_variance=0.01, planned_rounds=10,
                        optimizer_state=torch.load(buf, weights_only=True))  # fmt: skip
    one.step(torch.full((4,), 0.5), 3)
    two.step(torch.full((4,), 0.5), 3)
    assert torch.equal(one.params, two.params)


def test_a_non_finite_model_stops_the_run_with_the_fix_named() -> None:
    from fedmeta.server.round import TrainingDiverged

    cfg = load_config(None, ["training.optimizer=sgd", "training.meta_lr=1.0",
                             "training.momentum=0"]).training  # fmt: skip
    state = TrainingState(torch.zeros(4), cfg, planned_rounds=10)
    state.step(torch.full((4,), 3e38), 0)  # finite
    with pytest.raises(TrainingDiverged, match="round 2: .*training.meta_lr"):
        state.step(torch.full((4,), 3e38), 1)  # -3e38 - 3e38 overflows float32


def test_adam_bc_steps_at_most_sqrt2_times_adams_by_default() -> None:
    """With the default floor (Phi), a noise-only coordinate does not get a huge step."""
    torch.manual_seed(0)  # test data only
    phi = 1e-4
    cfg_bc = load_config(None, ["training.optimizer=adam_bc", "training.meta_lr=0.01"]).training
    cfg_adam = load_config(None, ["training.optimizer=adam", "training.meta_lr=0.01"]).training
    bc = TrainingState(torch.zeros(1000), cfg_bc, noise_variance=phi, planned_rounds=100)
    adam = TrainingState(torch.zeros(1000), cfg_adam, noise_variance=phi, planned_rounds=100)
    for t in range(50):
        noise = torch.randn(1000) * phi**0.5
        before_bc, before_adam = bc.params.detach().clone(), adam.params.detach().clone()
        bc.step(noise, t)
        adam.step(noise, t)
        step_bc = (bc.params.detach() - before_bc).abs()
        step_adam = (adam.params.detach() - before_adam).abs()
        assert bool((step_bc <= 2**0.5 * step_adam + 1e-7).all())


def test_adam_floor_shrinks_noise_only_steps_and_keeps_signal_steps() -> None:
    """eps = k * sigma: a coordinate of pure noise moves about 1/(1+k) of Adam's distance, one
    whose signal dwarfs the noise keeps Adam's step (server/fedmeta/server/optimizer.py's
    argument)."""
    from fedmeta.server.optimizer import NoiseFloorAdam

    gen = torch.Generator().manual_seed(0)  # test data only
    sigma, steps = 1.0, 2000
    travelled = {}
    for name in ("adam", "floor"):
        p = torch.zeros(400, requires_grad=True)
        opt = (torch.optim.Adam([p], lr=1e-3) if name == "adam"
               else NoiseFloorAdam([p], lr=1e-3, phi=sigma**2, factor=3.0))  # fmt: skip
        path = torch.zeros(400)
        for _ in range(steps):
            p.grad = sigma * torch.randn(400, generator=gen)
            before = p.detach().clone()
            opt.step()
            path += (p.detach() - before).abs()
        travelled[name] = float(path.mean())
    # With k = 3 a noise-only step is at most 1/(1+3) of sqrt(v)-normalised Adam's, up to the
    # fluctuation of sqrt(v) around sigma; 0.4 leaves room for that.
    assert travelled["floor"] < 0.4 * travelled["adam"]
    strong = torch.zeros(1, requires_grad=True)
    opt = NoiseFloorAdam([strong], lr=1e-3, phi=1e-8, factor=3.0)  # sigma 1e-4 << signal 1
    for _ in range(10):
        strong.grad = torch.ones(1)
        opt.step()
    assert float(-strong.detach()) == pytest.approx(10 * 1e-3, rel=1e-3)
