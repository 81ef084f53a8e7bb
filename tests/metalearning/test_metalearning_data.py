"""Task data, Omniglot/image-folder loaders, checksums and federated partitions
(metalearning.data)."""

from __future__ import annotations

import io
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import metalearning as ml
from metalearning.data import ChecksumError, DataError

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------- sinusoid


def test_sinusoid_tasks_ranges_and_determinism() -> None:
    fam = ml.SinusoidTasks(5, 7)
    b = fam.sample(50, seed=3)
    assert b.support_x.shape == (50, 5, 1) and b.query_y.shape == (50, 7, 1)
    assert float(b.support_x.min()) >= -5 and float(b.support_x.max()) <= 5
    assert float(b.query_y.abs().max()) <= 5
    assert all(torch.equal(x, y) for x, y in zip(b, fam.sample(50, seed=3), strict=False))
    assert not torch.equal(b.support_x, fam.sample(50, seed=4).support_x)


def test_sinusoid_federation_slices_and_stable_ids() -> None:
    fts = ml.FederatedTaskSet.sinusoid(4, tasks_per_participant=30, k_support=5, seed=7)
    assert fts.task_counts() == {"0": 30, "1": 30, "2": 30, "3": 30}
    ranges = [s["amplitude_range"] for s in fts.summary()]
    assert ranges[0][0] == pytest.approx(0.1) and ranges[-1][1] == pytest.approx(5.0)
    assert all(a[1] == pytest.approx(b[0]) for a, b in zip(ranges, ranges[1:], strict=False))
    for pid, (_lo, hi) in zip(fts.ids, ranges, strict=False):
        amp = fts.participant(pid).tasks(range(30)).query_y.abs().amax(dim=(1, 2))
        assert float(amp.max()) <= hi + 1e-5
    again = ml.FederatedTaskSet.sinusoid(4, tasks_per_participant=30, k_support=5, seed=7)
    t1, t2 = fts.participant(2).task(17), again.participant("2").task(17)
    assert all(torch.equal(x, y) for x, y in zip(t1, t2, strict=False))
    # fetching in another order gives the same task (ids, not call order)
    assert torch.equal(fts.participant(2).tasks([17, 3]).support_x[0], t1.support_x)
    assert fts.max_tasks_per_example == 1


# ---------------------------------------------------------------- tiny Omniglot-shaped sources


def _tiny_omniglot_arrays(rng: np.random.Generator, n_chars: int, n_draw: int = 20) -> np.ndarray:
    white = np.ones((n_chars, n_draw, 105, 105), dtype=bool)
    for c in range(n_chars):
        for d in range(n_draw):
            r0, c0 = rng.integers(10, 80, size=2)
            white[c, d, r0 : r0 + 15 + c, c0 : c0 + 10] = False  # a stroke block
    return white


