"""Private rounds in a public subspace: sensitivity, equivalence, refusal, an e2e run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.federation.test_public_warm_start import _tiny_omniglot

from fedmeta.accounting import GaussianRound, TwoStagePoissonScheme
from fedmeta.checkpoint import load_checkpoint
from fedmeta.config import ConfigError
from fedmeta.config_io import load_config
from fedmeta.metalearning.public_basis import top_directions
from fedmeta.server.noise import NoiseSource, noised_sum
from fedmeta.server.subspace import PublicSubspace, Subspace, gamma, public_subspace
from fedmeta.simulation.simulate import main
from fedmeta.workload import build_workload


def _orthonormal(d: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))
    return q


@pytest.mark.unit
@settings(max_examples=60, deadline=None)
@given(d=st.integers(1, 60), k_frac=st.floats(0.0, 1.0), seed=st.integers(0, 2**31 - 1),
       scale=st.floats(1e-6, 1e6))  # fmt: skip
def test_a_projection_is_never_longer_than_the_gradient(
    d: int, k_frac: float, seed: int, scale: float
) -> None:
    """``||U^T g|| <= ||g||`` for orthonormal U, to the rounding the module bounds."""
    k = max(1, round(k_frac * d))
    sub = Subspace.of(_orthonormal(d, k, seed), 0)
    g = torch.randn(d, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    g *= scale
    sigma = math.sqrt((1 + sub.defect) / (1 - k * gamma(d)))
    # The products' rounding (the module's bound), and the two computed norms' own.
    bound = float(g.norm()) * sigma * (1 + math.sqrt(k) * gamma(d)) * (1 + gamma(k) + gamma(d))
    assert float((sub.basis.T @ g).norm()) <= bound


@pytest.mark.unit
@settings(max_examples=60, deadline=None)
@given(d=st.integers(2, 60), k_frac=st.floats(0.0, 1.0), seed=st.integers(0, 2**31 - 1),
       size=st.floats(0.0, 1e4), clip=st.floats(1e-3, 1e3))  # fmt: skip
def test_one_task_moves_the_released_coordinates_at_most_the_sensitivity(
    d: int, k_frac: float, seed: int, size: float, clip: float
) -> None:
    """One clipped row added to any sum, inside or far outside the ball, moves it <= Delta."""
    k = max(1, round(k_frac * d))
    sub = Subspace.of(_orthonormal(d, k, seed), 0)
    rng = torch.Generator().manual_seed(seed + 2)
    s = torch.randn(d, generator=rng, dtype=torch.float64)
    s *= size * clip / max(float(s.norm()), 1e-300)
    g = torch.randn(d, generator=rng, dtype=torch.float64)
    g *= clip / float(g.norm())
    bound = 10.0 * clip  # the normaliser x C of a lot of 10
    (a, delta), (b, _) = sub.project(s, clip, bound), sub.project(s + g, clip, bound)
    assert delta >= clip
    assert float((a - b).norm()) <= delta


@pytest.mark.unit
def test_the_whole_space_releases_what_the_full_space_release_does() -> None:
    """U = I: the same noise draw gives the same update, to one release cell."""
    d, clip, normaliser = 300, 1.0, 20.0
    scheme = TwoStagePoissonScheme(4, 4, 0.05)
    event = GaussianRound(scheme, 0.9, None, "add_remove")
    rows = torch.randn(12, d, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    total = (rows / rows.norm(dim=1, keepdim=True).clamp_min(clip)).sum(dim=0)
    full = noised_sum(total, clip=clip, event=event, source=NoiseSource.insecure_for_tests(7))
    sub = Subspace.of(torch.eye(d, dtype=torch.float64), 0)
    coords, sensitivity = sub.project(total, clip, normaliser * clip)
    assert 0 <= sensitivity / clip - 1 < 1e-9
    released = noised_sum(coords, clip=sensitivity, event=event,
                          source=NoiseSource.insecure_for_tests(7))  # fmt: skip
    assert released.grid == full.grid
    # The noise differs by the factor Delta / C: a released value moves to a neighbouring cell at
    # most (the release is rounded to the grid).
    diff = (sub.lift(released.value) - full.value).abs()
    assert float(diff.max()) <= full.grid * (1 + 1e-9)
    assert float((diff > 0).double().mean()) < 0.05


@pytest.mark.unit
def test_a_non_private_mean_is_confined_to_the_subspace() -> None:
    sub = Subspace.of(_orthonormal(40, 5, 11), 0)
    v = torch.randn(40, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    kept = sub.restrict(v)
    assert torch.allclose(sub.restrict(kept), kept, rtol=0, atol=1e-12 * float(v.norm()))
    assert float((v - kept) @ kept) == pytest.approx(0.0, abs=1e-12 * float(v.norm()) ** 2)


@pytest.mark.unit
def test_a_subspace_without_public_data_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"privacy.subspace.dimension needs public data.*"
                       r"public.warm_start = true") as err:  # fmt: skip
        load_config(None, ["privacy.subspace.dimension=8"])
    assert "\n" not in str(err.value).strip()
    with pytest.raises(ConfigError, match="privacy.subspace.basis_tasks must be >="):
        load_config(None, ["privacy.subspace.dimension=8", "privacy.subspace.basis_tasks=4"])
    assert load_config(None, []).privacy.subspace.dimension is None  # off by default


@pytest.mark.unit
def test_the_basis_is_recomputed_every_refresh_and_on_resume() -> None:
    calls: list[int] = []

    def compute(params: torch.Tensor, round_index: int) -> torch.Tensor:
        calls.append(round_index)
        return _orthonormal(6, 2, round_index)

    schedule = PublicSubspace(3, compute)
    for index in range(7):
        assert schedule.at(torch.zeros(6), index).round == index - index % 3
    assert calls == [0, 3, 6]
    resumed = PublicSubspace(3, compute)  # a resumed run has no basis until its first round
    assert resumed.at(torch.zeros(6), 4).round == 4 and calls[-1] == 4


@pytest.mark.unit
def test_a_subspace_larger_than_the_trained_parameters_is_refused() -> None:
    cfg = load_config(None, ["dataset.name=omniglot", "dataset.path=/data",
                             "dataset.split=evaluation", "public.warm_start=true",
                             "privacy.subspace.dimension=20"])  # fmt: skip
    workload = SimpleNamespace(public_classes=object(), trained_dim=10)
    with pytest.raises(ValueError, match="dimension = 20 exceeds the 10 trained parameters"):
        public_subspace(cfg, workload)


def _sets(root: Path, *extra: str) -> list[str]:
    return [
        "dataset.name=omniglot", f"dataset.path={root}", "dataset.split=evaluation",
        "dataset.ways=3", "dataset.shots=1", "dataset.query=2", "dataset.tasks_per_participant=20",
        "dataset.test_tasks=4", "dataset.validation_tasks=2", "dataset.probe_tasks=0",
        "federation.participants=2", "rounds=2", "privacy.epsilon_budget=8",
        "privacy.delta=1e-5", "privacy.noise_multiplier=1.0", "training.inner_lr=0.4",
        "public.warm_start=true", "public.steps=2", "public.tasks_per_step=2",
        "privacy.insecure_test_seed=5", "training.optimizer=sgd", "training.momentum=0",
        "training.meta_lr=0.1", "dataset.filters=8", *extra,
    ]  # fmt: skip


@pytest.mark.unit
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_basis_spans_the_top_singular_directions_on_the_rows_device(device: str) -> None:
    """The Gram route, on the rows' own device, against the known top right singular vectors."""
    g = torch.Generator().manual_seed(7)
    n, d, k = 40, 300, 5
    left, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    right, _ = torch.linalg.qr(torch.randn(d, n, generator=g, dtype=torch.float64))
    spectrum = torch.logspace(2, -2, n, dtype=torch.float64)
    rows = ((left * spectrum) @ right.T).to(torch.float32)
    basis = top_directions(rows.to(device), k)
    assert basis.device.type == device and basis.dtype == torch.float64
    u, expected = basis.cpu(), right[:, :k]
    gap = float(spectrum[k - 1] - spectrum[k])
    # Davis-Kahan: the rows' float32 rounding (at most half an ulp of each entry, Frobenius
    # norm below u * ||rows||_F) turns the projector by at most that over the spectral gap;
    # the float64 Gram and QR add far less. Twice it, for the bound's constant.
    rounding = 2.0**-24 * float(torch.linalg.matrix_norm(rows.to(torch.float64)))
    turned = float(torch.linalg.matrix_norm(u @ u.T - expected @ expected.T, ord=2))
    assert turned <= 2 * 2 * rounding / gap


