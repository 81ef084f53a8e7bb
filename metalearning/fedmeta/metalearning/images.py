"""Images grouped by class, and datasets stored as one folder per class.

* :class:`ClassDataset` - uint8 images ``[N, C, H, W]`` plus class offsets, with each class's group
  (the Omniglot alphabet) for non-IID partitioning; :class:`DataSplits` - meta-train / validation /
  meta-test class splits.
* :func:`load_image_folder` - any one-folder-per-class dataset (CIFAR-FS / Mini-ImageNet layout).
* :func:`image_folder_source_digest` - the identity of the files :func:`load_image_folder` reads.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from fedmeta.metalearning.digests import manifest_digest
from fedmeta.metalearning.errors import DataError
from fedmeta.metalearning.items import LOOK_BYTES, image_item_digest, model_input_looks

__all__ = [
    "ClassDataset",
    "DataSplits",
    "image_folder_source_digest",
    "load_image_folder",
    "pixels_to_unit",
]


#: The 256 pixel values in [0, 1], divided on the host (IEEE division, correctly rounded).
UNIT_PIXELS = torch.arange(256, dtype=torch.float32) / 255.0


def pixels_to_unit(images: Tensor) -> Tensor:
    """uint8 pixels (0..255) as float32 in [0, 1]: what every task and model input carries.

    On an accelerator the host's table is gathered instead of dividing there: CUDA's float
    division gave values one unit in the last place away from the host's (a GPU test found it),
    and a task must be the same task wherever it is built.
    """
    if images.device.type == "cpu":
        return images.float() / 255.0
    return UNIT_PIXELS.to(images.device)[images.long()]


@dataclass
class ClassDataset:
    """Images grouped by class.

    ``images`` is uint8 ``[N, C, H, W]`` (0..255; for Omniglot 255 = stroke), class ``c`` owns rows
    ``offsets[c]:offsets[c+1]``; ``groups[c]`` is its group (Omniglot alphabet; the class name for
    image folders), ``names[c]`` its name.
    """

    images: Tensor
    offsets: np.ndarray
    names: list[str]
    groups: list[str]
    source: str = ""
    #: Per image row: the content digest of the item it was made from, at source resolution
    #: (metalearning/items.py; uint64). A rotation keeps its source item's digest. None: unknown.
    item_ids: np.ndarray | None = None
    #: Per image row: the look of the model input it was made from (uint8 ``[N, 32]``,
    #: metalearning/items.py), aligned with ``item_ids``; a rotation keeps its source's look.
    item_looks: np.ndarray | None = None
    #: ``images`` copied to an accelerator, by device, on first use there (see :meth:`example`).
    _on_device: dict[str, Tensor] = field(default_factory=dict, init=False, repr=False,
                                          compare=False)  # fmt: skip

    def __post_init__(self) -> None:
        n = len(self.names)
        if self.offsets.shape != (n + 1,) or len(self.groups) != n:
            raise ValueError("offsets must have n_classes + 1 entries and groups n_classes")
        if n and int(self.offsets[-1]) != self.images.shape[0]:
            raise ValueError("offsets[-1] must equal the number of images")
        if self.item_ids is not None and self.item_ids.shape != (self.images.shape[0],):
            raise ValueError("item_ids must hold one digest per image")
        if self.item_looks is not None and self.item_looks.shape != (
            self.images.shape[0], LOOK_BYTES):  # fmt: skip
            raise ValueError(f"item_looks must hold one {LOOK_BYTES}-byte look per image")

    def items_of(self, classes: Iterable[int]) -> np.ndarray | None:
        """The item digests of ``classes``' images (None when the source gave none)."""
        if self.item_ids is None:
            return None
        cls = [int(c) for c in classes]
        if not cls:
            return np.zeros(0, np.uint64)
        return np.concatenate([self.item_ids[self.offsets[c] : self.offsets[c + 1]] for c in cls])

    def looks_of(self, classes: Iterable[int]) -> np.ndarray | None:
        """The looks of ``classes``' images, aligned with :meth:`items_of` (None: none known)."""
        if self.item_looks is None:
            return None
        rows = [np.arange(self.offsets[c], self.offsets[c + 1]) for c in (int(c) for c in classes)]
        if not rows:
            return np.zeros((0, LOOK_BYTES), np.uint8)
        looks: np.ndarray = self.item_looks[np.concatenate(rows)]
        return looks

    @property
    def n_classes(self) -> int:
        """Number of classes."""
        return len(self.names)

    @property
    def counts(self) -> np.ndarray:
        """Examples per class."""
        return np.diff(self.offsets)

    def digest(self) -> str:
        """SHA-256 (hex) of the classes' names, sizes and pixels: what a ledger record names."""
        h = hashlib.sha256()
        h.update(json.dumps([self.names, self.counts.tolist()]).encode() + b"\0")
        h.update(self.images.contiguous().numpy().tobytes())
        return h.hexdigest()

    def subset(self, classes: Iterable[int]) -> ClassDataset:
        """Return a dataset of the given classes (in that order)."""
        cls = [int(c) for c in classes]
        if not cls:
            shape = (0, *self.images.shape[1:])
            return ClassDataset(
                torch.empty(shape, dtype=torch.uint8),
                np.zeros(1, np.int64),
                [],
                [],
                self.source,
                None if self.item_ids is None else np.zeros(0, np.uint64),
                None if self.item_looks is None else np.zeros((0, LOOK_BYTES), np.uint8),
            )
        idx = np.concatenate([np.arange(self.offsets[c], self.offsets[c + 1]) for c in cls])
        counts = self.counts[cls]
        return ClassDataset(
            self.images[torch.from_numpy(idx)],
            np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            [self.names[c] for c in cls],
            [self.groups[c] for c in cls],
            self.source,
            None if self.item_ids is None else self.item_ids[idx],
            None if self.item_looks is None else self.item_looks[idx],
        )

    def with_rotations(self, angles: Sequence[int] = (0, 90, 180, 270)) -> ClassDataset:
        """Each rotation of each class becomes a new class (MAML's Omniglot augmentation).

        Class ``c`` rotated by ``angles[j]`` is class ``j * n_classes + c`` and keeps ``c``'s group,
        so a group-wise partition keeps all rotations of a character with one participant.
        """
        parts, names, groups, offsets = [], [], [], [0]
        for a in angles:
            if a % 90:
                raise ValueError(f"angles must be multiples of 90; got {a}")
            parts.append(torch.rot90(self.images, k=(a // 90) % 4, dims=(-2, -1)))
            names += [f"{n}@rot{a}" for n in self.names]
            groups += list(self.groups)
            offsets += list(int(offsets[-1]) + self.offsets[1:])
        items = None if self.item_ids is None else np.tile(self.item_ids, len(angles))
        looks = None if self.item_looks is None else np.tile(self.item_looks, (len(angles), 1))
        return ClassDataset(torch.cat(parts).contiguous(), np.asarray(offsets, np.int64), names,
                            groups, self.source, items, looks)  # fmt: skip

    def example(self, idx: np.ndarray, device: torch.device | None = None) -> Tensor:
        """Float images in [0, 1] for global example indices ``idx`` (any shape), on ``device``.

        On an accelerator the uint8 images are copied there once and the examples gathered and
        converted there: a GPU round's tasks are then built without the host (DP-MAML's round
        gathers 48,000 images), with the host's values (:func:`pixels_to_unit`).
        """
        images = self.images
        if device is not None and device.type != "cpu":
            key = str(device)
            if key not in self._on_device:
                self._on_device[key] = self.images.to(device)
            images = self._on_device[key]
        index = torch.from_numpy(np.asarray(idx, np.int64).reshape(-1)).to(images.device)
        return pixels_to_unit(images[index]).reshape(*np.shape(idx), *self.images.shape[1:])


class DataSplits(NamedTuple):
    """Meta-train / validation / meta-test class splits (disjoint classes)."""

    train: ClassDataset
    val: ClassDataset
    test: ClassDataset


# --------------------------------------------------------------------------------------------------
# one folder per class

_IMG_EXT = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
_SPLITS = ("train", "val", "test")


def _split_roots(root: Path) -> list[Path]:
    """The folders of class folders under ``root``: its train/val/test, or ``root`` itself."""
    if not root.is_dir():
        raise DataError(f"{root}: expected a directory of class folders (one folder per class)")
    if all((root / s).is_dir() for s in _SPLITS):
        return [root / s for s in _SPLITS]
    return [root]


def _class_files(root: Path) -> list[tuple[Path, list[Path]]]:
    """``(class folder, its image files)`` in sorted order: exactly what the loader reads."""
    classes = sorted(d for d in root.iterdir() if d.is_dir())
    if not classes:
        raise DataError(f"{root}: expected one sub-folder per class containing images; found none")
    out = []
    for d in classes:
        files = sorted(f for f in d.iterdir() if f.suffix.lower() in _IMG_EXT)
        if not files:
            raise DataError(f"{d}: class folder has no images ({', '.join(sorted(_IMG_EXT))})")
        out.append((d, files))
    return out


def _read_class_folders(root: Path, image_size: int, channels: int) -> ClassDataset:
    from PIL import Image

    arrays, names, counts, items = [], [], [], []
    mode = "L" if channels == 1 else "RGB"
    for d, files in _class_files(root):
        for f in files:
            try:
                with Image.open(f) as raw:
                    items.append(image_item_digest(raw))  # at the resolution it was stored in
                    im = raw.convert(mode)
                    if im.size != (image_size, image_size):
                        im = im.resize((image_size, image_size), Image.Resampling.BILINEAR)
                    a = np.asarray(im, dtype=np.uint8)
            except Exception as e:  # noqa: BLE001
                raise DataError(f"{f}: not a readable image ({e})") from e
            arrays.append(a[None] if channels == 1 else a.transpose(2, 0, 1))
        names.append(d.name)
        counts.append(len(files))
    images = np.stack(arrays)
    return ClassDataset(
        torch.from_numpy(images),
        np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        names,
        list(names),
        str(root),
        np.asarray(items, dtype=np.uint64),
        model_input_looks(images),  # what the model sees, as every loader names it
    )


def load_image_folder(
    path: str | Path,
    *,
    image_size: int = 84,
    channels: int = 3,
    fractions: tuple[float, float, float] = (0.64, 0.16, 0.20),
    seed: int = 0,
) -> DataSplits:
    """Load a one-folder-per-class image dataset (CIFAR-FS / Mini-ImageNet layout).

    If ``path`` has ``train/``, ``val/`` and ``test/`` sub-folders, each is a split of class
    folders; otherwise its class folders are shuffled with ``seed`` and split by ``fractions``
    (64/16/20 as for Mini-ImageNet and CIFAR-FS). Images are resized to ``image_size`` and stored as
    uint8.
    """
    root = Path(path)
    roots = _split_roots(root)
    if len(roots) == 3:
        return DataSplits(*(_read_class_folders(r, image_size, channels) for r in roots))
    ds = _read_class_folders(root, image_size, channels)
    if abs(sum(fractions) - 1) > 1e-9 or min(fractions) < 0:
        raise ValueError(f"fractions must be non-negative and sum to 1; got {fractions}")
    perm = np.random.default_rng([int(seed), 0xF01D]).permutation(ds.n_classes)
    n_tr = int(round(fractions[0] * ds.n_classes))
    n_va = int(round(fractions[1] * ds.n_classes))
    parts = (perm[:n_tr], perm[n_tr : n_tr + n_va], perm[n_tr + n_va :])
    return DataSplits(*(ds.subset(np.sort(p)) for p in parts))


def image_folder_source_digest(path: str | Path) -> str:
    """SHA-256 identity of the image files :func:`load_image_folder` would read under ``path``.

    It covers every image file (by extension) in every class folder - of ``train/``, ``val/`` and
    ``test/`` when all three exist, else of ``path`` - by its path relative to ``path`` and its
    bytes (:func:`~metalearning.digests.manifest_digest`). It does not depend on ``image_size``,
    ``seed``, ``fractions``, partitions or participants; other files in the tree (a README, a
    non-image file) are not covered, since the loader ignores them. Renaming a class folder changes
    it (class names are labels). File digests are cached per ``(path, size, mtime)``, so a second
    call costs a ``stat`` per file.
    """
    root = Path(path)
    files = [f for r in _split_roots(root) for _, fs in _class_files(r) for f in fs]
    return manifest_digest(root, files)
