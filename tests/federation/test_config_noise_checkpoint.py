"""Configuration validation, the secure noise source and safe, atomic checkpoints."""

from __future__ import annotations

import ast
import math
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from fedmeta.accounting import GaussianRound, TwoStagePoissonScheme
from fedmeta.checkpoint import (
    Checkpoint,
    CheckpointError,
    atomic_write_bytes,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from fedmeta.config import Config, ConfigError
from fedmeta.config_io import load_config
from fedmeta.server.noise import GRID_BITS, NoiseSource, noised_sum, release_grid

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
EVENT = GaussianRound(TwoStagePoissonScheme(10, 2, 0.5), 1.5)


def test_interface_keys_reach_the_tree() -> None:
    cfg = load_config(None, [
        "rounds=7", "seed=3", "privacy.epsilon_budget=2.5", "privacy.delta=1e-6",
        "privacy.noise_multiplier=1.2", "privacy.enabled=false", "dataset.name=sinusoid",
        "federation.participants=9", "metrics.port=9100", "privacy.neighbouring=replace_one",
    ])  # fmt: skip
    assert (cfg.rounds, cfg.seed, cfg.privacy.epsilon_budget, cfg.privacy.delta) == (
        7,
        3,
        2.5,
        1e-6,
    )
    assert cfg.privacy.noise_multiplier == 1.2 and cfg.privacy.enabled is False
    assert (
        cfg.privacy.neighbouring == "replace_one" and Config().privacy.neighbouring == "add_remove"
    )
    assert cfg.federation.participants == 9 and cfg.metrics.port == 9100
    assert load_config(None, ["metrics.port=none"]).metrics.port is None


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path: Path, tmp_path: Path) -> None:
    needs_path = "omniglot" in path.name
    cfg = load_config(path, [f"dataset.path={tmp_path}"] if needs_path else [])
    assert cfg.rounds >= 1
    assert "shared" not in path.read_text()  # a user's clone has no ../shared


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("privacy.delta=2", "privacy.delta must be > 0 and < 1; got 2"),
        ("privacy.epsilon_budget=-1", "privacy.epsilon_budget must be > 0"),
        ("rounds=0", "rounds must be >= 1"),
        ("sampling.task_rate=1.5", "sampling.task_rate must be > 0 and <= 1"),
        ("dataset.name=mnist", "dataset.name must be one of"),
        ("federation.participantz=3", "federation.participantz unknown key"),
        ("sampling.participants_per_round=50",
         "sampling.participants_per_round must be in [1, federation.participants=20]"),
        ("dataset.name=omniglot", "dataset.path must be set"),
        ("sampling.stage2=fixed", "sampling.tasks_per_round must be set"),
        ("metrics.port=70000", "metrics.port must be >= 0 and <= 65535"),
        ("privacy.neighbouring=swap", "privacy.neighbouring must be one of"),
        ("privacy.normaliser=0", "privacy.normaliser must be > 0"),
    ],
)  # fmt: skip
def test_errors_name_the_field_and_the_range(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert needle in str(info.value)


def test_participants_per_round_unset_means_every_participant() -> None:
    assert load_config(None, []).n1 == 20
    cfg = load_config(None, ["federation.participants=7"])
    assert cfg.n1 == 7 and cfg.sampling.participants_per_round == 7
    assert load_config(None, ["sampling.participants_per_round=3"]).n1 == 3
    with pytest.raises(ConfigError, match=r"participants_per_round must be in \[1, federation"):
        load_config(None, ["federation.participants=7", "sampling.participants_per_round=8"])


def test_disjoint_example_tasks_need_a_public_normaliser(tmp_path: Path) -> None:
    """tasks_per_participant only caps disjoint tasks, so it cannot give the expected lot."""
    from fedmeta.server.plan import normaliser

    omni = ["dataset.name=omniglot", f"dataset.path={tmp_path}", "dataset.disjoint_examples=true"]
    with pytest.raises(ConfigError) as info:
        load_config(None, [*omni, "dataset.tasks_per_participant=100000"])
    assert "privacy.normaliser must be set with dataset.disjoint_examples = true" in str(info.value)
    assert "dataset.tasks_per_participant (100000) only caps" in str(info.value)
    cfg = load_config(None, [*omni, "privacy.normaliser=100"])
    assert normaliser(cfg) == 100.0
    # not needed where the divisor does not depend on the counts, or nothing is divided
    load_config(None, [*omni, "sampling.stage2=fixed", "sampling.tasks_per_round=5"])
    load_config(None, [*omni, "privacy.enabled=false"])
    load_config(None, ["dataset.disjoint_examples=true"])  # sinusoid tasks: the count is exact


def test_fixed_stage_two_is_bounded_by_the_public_min_tasks() -> None:
    cfg = load_config(None, ["sampling.stage2=fixed", "sampling.tasks_per_round=5",
                             "sampling.min_tasks=40"])  # fmt: skip
    assert cfg.min_tasks == 40
    assert (
        load_config(None, ["sampling.stage2=fixed", "sampling.tasks_per_round=5"]).min_tasks == 200
    )
    with pytest.raises(
        ConfigError, match=r"tasks_per_round must be in \[1, sampling.min_tasks=4\]"
    ):
        load_config(None, ["sampling.stage2=fixed", "sampling.tasks_per_round=5",
                           "sampling.min_tasks=4"])  # fmt: skip


def test_files_are_read_with_one_line_errors(tmp_path: Path) -> None:
    good = tmp_path / "c.toml"
    good.write_text("rounds = 5\n[privacy]\nepsilon_budget = 3.0\n")
    cfg = load_config(good, ["rounds=6"])
    assert cfg.rounds == 6 and cfg.privacy.epsilon_budget == 3.0
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["rounds"])
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes("# r\xe9sum\xe9\nrounds = 5\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8") as info:
        load_config(latin1)
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------- noise