@pytest.mark.e2e
def test_a_run_in_a_subspace_steps_inside_it_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain SGD on a basis fixed for the run: the model moves only inside the public subspace."""
    monkeypatch.setenv("FEDMETA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FEDMETA_STATE_DIR", str(tmp_path / "state"))
    _tiny_omniglot(tmp_path)
    sub = ["privacy.subspace.dimension=3", "privacy.subspace.basis_tasks=6",
           "privacy.subspace.refresh_every=10"]  # fmt: skip
    cfg = load_config(None, _sets(tmp_path, *sub))
    result = main(cfg, out_dir=tmp_path / "run")
    summary = result.summary
    assert summary["rounds_completed"] == 2
    assert summary["subspace"]["dimension"] == 3 and summary["subspace"]["residual"] == "dropped"
    # k values per spend, and the count of clip bits (adaptive clipping, on by default)
    assert summary["implemented_guarantee"]["released_coordinates"] == (3 + 1) * 2
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["subspace"]["refresh_every"] == 10
    wl = build_workload(cfg)
    start = wl.initial_params()
    basis = public_subspace(cfg, wl)
    assert basis is not None
    u = basis.at(start, 0).basis
    final = _params(tmp_path / "run")
    moved = (final - start).to(torch.float64)
    assert float(moved.norm()) > 0
    outside = moved - u @ (u.T @ moved)
    # What leaves the subspace is the float32 rounding of the parameters: half an ulp per step.
    rounding = 2 * 2.0**-24 * (float(start.norm()) + float(final.norm()))
    assert float(outside.norm()) <= rounding
    # The same run in the full space moves outside it.
    full = main(load_config(None, _sets(tmp_path)), out_dir=tmp_path / "full")
    assert full.summary["subspace"] is None
    moved_full = (_params(tmp_path / "full") - start).to(torch.float64)
    assert float((moved_full - u @ (u.T @ moved_full)).norm()) > 0.5 * float(moved_full.norm())


def _params(run_dir: Path) -> torch.Tensor:
    ckpt = load_checkpoint(run_dir)
    assert ckpt is not None
    return ckpt.params
