"""The sinusoid regression benchmark of MAML (Finn et al. 2017, Section 5.1).

Its data is generated from the family's parameters and a seed; nothing is read from disk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fedmeta.metalearning.tasks import Task, seeded_rng, stack_tasks

__all__ = ["SinusoidTasks"]


@dataclass(frozen=True)
class SinusoidTasks:
    """Sinusoid regression tasks y = A sin(x - phase) (Finn et al. 2017, Section 5.1).

    ``k_support`` and ``k_query`` points per task, x uniform in ``x_range``; amplitude and phase
    uniform in their ranges.
    """

    k_support: int = 10
    k_query: int = 10
    amplitude_range: tuple[float, float] = (0.1, 5.0)
    phase_range: tuple[float, float] = (0.0, math.pi)
    x_range: tuple[float, float] = (-5.0, 5.0)

    def __post_init__(self) -> None:
        if self.k_support < 1 or self.k_query < 1:
            raise ValueError(
                f"k_support and k_query must be >= 1; got {self.k_support}, {self.k_query}"
            )
        for name in ("amplitude_range", "phase_range", "x_range"):
            lo, hi = getattr(self, name)
            if not lo <= hi:
                raise ValueError(f"{name} must be (low, high) with low <= high; got {(lo, hi)}")

    def task_from_rng(self, rng: np.random.Generator) -> tuple[Task, float, float]:
        """One task and its (amplitude, phase), drawn from ``rng``."""
        amp = rng.uniform(*self.amplitude_range)
        phase = rng.uniform(*self.phase_range)
        x = rng.uniform(*self.x_range, size=(self.k_support + self.k_query, 1))
        y = amp * np.sin(x - phase)
        xt = torch.from_numpy(x.astype(np.float32))
        yt = torch.from_numpy(y.astype(np.float32))
        k = self.k_support
        return Task(xt[:k], yt[:k], xt[k:], yt[k:]), float(amp), float(phase)

    def sample(self, n_tasks: int, seed: int) -> Task:
        """``n_tasks`` tasks as one batch; task i is a function of ``(seed, i)`` only."""
        return stack_tasks(
            [self.task_from_rng(seeded_rng(seed, 0x51, i))[0] for i in range(n_tasks)]
        )
