"""Task data for the meta-learning workload: sinusoids, Omniglot, image folders, federated sets.

Everything random takes an explicit seed or ``numpy.random.Generator``; nothing touches a global
RNG.

* :class:`Task` - one N-way K-shot task ``(support_x, support_y, query_x, query_y)``; batched when
  the tensors carry a leading task dimension (:func:`stack_tasks`).
* :class:`SinusoidTasks` - the MAML regression benchmark (amplitude [0.1, 5], phase [0, pi], x [-5,
  5]).
* :class:`ClassDataset` - images grouped by class (uint8 ``[N, C, H, W]`` plus class offsets), with
  the class's group (Omniglot alphabet) for non-IID partitioning.
* :func:`load_omniglot` - npz / zip / unpacked-folder Omniglot, resized to 28x28, split into
  :class:`DataSplits` (DP-MAML 1150/50/423 characters, or background/evaluation), cached by
  checksum.
* :func:`load_image_folder` - any one-folder-per-class dataset (CIFAR-FS / Mini-ImageNet layout).
* :func:`download_omniglot` / :func:`verify_checksum` - opt-in download with a digest check.
* :class:`FederatedTaskSet` - participants owning disjoint classes (or task-distribution slices),
  each with a fixed, numbered task list; task ``t`` of participant ``p`` is a pure function of
  ``(seed, p, t)``, stable across rounds and restarts.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import re
import time
import urllib.request
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "ChecksumError",
    "ClassDataset",
    "DataError",
    "DataSplits",
    "FederatedTaskSet",
    "OMNIGLOT_FILES",
    "ParticipantTasks",
    "SinusoidParticipant",
    "SinusoidTasks",
    "Task",
    "download_omniglot",
    "load_image_folder",
    "load_omniglot",
    "partition_classes",
    "sample_tasks",
    "stack_tasks",
    "verify_checksum",
]


class DataError(ValueError):
    """Missing or malformed data; the message says what was expected and where."""


class ChecksumError(DataError):
    """A file's digest does not match the expected one."""


# --------------------------------------------------------------------------------------------------
# tasks


class Task(NamedTuple):
    """One task (or a batch of tasks with a leading task dimension)."""

    support_x: Tensor
    support_y: Tensor
    query_x: Tensor
    query_y: Tensor

    def to(self, device: torch.device | str) -> Task:
        """Move all four tensors to ``device`` (no copy when already there)."""
        return Task(*(t.to(device, non_blocking=True) for t in self))

    def task(self, i: int) -> Task:
        """Task ``i`` of a batch."""
        return Task(*(t[i] for t in self))

    @property
    def num_tasks(self) -> int:
        """Leading dimension of a batched task."""
        return int(self.support_x.shape[0])


def stack_tasks(tasks: Sequence[Task]) -> Task:
    """Stack unbatched tasks of one shape into a batched :class:`Task`."""
    if not tasks:
        raise ValueError("stack_tasks needs at least one task")
    return Task(*(torch.stack(parts) for parts in zip(*tasks, strict=True)))


