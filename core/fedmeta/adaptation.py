"""The inner loop a configuration asks for, at training and at test, and how the summary states it.

Training and evaluation adapt the same way unless ``training.eval_inner_steps`` /
``training.eval_inner_lr`` say otherwise: a meta-model trained for one step and adapted for three
can be worse than untrained (the 20-way runs of docs/results.md), so a mismatch is a choice the
summary names, never a silent one. (The default job's 1 training and 10 test steps is such a
named mismatch: Finn et al. 2017's sinusoid protocol, kept because it is what was measured.) The
guards (``inner_grad_clip``, ``inner_step_check``,
:class:`fedmeta.metalearning.maml.InnerLoop`) are the same at both.
"""

from __future__ import annotations

import math
from typing import Any

from fedmeta.client_config import ClientTrainingConfig
from fedmeta.config_training import TrainingConfig


def inner_kwargs(cfg: TrainingConfig, *, evaluation: bool) -> dict[str, Any]:
    """Keyword arguments of ``per_task_clipped_grads`` (training) or ``evaluate`` (test)."""
    kwargs = training_inner_kwargs(cfg)
    if evaluation:
        if cfg.eval_inner_steps is not None:
            kwargs["inner_steps"] = cfg.eval_inner_steps
        if cfg.eval_inner_lr is not None:
            kwargs["inner_lr"] = cfg.eval_inner_lr
    return kwargs


def training_inner_kwargs(cfg: TrainingConfig | ClientTrainingConfig) -> dict[str, Any]:
    """The inner loop of training: what a participant runs with the settings it is sent."""
    return {
        "inner_steps": cfg.inner_steps,
        "inner_lr": cfg.inner_lr,
        "inner_grad_clip": math.inf if cfg.inner_grad_clip is None else cfg.inner_grad_clip,
        "step_check": cfg.inner_step_check,
    }


def adaptation_summary(cfg: TrainingConfig) -> dict[str, Any]:
    """The ``adaptation`` entry of ``summary.json``: both inner loops and whether they match."""
    train = inner_kwargs(cfg, evaluation=False)
    test = inner_kwargs(cfg, evaluation=True)
    matched = (train["inner_steps"], train["inner_lr"]) == (test["inner_steps"], test["inner_lr"])
    return {
        "train_steps": train["inner_steps"],
        "train_lr": train["inner_lr"],
        "eval_steps": test["inner_steps"],
        "eval_lr": test["inner_lr"],
        "matched": matched,
        "note": None
        if matched
        else "training and evaluation adapt differently (training.eval_inner_steps/eval_inner_lr)",
        "inner_grad_clip": cfg.inner_grad_clip,
        "step_check": cfg.inner_step_check,
        # Meta-SGD: the rates are learned per coordinate; train_lr/eval_lr are where they started.
        "learned_inner_rates": cfg.meta_sgd,
        # Which arithmetic the participants' gradients ran in (the clip is float32 in each).
        "precision": cfg.precision,
    }
