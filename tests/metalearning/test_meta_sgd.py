"""Meta-SGD: one learned inner rate per meta-parameter (Li et al. 2017, Eq. 1).

References are computed independently of the code under test: plain MAML on the same model (the
rates start at ``inner_lr``, so the two must agree), the closed form of the first-order rate
gradient, and central finite differences of the adapted query loss in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

import fedmeta.metalearning as ml
from fedmeta.adaptation import adaptation_summary
from fedmeta.config import ConfigError
from fedmeta.config_io import load_config
from fedmeta.config_training import TrainingConfig
from fedmeta.metalearning import INNER_RATES, Task, inner_rates, with_learned_inner_rates
from fedmeta.workload import build_model, initial_params

pytestmark = pytest.mark.unit

LR = 0.05


def _sinusoid_tasks(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> Task:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 10, 1, generator=g, dtype=dtype) * 10 - 5
    phase = torch.rand(n, 1, 1, generator=g, dtype=dtype) * math.pi
    qx = torch.rand(n, 10, 1, generator=g, dtype=dtype) * 10 - 5
    return Task(x, 3 * torch.sin(x + phase), qx, 3 * torch.sin(qx + phase))


def _image_tasks(n: int, ways: int = 3) -> Task:
    g = torch.Generator().manual_seed(1)
    sx = torch.randn(n, ways, 1, 28, 28, generator=g)
    qx = torch.randn(n, 2 * ways, 1, 28, 28, generator=g)
    labels = torch.arange(ways)
    return Task(sx, labels.repeat(n, 1), qx, labels.repeat(n, 2))


def _pair(model: torch.nn.Module, lr: float = LR) -> tuple[dict, torch.nn.Module, dict]:
    """Plain params, the same model with learned rates, and its params (rates at ``lr``)."""
    plain = ml.init_params(model, 0)
    meta_model = with_learned_inner_rates(model, lr)
    return plain, meta_model, ml.init_params(meta_model, 0)


def _tolerance(dtype: torch.dtype, scale: float = 1e3) -> float:
    # The two computations differ only in rounding (lr * g against lr_tensor * g), a few ulps per
    # operation amplified by the network's depth: scale * machine epsilon, relative.
    return scale * torch.finfo(dtype).eps


def test_rates_are_the_flat_vectors_tail_and_start_at_inner_lr() -> None:
    plain, model, params = _pair(ml.SinusoidMLP())
    names = list(params)
    d = sum(v.numel() for v in plain.values())
    assert names[: len(plain)] == list(plain)  # the model's own parameters first, unchanged
    assert all(n.startswith(INNER_RATES + ".") for n in names[len(plain) :])
    assert ml.param_spec(model).numel == 2 * d
    rates = inner_rates(params)
    assert rates is not None and set(rates) == set(plain)
    assert all(r.shape == plain[n].shape and bool((r == LR).all()) for n, r in rates.items())
    for n in plain:  # the same draws for the model's own parameters
        assert torch.equal(params[n], plain[n])
    assert inner_rates(plain) is None
    with pytest.raises(ValueError, match="already has learned inner rates"):
        with_learned_inner_rates(model, LR)


@pytest.mark.parametrize("method", ["loop", "vmap"])
@pytest.mark.parametrize("first_order", [True, False])
def test_at_their_initial_value_the_rates_give_plain_mamls_gradient(
    method: str, first_order: bool
) -> None:
    plain, model, params = _pair(ml.SinusoidMLP())
    tasks = _sinusoid_tasks(4)
    kw = {"inner_steps": 3, "inner_lr": LR, "first_order": first_order, "device": "cpu",
          "method": method}  # fmt: skip
    want = ml.per_task_grads(ml.SinusoidMLP(), plain, tasks, **kw)
    got = ml.per_task_grads(model, params, tasks, **kw)
    d = want.shape[1]
    assert got.shape == (4, 2 * d)
    torch.testing.assert_close(got[:, :d], want, rtol=_tolerance(want.dtype), atol=1e-6)
    assert bool((got[:, d:].abs().sum(dim=1) > 0).all())  # every task moves the rates


def test_the_fused_conv_path_agrees_with_plain_maml() -> None:
    """ConvNet4's loop path reads the parameters by name (fused_forward): the rates must not upset
    it."""
    plain, model, params = _pair(ml.ConvNet4(3, hidden=8), lr=0.4)
    tasks = _image_tasks(2)
    kw = {"inner_steps": 2, "inner_lr": 0.4, "first_order": True, "device": "cpu"}
    want = ml.per_task_grads(ml.ConvNet4(3, hidden=8), plain, tasks, method="loop", **kw)
    loop = ml.per_task_grads(model, params, tasks, method="loop", **kw)
    vmap = ml.per_task_grads(model, params, tasks, method="vmap", **kw)
    d = want.shape[1]
    torch.testing.assert_close(loop[:, :d], want, rtol=_tolerance(want.dtype), atol=1e-6)
    torch.testing.assert_close(loop, vmap, rtol=_tolerance(want.dtype), atol=1e-6)


def test_first_order_rate_gradient_is_minus_support_times_query_gradient() -> None:
    """One step, first order: theta' = theta - alpha * g_s, so dL_q/dalpha = -g_s * g_q(theta')."""
    plain, model, params = _pair(ml.SinusoidMLP())
    tasks = _sinusoid_tasks(3)
    got = ml.per_task_grads(model, params, tasks, inner_steps=1, inner_lr=LR, first_order=True,
                            device="cpu", method="loop")  # fmt: skip
    rates = inner_rates(params)
    assert rates is not None
    tail_names = list(rates)  # the order of the rate tail of the flat vector
    net = ml.SinusoidMLP()
    for i in range(3):
        t = tasks.task(i)
        p = {n: v.clone().requires_grad_(True) for n, v in plain.items()}
        loss_s = torch.nn.functional.mse_loss(torch.func.functional_call(net, p, (t.support_x,)),
                                              t.support_y)  # fmt: skip
        g_s = dict(zip(p, torch.autograd.grad(loss_s, list(p.values())), strict=True))
        q = {n: (plain[n] - LR * g_s[n]).detach().requires_grad_(True) for n in plain}
        loss_q = torch.nn.functional.mse_loss(torch.func.functional_call(net, q, (t.query_x,)),
                                              t.query_y)  # fmt: skip
        g_q = dict(zip(q, torch.autograd.grad(loss_q, list(q.values())), strict=True))
        want = torch.cat([(-g_s[n] * g_q[n]).reshape(-1) for n in tail_names])
        d = sum(v.numel() for v in plain.values())
        torch.testing.assert_close(got[i, d:], want, rtol=_tolerance(want.dtype), atol=1e-7)


@pytest.mark.parametrize("method", ["loop", "vmap"])
def test_second_order_rate_gradient_matches_finite_differences(method: str) -> None:
    """In float64 the exact (second-order) rate gradient matches central differences of the adapted
    query loss (task_scores of a regression task is that loss), on both gradient paths."""
    _, model, params = _pair(ml.SinusoidMLP().double())
    params = {n: v.double() for n, v in params.items()}
    tasks = _sinusoid_tasks(1, dtype=torch.float64)
    kw = {"inner_steps": 2, "inner_lr": LR, "device": "cpu", "method": method}
    grad = ml.per_task_grads(model, params, tasks, first_order=False, **kw)[0]
    names, shapes = ml.param_spec(model).names, ml.param_spec(model).shapes
    flat = ml.flatten_params(params).double()
    d = flat.numel() // 2
    h = 1e-6
    picks = [d, d + 7, d + 40, 2 * d - 1]  # coordinates of the rate tail

    def loss(vec: torch.Tensor) -> float:
        p = ml.unflatten_params(vec, ml.ParamSpec(names, shapes))
        return float(ml.task_scores(model, p, tasks, **kw)[0])

    for i in picks:
        e = torch.zeros_like(flat)
        e[i] = h
        fd = (loss(flat + e) - loss(flat - e)) / (2 * h)
        # Central differences err by O(h^2 f''') and by O(eps * f / h) from rounding.
        assert math.isclose(float(grad[i]), fd, rel_tol=1e-5, abs_tol=1e-7), (i, grad[i], fd)


@pytest.mark.parametrize("method", ["loop", "vmap"])
def test_a_zero_rate_leaves_its_parameter_unadapted(method: str) -> None:
    _, model, params = _pair(ml.SinusoidMLP())
    zero = {n: torch.zeros_like(v) if n.startswith(INNER_RATES) else v for n, v in params.items()}
    tasks = _sinusoid_tasks(4)
    kw = {"inner_lr": LR, "device": "cpu", "method": method}
    adapted = ml.task_scores(model, zero, tasks, inner_steps=5, **kw)
    unadapted = ml.task_scores(model, zero, tasks, inner_steps=0, **kw)
    # The loop evaluates the same parameters the same way: equal. Under vmap the adapted
    # parameters are batched per task, so the forward pass sums in another order: rounding only.
    tol = 0.0 if method == "loop" else _tolerance(torch.float32, 10)
    torch.testing.assert_close(adapted, unadapted, rtol=tol, atol=0.0)
    moved = ml.task_scores(model, params, tasks, inner_steps=5, **kw)
    assert float((moved - unadapted).abs().min()) > 1e-3


def test_the_configuration_builds_the_model_with_rates_and_says_so() -> None:
    cfg = load_config(None, ["training.meta_sgd=true", "training.inner_lr=0.02",
                             "training.optimizer=sgd"])  # fmt: skip
    plain = load_config(None, [])
    start, start_plain = initial_params(cfg, build_model(cfg)), initial_params(plain,
                                                                               build_model(plain))
    assert start.numel() == 2 * start_plain.numel()
    torch.testing.assert_close(start[: start_plain.numel()], start_plain, rtol=0, atol=0)
    assert bool((start[start_plain.numel() :] == torch.tensor(0.02)).all())
    summary = adaptation_summary(cfg.training)
    assert summary["learned_inner_rates"] is True
    assert adaptation_summary(plain.training)["learned_inner_rates"] is False


def test_a_test_time_rate_or_a_subset_is_refused_with_learned_rates() -> None:
    with pytest.raises(ValidationError, match=r"training.eval_inner_lr must be unset"):
        TrainingConfig(meta_sgd=True, eval_inner_lr=0.1)
    with pytest.raises(ValidationError, match=r"needs training.trained_parameters = 'all'"):
        TrainingConfig(meta_sgd=True, trained_parameters="head")
    assert TrainingConfig(meta_sgd=True, eval_inner_steps=5).eval_inner_steps == 5


def test_adam_steps_that_could_turn_a_rate_negative_are_refused() -> None:
    """Adam moves each rate by about meta_lr a round; over the rounds the walk must stay within a
    quarter of the starting rate (the measured design, 0.003 over 300 rounds from 0.4, passes)."""
    measured = ["training.meta_sgd=true", "training.inner_lr=0.4", "training.meta_lr=0.003",
                "rounds=300"]  # fmt: skip
    assert load_config(None, measured).training.meta_sgd
    with pytest.raises(ConfigError, match=r"meta_lr x sqrt\(rounds\) = 0.104 must be at most"):
        load_config(None, [*measured, "rounds=1200"])  # 0.003 x sqrt(1200) > 0.4 / 4
    for optimizer in ("adam", "adam_bc", "adam_floor"):
        with pytest.raises(ConfigError, match=rf"optimizer = '{optimizer}'"):
            load_config(None, ["training.meta_sgd=true", f"training.optimizer={optimizer}"])
    sgd = load_config(None, ["training.meta_sgd=true", "training.optimizer=sgd"])
    assert sgd.training.optimizer == "sgd"  # SGD's step scales with the gradient: not refused