def _rng(seed: int, *path: int) -> np.random.Generator:
    """Return a Generator that is a pure function of ``(seed, *path)``."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, *(int(p) for p in path)])


# --------------------------------------------------------------------------------------------------
# sinusoid


@dataclass(frozen=True)
class SinusoidTasks:
    """Sinusoid regression tasks y = A sin(x - phase) (Finn et al. 2017, Section 5.1).

    ``k_support`` and ``k_query`` points per task, x uniform in ``x_range``; amplitude and phase
    uniform in their ranges.
    """

    k_support: int = 10
    k_query: int = 10
    amplitude_range: tuple[float, float] = (0.1, 5.0)
    phase_range: tuple[float, float] = (0.0, math.pi)
    x_range: tuple[float, float] = (-5.0, 5.0)

    def __post_init__(self) -> None:
        if self.k_support < 1 or self.k_query < 1:
            raise ValueError(
                f"k_support and k_query must be >= 1; got {self.k_support}, {self.k_query}"
            )
        for name in ("amplitude_range", "phase_range", "x_range"):
            lo, hi = getattr(self, name)
            if not lo <= hi:
                raise ValueError(f"{name} must be (low, high) with low <= high; got {(lo, hi)}")

    def task_from_rng(self, rng: np.random.Generator) -> tuple[Task, float, float]:
        """One task and its (amplitude, phase), drawn from ``rng``."""
        amp = rng.uniform(*self.amplitude_range)
        phase = rng.uniform(*self.phase_range)
        x = rng.uniform(*self.x_range, size=(self.k_support + self.k_query, 1))
        y = amp * np.sin(x - phase)
        xt = torch.from_numpy(x.astype(np.float32))
        yt = torch.from_numpy(y.astype(np.float32))
        k = self.k_support
        return Task(xt[:k], yt[:k], xt[k:], yt[k:]), float(amp), float(phase)

    def sample(self, n_tasks: int, seed: int) -> Task:
        """``n_tasks`` tasks as one batch; task i is a function of ``(seed, i)`` only."""
        return stack_tasks([self.task_from_rng(_rng(seed, 0x51, i))[0] for i in range(n_tasks)])


# --------------------------------------------------------------------------------------------------
# class datasets


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

    def __post_init__(self) -> None:
        n = len(self.names)
        if self.offsets.shape != (n + 1,) or len(self.groups) != n:
            raise ValueError("offsets must have n_classes + 1 entries and groups n_classes")
        if n and int(self.offsets[-1]) != self.images.shape[0]:
            raise ValueError("offsets[-1] must equal the number of images")

    @property
    def n_classes(self) -> int:
        """Number of classes."""
        return len(self.names)

    @property
    def counts(self) -> np.ndarray:
        """Examples per class."""
        return np.diff(self.offsets)

    def subset(self, classes: Iterable[int]) -> ClassDataset:
        """Return a dataset of the given classes (in that order)."""
        cls = [int(c) for c in classes]
        if not cls:
            shape = (0, *self.images.shape[1:])
            return ClassDataset(
                torch.empty(shape, dtype=torch.uint8), np.zeros(1, np.int64), [], [], self.source
            )
        idx = np.concatenate([np.arange(self.offsets[c], self.offsets[c + 1]) for c in cls])
        counts = self.counts[cls]
        return ClassDataset(
            self.images[torch.from_numpy(idx)],
            np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            [self.names[c] for c in cls],
            [self.groups[c] for c in cls],
            self.source,
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
        return ClassDataset(
            torch.cat(parts).contiguous(), np.asarray(offsets, np.int64), names, groups, self.source
        )

    def example(self, idx: np.ndarray) -> Tensor:
        """Float images in [0, 1] for global example indices ``idx`` (any shape)."""
        t = self.images[torch.from_numpy(np.asarray(idx, np.int64).reshape(-1))]
        return (t.float() / 255.0).reshape(*np.shape(idx), *self.images.shape[1:])


class DataSplits(NamedTuple):
    """Meta-train / validation / meta-test class splits (disjoint classes)."""

    train: ClassDataset
    val: ClassDataset
    test: ClassDataset


def _task_from_plan(ds: ClassDataset, plan: np.ndarray, k_shot: int) -> Task:
    """Build a task from ``plan`` [n_way, k_shot + q] global example indices; label = row index."""
    n_way, per = plan.shape
    x = ds.example(plan)  # [n_way, per, C, H, W]
    y = torch.arange(n_way).repeat_interleave(per).reshape(n_way, per)
    sx = x[:, :k_shot].reshape(-1, *x.shape[2:])
    qx = x[:, k_shot:].reshape(-1, *x.shape[2:])
    return Task(sx, y[:, :k_shot].reshape(-1), qx, y[:, k_shot:].reshape(-1))


def _draw_plan(
    ds: ClassDataset, classes: np.ndarray, n_way: int, per: int, rng: np.random.Generator
) -> np.ndarray:
    chosen = rng.choice(classes, size=n_way, replace=False)
    rows = []
    for c in chosen:
        lo, hi = int(ds.offsets[c]), int(ds.offsets[c + 1])
        rows.append(lo + rng.choice(hi - lo, size=per, replace=False))
    return np.stack(rows)


def _check_task_shape(ds: ClassDataset, classes: np.ndarray, n_way: int, per: int) -> None:
    if n_way < 1 or per < 2:
        raise ValueError(f"n_way must be >= 1 and k_shot, q_query >= 1; got {n_way}, {per}")
    eligible = int((ds.counts[classes] >= per).sum()) if len(classes) else 0
    if eligible < n_way:
        raise ValueError(
            f"need {n_way} classes with >= {per} examples (k_shot + q_query) for a task; "
            f"only {eligible} of {len(classes)} classes qualify"
        )


def sample_tasks(
    ds: ClassDataset, *, n_way: int, k_shot: int, q_query: int, n_tasks: int, seed: int
) -> Task:
    """``n_tasks`` N-way K-shot tasks (``q_query`` queries per class) from all classes of ``ds``.

    For validation / meta-test evaluation (default 600 tasks in
    :func:`~metalearning.maml.evaluate`'s usage). Task i depends only on ``(seed, i)``.
    """
    per = k_shot + q_query
    classes = np.flatnonzero(ds.counts >= per)
    _check_task_shape(ds, np.arange(ds.n_classes), n_way, per)
    return stack_tasks(
        [
            _task_from_plan(ds, _draw_plan(ds, classes, n_way, per, _rng(seed, 0x7E57, i)), k_shot)
            for i in range(n_tasks)
        ]
    )


# --------------------------------------------------------------------------------------------------
# Omniglot

OMNIGLOT_BASE_URL = "https://raw.githubusercontent.com/brendenlake/omniglot/master/python/"

#: Known digests of the official release zips. The MD5s are the ones torchvision pins for these
# files
#: (torchvision/datasets/omniglot.py). SHA-256 values were not obtainable offline when this was
# written;
#: :func:`download_omniglot` therefore checks MD5 and records the SHA-256 it saw beside the file,
# and  callers may pin a SHA-256 with ``sha256=``.
OMNIGLOT_FILES: dict[str, dict[str, str | None]] = {
    "images_background.zip": {"md5": "68d2efa1b9178cc56df9314c21c6e718", "sha256": None},
    "images_evaluation.zip": {"md5": "6b91aef0f799c5bb55b94e3f2daec811", "sha256": None},
}

# Alphabets by first original character prefix (1-based), from ../shared/data/omniglot/README.md.
_ALPHABETS: list[tuple[int, str]] = [
    (1, "Arcadian"), (27, "Armenian"), (68, "Asomtavruli_(Georgian)"), (108, "Balinese"),
    (132, "Bengali"), (178, "Blackfoot_(Canadian_Aboriginal_Syllabics)"), (192, "Braille"),
    (218, "Cyrillic"), (251, "Early_Aramaic"), (273, "Syriac_(Estrangelo)"),
    (296, "Anglo-Saxon_Futhorc"), (325, "Futurama"), (351, "Grantha"), (394, "Greek"),
    (418, "Gujarati"), (466, "Hebrew"), (488, "Japanese_(hiragana)"),
    (540, "Inuktitut_(Canadian_Aboriginal_Syllabics)"), (556, "Malay_(Jawi_-_Arabic)"),
    (596, "Japanese_(katakana)"), (643, "Korean"), (683, "Latin"), (709, "Alphabet_of_the_Magi"),
    (729, "Mkhedruli_(Georgian)"), (770, "Burmese_(Myanmar)"), (804, "N_Ko"), (837,
    "Ojibwe_(Canadian_Aboriginal_Syllabics)"),
    (851, "Sanskrit"), (893, "Tagalog"), (910, "Tifinagh"),
    (965, "Angelic"), (985, "Atemayar_Qelisayer"), (1011, "Atlantean"), (1037, "Aurek-Besh"),
    (1063, "Avesta"), (1089, "Ge_ez"), (1115, "Glagolitic"), (1160, "Gurmukhi"), (1205, "Kannada"),
    (1246, "Keble"), (1272, "Malayalam"), (1319, "Manipuri"), (1359, "Mongolian"),
    (1389, "Old_Church_Slavonic_(Cyrillic)"), (1434, "Oriya"), (1480, "Syriac_(Serto)"),
    (1503, "Sylheti"), (1531, "Tengwar"), (1556, "Tibetan"), (1598, "ULOG"),
]  # fmt: skip
OMNIGLOT_N_BACKGROUND = 964
OMNIGLOT_N_EVALUATION = 659
_CACHE_VERSION = 1


def _alphabet_of(prefix: int) -> str:
    name = _ALPHABETS[0][1]
    for start, n in _ALPHABETS:
        if prefix >= start:
            name = n
    return name


def _file_digest(path: Path, algo: str = "sha256") -> str:
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify_checksum(path: str | Path, *, sha256: str | None = None, md5: str | None = None) -> str:
    """Check ``path`` against the given digests; return its SHA-256 (or raise ChecksumError)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"expected a file at {path}; none found")
    got = _file_digest(path, "sha256")
    if sha256 is not None and got != sha256.lower():
        raise ChecksumError(
            f"{path}: SHA-256 {got} does not match the expected {sha256.lower()}; the file is "
            "corrupted or not the official release - delete it and download again"
        )
    if md5 is not None:
        got_md5 = _file_digest(path, "md5")
        if got_md5 != md5.lower():
            raise ChecksumError(
                f"{path}: MD5 {got_md5} does not match the expected {md5.lower()}; the file is "
                "corrupted or not the official release - delete it and download again"
            )
    return got


