"""The sample-level inner loop audited on a support canary, with negative controls (issue 53).

The bound treats each task's noisy adapted parameters as released (docs/privacy.md, "Sample level
(issue 53): the bound"); the run never releases them, so this audit reads them where the
participant computes them: ``metalearning.sample_level.noisy_adapt`` with the participant's own
generator (``client.sample_gradients.round_generator``: AES-CTR keyed from the OS's CSPRNG). The
model is tests/federation/sample_release_audit.py's one weight under squared error; D's support set
holds the canary (its gradient far over the clip, so clipped it is ``-C_in``), D' holds nothing.
One step (K = 1) at public normaliser ``n = 1`` and rate ``alpha``: ``(theta - phi) / -alpha`` is
``-C_in + N(0, (z_in C_in)^2)`` on D and ``N(0, (z_in C_in)^2)`` on D', i.e. ``mu = 1 / z_in``.

At ``z_in = 2`` (``m = 1``, ``z_out`` far larger, so the event's ``mu`` is the inner one, 0.5:
epsilon 0.919 at delta 1e-2) the windows and trial counts are those of
tests/federation/test_sample_release_audit.py scaled by ``C_in / (m C_out) = 1/2`` (the same
Gaussian pair up to scale): at 6,000 trials the halved inner noise is caught, 1.47 against a bar
of 1.10 (0.1% quantile of the power analysis); the skipped inner clip by more than a whole
epsilon. Measured (one run of the slow test): halved inner noise 1.84 against 1.10.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from fedmeta.accounting.sample_level_bound import sample_level_epsilon
from fedmeta.client.sample_gradients import round_generator
from fedmeta.client_config import ClientSampleLevel
from fedmeta.metalearning import sample_level as sample_mod
from fedmeta.metalearning.example_slots import MaskedTasks
from fedmeta.metalearning.sample_level import SampleLevelSteps, noisy_adapt, per_example_grads

from .release_audit import lower_bound, patched
from .sample_release_audit import CANARY, Line, event

DELTA = 1e-2
CAUGHT = 1.2
ALPHA = 0.01
ROUND = event(1, 1000.0, z_in=2.0)
PART = ClientSampleLevel(example_rate=1.0, max_appearances=1, tasks_per_pass=1,
                         support_share=0.5, inner_clip=1.0, inner_noise_multiplier=2.0,
                         support_normaliser=1)  # fmt: skip
NEAR = (-math.inf, -2.25)  # the outer audit's window below -4.5, at scale 1/2


def _support(with_canary: bool) -> MaskedTasks:
    """One task: the canary alone in its support set, or an empty (padded) support set."""
    x, y = (torch.tensor([[[CANARY[0]]]]), torch.tensor([[[CANARY[1]]]]))
    mask = torch.tensor([[with_canary]])
    empty = torch.zeros((1, 1), dtype=torch.bool)
    return MaskedTasks(x, y, mask, x, y, empty)


def steps_taken(with_canary: bool, trials: int) -> np.ndarray:
    """``(theta - phi) / alpha`` of ``trials`` independent inner steps (each its own generator)."""
    model = Line()
    grads_of = per_example_grads(model)
    params = {"w": torch.zeros(1)}
    steps = SampleLevelSteps(1, ALPHA, PART.inner_clip, PART.inner_noise_multiplier,
                             PART.support_normaliser, 1.0)  # fmt: skip
    tasks = _support(with_canary)
    out = np.empty(trials)
    with torch.no_grad():
        for i in range(trials):
            adapted, _ = noisy_adapt(grads_of, params, tasks, steps, round_generator(PART, i, "t"))
            out[i] = float(adapted["w"][0, 0]) / -ALPHA  # the step is -alpha x (noisy sum)
    return out


def _halved(rng: np.random.Generator, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape) * 0.5).to(like)


def _unclipped(g: torch.Tensor, clip: float, *, nonfinite: str = "raise") -> Any:
    return g, torch.linalg.vector_norm(g, dim=1)


def _bound(trials: int, window: tuple[float, float]) -> float:
    # The canary's clipped gradient is -C_in: the step divided by -alpha is -C_in + noise.
    return lower_bound(steps_taken(True, trials), steps_taken(False, trials), window, DELTA)


@pytest.mark.integration
def test_the_inner_step_stays_within_its_epsilon_and_a_skipped_clip_is_caught() -> None:
    claim = sample_level_epsilon(ROUND, 1, DELTA)
    assert claim == pytest.approx(0.919, abs=2e-3)  # mu = 1 / z_in = 0.5
    assert _bound(1_000, NEAR) < claim
    with patched(sample_mod, "clip_by_global_norm", _unclipped):
        skipped = _bound(400, (-math.inf, -100.0))  # the raw gradient is -2000
    assert skipped > CAUGHT * claim, (skipped, claim)


@pytest.mark.slow
def test_halved_inner_noise_is_caught() -> None:
    claim = sample_level_epsilon(ROUND, 1, DELTA)
    assert _bound(6_000, NEAR) < claim
    with patched(sample_mod, "standard_normal", _halved):
        halved = _bound(6_000, NEAR)
    assert halved > CAUGHT * claim, (halved, claim)
    print({"halved": round(halved, 3), "claim": round(claim, 3)})