def test_secure_noise_is_not_reproduced_by_recreating_the_source() -> None:
    a, b = NoiseSource.create(), NoiseSource.create()
    assert a.secure and b.secure and "secure" in repr(a)
    assert not np.array_equal(a.standard_normal(64), b.standard_normal(64))
    c = NoiseSource.insecure_for_tests(3, stream=1)
    d = NoiseSource.insecure_for_tests(3, stream=1)
    assert not c.secure and "INSECURE" in repr(c)
    assert np.array_equal(c.standard_normal(1 << 17), d.standard_normal(1 << 17))  # threaded path
    assert not np.array_equal(
        c.standard_normal(8), NoiseSource.insecure_for_tests(3, 2).standard_normal(8)
    )


def test_the_private_path_gives_no_seed_to_torch_or_numpy(tmp_path: Path) -> None:
    """Static check over the modules a private round runs: no torch seeding, no numpy PRNG seeded
    by a value (a searched or leaked seed lets anyone regenerate the noise or the sample)."""
    seeding = {"manual_seed", "seed", "default_rng", "PCG64", "MT19937", "Philox", "SFC64",
               "RandomState", "SeedSequence"}  # fmt: skip
    offenders = []
    for folder in ("server", "accounting"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call):
                    name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                    if name in seeding:
                        offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
    assert not offenders, offenders


def test_noise_has_the_events_scale_and_sits_on_the_release_grid() -> None:
    source = NoiseSource.insecure_for_tests(20261123)
    out = noised_sum(torch.zeros(200_000), clip=2.0, event=EVENT, source=source)
    assert out.noise_std == pytest.approx(3.0) and out.event == EVENT
    assert out.grid == release_grid(3.0) == 2.0 ** (1 - GRID_BITS)
    values = out.value.numpy()
    assert np.array_equal(values, np.rint(values / out.grid) * out.grid)  # on the grid
    # Seeded, so deterministic: the sample variance against the event's std (chi-square, 1e-6).
    n = values.size
    low, high = stats.chi2.ppf([1e-6, 1 - 1e-6], n - 1) * 9.0 / (n - 1)
    assert low < float(values.var(ddof=1)) < high
    assert abs(float(values.mean())) < 5.3 * 3.0 / math.sqrt(n)
    assert stats.kstest(values / 3.0, "norm").pvalue > 1e-6


def test_noised_sum_refuses_a_bad_clip() -> None:
    with pytest.raises(ValueError, match="clip must be a finite number > 0; got 0.0"):
        noised_sum(torch.zeros(3), clip=0.0, event=EVENT, source=NoiseSource.create())


# ------------------------------------------------------------------------------------- checkpoints


def test_checkpoint_round_trip_and_atomic_writes(tmp_path: Path) -> None:
    assert load_checkpoint(tmp_path) is None
    saved = Checkpoint("r", "non-private", torch.arange(3.0), {}, 4, Config(), False,
                       outcomes=({"a": 1},))  # fmt: skip
    save_checkpoint(tmp_path, saved)
    state = load_checkpoint(tmp_path)
    assert state is not None and state.next_round == 4 and state.outcomes == ({"a": 1},)
    assert torch.equal(state.params, torch.arange(3.0))
    atomic_write_bytes(tmp_path / "x.bin", b"abc")
    assert (tmp_path / "x.bin").read_bytes() == b"abc"
    assert not [p for p in os.listdir(tmp_path) if ".tmp." in p]