def download_omniglot(
    dest: str | Path,
    *,
    base_url: str = OMNIGLOT_BASE_URL,
    checksums: Mapping[str, Mapping[str, str | None]] | None = None,
    timeout: float = 60.0,
) -> Path:
    """Download ``images_background.zip`` and ``images_evaluation.zip`` into ``dest`` (opt-in).

    Each file is fetched to a temporary name, checked against ``checksums`` (default
    :data:`OMNIGLOT_FILES`) and only then renamed into place; a mismatch deletes it and raises
    :class:`ChecksumError`. Files already present are verified, not refetched. The SHA-256 of each
    verified file is written to ``<file>.sha256``. Returns ``dest``.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    sums = dict(checksums or OMNIGLOT_FILES)
    for name, digests in sums.items():
        target = dest / name
        if not target.is_file():
            tmp = target.with_suffix(".part")
            try:
                with (
                    urllib.request.urlopen(base_url + name, timeout=timeout) as r,
                    open(tmp, "wb") as f,
                ):
                    while block := r.read(1 << 20):
                        f.write(block)
                verify_checksum(tmp, sha256=digests.get("sha256"), md5=digests.get("md5"))
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            tmp.replace(target)
        got = verify_checksum(target, sha256=digests.get("sha256"), md5=digests.get("md5"))
        target.with_name(name + ".sha256").write_text(f"{got}  {name}\n")
    return dest


_PNG_RE = re.compile(r"(?:^|/)(?P<alpha>[^/]+)/character\d+/(?P<char>\d+)_(?P<draw>\d+)\.png$")


def _decode_png(data: bytes, where: str) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            arr = np.asarray(im.convert("L")) > 127
    except Exception as e:  # noqa: BLE001 - re-raised with the location
        raise DataError(f"{where}: not a readable PNG image ({e})") from e
    return arr


def _assemble(
    entries: list[tuple[int, int, str, np.ndarray]], where: str
) -> tuple[np.ndarray, list[str], list[int]]:
    """(char prefix, drawing, alphabet, bool image) -> white-True array [chars, draws, H, W]."""
    if not entries:
        raise DataError(
            f"{where}: no Omniglot drawings found; expected <alphabet>/characterNN/<NNNN>_<DD>.png"
        )
    chars = sorted({e[0] for e in entries})
    draws = sorted({e[1] for e in entries})
    shape = entries[0][3].shape
    pos_c = {c: i for i, c in enumerate(chars)}
    pos_d = {d: i for i, d in enumerate(draws)}
    out = np.ones((len(chars), len(draws), *shape), dtype=bool)
    seen = np.zeros((len(chars), len(draws)), dtype=bool)
    alpha = [""] * len(chars)
    for c, d, a, img in entries:
        if img.shape != shape:
            raise DataError(f"{where}: character {c} drawing {d} is {img.shape}, expected {shape}")
        out[pos_c[c], pos_d[d]] = img
        seen[pos_c[c], pos_d[d]] = True
        alpha[pos_c[c]] = a
    if not seen.all():
        c, d = np.argwhere(~seen)[0]
        raise DataError(
            f"{where}: character {chars[c]} lacks drawing {draws[d]}; every character needs "
            f"{len(draws)} drawings"
        )
    return out, alpha, chars


def _read_zip(path: Path) -> tuple[np.ndarray, list[str], list[int]]:
    entries = []
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                m = _PNG_RE.search(info.filename)
                if m:
                    img = _decode_png(z.read(info), f"{path}:{info.filename}")
                    entries.append((int(m["char"]), int(m["draw"]), m["alpha"], img))
    except zipfile.BadZipFile as e:
        raise DataError(
            f"{path}: not a valid zip file ({e}); expected the Omniglot release zip"
        ) from e
    return _assemble(entries, str(path))


def _read_folder(path: Path) -> tuple[np.ndarray, list[str], list[int]]:
    entries = []
    for f in sorted(path.rglob("*.png")):
        m = _PNG_RE.search(f.relative_to(path.parent).as_posix())
        if m:
            entries.append(
                (int(m["char"]), int(m["draw"]), m["alpha"], _decode_png(f.read_bytes(), str(f)))
            )
    return _assemble(entries, str(path))


def _read_npz(path: Path) -> tuple[np.ndarray, list[str], list[int]]:
    try:
        with np.load(path) as z:
            if "images" not in z:
                raise DataError(
                    f"{path}: expected an array 'images' (bool [chars, 20, 105, 105]); "
                    f"found {list(z)}"
                )
            images = z["images"]
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"{path}: not a readable npz file ({e})") from e
    if images.ndim != 4 or images.dtype != np.bool_:
        raise DataError(
            f"{path}: 'images' must be bool [chars, drawings, H, W]; "
            f"got {images.dtype} {images.shape}"
        )
    first = 1 if "background" in path.name else OMNIGLOT_N_BACKGROUND + 1
    prefixes = list(range(first, first + images.shape[0]))
    return images, [_alphabet_of(p) for p in prefixes], prefixes


def _resize_strokes(white: np.ndarray, size: int, chunk: int = 4096) -> Tensor:
    """White-True bool [n, H, W] -> uint8 [n, 1, size, size] stroke intensity (255 = ink).

    Anti-aliased bilinear downsampling in chunks (vectorised; about 1 s for all 32,460 drawings).
    """
    n = white.shape[0]
    out = torch.empty((n, 1, size, size), dtype=torch.uint8)
    for s in range(0, n, chunk):
        x = torch.from_numpy(~white[s : s + chunk]).float().unsqueeze(1)
        if x.shape[-1] != size or x.shape[-2] != size:
            x = F.interpolate(
                x, size=(size, size), mode="bilinear", antialias=True, align_corners=False
            )
        out[s : s + chunk] = (x.clamp(0, 1) * 255).round().to(torch.uint8)
    return out


def default_cache_dir() -> Path:
    """``$FEDMETA_CACHE_DIR``, else ``$XDG_CACHE_HOME/fedmeta``, else ``~/.cache/fedmeta``."""
    if d := os.environ.get("FEDMETA_CACHE_DIR"):
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fedmeta"


def _find_omniglot_sources(path: Path) -> tuple[str, list[Path]]:
    parts = ("images_background", "images_evaluation")
    for kind, suffix in (("npz", ".npz"), ("zip", ".zip"), ("folder", "")):
        cands = [path / (p + suffix) for p in parts]
        ok = [c.is_file() if suffix else c.is_dir() for c in cands]
        if all(ok):
            return kind, cands
    raise DataError(
        f"no Omniglot data at {path}: expected images_background.npz + images_evaluation.npz, "
        "images_background.zip + images_evaluation.zip (the official release; "
        "metalearning.data.download_omniglot fetches them), or the unpacked folders "
        "images_background/ + images_evaluation/"
        + ("" if path.is_dir() else f" (and {path} is not a directory)")
    )


def _load_omniglot_all(
    path: Path, image_size: int, cache: bool | str | Path
) -> tuple[Tensor, list[str], list[int]]:
    """All characters (background, evaluation): uint8 [chars, 20, 1, s, s], alphabets, prefixes."""
    kind, files = _find_omniglot_sources(path)
    cache_file = None
    if cache and kind != "folder":
        key = hashlib.sha256(
            ("|".join(_file_digest(f) for f in files) + f"|{image_size}|v{_CACHE_VERSION}").encode()
        ).hexdigest()[:24]
        cdir = default_cache_dir() if cache is True else Path(cache)
        cache_file = cdir / f"omniglot-{image_size}-{key}.npz"
        if cache_file.is_file():
            try:
                with np.load(cache_file) as z:
                    return (
                        torch.from_numpy(z["images"]),
                        [str(a) for a in z["alphabets"]],
                        [int(p) for p in z["prefixes"]],
                    )
            except Exception:  # noqa: BLE001 - a broken cache is rebuilt
                cache_file.unlink(missing_ok=True)
    reader = {"npz": _read_npz, "zip": _read_zip, "folder": _read_folder}[kind]
    imgs, alphas, prefixes = [], [], []
    for f in files:
        white, a, p = reader(f)
        c, d, h, w = white.shape
        imgs.append(
            _resize_strokes(white.reshape(c * d, h, w), image_size).reshape(
                c, d, 1, image_size, image_size
            )
        )
        alphas += a
        prefixes += p
    draws = {t.shape[1] for t in imgs}
    if len(draws) != 1:
        raise DataError(
            f"{path}: background and evaluation sets have different drawings per character {draws}"
        )
    images = torch.cat(imgs)
    if cache_file is not None:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".{os.getpid()}.tmp.npz")
            np.savez(
                tmp, images=images.numpy(), alphabets=np.array(alphas), prefixes=np.array(prefixes)
            )
            tmp.replace(cache_file)
        except OSError:
            pass  # caching is an optimisation only
    return images, alphas, prefixes


def load_omniglot(
    path: str | Path,
    *,
    split: str = "dpmaml",
    rotations: bool = False,
    image_size: int = 28,
    seed: int = 0,
    cache: bool | str | Path = True,
    download: bool = False,
) -> DataSplits:
    """Load Omniglot from ``path``; split its characters into meta-train / validation / meta-test.

    ``path`` holds ``images_background`` + ``images_evaluation`` as npz (``images`` bool [chars, 20,
    105, 105], True = white), as the official zips, or as their unpacked folders. Drawings are
    resized to ``image_size`` (28) as uint8 stroke intensity; the resized array is cached in
    :func:`default_cache_dir` keyed by the sources' SHA-256 (``cache=False`` disables, a path
    relocates).

    Args:
        path: directory holding one of the three layouts above.
        split: ``"dpmaml"`` - the 1623 characters shuffled with ``seed``, first 1150 meta-train,
            next 50 validation, last 423 meta-test (DP-MAML Section 6); ``"background"`` - the
            standard split of Lake et al.: the 964 background characters meta-train, the 659
            evaluation characters meta-test, empty validation; ``"all"`` - everything in ``train``.
        rotations: add rotations by 90/180/270 degrees as new classes (MAML), to every split.
        image_size: side of the resized images (28 as in MAML / DP-MAML).
        seed: seed of the ``"dpmaml"`` character shuffle.
        cache: True (default cache dir), False, or a cache directory.
        download: fetch the official zips into ``path`` first when no source is found there.
    """
    path = Path(path)
    if download:
        try:
            _find_omniglot_sources(path)
        except DataError:
            download_omniglot(path)
    images, alphas, prefixes = _load_omniglot_all(path, image_size, cache)
    n_chars, n_draw = images.shape[:2]
    flat = images.reshape(n_chars * n_draw, *images.shape[2:])
    offsets = np.arange(n_chars + 1, dtype=np.int64) * n_draw
    full = ClassDataset(flat, offsets, [f"{p:04d}" for p in prefixes], alphas, str(path))
    if split == "dpmaml":
        if n_chars < 1623:
            raise DataError(f"{path}: the dpmaml split needs 1623 characters; found {n_chars}")
        perm = np.random.default_rng([int(seed), 0x0DB]).permutation(n_chars)
        parts = (perm[:1150], perm[1150:1200], perm[1200:])
    elif split == "background":
        bg = np.array([p <= OMNIGLOT_N_BACKGROUND for p in prefixes])
        parts = (np.flatnonzero(bg), np.zeros(0, np.int64), np.flatnonzero(~bg))
    elif split == "all":
        parts = (np.arange(n_chars), np.zeros(0, np.int64), np.zeros(0, np.int64))
    else:
        raise ValueError(f"split must be 'dpmaml', 'background' or 'all'; got {split!r}")
    out = [full.subset(np.sort(p)) for p in parts]
    if rotations:
        out = [d.with_rotations() for d in out]
    return DataSplits(*out)


# --------------------------------------------------------------------------------------------------
# image folders

_IMG_EXT = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


def _read_class_folders(root: Path, image_size: int, channels: int) -> ClassDataset:
    from PIL import Image

    classes = sorted(d for d in root.iterdir() if d.is_dir())
    if not classes:
        raise DataError(f"{root}: expected one sub-folder per class containing images; found none")
    arrays, names, counts = [], [], []
    mode = "L" if channels == 1 else "RGB"
    for d in classes:
        files = sorted(f for f in d.iterdir() if f.suffix.lower() in _IMG_EXT)
        if not files:
            raise DataError(f"{d}: class folder has no images ({', '.join(sorted(_IMG_EXT))})")
        for f in files:
            try:
                with Image.open(f) as raw:
                    im = raw.convert(mode)
                    if im.size != (image_size, image_size):
                        im = im.resize((image_size, image_size), Image.Resampling.BILINEAR)
                    a = np.asarray(im, dtype=np.uint8)
            except Exception as e:  # noqa: BLE001
                raise DataError(f"{f}: not a readable image ({e})") from e
            arrays.append(a[None] if channels == 1 else a.transpose(2, 0, 1))
        names.append(d.name)
        counts.append(len(files))
    return ClassDataset(
        torch.from_numpy(np.stack(arrays)),
        np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        names,
        list(names),
        str(root),
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
    if not root.is_dir():
        raise DataError(f"{root}: expected a directory of class folders (one folder per class)")
    if all((root / s).is_dir() for s in ("train", "val", "test")):
        return DataSplits(
            *(_read_class_folders(root / s, image_size, channels) for s in ("train", "val", "test"))
        )
    ds = _read_class_folders(root, image_size, channels)
    if abs(sum(fractions) - 1) > 1e-9 or min(fractions) < 0:
        raise ValueError(f"fractions must be non-negative and sum to 1; got {fractions}")
    perm = np.random.default_rng([int(seed), 0xF01D]).permutation(ds.n_classes)
    n_tr = int(round(fractions[0] * ds.n_classes))
    n_va = int(round(fractions[1] * ds.n_classes))
    parts = (perm[:n_tr], perm[n_tr : n_tr + n_va], perm[n_tr + n_va :])
    return DataSplits(*(ds.subset(np.sort(p)) for p in parts))


# --------------------------------------------------------------------------------------------------
# federated partitions


def partition_classes(
    ds: ClassDataset, n_participants: int, *, mode: str = "group", seed: int = 0
) -> list[np.ndarray]:
    """Split ``ds``'s classes into ``n_participants`` disjoint, sorted index arrays.

    ``mode="group"``: whole groups (Omniglot alphabets: the natural non-IID split) are shuffled with
    ``seed`` and dealt greedily to the participant with the fewest classes so far. ``mode="even"``:
    the classes are shuffled and dealt into near-equal parts (IID over classes).
    """
    if n_participants < 1:
        raise ValueError(f"n_participants must be >= 1; got {n_participants}")
    rng = np.random.default_rng([int(seed), 0x9A27])
    if mode == "even":
        if ds.n_classes < n_participants:
            raise ValueError(
                f"n_participants must be <= the number of classes ({ds.n_classes}); "
                f"got {n_participants}"
            )
        perm = rng.permutation(ds.n_classes)
        return [np.sort(p) for p in np.array_split(perm, n_participants)]
    if mode != "group":
        raise ValueError(f"mode must be 'group' or 'even'; got {mode!r}")
    groups: dict[str, list[int]] = {}
    for c, g in enumerate(ds.groups):
        groups.setdefault(g, []).append(c)
    if len(groups) < n_participants:
        raise ValueError(
            f"n_participants must be <= the number of groups/alphabets ({len(groups)}) for "
            f"mode='group'; got {n_participants} (use mode='even')"
        )
    names = sorted(groups)
    shuffled = rng.permutation(len(names))
    # Largest groups first (shuffled among ties) for a balanced greedy deal.
    order = sorted(shuffled.tolist(), key=lambda i: -len(groups[names[i]]))
    owned: list[list[int]] = [[] for _ in range(n_participants)]
    for j, i in enumerate(order):
        target = (
            j
            if j < n_participants
            else min(range(n_participants), key=lambda p: (len(owned[p]), p))
        )
        owned[target] += groups[names[i]]
    return [np.array(sorted(o), dtype=np.int64) for o in owned]


@dataclass
class ParticipantTasks:
    """One participant's fixed, numbered list of N-way K-shot tasks over its own classes.

    ``plan[t]`` holds the global example indices of task ``t`` (``[n_way, k_shot + q_query]``; row j
    is label j, the first ``k_shot`` columns the support set). Task ids are ``0 .. num_tasks - 1``.
    """

    id: str
    dataset: ClassDataset
    classes: np.ndarray
    plan: np.ndarray
    k_shot: int

    @property
    def num_tasks(self) -> int:
        """Number of tasks this participant holds."""
        return int(self.plan.shape[0])

    def task(self, task_id: int) -> Task:
        """Task ``task_id`` (unbatched)."""
        if not 0 <= task_id < self.num_tasks:
            raise IndexError(f"task_id must be in [0, {self.num_tasks}); got {task_id}")
        return _task_from_plan(self.dataset, self.plan[task_id], self.k_shot)

    def tasks(self, task_ids: Sequence[int]) -> Task:
        """Return the given tasks as one batch (order kept)."""
        return stack_tasks([self.task(int(t)) for t in task_ids])

    def example_use_counts(self) -> np.ndarray:
        """Per example (global index order): how many of this participant's tasks use it."""
        return np.bincount(self.plan.reshape(-1), minlength=self.dataset.images.shape[0])

    @property
    def max_tasks_per_example(self) -> int:
        """Most tasks any single example appears in (the example-level group size)."""
        return int(self.example_use_counts().max(initial=0))

    def summary(self) -> dict[str, Any]:
        """Class, task and example-reuse counts."""
        groups = sorted({self.dataset.groups[c] for c in self.classes})
        return {
            "participant": self.id,
            "classes": int(len(self.classes)),
            "groups": len(groups),
            "tasks": self.num_tasks,
            "max_tasks_per_example": self.max_tasks_per_example,
        }


