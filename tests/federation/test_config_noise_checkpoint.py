"""Configuration validation, the noise source and atomic checkpoints."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from fedmeta.config import Config, ConfigError, load_config
from server.checkpoint import atomic_write_bytes, load_checkpoint, save_checkpoint
from server.noise import NoiseSource, gaussian_noise, noised_sum

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_defaults_and_interface_keys() -> None:
    cfg = Config()
    assert cfg.dataset.name == "sinusoid" and cfg.privacy.enabled
    cfg = load_config(None, [
        "rounds=7", "seed=3", "privacy.epsilon_budget=2.5", "privacy.delta=1e-6",
        "privacy.noise_multiplier=1.2", "privacy.enabled=false", "dataset.name=sinusoid",
        "federation.participants=9", "metrics.port=9100",
    ])  # fmt: skip
    assert (cfg.rounds, cfg.seed, cfg.privacy.epsilon_budget, cfg.privacy.delta) == (
        7,
        3,
        2.5,
        1e-6,
    )
    assert cfg.privacy.noise_multiplier == 1.2 and cfg.privacy.enabled is False
    assert cfg.federation.participants == 9 and cfg.metrics.port == 9100
    assert cfg.metrics.bind == "127.0.0.1" and cfg.metrics.private_diagnostics is False
    assert load_config(None, ["metrics.port=none"]).metrics.port is None


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path: Path, tmp_path: Path) -> None:
    cfg = load_config(path, [f"dataset.path={tmp_path}"] if "omniglot" in path.name else [])
    assert cfg.rounds >= 1


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("privacy.delta=2", "privacy.delta must be > 0 and < 1; got 2"),
        ("privacy.epsilon_budget=-1", "privacy.epsilon_budget must be > 0"),
        ("rounds=0", "rounds must be >= 1"),
        ("sampling.task_rate=1.5", "sampling.task_rate must be > 0 and <= 1"),
        ("dataset.name=mnist", "dataset.name must be one of"),
        ("federation.participantz=3", "federation.participantz unknown key"),
        (
            "sampling.participants_per_round=50",
            "sampling.participants_per_round must be in [1, federation.participants=20]",
        ),
        ("dataset.name=omniglot", "dataset.path must be set"),
        ("sampling.stage2=fixed", "sampling.tasks_per_round must be set"),
        ("metrics.port=70000", "metrics.port must be >= 0 and <= 65535"),
    ],
)
def test_errors_name_the_field_and_the_range(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert needle in str(info.value)


def test_config_is_frozen_and_toml_is_read(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("rounds = 5\n[privacy]\nepsilon_budget = 3.0\n")
    cfg = load_config(f, ["rounds=6"])
    assert cfg.rounds == 6 and cfg.privacy.epsilon_budget == 3.0
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        cfg.rounds = 9  # type: ignore[misc]
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["rounds"])


def test_noise_is_secretly_seeded_unless_a_test_seed_is_given() -> None:
    a, b = NoiseSource.create(), NoiseSource.create()
    assert a.secure and b.secure
    assert not torch.equal(gaussian_noise(8, 1.0, a), gaussian_noise(8, 1.0, b))
    c, d = NoiseSource.create(insecure_test_seed=3), NoiseSource.create(insecure_test_seed=3)
    assert not c.secure
    assert torch.equal(gaussian_noise(8, 1.0, c), gaussian_noise(8, 1.0, d))


def test_noise_level_and_returned_event() -> None:
    from accounting import GaussianRound, TwoStagePoissonScheme

    event = GaussianRound(TwoStagePoissonScheme(10, 2, 0.5), 1.5)
    out = noised_sum(torch.zeros(200_000), clip=2.0, event=event, source=NoiseSource.create())
    assert out.event is event and out.noise_std == pytest.approx(3.0)
    std = float(out.value.std())
    # 200k samples: the sample std is within ~0.5% of 3.0 with overwhelming probability.
    assert abs(std - 3.0) < 0.03 and abs(float(out.value.mean())) < 0.03
    with pytest.raises(ValueError, match="clip must be > 0"):
        noised_sum(torch.zeros(3), clip=0.0, event=event, source=NoiseSource.create())


def test_checkpoint_roundtrip_and_atomicity(tmp_path: Path) -> None:
    assert load_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, {"params": torch.arange(3.0), "next_round": 4})
    state = load_checkpoint(tmp_path)
    assert (
        state is not None
        and state["next_round"] == 4
        and torch.equal(state["params"], torch.arange(3.0))
    )
    atomic_write_bytes(tmp_path / "x.bin", b"abc")
    assert (tmp_path / "x.bin").read_bytes() == b"abc"
    assert not [p for p in os.listdir(tmp_path) if ".tmp." in p]
    assert math.isfinite(1.0)


@pytest.mark.unit
def test_dataset_options_reach_the_workload(tmp_path: Path) -> None:
    """The Omniglot options of the config are passed to the workload package, and bad values name
    the field."""
    import numpy as np

    from client.workload import build_model, workload
    from fedmeta.config import load_config

    # A tiny Omniglot-shaped npz pair: 2 alphabets' worth of characters, 20 drawings each.
    rng = np.random.default_rng(0)
    for name, chars in (("images_background", 12), ("images_evaluation", 8)):
        images = rng.random((chars, 20, 105, 105)) > 0.1
        labels = np.repeat(np.arange(chars)[:, None], 20, axis=1)
        np.savez(tmp_path / f"{name}.npz", images=images, labels=labels)
    cfg = load_config(
        None,
        [
            "dataset.name=omniglot",
            f"dataset.path={tmp_path}",
            "dataset.split=background",
            "dataset.partition=even",
            "dataset.norm=group",
            "dataset.tasks_per_participant=3",
            "dataset.query=1",
            "dataset.shots=1",
            "federation.participants=2",
            "sampling.participants_per_round=1",
        ],
    )
    wl = workload(cfg)
    # background split: the 12 background characters train, the 8 evaluation characters test.
    assert wl.splits.train.n_classes == 12
    assert wl.splits.test.n_classes == 8
    assert sum(wl.task_set.task_counts().values()) == 6
    blocks = [m for m in build_model(cfg).modules() if hasattr(m, "_norm")]
    assert blocks and all(m._norm == "group" for m in blocks)
    with pytest.raises(Exception, match="dataset.split"):
        load_config(None, ["dataset.split=nope"])