class _Planted:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("touch PLANTED_CODE_RAN",))


def test_a_planted_checkpoint_never_runs_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"format_version": 2, "payload": _Planted()}, run / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="objects other than tensors and plain data"):
        load_checkpoint(run)
    assert not (tmp_path / "PLANTED_CODE_RAN").exists()
    (run / "checkpoint.pt").write_bytes(pickle.dumps({"format_version": 2}))
    with pytest.raises(CheckpointError):
        read_checkpoint(run)


@pytest.mark.parametrize(
    "content", [b"", b"\x00" * 100, os.urandom(4096)], ids=["empty", "zeros", "random"]
)
def test_a_broken_checkpoint_is_one_line(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "checkpoint.pt").write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path)
    assert "\n" not in str(info.value) and str(tmp_path) in str(info.value)


def test_many_random_files_are_each_one_line(tmp_path: Path) -> None:
    """Random bytes fail inside torch or pickle in many ways; every one is a CheckpointError."""
    import numpy as np

    rng = np.random.default_rng(20261123)  # test data only
    for i in range(300):
        size = int(rng.integers(1, 600))
        content = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        if i % 3 == 0:  # a pickle opcode first makes torch take its legacy-pickle path
            content = b"\x80\x02" + content
        (tmp_path / "checkpoint.pt").write_bytes(content)
        with pytest.raises(CheckpointError):
            load_checkpoint(tmp_path)


def test_a_checkpoint_of_another_format_says_so(tmp_path: Path) -> None:
    torch.save({"format_version": 1, "params": torch.zeros(2)}, tmp_path / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="format 1, this fedmeta reads formats 2, 3"):
        load_checkpoint(tmp_path)


def test_dataset_options_reach_the_workload(tmp_path: Path) -> None:
    """The Omniglot options of the config reach the workload package."""
    from fedmeta.workload import build_workload, data_fingerprint

    rng = np.random.default_rng(0)
    for name, chars in (("images_background", 12), ("images_evaluation", 8)):
        images = rng.random((chars, 20, 105, 105)) > 0.1
        labels = np.repeat(np.arange(chars)[:, None], 20, axis=1)
        np.savez(tmp_path / f"{name}.npz", images=images, labels=labels)
    cfg = load_config(None, [
        "dataset.name=omniglot", f"dataset.path={tmp_path}", "dataset.split=background",
        "dataset.partition=even", "dataset.norm=group", "dataset.tasks_per_participant=3",
        "dataset.query=1", "dataset.shots=1", "federation.participants=2",
        "sampling.participants_per_round=1",
    ])  # fmt: skip
    wl = build_workload(cfg)
    assert wl.splits.train.n_classes == 12 and wl.splits.test.n_classes == 8
    assert sum(wl.task_set.task_counts().values()) == 6
    blocks = [m for m in wl.model.modules() if hasattr(m, "_norm")]
    assert blocks and all(m._norm == "group" for m in blocks)
    # The data's identity ignores seed, partition and participants; it follows the files.
    other = load_config(None, [
        f"dataset.path={tmp_path}", "dataset.name=omniglot", "seed=9",
        "federation.participants=3", "sampling.participants_per_round=1",
    ])  # fmt: skip
    assert data_fingerprint(cfg) == data_fingerprint(other)


def test_the_network_width_is_configured_and_group_norm_must_divide_it() -> None:
    from fedmeta.workload import build_model

    sets = ["dataset.name=omniglot", "dataset.path=/nowhere", "dataset.ways=5"]
    sizes = {f: sum(p.numel() for p in build_model(load_config(None, [*sets,
             f"dataset.filters={f}"])).parameters()) for f in (16, 64)}  # fmt: skip
    # 4 conv blocks (3x3 kernels, bias, norm scale and shift) and a 5-way head on 1x1xf features.
    assert sizes == {f: 9 * f + 3 * (9 * f * f) + 4 * 3 * f + 5 * f + 5 for f in (16, 64)}
    assert sizes[64] == 112_261  # MAML's and DP-MAML's Omniglot network, the default
    assert load_config(None, [*sets, "dataset.norm=group", "dataset.filters=96"]).dataset.filters
    with pytest.raises(ConfigError, match=r"dataset.filters must be a multiple of 32"):
        load_config(None, [*sets, "dataset.norm=group", "dataset.filters=16"])