@dataclass
class SinusoidParticipant:
    """A participant's slice of the sinusoid task distribution and its numbered task list.

    Task ``t`` is drawn from ``(seed, index, t)``: amplitude in this participant's
    ``amplitude_range``, phase and x as in :class:`SinusoidTasks`. Every task has its own x points,
    so no example is shared between tasks (``max_tasks_per_example == 1``).
    """

    id: str
    index: int
    family: SinusoidTasks
    num_tasks: int
    seed: int

    def task(self, task_id: int) -> Task:
        """Task ``task_id`` (unbatched)."""
        if not 0 <= task_id < self.num_tasks:
            raise IndexError(f"task_id must be in [0, {self.num_tasks}); got {task_id}")
        return self.family.task_from_rng(_rng(self.seed, 0x5111, self.index, task_id))[0]

    def tasks(self, task_ids: Sequence[int]) -> Task:
        """Return the given tasks as one batch (order kept)."""
        return stack_tasks([self.task(int(t)) for t in task_ids])

    @property
    def max_tasks_per_example(self) -> int:
        """Always 1: sinusoid tasks share no points."""
        return 1

    def summary(self) -> dict[str, Any]:
        """Task count and amplitude slice."""
        return {
            "participant": self.id,
            "classes": None,
            "amplitude_range": list(self.family.amplitude_range),
            "tasks": self.num_tasks,
            "max_tasks_per_example": 1,
        }


