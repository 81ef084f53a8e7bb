"""The public warm start (metalearning.warm_start) and Omniglot's evaluation split."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fedmeta.metalearning as ml
from fedmeta.metalearning import DataError
from fedmeta.metalearning.omniglot import (
    OMNIGLOT_N_BACKGROUND,
    _public_characters,
    _split_characters,
)

pytestmark = pytest.mark.unit


def _pattern_classes(n_classes: int, per_class: int = 8, seed: int = 0) -> ml.ClassDataset:
    """Classes that a conv net can tell apart: a fixed random stroke pattern each, plus noise."""
    rng = np.random.default_rng(seed)
    base = rng.random((n_classes, 1, 28, 28)) < 0.15
    flips = rng.random((n_classes, per_class, 1, 28, 28)) < 0.03
    images = (base[:, None] ^ flips).reshape(-1, 1, 28, 28).astype(np.uint8) * 255
    return ml.ClassDataset(
        torch.from_numpy(images),
        np.arange(n_classes + 1) * per_class,
        [f"{i:04d}" for i in range(n_classes)],
        [f"a{i // 4}" for i in range(n_classes)],
    )


def test_evaluation_split_keeps_the_background_alphabets_out_and_public() -> None:
    prefixes = list(range(1, 1624))
    train, val, test = _split_characters(Path("x"), "evaluation", 1623, prefixes, 0)
    public = _public_characters("evaluation", prefixes)
    assert public is not None
    assert (len(train), len(val), len(test), len(public)) == (445, 50, 164, 964)
    private = np.concatenate([train, val, test])
    assert len(set(private.tolist())) == 659
    assert all(prefixes[c] > OMNIGLOT_N_BACKGROUND for c in private)
    assert all(prefixes[c] <= OMNIGLOT_N_BACKGROUND for c in public)
    again = _split_characters(Path("x"), "evaluation", 1623, prefixes, 0)
    assert all(np.array_equal(a, b) for a, b in zip(again, (train, val, test), strict=True))
    assert _public_characters("dpmaml", prefixes) is None
    with pytest.raises(DataError, match="659 evaluation characters"):
        _split_characters(Path("x"), "evaluation", 50, list(range(1, 51)), 0)


def test_public_classes_shared_with_private_ones_are_refused() -> None:
    ds = _pattern_classes(12)
    public, private = ds.subset(range(6)), ds.subset(range(6, 12))
    ml.check_disjoint(public, [private])
    with pytest.raises(DataError, match=r"2 public classes are also private.*0004, 0005"):
        ml.check_disjoint(public, [private, ds.subset([4, 5])])


def test_warm_start_is_deterministic_and_helps_on_held_out_public_tasks() -> None:
    ds = _pattern_classes(24)
    public, held_out = ds.subset(range(16)), ds.subset(range(16, 24))
    model = ml.ConvNet4(3, in_channels=1, image_size=28)
    start = ml.flatten_params(ml.init_params(model, 0)).float()
    kw = {"n_way": 3, "k_shot": 1, "q_query": 2, "seed": 5}
    short = ml.WarmStart(steps=2, tasks_per_step=2, meta_lr=3e-3, inner_steps=1, inner_lr=0.4,
                         first_order=True)  # fmt: skip
    once = ml.public_warm_start(model, start, public, short, **kw)
    assert torch.equal(once, ml.public_warm_start(model, start, public, short, **kw))
    assert not torch.equal(once, start)
    how = ml.WarmStart(steps=10, tasks_per_step=4, meta_lr=3e-3, inner_steps=1, inner_lr=0.4,
                       first_order=True)  # fmt: skip
    warm = ml.public_warm_start(model, start, public, how, **kw)
    assert warm.dtype == torch.float32 and warm.shape == start.shape
    # Held-out classes of the same kind: 37% before, 56% after on the machine that wrote this.
    tasks = ml.sample_tasks(held_out, n_way=3, k_shot=1, q_query=2, n_tasks=60, seed=9)
    before = ml.evaluate(model, start, tasks, inner_steps=1, device="cpu").mean
    after = ml.evaluate(model, warm, tasks, inner_steps=1, device="cpu").mean
    assert after > before + 0.1, (before, after)


def test_the_warm_start_is_computed_once_per_settings_and_cache_damage_recomputes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedmeta.metalearning import warm_start as ws

    public = _pattern_classes(6)
    model = ml.ConvNet4(3, hidden=8)
    params = ml.flatten_params(ml.init_params(model, 0))
    how = ml.WarmStart(2, 2, 1e-3, 1, 0.4, True)
    calls: list[int] = []
    real = ws.meta_train

    def counted(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(ws, "meta_train", counted)

    def warm(how: ml.WarmStart = how, seed: int = 0, cache: Path | None = tmp_path) -> torch.Tensor:
        return ml.public_warm_start(model, params, public, how, n_way=3, k_shot=1, q_query=2,
                                    seed=seed, cache_dir=cache)  # fmt: skip

    first = warm()
    assert torch.equal(warm(), first) and len(calls) == 1  # read back, bit for bit
    assert torch.equal(first, warm(cache=None))  # the cache holds what pre-training computes
    calls.clear()
    warm(seed=1)
    warm(ml.WarmStart(3, 2, 1e-3, 1, 0.4, True))
    assert len(calls) == 2  # another seed or setting is another warm start
    (cached,) = [p for p in tmp_path.glob("warm-start-*.npy")
                 if torch.equal(torch.from_numpy(np.load(p)), first)]  # fmt: skip
    cached.write_bytes(b"not an array")
    assert torch.equal(warm(), first) and len(calls) == 3  # damaged: recomputed, rewritten
    assert torch.equal(torch.from_numpy(np.load(cached)), first)


def test_the_public_data_digest_names_its_content() -> None:
    """What the ledger records: equal for equal classes, changed by one pixel or one name."""
    public = _pattern_classes(6)
    assert public.digest() == _pattern_classes(6).digest() and len(public.digest()) == 64
    edited = _pattern_classes(6)
    edited.images[3, 0, 5, 5] ^= 255
    renamed = _pattern_classes(6)
    renamed.names[0] = "other"
    digests = {public.digest(), edited.digest(), renamed.digest(), public.subset(range(5)).digest()}
    assert len(digests) == 4