def _png(white: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(white).convert("1").save(buf, format="PNG")
    return buf.getvalue()


def _write_sources(root: Path, as_zip: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {
        "images_background": _tiny_omniglot_arrays(rng, 4),
        "images_evaluation": _tiny_omniglot_arrays(rng, 3),
    }
    first = {"images_background": 1, "images_evaluation": 965}
    for part, white in arrays.items():
        files = {}
        for c in range(white.shape[0]):
            alpha = f"Alpha{part[-4:]}{c // 2}"
            for d in range(white.shape[1]):
                name = (
                    f"{part}/{alpha}/character{c % 2 + 1:02d}/{first[part] + c:04d}_{d + 1:02d}.png"
                )
                files[name] = _png(white[c, d])
        if as_zip:
            with zipfile.ZipFile(root / f"{part}.zip", "w") as z:
                for n, data in files.items():
                    z.writestr(n, data)
        else:
            for n, data in files.items():
                (root / n).parent.mkdir(parents=True, exist_ok=True)
                (root / n).write_bytes(data)
    return arrays


@pytest.mark.parametrize("fmt", ["zip", "folder", "npz"])
def test_omniglot_loader_on_tiny_sources(tmp_path: Path, fmt: str) -> None:
    if fmt == "npz":
        rng = np.random.default_rng(0)
        arrays = {
            "images_background": _tiny_omniglot_arrays(rng, 4),
            "images_evaluation": _tiny_omniglot_arrays(rng, 3),
        }
        for part, white in arrays.items():
            np.savez_compressed(
                tmp_path / f"{part}.npz",
                images=white,
                labels=np.repeat(np.arange(white.shape[0])[:, None], 20, 1),
            )
    else:
        arrays = _write_sources(tmp_path, fmt == "zip")
    splits = ml.load_omniglot(tmp_path, split="background", cache=tmp_path / "cache")
    assert splits.train.n_classes == 4 and splits.test.n_classes == 3 and splits.val.n_classes == 0
    assert splits.train.images.shape == (80, 1, 28, 28) and splits.train.images.dtype == torch.uint8
    # strokes are bright: ink fraction of the 105x105 original ~ mean intensity of the 28x28 image
    ink = (~arrays["images_background"][0, 0]).mean()
    assert float(splits.train.images[0].float().mean() / 255) == pytest.approx(ink, abs=0.02)
    if fmt == "npz":
        assert splits.train.names[0] == "0001" and splits.test.names[0] == "0965"
    cached = ml.load_omniglot(tmp_path, split="background", cache=tmp_path / "cache")
    assert torch.equal(cached.train.images, splits.train.images)
    rot = ml.load_omniglot(tmp_path, split="background", rotations=True, cache=False)
    assert rot.train.n_classes == 16
    assert torch.equal(rot.train.images[80:100], torch.rot90(splits.train.images[:20], 1, (-2, -1)))


def test_zip_and_folder_sources_agree(tmp_path: Path) -> None:
    (tmp_path / "z").mkdir()
    (tmp_path / "f").mkdir()
    _write_sources(tmp_path / "z", True)
    _write_sources(tmp_path / "f", False)
    a = ml.load_omniglot(tmp_path / "z", split="all", cache=False).train
    b = ml.load_omniglot(tmp_path / "f", split="all", cache=False).train
    assert torch.equal(a.images, b.images) and a.groups == b.groups and a.names == b.names


def test_missing_and_malformed_omniglot(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"images_background\.npz.*images_background\.zip") as e:
        ml.load_omniglot(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(e.value)
    (tmp_path / "images_background.npz").write_bytes(b"not an npz")
    (tmp_path / "images_evaluation.npz").write_bytes(b"not an npz")
    with pytest.raises(DataError, match="not a readable npz"):
        ml.load_omniglot(tmp_path, cache=False)
    np.savez(tmp_path / "images_background.npz", pictures=np.zeros(3))
    with pytest.raises(DataError, match="expected an array 'images'"):
        ml.load_omniglot(tmp_path, cache=False)
    bad = tmp_path / "badzip"
    bad.mkdir()
    (bad / "images_background.zip").write_bytes(b"PK garbage")
    (bad / "images_evaluation.zip").write_bytes(b"PK garbage")
    with pytest.raises(DataError, match="not a valid zip"):
        ml.load_omniglot(bad, cache=False)


def test_checksum_rejects_corruption_and_download_verifies(tmp_path: Path) -> None:
    src = tmp_path / "mirror"
    src.mkdir()
    _write_sources(src, True)
    import hashlib

    sums = {
        n: {"sha256": hashlib.sha256((src / n).read_bytes()).hexdigest(), "md5": None}
        for n in ("images_background.zip", "images_evaluation.zip")
    }
    dest = ml.download_omniglot(tmp_path / "dl", base_url=src.as_uri() + "/", checksums=sums)
    assert (
        (dest / "images_background.zip.sha256")
        .read_text()
        .startswith(sums["images_background.zip"]["sha256"])
    )
    assert ml.load_omniglot(dest, split="background", cache=False).train.n_classes == 4
    # corrupt the local copy: verification rejects it with a clear error
    data = bytearray((dest / "images_evaluation.zip").read_bytes())
    data[100] ^= 0xFF
    (dest / "images_evaluation.zip").write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="does not match"):
        ml.verify_checksum(dest / "images_evaluation.zip", **sums["images_evaluation.zip"])
    with pytest.raises(ChecksumError):
        ml.download_omniglot(dest, base_url=src.as_uri() + "/", checksums=sums)
    # a corrupted mirror never lands in place
    (src / "images_background.zip").write_bytes(b"corrupted")
    with pytest.raises(ChecksumError):
        ml.download_omniglot(tmp_path / "dl2", base_url=src.as_uri() + "/", checksums=sums)
    assert not (tmp_path / "dl2" / "images_background.zip").exists()
    with pytest.raises(ChecksumError):
        ml.verify_checksum(src / "images_background.zip", md5="0" * 32)


# ---------------------------------------------------------------- image folders


def _image_folder(root: Path, n_classes: int = 6, per: int = 5) -> None:
    rng = np.random.default_rng(0)
    for c in range(n_classes):
        d = root / f"class{c}"
        d.mkdir(parents=True)
        for i in range(per):
            Image.fromarray(rng.integers(0, 255, (10, 12, 3), dtype=np.uint8)).save(d / f"{i}.png")


def test_image_folder_loader(tmp_path: Path) -> None:
    _image_folder(tmp_path / "ds", n_classes=10)
    s = ml.load_image_folder(tmp_path / "ds", image_size=8, fractions=(0.6, 0.2, 0.2), seed=1)
    assert [d.n_classes for d in s] == [6, 2, 2]
    assert s.train.images.shape == (30, 3, 8, 8)
    assert not set(s.train.names) & set(s.test.names)
    t = ml.sample_tasks(s.train, n_way=3, k_shot=2, q_query=2, n_tasks=4, seed=0)
    assert t.support_x.shape == (4, 6, 3, 8, 8) and t.support_y.tolist()[0] == [0, 0, 1, 1, 2, 2]
    for split in ("train", "val", "test"):
        _image_folder(tmp_path / "pre" / split, n_classes=3)
    s2 = ml.load_image_folder(tmp_path / "pre", image_size=8)
    assert [d.n_classes for d in s2] == [3, 3, 3]
    with pytest.raises(DataError, match="one sub-folder per class"):
        ml.load_image_folder(tmp_path / "ds" / "class0")
    (tmp_path / "ds" / "empty").mkdir()
    with pytest.raises(DataError, match="no images"):
        ml.load_image_folder(tmp_path / "ds")


# ---------------------------------------------------------------- partitions and task lists


def _fake_classes(n_groups: int = 6, per_group: int = 5, per_class: int = 20) -> ml.ClassDataset:
    n = n_groups * per_group
    images = torch.arange(n * per_class, dtype=torch.int64).remainder(256).to(torch.uint8)
    images = images.reshape(-1, 1, 1, 1).expand(-1, 1, 4, 4).contiguous()
    return ml.ClassDataset(
        images,
        np.arange(n + 1) * per_class,
        [str(i) for i in range(n)],
        [f"g{i // per_group}" for i in range(n)],
    )


@pytest.mark.parametrize("mode", ["group", "even"])
def test_partition_disjoint_deterministic(mode: str) -> None:
    ds = _fake_classes()
    parts = ml.partition_classes(ds, 4, mode=mode, seed=3)
    allc = np.concatenate(parts)
    assert sorted(allc.tolist()) == list(range(ds.n_classes))
    assert all(len(p) for p in parts)
    again = ml.partition_classes(ds, 4, mode=mode, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=False))
    if mode == "group":  # whole groups per participant
        owner = {}
        for i, p in enumerate(parts):
            for c in p:
                assert owner.setdefault(ds.groups[c], i) == i
    with pytest.raises(ValueError, match="n_participants"):
        ml.partition_classes(ds, 100, mode=mode)


def test_federated_task_lists_stable_and_reuse_reported() -> None:
    ds = _fake_classes()
    fts = ml.FederatedTaskSet.from_classes(
        ds, 3, n_way=3, k_shot=1, q_query=2, tasks_per_participant=50, seed=5
    )
    assert fts.task_counts() == {"0": 50, "1": 50, "2": 50}
    p = fts.participant(1)
    t = p.task(7)
    assert t.support_x.shape == (3, 1, 4, 4) and t.query_y.tolist() == [0, 0, 1, 1, 2, 2]
    own = set(p.plan.reshape(-1) // 20)
    assert own <= set(p.classes.tolist())
    other = set(fts.participant(0).plan.reshape(-1) // 20)
    assert not own & other
    again = ml.FederatedTaskSet.from_classes(
        ds, 3, n_way=3, k_shot=1, q_query=2, tasks_per_participant=80, seed=5
    )
    # task ids are stable: asking for more tasks (or a restart) does not change existing ones
    assert np.array_equal(again.participant(1).plan[:50], p.plan)
    assert all(torch.equal(a, b) for a, b in zip(again.participant(1).task(7), t, strict=False))
    counts = p.example_use_counts()
    assert p.max_tasks_per_example == counts.max() > 1
    s = fts.summary()
    assert (
        s[1]["tasks"] == 50
        and s[1]["classes"] == len(p.classes)
        and s[1]["max_tasks_per_example"] >= 2
    )


def test_disjoint_example_mode() -> None:
    ds = _fake_classes()
    fts = ml.FederatedTaskSet.from_classes(
        ds,
        2,
        n_way=3,
        k_shot=1,
        q_query=3,
        tasks_per_participant=None,
        disjoint_examples=True,
        seed=1,
    )
    assert fts.max_tasks_per_example == 1
    for pid in fts.ids:
        p = fts.participant(pid)
        assert len(np.unique(p.plan)) == p.plan.size
        # capacity: 15 classes x 20 examples / (3 ways x 4 per class) = 25 tasks at most
        assert 20 <= p.num_tasks <= 25
    capped = ml.FederatedTaskSet.from_classes(
        ds, 2, n_way=3, k_shot=1, q_query=3, tasks_per_participant=5, disjoint_examples=True, seed=1
    )
    assert capped.task_counts() == {"0": 5, "1": 5}


# ---------------------------------------------------------------- the shared Omniglot npz


def test_shared_omniglot_splits_and_speed(shared_omniglot: Path, tmp_path: Path) -> None:
    t0 = time.perf_counter()
    s = ml.load_omniglot(shared_omniglot, cache=tmp_path)
    cold = time.perf_counter() - t0
    assert [d.n_classes for d in s] == [1150, 50, 423]
    assert s.train.images.shape == (1150 * 20, 1, 28, 28)
    assert not set(s.train.names) & set(s.test.names)
    t0 = time.perf_counter()
    s2 = ml.load_omniglot(shared_omniglot, cache=tmp_path)
    warm = time.perf_counter() - t0
    assert torch.equal(s2.train.images, s.train.images)
    assert cold < 30 and warm < 5, (cold, warm)
    b = ml.load_omniglot(shared_omniglot, split="background", cache=tmp_path)
    assert [d.n_classes for d in b] == [964, 0, 659]
    assert len(set(b.train.groups)) == 30 and len(set(b.test.groups)) == 20
    fts = ml.FederatedTaskSet.from_classes(
        b.train, 10, n_way=5, k_shot=1, q_query=15, tasks_per_participant=20
    )
    summ = fts.summary()
    assert sum(x["groups"] for x in summ) == 30
    assert sum(x["classes"] for x in summ) == 964
    x = fts.participant(0).task(0)
    assert x.support_x.shape == (5, 1, 28, 28) and x.query_x.shape == (75, 1, 28, 28)
    assert 0 <= float(x.support_x.min()) and float(x.support_x.max()) <= 1