@dataclass
class FederatedTaskSet:
    """Participants (ids ``"0"``, ``"1"``, ...) with disjoint data and fixed numbered task lists.

    Build with :meth:`from_classes` (image data) or :meth:`sinusoid`. ``task_counts()`` feeds
    ``accounting.TwoStageSampler.sample``; ``participant(pid).tasks(ids)`` feeds
    :func:`~metalearning.maml.per_task_clipped_grads`.
    """

    participants: dict[str, ParticipantTasks | SinusoidParticipant]
    config: dict[str, Any] = field(default_factory=dict)

    def participant(self, pid: str | int) -> ParticipantTasks | SinusoidParticipant:
        """Participant by id (``"3"`` or ``3``)."""
        key = str(pid)
        if key not in self.participants:
            raise KeyError(f"unknown participant {pid!r}; ids are 0..{len(self.participants) - 1}")
        return self.participants[key]

    @property
    def ids(self) -> list[str]:
        """Participant ids in order."""
        return list(self.participants)

    def task_counts(self) -> dict[str, int]:
        """Participant id -> number of tasks."""
        return {pid: p.num_tasks for pid, p in self.participants.items()}

    @property
    def max_tasks_per_example(self) -> int:
        """Largest number of tasks any single example appears in, over all participants."""
        return max((p.max_tasks_per_example for p in self.participants.values()), default=0)

    def summary(self) -> list[dict[str, Any]]:
        """One dict per participant: classes, tasks, max tasks per example."""
        return [p.summary() for p in self.participants.values()]

    @classmethod
    def sinusoid(
        cls,
        n_participants: int,
        *,
        tasks_per_participant: int = 1000,
        k_support: int = 10,
        k_query: int = 10,
        partition: str = "amplitude",
        seed: int = 0,
        family: SinusoidTasks | None = None,
    ) -> FederatedTaskSet:
        """Build sinusoid participants with fixed, seed-derived task lists.

        ``partition="amplitude"`` gives participant i the i-th of ``n_participants`` equal amplitude
        intervals (non-IID); ``"iid"`` gives everyone the whole distribution.
        """
        fam = family or SinusoidTasks(k_support, k_query)
        if n_participants < 1 or tasks_per_participant < 1:
            raise ValueError(
                f"n_participants and tasks_per_participant must be >= 1; got {n_participants}, "
                f"{tasks_per_participant}"
            )
        lo, hi = fam.amplitude_range
        parts: dict[str, ParticipantTasks | SinusoidParticipant] = {}
        for i in range(n_participants):
            if partition == "amplitude":
                w = (hi - lo) / n_participants
                f_i = SinusoidTasks(
                    fam.k_support,
                    fam.k_query,
                    (lo + i * w, lo + (i + 1) * w),
                    fam.phase_range,
                    fam.x_range,
                )
            elif partition == "iid":
                f_i = fam
            else:
                raise ValueError(f"partition must be 'amplitude' or 'iid'; got {partition!r}")
            parts[str(i)] = SinusoidParticipant(str(i), i, f_i, tasks_per_participant, seed)
        return cls(parts, {"kind": "sinusoid", "partition": partition, "seed": seed})

    @classmethod
    def from_classes(
        cls,
        ds: ClassDataset,
        n_participants: int,
        *,
        n_way: int = 5,
        k_shot: int = 1,
        q_query: int = 15,
        tasks_per_participant: int | None = 1000,
        partition: str = "group",
        disjoint_examples: bool = False,
        seed: int = 0,
    ) -> FederatedTaskSet:
        """Partition ``ds``'s classes (:func:`partition_classes`) and fix each participant's tasks.

        With ``disjoint_examples=False`` task ``t`` of participant ``i`` is drawn from ``(seed, i,
        t)`` alone (classes without replacement, then ``k_shot + q_query`` examples per class
        without replacement); examples may recur across tasks. With ``disjoint_examples=True`` each
        example is used by at most one task: tasks are dealt from per-class shuffled pools (seeded
        by ``(seed, i)``) until fewer than ``n_way`` classes have enough unused examples, or
        ``tasks_per_participant`` is reached (None: as many as fit).
        """
        per = k_shot + q_query
        if k_shot < 1 or q_query < 1:
            raise ValueError(f"k_shot and q_query must be >= 1; got {k_shot}, {q_query}")
        if not disjoint_examples and (tasks_per_participant is None or tasks_per_participant < 1):
            raise ValueError(f"tasks_per_participant must be >= 1; got {tasks_per_participant}")
        owned = partition_classes(ds, n_participants, mode=partition, seed=seed)
        parts: dict[str, ParticipantTasks | SinusoidParticipant] = {}
        for i, classes in enumerate(owned):
            where = f"participant {i}"
            try:
                _check_task_shape(ds, classes, n_way, per)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            eligible = classes[ds.counts[classes] >= per]
            if not disjoint_examples:
                assert tasks_per_participant is not None
                plan = np.stack(
                    [
                        _draw_plan(ds, eligible, n_way, per, _rng(seed, 0x7A5C, i, t))
                        for t in range(tasks_per_participant)
                    ]
                )
            else:
                rng = _rng(seed, 0xD15, i)
                pools = {
                    int(c): list(int(ds.offsets[c]) + rng.permutation(int(ds.counts[c])))
                    for c in eligible
                }
                rows: list[np.ndarray] = []
                limit = math.inf if tasks_per_participant is None else tasks_per_participant
                while len(rows) < limit:
                    avail = np.array([c for c in eligible if len(pools[int(c)]) >= per])
                    if len(avail) < n_way:
                        break
                    chosen = rng.choice(avail, size=n_way, replace=False)
                    rows.append(
                        np.stack([[pools[int(c)].pop() for _ in range(per)] for c in chosen])
                    )
                if not rows:
                    raise ValueError(f"{where}: not enough examples for one disjoint task")
                plan = np.stack(rows)
            parts[str(i)] = ParticipantTasks(str(i), ds, classes, plan.astype(np.int64), k_shot)
        cfg = {
            "kind": "classes", "n_way": n_way, "k_shot": k_shot, "q_query": q_query,
            "partition": partition, "disjoint_examples": disjoint_examples, "seed": seed,
        }  # fmt: skip
        return cls(parts, cfg)


def _timed(fn: Any, *a: Any, **k: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    r = fn(*a, **k)
    return r, time.perf_counter() - t0
