"""Pinned task data: the same seed gives the same tasks, bit for bit, across refactorings.

The digests below were computed before ``metalearning/fedmeta/metalearning/data.py`` was split into
modules (issue 10)
and must not change unless task generation is changed on purpose (which breaks the stability of
task ids across restarts: say so in the commit). Everything pinned is computed from integers (seeded
draws, example indices, uint8 pixels at their source size) so that it does not depend on the
machine's floating-point kernels; the sinusoid's targets are rounded to 1e-4 because ``np.sin`` may
differ by an ulp between numpy builds.
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import fedmeta.metalearning as ml

pytestmark = pytest.mark.unit


def _digest(*parts: object) -> str:
    h = hashlib.sha256()
    for p in parts:
        a = p.numpy() if isinstance(p, torch.Tensor) else np.asarray(p)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def _sinusoid_digest(t: ml.Task) -> str:
    return _digest(
        t.support_x,
        t.query_x,
        np.round(t.support_y.double().numpy(), 4),
        np.round(t.query_y.double().numpy(), 4),
    )


def _classes(n_groups: int = 6, per_group: int = 5, per_class: int = 20) -> ml.ClassDataset:
    n = n_groups * per_group
    images = torch.arange(n * per_class * 16, dtype=torch.int64).mul(7).remainder(251)
    return ml.ClassDataset(
        images.to(torch.uint8).reshape(-1, 1, 4, 4),
        np.arange(n + 1) * per_class,
        [f"c{i}" for i in range(n)],
        [f"g{i // per_group}" for i in range(n)],
    )


def test_sinusoid_tasks_pinned() -> None:
    assert _sinusoid_digest(ml.SinusoidTasks(5, 7).sample(4, seed=3)) == "f60e7c59d11f11ce"
    fts = ml.FederatedTaskSet.sinusoid(3, tasks_per_participant=5, k_support=4, seed=7)
    assert _sinusoid_digest(fts.participant("2").tasks([0, 4])) == "1e78b88fa32f5274"
    iid = ml.FederatedTaskSet.sinusoid(2, tasks_per_participant=3, partition="iid", seed=1)
    assert _sinusoid_digest(iid.participant("1").tasks([2])) == "b0b46ce738fecc74"


def test_class_tasks_and_partitions_pinned() -> None:
    ds = _classes()
    assert _digest(*ml.sample_tasks(ds, n_way=3, k_shot=1, q_query=2, n_tasks=4, seed=11)) == (
        "3e3d57bc15059926"
    )
    assert _digest(*ml.partition_classes(ds, 4, mode="group", seed=3)) == "69ace3658f3c9ee3"
    assert _digest(*ml.partition_classes(ds, 4, mode="even", seed=3)) == "01422d5b912481fd"
    fts = ml.FederatedTaskSet.from_classes(
        ds, 3, n_way=3, k_shot=1, q_query=2, tasks_per_participant=6, seed=5
    )
    assert _digest(*(fts.participant(p).plan for p in fts.ids)) == "94f9155acdf15ca8"
    assert _digest(*fts.participant("1").tasks([5, 0])) == "ec181ec0c36b6bfb"
    disjoint = ml.FederatedTaskSet.from_classes(
        ds, 2, n_way=3, k_shot=1, q_query=3, tasks_per_participant=None, disjoint_examples=True
    )
    assert _digest(*(disjoint.participant(p).plan for p in disjoint.ids)) == "aa5bcefd70dad0a5"


def _png(white: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(white).convert("1").save(buf, format="PNG")
    return buf.getvalue()


def _omniglot_sources(root: Path) -> None:
    """Four background and three evaluation characters, as npz and as the official zips."""
    rng = np.random.default_rng(0)
    first = {"images_background": 1, "images_evaluation": 965}
    (root / "npz").mkdir()
    (root / "zip").mkdir()
    for part, n_chars in (("images_background", 4), ("images_evaluation", 3)):
        white = rng.random((n_chars, 20, 105, 105)) > 0.1
        np.savez(root / "npz" / f"{part}.npz", images=white)
        with zipfile.ZipFile(root / "zip" / f"{part}.zip", "w") as z:
            for c in range(n_chars):
                for d in range(20):
                    folder = f"{part}/A{c // 2}/character{c % 2 + 1:02d}"
                    name = f"{folder}/{first[part] + c:04d}_{d + 1:02d}.png"
                    z.writestr(name, _png(white[c, d]))


def test_omniglot_loading_pinned(tmp_path: Path) -> None:
    _omniglot_sources(tmp_path)
    for kind in ("npz", "zip"):
        s = ml.load_omniglot(tmp_path / kind, split="background", image_size=105, cache=False)
        assert _digest(s.train.images, s.test.images, s.train.offsets) == "955eb0b32eb1e5d3", kind
        want = ["Arcadian"] * 4 if kind == "npz" else ["A0", "A0", "A1", "A1"]
        assert s.train.groups == want
    rot = ml.load_omniglot(
        tmp_path / "npz", split="all", rotations=True, image_size=105, cache=False
    )
    tasks = ml.sample_tasks(rot.train, n_way=5, k_shot=1, q_query=2, n_tasks=2, seed=4)
    assert _digest(*tasks) == "1fd52149e1f5102e"


def test_image_folder_pinned(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for c in range(10):
        (tmp_path / f"class{c}").mkdir()
        for i in range(4):
            pixels = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / f"class{c}" / f"{i}.png")
    s = ml.load_image_folder(tmp_path, image_size=8, fractions=(0.6, 0.2, 0.2), seed=1)
    assert [d.names for d in s] == [
        ["class0", "class1", "class2", "class3", "class6", "class9"],
        ["class4", "class7"],
        ["class5", "class8"],
    ]
    assert _digest(s.train.images, s.val.images, s.test.images) == "bc9489d7d815641f"
