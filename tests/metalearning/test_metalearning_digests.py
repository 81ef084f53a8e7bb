"""Source digests: the identity of the files a loader reads (metalearning.digests and loaders)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tests.omniglot_files import png, write_release

import fedmeta.metalearning as ml
from fedmeta.metalearning import DataError, digests

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _fresh_digest_cache() -> None:
    digests._sha256_by_stat.cache_clear()  # noqa: SLF001 - each test counts its own reads


def _omniglot(root: Path, layout: str) -> None:
    """Two background and one evaluation character, four drawings each, in ``layout``."""
    rng = np.random.default_rng(0)
    for part, first, n in (("images_background", 1, 2), ("images_evaluation", 965, 1)):
        white = rng.random((n, 4, 105, 105)) > 0.1
        if layout == "npz":
            root.mkdir(parents=True, exist_ok=True)
            np.savez(root / f"{part}.npz", images=white)
            continue
        files = {
            f"{part}/Alpha/character{c + 1:02d}/{first + c:04d}_{d + 1:02d}.png": png(white[c, d])
            for c in range(n)
            for d in range(4)
        }
        write_release(root, part, files, as_zip=layout == "zip")


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    reads: list[Path] = []
    real = digests.file_digest

    def spy(path: Path, algo: str = "sha256") -> str:
        reads.append(path)
        return real(path, algo)

    monkeypatch.setattr(digests, "file_digest", spy)
    return reads


@pytest.mark.parametrize("layout", ["npz", "zip", "folder"])
def test_omniglot_digest_follows_content_not_location(tmp_path: Path, layout: str) -> None:
    _omniglot(tmp_path / "a", layout)
    d = ml.omniglot_source_digest(tmp_path / "a")
    assert len(d) == 64 and int(d, 16) >= 0
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert ml.omniglot_source_digest(tmp_path / "b") == d  # moved data keeps its identity
    # a file the loader does not read is not covered
    (tmp_path / "b" / "README.txt").write_text("notes")
    assert ml.omniglot_source_digest(tmp_path / "b") == d
    # the loader reads it all: splits and seeds are views of the same identity
    ml.load_omniglot(tmp_path / "b", split="background", seed=3, cache=False)
    assert ml.omniglot_source_digest(tmp_path / "b") == d
    # one changed byte in what the loader reads is another dataset
    victim = sorted(p for p in (tmp_path / "b").rglob("*") if p.suffix in (".npz", ".zip", ".png"))
    data = bytearray(victim[-1].read_bytes())
    data[-5] ^= 0xFF
    victim[-1].write_bytes(bytes(data))
    assert ml.omniglot_source_digest(tmp_path / "b") != d


def test_omniglot_digest_layouts_differ_and_folder_names_count(tmp_path: Path) -> None:
    for layout in ("npz", "zip", "folder"):
        _omniglot(tmp_path / layout, layout)
    got = {layout: ml.omniglot_source_digest(tmp_path / layout) for layout in ("npz", "zip")}
    got["folder"] = ml.omniglot_source_digest(tmp_path / "folder")
    assert len(set(got.values())) == 3  # other bytes, other identity (documented)
    # a drawing's folder names are its labels: renaming the alphabet is another dataset
    (tmp_path / "folder" / "images_background" / "Alpha").rename(
        tmp_path / "folder" / "images_background" / "Beta"
    )
    assert ml.omniglot_source_digest(tmp_path / "folder") != got["folder"]


def test_digest_is_cached_by_path_size_mtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _omniglot(tmp_path, "npz")
    reads = _count_reads(monkeypatch)
    d = ml.omniglot_source_digest(tmp_path)
    assert len(reads) == 2
    assert ml.omniglot_source_digest(tmp_path) == d and len(reads) == 2  # no file read again
    f = tmp_path / "images_evaluation.npz"
    st = f.stat()
    np.savez(f, images=np.ones((1, 4, 105, 105), dtype=bool))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new mtime, whatever the clock
    assert ml.omniglot_source_digest(tmp_path) != d
    assert [p.name for p in reads[2:]] == ["images_evaluation.npz"]


def test_omniglot_digest_missing_source_says_what_is_expected(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no Omniglot data at .*images_background\.npz"):
        ml.omniglot_source_digest(tmp_path)


# The identity of the full Omniglot npz pair the tests read when present (its files' SHA-256s are
# 8bf84167... images_background.npz and 0b84c7ff... images_evaluation.npz).
SHARED_NPZ_DIGEST = "724dda0ec42025ce9e12ff3a33d20a7d3bb2f47acaf3bb6fe20d0cf4ecc84852"


def test_shared_omniglot_digest_pinned(shared_omniglot: Path) -> None:
    assert ml.omniglot_source_digest(shared_omniglot) == SHARED_NPZ_DIGEST


def _image_folder(root: Path, classes: int = 3, per: int = 2) -> None:
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(per):
            Image.fromarray(rng.integers(0, 255, (6, 6, 3), dtype=np.uint8)).save(
                root / f"class{c}" / f"{i}.png"
            )


def test_image_folder_digest_covers_what_the_loader_reads(tmp_path: Path) -> None:
    _image_folder(tmp_path / "a")
    d = ml.image_folder_source_digest(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert ml.image_folder_source_digest(tmp_path / "b") == d
    (tmp_path / "b" / "README.md").write_text("not read")  # not in a class folder
    (tmp_path / "b" / "class0" / "labels.csv").write_text("not an image")
    assert ml.image_folder_source_digest(tmp_path / "b") == d
    (tmp_path / "b" / "class1" / "1.png").rename(tmp_path / "b" / "class2" / "9.png")
    assert ml.image_folder_source_digest(tmp_path / "b") != d  # an image moved to another class
    for split in ("train", "val", "test"):
        _image_folder(tmp_path / "pre" / split)
    pre = ml.image_folder_source_digest(tmp_path / "pre")
    assert pre != d
    (tmp_path / "pre" / "extra").mkdir()  # ignored: the train/val/test layout reads the splits
    (tmp_path / "pre" / "extra" / "x.png").write_bytes((tmp_path / "a/class0/0.png").read_bytes())
    assert ml.image_folder_source_digest(tmp_path / "pre") == pre
    with pytest.raises(DataError, match="one sub-folder per class"):
        ml.image_folder_source_digest(tmp_path / "a" / "class0")


def test_manifest_covers_one_directory(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.bin").write_bytes(b"x")
    (tmp_path / "y.bin").write_bytes(b"y")
    digests.manifest_digest(tmp_path / "a", [tmp_path / "a" / "x.bin"])
    with pytest.raises(ValueError, match="is not under"):
        digests.manifest_digest(tmp_path / "a", [tmp_path / "y.bin"])
