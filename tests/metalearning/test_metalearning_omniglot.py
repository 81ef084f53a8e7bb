"""Omniglot loaders (npz, zip, folder), checksums, download, cache (metalearning.omniglot)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tests.omniglot_files import png, write_release

import fedmeta.metalearning as ml
from fedmeta.metalearning import ChecksumError, DataError

# Unit tests unless marked otherwise (tests/conftest.py).


# ---------------------------------------------------------------- tiny Omniglot-shaped sources


def _tiny_omniglot_arrays(rng: np.random.Generator, n_chars: int, n_draw: int = 20) -> np.ndarray:
    white = np.ones((n_chars, n_draw, 105, 105), dtype=bool)
    for c in range(n_chars):
        for d in range(n_draw):
            r0, c0 = rng.integers(10, 80, size=2)
            white[c, d, r0 : r0 + 15 + c, c0 : c0 + 10] = False  # a stroke block
    return white


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
                files[name] = png(white[c, d])
        write_release(root, part, files, as_zip=as_zip)
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


# ---------------------------------------------------------------- the shared Omniglot npz


@pytest.mark.integration
def test_shared_omniglot_splits_and_cache(shared_omniglot: Path, tmp_path: Path) -> None:
    s = ml.load_omniglot(shared_omniglot, cache=tmp_path)
    assert [d.n_classes for d in s] == [1150, 50, 423]
    ev = ml.load_omniglot(shared_omniglot, split="evaluation", cache=tmp_path)
    public = ml.load_omniglot_public(shared_omniglot, split="evaluation", cache=tmp_path)
    assert [d.n_classes for d in (*ev, public)] == [445, 50, 164, 964]
    private = set(ev.train.names) | set(ev.val.names) | set(ev.test.names)
    assert len(private) == 659 and not private & set(public.names)
    assert set(public.groups).isdisjoint(set(ev.train.groups) | set(ev.test.groups))
    with pytest.raises(ValueError, match="declares no public classes"):
        ml.load_omniglot_public(shared_omniglot, split="dpmaml", cache=tmp_path)
    assert s.train.images.shape == (1150 * 20, 1, 28, 28)
    assert not set(s.train.names) & set(s.test.names)
    assert len(list(tmp_path.glob("omniglot-28-*.npz"))) == 1  # the second load reads this
    s2 = ml.load_omniglot(shared_omniglot, cache=tmp_path)
    assert torch.equal(s2.train.images, s.train.images)
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
