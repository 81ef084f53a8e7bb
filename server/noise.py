"""Gaussian noise for the sum of clipped per-task gradients; the mechanism returns its event.

The release of one round is ``sum_i clip(g_i) + N(0, (z C)^2 I)`` (DP-MAML Algorithm 1; Abadi et al.
2016), with one noise draw per round over the whole flat vector. Noise comes from a
``torch.Generator`` seeded with 63 bits from :mod:`secrets` (the operating system's CSPRNG), so
nobody can regenerate and subtract it from a published model. A reproducible seed exists for tests
only: it is passed as ``insecure_test_seed`` and the resulting generator is labelled
``secure=False`` in every output.

Caveat (stated, not hidden): torch's CPU generator is a Mersenne Twister; the secret is its seed.
Opacus's "secure mode" additionally uses a CSPRNG for the draws themselves (torchcsprng); that
library is unmaintained, so fedmeta relies on the secret seed.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class NoiseSource:
    """A torch generator for privacy noise and whether its seed is secret."""

    generator: torch.Generator
    secure: bool

    @classmethod
    def create(cls, insecure_test_seed: int | None = None) -> NoiseSource:
        """A secretly seeded generator, or (tests only) a reproducible one labelled insecure."""
        gen = torch.Generator(device="cpu")
        if insecure_test_seed is None:
            gen.manual_seed(secrets.randbits(63))
            return cls(gen, True)
        gen.manual_seed(int(insecure_test_seed))
        return cls(gen, False)


@dataclass(frozen=True)
class NoisedSum:
    """The noised sum and the accounting event of the mechanism that produced it."""

    value: Tensor
    event: Any  # accounting.GaussianRound
    noise_std: float


def gaussian_noise(dim: int, std: float, source: NoiseSource) -> Tensor:
    """``N(0, std^2 I_dim)`` in float64 on the CPU (summed in float64, cast by the caller)."""
    if not std >= 0:
        raise ValueError(f"std must be >= 0; got {std}")
    return torch.normal(
        0.0, float(std), size=(int(dim),), generator=source.generator, dtype=torch.float64
    )


def noised_sum(total: Tensor, *, clip: float, event: Any, source: NoiseSource) -> NoisedSum:
    """Add ``N(0, (z C)^2 I)`` to ``total`` (the sum of clipped gradients), ``z`` from ``event``.

    ``event`` is the accounting ``GaussianRound`` this release is accounted as; the noise multiplier
    is read from it, so the noise drawn and the event spent cannot disagree. The caller records the
    spend in the ledger *before* calling this function.
    """
    z = float(event.noise_multiplier)
    if not z > 0:
        raise ValueError(f"noise_multiplier must be > 0; got {z}")
    if not clip > 0:
        raise ValueError(f"clip must be > 0; got {clip}")
    std = z * float(clip)
    value = total.to(torch.float64) + gaussian_noise(total.numel(), std, source).reshape(
        total.shape
    )
    return NoisedSum(value, event, std)
