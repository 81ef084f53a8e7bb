"""The server's meta-optimizer: one step per round along the released, normalised noisy gradient.

Every step is post-processing of the noisy update and of public constants (the learning-rate
schedule, the noise variance that the configuration fixes), so the choice of optimizer costs no
privacy. Three are offered (``training.optimizer``):

* ``adam`` - Adam (Kingma and Ba 2015), DP-MAML's meta-optimizer.
* ``adam_bc`` - DP-AdamBC (Tang, Shpilevskiy and Lecuyer, AAAI 2024): the Gaussian noise adds a
  constant ``Phi = (z C / B)^2`` to every coordinate's second moment (``B`` the public normaliser),
  which turns DP-Adam into sign-free DP-SGD when the signal is weaker than the noise. The update
  divides by ``sqrt(max(v_hat - Phi, floor))`` instead of ``sqrt(v_hat) + eps``.
* ``sgd`` - SGD with (heavy-ball) momentum.
* ``adam_floor`` - Adam whose ``eps`` is ``training.adam_noise_floor`` times the noise std
  ``sqrt(Phi)``. Adam's step ``m / (sqrt(v) + eps)`` is about the learning rate on every
  coordinate whatever the signal: under DP noise ``sqrt(v) ~ sqrt(Phi)`` even where the true
  gradient is 0, so each coordinate takes a full-size step in a random direction (docs/results.md,
  the 20-way runs). With ``eps = k sqrt(Phi)`` a noise-only coordinate's step shrinks by about
  ``1 / (1 + k)``, while a coordinate whose signal is well above the noise keeps Adam's step.
  Unlike DP-AdamBC's subtraction it cannot divide by a small difference.

The learning rate follows ``training.lr_schedule``: ``constant``, or ``cosine`` decay to
``training.lr_min_factor`` of the base rate over the planned rounds, after
``training.warmup_rounds`` of linear warm-up.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from fedmeta.config_training import TrainingConfig


def learning_rate(cfg: TrainingConfig, step: int, planned: int) -> float:
    """The rate at 0-based ``step`` of ``planned`` steps."""
    base = cfg.meta_lr
    if step < cfg.warmup_rounds:
        return base * (step + 1) / (cfg.warmup_rounds + 1)
    if cfg.lr_schedule == "constant":
        return base
    span = max(planned - cfg.warmup_rounds, 1)
    progress = min((step - cfg.warmup_rounds) / span, 1.0)
    low = base * cfg.lr_min_factor
    return low + (base - low) * 0.5 * (1 + math.cos(math.pi * progress))


class NoiseFloorAdam(torch.optim.Adam):
    """Adam with ``eps = max(1e-8, factor * sqrt(phi))``; ``phi`` follows the round's noise."""

    def __init__(self, params: Any, lr: float, phi: float, factor: float) -> None:
        """``phi``: per-coordinate noise variance of the update; ``factor``: k in k sqrt(phi)."""
        if not (phi >= 0 and factor >= 0):
            raise ValueError(f"phi and factor must be >= 0; got {phi}, {factor}")
        super().__init__(params, lr=lr)
        for group in self.param_groups:
            group["phi"], group["noise_floor_factor"] = phi, factor

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Adam's step after setting each group's eps from its current noise variance."""
        for group in self.param_groups:
            group["eps"] = max(1e-8, group["noise_floor_factor"] * math.sqrt(group["phi"]))
        return super().step(closure)


class AdamBC(torch.optim.Optimizer):
    """DP-AdamBC: Adam whose second moment is corrected for the known DP noise variance ``phi``."""

    def __init__(
        self,
        params: Any,
        lr: float,
        phi: float,
        floor: float,
        betas: tuple[float, float] = (0.9, 0.999),
    ) -> None:
        """``phi``: per-coordinate noise variance of the update; ``floor``: gamma' of the paper."""
        if not (phi >= 0 and floor > 0):
            raise ValueError(f"phi must be >= 0 and floor > 0; got {phi}, {floor}")
        super().__init__(params, {"lr": lr, "betas": betas, "phi": phi, "floor": floor})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One DP-AdamBC step."""
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float64)
                    state["m"] = torch.zeros_like(p, dtype=torch.float64)
                    state["v"] = torch.zeros_like(p, dtype=torch.float64)
                state["step"] += 1
                t = float(state["step"])
                g = p.grad.to(torch.float64)
                state["m"].mul_(beta1).add_(g, alpha=1 - beta1)
                state["v"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                m_hat = state["m"] / (1 - beta1**t)
                v_hat = state["v"] / (1 - beta2**t)
                denom = (v_hat - group["phi"]).clamp_min(group["floor"]).sqrt_()
                p.add_((m_hat / denom).to(p.dtype), alpha=-group["lr"])


def make_optimizer(
    params: Tensor, cfg: TrainingConfig, noise_variance: float
) -> torch.optim.Optimizer:
    """The configured optimizer over ``params``; ``noise_variance`` is Phi (0 when not private)."""
    if cfg.optimizer == "adam":
        return torch.optim.Adam([params], lr=cfg.meta_lr)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD([params], lr=cfg.meta_lr, momentum=cfg.momentum)
    if cfg.optimizer == "adam_floor":
        return NoiseFloorAdam([params], cfg.meta_lr, noise_variance, cfg.adam_noise_floor)
    floor = cfg.adam_bc_floor if cfg.adam_bc_floor is not None else max(noise_variance, 1e-12)
    return AdamBC([params], lr=cfg.meta_lr, phi=noise_variance, floor=floor)
