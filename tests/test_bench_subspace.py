"""bench/subspace.py's measure of what a public gradient subspace keeps (issue 42, item 3)."""

from __future__ import annotations

import math

import pytest
import torch
from tests.bench_scripts import bench_script

pytestmark = pytest.mark.unit


def test_kept_is_one_in_the_gradients_span_and_zero_orthogonal_to_it() -> None:
    kept = bench_script("subspace")._kept
    gen = torch.Generator().manual_seed(0)
    grads = torch.zeros(50, 10, dtype=torch.float64)
    grads[:, :3] = 0.1 * torch.randn(50, 3, generator=gen, dtype=torch.float64) + 0.05
    eye = torch.eye(10, dtype=torch.float64)
    assert kept(eye[:3], grads, clip=1.0) == pytest.approx(1.0)  # norms < 1: nothing re-clipped
    assert kept(eye[3:], grads, clip=1.0) == pytest.approx(0.0, abs=1e-12)
    one = kept(eye[:1], grads, clip=1.0)  # one of the three directions: the first's share
    mean = grads.mean(dim=0)
    assert one == pytest.approx(float(abs(mean[0]) / mean.norm()))
    # Re-clipping in the subspace shortens, never lengthens, the kept mean.
    assert kept(eye[:3], grads, clip=0.01) <= kept(eye[:3], grads, clip=1.0) + 1e-12
    assert math.isfinite(one)
