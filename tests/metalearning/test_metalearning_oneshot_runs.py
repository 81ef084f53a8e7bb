"""The official Omniglot one-shot runs: reading, labels, pixels, errors, evaluation.

The runs are built here in the official layout (``runNN/training/classKK.png``,
``runNN/test/itemKK.png``, ``runNN/class_labels.txt``) from synthetic strokes: class ``k`` is a bar
at angle ``k * 9`` degrees plus a block at its own place, a test item the same drawing shifted by
up to 2 pixels. Each run labels its items with its own permutation, written in shuffled line order.
"""

from __future__ import annotations

import io
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import fedmeta.metalearning as ml
from fedmeta.metalearning import DataError
from fedmeta.metalearning.oneshot_runs import HUMAN_ERROR_RATE, ONESHOT_RUNS, ONESHOT_WAYS

# Unit tests unless marked otherwise (tests/conftest.py).

_YY, _XX = np.mgrid[0:105, 0:105].astype(float)


def _stroke(k: int, dy: int = 0, dx: int = 0) -> np.ndarray:
    """Class ``k``'s drawing, white-True bool [105, 105] (the npz convention), shifted."""
    th = np.pi * k / ONESHOT_WAYS
    py, px = _YY - 52 - dy, _XX - 52 - dx
    along = py * np.cos(th) + px * np.sin(th)
    across = -py * np.sin(th) + px * np.cos(th)
    white = ~((np.abs(across) < 3) & (np.abs(along) < 35))
    r0, c0 = 10 + 20 * (k % 5) + dy, 10 + 22 * (k // 5) + dx
    white[r0 : r0 + 12, c0 : c0 + 12] = False
    return white


def _png(white: np.ndarray) -> bytes:
    """A 1-bit PNG of black strokes on white, as in the official release."""
    buf = io.BytesIO()
    Image.fromarray(white).convert("1").save(buf, format="PNG")
    return buf.getvalue()


def _write_run(run_dir: Path, training: list[bytes], test: list[bytes], labels: list[int]) -> None:
    """One run: ``labels[i]`` is the 0-based class of item ``i + 1``; lines in shuffled order."""
    run = run_dir.name
    (run_dir / "training").mkdir(parents=True)
    (run_dir / "test").mkdir()
    for k, data in enumerate(training, start=1):
        (run_dir / "training" / f"class{k:02d}.png").write_bytes(data)
    for i, data in enumerate(test, start=1):
        (run_dir / "test" / f"item{i:02d}.png").write_bytes(data)
    lines = [
        f"{run}/test/item{i + 1:02d}.png {run}/training/class{c + 1:02d}.png"
        for i, c in enumerate(labels)
    ]
    order = np.random.default_rng(len(run)).permutation(len(lines))
    (run_dir / "class_labels.txt").write_text("\n".join(lines[j] for j in order) + "\n")


def _write_runs(root: Path) -> dict[str, np.ndarray]:
    """The 20 synthetic runs under ``root``; returns each run's item -> class permutation."""
    rng = np.random.default_rng(0)
    training = [_png(_stroke(k)) for k in range(ONESHOT_WAYS)]
    perms = {}
    for r in range(1, ONESHOT_RUNS + 1):
        perm = rng.permutation(ONESHOT_WAYS)
        shifts = rng.integers(-2, 3, size=(ONESHOT_WAYS, 2))
        test = [_png(_stroke(int(c), *map(int, s))) for c, s in zip(perm, shifts, strict=True)]
        _write_run(root / f"run{r:02d}", training, test, perm.tolist())
        perms[f"run{r:02d}"] = perm
    return perms


def _zip(folder: Path, target: Path, prefix: str) -> Path:
    with zipfile.ZipFile(target, "w") as z:
        for f in sorted(folder.rglob("*")):
            if f.is_file():
                z.write(f, prefix + f.relative_to(folder).as_posix())
    return target


@pytest.fixture(scope="module")
def runs_tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    root = tmp_path_factory.mktemp("oneshot") / "all_runs"
    return root, _write_runs(root)


@pytest.fixture
def runs_copy(runs_tree: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> Path:
    """A private copy of the runs for a test that breaks them."""
    return Path(shutil.copytree(runs_tree[0], tmp_path / "all_runs"))


def _same(a: list[ml.OneShotRun], b: list[ml.OneShotRun]) -> bool:
    return [r.name for r in a] == [r.name for r in b] and all(
        torch.equal(x, y)
        for ra, rb in zip(a, b, strict=True)
        for x, y in zip(ra.task, rb.task, strict=True)
    )


def test_zip_and_folder_forms_agree(runs_tree: tuple[Path, dict], tmp_path: Path) -> None:
    root, _ = runs_tree
    runs = ml.load_oneshot_runs(root)  # the folder holding run01 .. run20
    assert [r.name for r in runs] == [f"run{r:02d}" for r in range(1, 21)]
    assert _same(ml.load_oneshot_runs(root.parent), runs)  # a parent holding all_runs/
    flat = _zip(root, tmp_path / "flat.zip", "")
    nested = _zip(root, tmp_path / "all_runs.zip", "all_runs/")
    assert _same(ml.load_oneshot_runs(flat), runs)
    assert _same(ml.load_oneshot_runs(nested), runs)
    assert _same(ml.load_oneshot_runs(tmp_path), runs)  # a folder holding all_runs.zip


def test_labels_follow_class_labels_txt(runs_tree: tuple[Path, dict]) -> None:
    root, perms = runs_tree
    runs = ml.load_oneshot_runs(root)
    for run in runs:
        assert run.task.support_y.tolist() == list(range(20))
        assert run.task.query_y.tolist() == perms[run.name].tolist()
        assert run.task.support_x.shape == (20, 1, 28, 28)
        assert run.task.query_x.dtype == torch.float32
    assert any((p != np.arange(20)).any() for p in perms.values())  # not the identity


def _check_pixels_match_load_omniglot(
    npz_dir: Path, runs_dir: Path, sizes: tuple[int, ...]
) -> None:
    """Write the first two evaluation characters as a run's PNGs; compare with load_omniglot."""
    with np.load(npz_dir / "images_evaluation.npz") as z:
        white = z["images"][:2]  # bool [2, drawings, 105, 105], True = white
    training, test = [_png(w) for w in white[0, :20]], [_png(w) for w in white[1, :20]]
    for r in range(1, ONESHOT_RUNS + 1):
        _write_run(runs_dir / f"run{r:02d}", training, test, list(range(20)))
    for size in sizes:
        evaluation = ml.load_omniglot(
            npz_dir, split="background", image_size=size, cache=False
        ).test
        run = ml.load_oneshot_runs(runs_dir, image_size=size)[0]
        n_draw = int(evaluation.counts[0])
        assert torch.equal(run.task.support_x, evaluation.example(np.arange(20)))
        assert torch.equal(run.task.query_x, evaluation.example(n_draw + np.arange(20)))
        ink = run.task.support_x.mean()  # strokes are 1.0 on a 0.0 background
        assert 0.02 < float(ink) < 0.3 and float(run.task.support_x.max()) == 1.0


def test_pixels_match_load_omniglot(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    for part, n_chars in (("images_background", 1), ("images_evaluation", 2)):
        white = np.stack(
            [
                [
                    _stroke(int(rng.integers(20)), *map(int, rng.integers(-9, 10, 2)))
                    for _ in range(20)
                ]
                for _ in range(n_chars)
            ]
        )
        np.savez(tmp_path / f"{part}.npz", images=white)
    _check_pixels_match_load_omniglot(tmp_path, tmp_path / "runs", (28, 105))


@pytest.mark.integration
def test_pixels_match_load_omniglot_on_the_real_drawings(
    shared_omniglot: Path, tmp_path: Path
) -> None:
    _check_pixels_match_load_omniglot(shared_omniglot, tmp_path / "runs", (28,))


# ---------------------------------------------------------------- errors


def test_missing_sources_and_files_are_named(runs_copy: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no Omniglot one-shot runs at .*all_runs\.zip"):
        ml.load_oneshot_runs(tmp_path / "nowhere")
    gone = runs_copy / "run07" / "training" / "class13.png"
    kept = gone.read_bytes()
    gone.unlink()
    with pytest.raises(DataError, match=r"run07/training/class13\.png is missing") as e:
        ml.load_oneshot_runs(runs_copy)
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match=r"run07/training/class13\.png is missing"):
        ml.load_oneshot_runs(_zip(runs_copy, tmp_path / "broken.zip", "all_runs/"))
    gone.write_bytes(kept)
    shutil.rmtree(runs_copy / "run20")
    with pytest.raises(DataError, match=r"run20/class_labels\.txt is missing"):
        ml.load_oneshot_runs(_zip(runs_copy, tmp_path / "short.zip", ""))
    (tmp_path / "bad.zip").write_bytes(b"PK not a zip")
    with pytest.raises(DataError, match="not a valid zip"):
        ml.load_oneshot_runs(tmp_path / "bad.zip")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("run03/test/item01.png", r"line 1: expected 'run03/test/itemKK\.png run03/training/"),
        ("run03/test/item01.png run04/training/class01.png", "line 1: expected"),
        ("run03/test/item01.png run03/training/class21.png", "class21 is not one of"),
        ("run03/test/item00.png run03/training/class01.png", "item00 is not one of"),
        ("run03/test/item01.png run03/training/class01.png", "item01 is listed twice"),
        ("", "item02 has no line"),
    ],
)
def test_malformed_class_labels(runs_copy: Path, line: str, message: str) -> None:
    labels = runs_copy / "run03" / "class_labels.txt"
    kept = [ln for ln in labels.read_text().splitlines() if "item02" not in ln]
    labels.write_text("\n".join([line, *kept]) + "\n")
    with pytest.raises(DataError, match=message) as e:
        ml.load_oneshot_runs(runs_copy)
    assert "run03/class_labels.txt" in str(e.value)


def test_images_must_look_like_omniglot_drawings(runs_copy: Path) -> None:
    item = runs_copy / "run05" / "test" / "item09.png"
    item.write_bytes(_png(~_stroke(3)))  # white strokes on black
    with pytest.raises(DataError, match=r"item09\.png: more than half of it is ink.*inverted"):
        ml.load_oneshot_runs(runs_copy)
    item.write_bytes(_png(_stroke(3)[:100, :100]))
    with pytest.raises(
        DataError, match=r"item09\.png: is 100x100 pixels; the official runs are 105x105"
    ):
        ml.load_oneshot_runs(runs_copy)


def test_model_must_fit_the_runs(runs_tree: tuple[Path, dict]) -> None:
    runs = ml.load_oneshot_runs(runs_tree[0])
    five = ml.ConvNet4(5, hidden=8)
    with pytest.raises(ValueError) as e:
        ml.evaluate_oneshot_runs(five, None, runs, device="cpu")
    assert str(e.value) == (
        "the official runs are 20-way; this model is 5-way: train with "
        "configs/omniglot-20way-1shot.toml"
    )
    big = ml.load_oneshot_runs(runs_tree[0], image_size=56)
    with pytest.raises(ValueError, match="does not take the runs' images \\[1, 56, 56\\]"):
        ml.evaluate_oneshot_runs(ml.ConvNet4(20, hidden=8), None, big, device="cpu")


# ---------------------------------------------------------------- evaluation


@pytest.mark.integration
def test_adapted_model_classifies_separable_runs(runs_tree: tuple[Path, dict]) -> None:
    torch.set_num_threads(1)
    model = ml.ConvNet4(20, hidden=16)
    params = ml.init_params(model, 0)
    result = ml.evaluate_oneshot_runs(
        model, params, runs_tree[0], inner_steps=20, inner_lr=0.4, device="cpu"
    )
    assert result.runs == tuple(f"run{r:02d}" for r in range(1, 21))
    assert len(result.errors) == 20 and all(e * 20 == round(e * 20) for e in result.errors)
    assert result.mean_error == pytest.approx(sum(result.errors) / 20)
    assert result.mean_error <= HUMAN_ERROR_RATE  # separable by construction: near 0
    # the labels matter: the same runs with every item's label moved on by one are mostly wrong
    runs = ml.load_oneshot_runs(runs_tree[0])[:2]
    shifted = [
        ml.OneShotRun(r.name, r.task._replace(query_y=(r.task.query_y + 1) % 20)) for r in runs
    ]
    wrong = ml.evaluate_oneshot_runs(model, params, shifted, inner_steps=20, device="cpu")
    assert wrong.mean_error >= 0.8
