"""One-folder-per-class image datasets (metalearning.images)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import fedmeta.metalearning as ml
from fedmeta.metalearning import DataError

pytestmark = pytest.mark.unit


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
