"""Omniglot (Lake et al. 2015): download, checksums, decoding, the resize cache, class splits.

* :func:`load_omniglot` - npz / zip / unpacked-folder Omniglot, resized to 28x28, split into
  :class:`~metalearning.images.DataSplits` (DP-MAML 1150/50/423 characters, or
  background/evaluation), cached by checksum.
* :func:`download_omniglot` - opt-in download of the official zips with a digest check.
* :func:`omniglot_source_digest` - the identity of the source files :func:`load_omniglot` reads.
* :func:`decode_png` / :func:`resize_strokes` - the pixel convention, shared with the one-shot
  runs (:mod:`metalearning.oneshot_runs`): a drawing is decoded to white-True booleans, then
  resized to uint8 stroke intensity (255 = ink).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import urllib.request
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fedmeta.metalearning.digests import file_sha256, manifest_digest, verify_checksum
from fedmeta.metalearning.errors import DataError
from fedmeta.metalearning.images import ClassDataset, DataSplits

__all__ = [
    "OMNIGLOT_FILES",
    "decode_png",
    "default_cache_dir",
    "download_omniglot",
    "load_omniglot",
    "omniglot_source_digest",
    "resize_strokes",
]

OMNIGLOT_BASE_URL = "https://raw.githubusercontent.com/brendenlake/omniglot/master/python/"

#: Known digests of the official release zips. The MD5s are the ones torchvision pins for these
#: files (torchvision/datasets/omniglot.py). SHA-256 values were not obtainable offline when this
#: was written; :func:`download_omniglot` therefore checks MD5 and records the SHA-256 it saw beside
#: the file, and callers may pin a SHA-256 with ``sha256=``.
OMNIGLOT_FILES: dict[str, dict[str, str | None]] = {
    "images_background.zip": {"md5": "68d2efa1b9178cc56df9314c21c6e718", "sha256": None},
    "images_evaluation.zip": {"md5": "6b91aef0f799c5bb55b94e3f2daec811", "sha256": None},
}

# Alphabets by their first character's 1-based file prefix (``NNNN_DD.png``) in the official
# release: 30 background alphabets (prefixes 1-964), then 20 evaluation alphabets (965-1623). The
# npz form has no folder names, so the alphabet (a participant's unit in a group partition) comes
# from here.
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
_CACHE_VERSION = 1


def _alphabet_of(prefix: int) -> str:
    name = _ALPHABETS[0][1]
    for start, n in _ALPHABETS:
        if prefix >= start:
            name = n
    return name


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
    :class:`~metalearning.errors.ChecksumError`. Files already present are verified, not refetched.
    The SHA-256 of each verified file is written to ``<file>.sha256``. Returns ``dest``.
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


# --------------------------------------------------------------------------------------------------
# decoding

_PNG_RE = re.compile(r"(?:^|/)(?P<alpha>[^/]+)/character\d+/(?P<char>\d+)_(?P<draw>\d+)\.png$")


def decode_png(data: bytes, where: str) -> np.ndarray:
    """A drawing's PNG bytes -> bool ``[H, W]``, True = white background (the npz convention).

    The official PNGs are black strokes on white; grey levels above 127 count as background.
    """
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


def read_zip(path: Path) -> tuple[np.ndarray, list[str], list[int]]:
    entries = []
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                m = _PNG_RE.search(info.filename)
                if m:
                    img = decode_png(z.read(info), f"{path}:{info.filename}")
                    entries.append((int(m["char"]), int(m["draw"]), m["alpha"], img))
    except zipfile.BadZipFile as e:
        raise DataError(
            f"{path}: not a valid zip file ({e}); expected the Omniglot release zip"
        ) from e
    return _assemble(entries, str(path))


def folder_pngs(path: Path) -> list[tuple[str, re.Match[str]]]:
    """The drawings of an unpacked folder that the loader reads, with their parsed names.

    ``os.walk`` and strings rather than ``Path.rglob``: the same files (neither follows directory
    links) at a fraction of the cost per file, which a second source digest of the 32,460
    drawings is made of.
    """
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        rel = os.path.relpath(dirpath, path.parent).replace(os.sep, "/")
        for name in sorted(filenames):
            if name.endswith(".png") and (m := _PNG_RE.search(f"{rel}/{name}")):
                out.append((os.path.join(dirpath, name), m))
    return out


def read_folder(path: Path) -> tuple[np.ndarray, list[str], list[int]]:
    entries = [
        (int(m["char"]), int(m["draw"]), m["alpha"], decode_png(Path(f).read_bytes(), f))
        for f, m in folder_pngs(path)
    ]
    return _assemble(entries, str(path))


def read_npz(path: Path) -> tuple[np.ndarray, list[str], list[int]]:
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


def resize_strokes(white: np.ndarray, size: int, chunk: int = 4096) -> Tensor:
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


# --------------------------------------------------------------------------------------------------
# sources, cache, splits


def default_cache_dir() -> Path:
    """``$FEDMETA_CACHE_DIR``, else ``$XDG_CACHE_HOME/fedmeta``, else ``~/.cache/fedmeta``."""
    if d := os.environ.get("FEDMETA_CACHE_DIR"):
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fedmeta"


def find_omniglot_sources(path: Path) -> tuple[str, list[Path]]:
    parts = ("images_background", "images_evaluation")
    for kind, suffix in (("npz", ".npz"), ("zip", ".zip"), ("folder", "")):
        cands = [path / (p + suffix) for p in parts]
        ok = [c.is_file() if suffix else c.is_dir() for c in cands]
        if all(ok):
            return kind, cands
    raise DataError(
        f"no Omniglot data at {path}: expected images_background.npz + images_evaluation.npz, "
        "images_background.zip + images_evaluation.zip (the official release; "
        "fedmeta.metalearning.download_omniglot fetches them), or the unpacked folders "
        "images_background/ + images_evaluation/"
        + ("" if path.is_dir() else f" (and {path} is not a directory)")
    )


def omniglot_source_digest(path: str | Path) -> str:
    """SHA-256 identity of the Omniglot source files :func:`load_omniglot` would read at ``path``.

    It covers the layout :func:`load_omniglot` picks (npz first, then zips, then folders): the two
    npz files, the two zips, or every drawing ``<alphabet>/characterNN/<NNNN>_<DD>.png`` of the two
    unpacked folders - each by its path relative to ``path`` and its bytes
    (:func:`~metalearning.digests.manifest_digest`). It does not depend on ``split``, ``seed``,
    ``rotations``, ``image_size``, partitions or participants, nor on where ``path`` lives.
    The same drawings in another layout (npz rather than zip) are other bytes, so another digest.
    File digests are cached per ``(path, size, mtime)``: a second call costs a ``stat`` per file.
    """
    root = Path(path)
    kind, sources = find_omniglot_sources(root)
    files: list[str | Path] = list(sources)
    if kind == "folder":
        files = [f for s in sources for f, _ in folder_pngs(s)]
    return manifest_digest(root, files)


def _cache_file(files: list[Path], image_size: int, cache_dir: Path) -> Path:
    """Where the resized drawings of ``files`` are cached: named by the sources' SHA-256."""
    key = hashlib.sha256(
        ("|".join(file_sha256(f) for f in files) + f"|{image_size}|v{_CACHE_VERSION}").encode()
    ).hexdigest()[:24]
    return cache_dir / f"omniglot-{image_size}-{key}.npz"


def _read_cache(cache_file: Path) -> tuple[Tensor, list[str], list[int]] | None:
    if not cache_file.is_file():
        return None
    try:
        with np.load(cache_file) as z:
            return (
                torch.from_numpy(z["images"]),
                [str(a) for a in z["alphabets"]],
                [int(p) for p in z["prefixes"]],
            )
    except Exception:  # noqa: BLE001 - a broken cache is rebuilt
        cache_file.unlink(missing_ok=True)
        return None


def _write_cache(cache_file: Path, images: Tensor, alphas: list[str], prefixes: list[int]) -> None:
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(
            tmp, images=images.numpy(), alphabets=np.array(alphas), prefixes=np.array(prefixes)
        )
        tmp.replace(cache_file)
    except OSError:
        pass  # caching is an optimisation only


def _load_omniglot_all(
    path: Path, image_size: int, cache: bool | str | Path
) -> tuple[Tensor, list[str], list[int]]:
    """All characters (background, evaluation): uint8 [chars, 20, 1, s, s], alphabets, prefixes."""
    kind, files = find_omniglot_sources(path)
    cache_file = None
    if cache and kind != "folder":  # keying a folder would mean hashing each drawing
        cache_dir = default_cache_dir() if cache is True else Path(cache)
        cache_file = _cache_file(files, image_size, cache_dir)
    if cache_file is not None and (hit := _read_cache(cache_file)) is not None:
        return hit
    reader = {"npz": read_npz, "zip": read_zip, "folder": read_folder}[kind]
    imgs, alphas, prefixes = [], [], []
    for f in files:
        white, a, p = reader(f)
        c, d, h, w = white.shape
        imgs.append(
            resize_strokes(white.reshape(c * d, h, w), image_size).reshape(
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
        _write_cache(cache_file, images, alphas, prefixes)
    return images, alphas, prefixes


def _split_characters(
    path: Path, split: str, n_chars: int, prefixes: list[int], seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if split == "dpmaml":
        if n_chars < 1623:
            raise DataError(f"{path}: the dpmaml split needs 1623 characters; found {n_chars}")
        perm = np.random.default_rng([int(seed), 0x0DB]).permutation(n_chars)
        return perm[:1150], perm[1150:1200], perm[1200:]
    if split == "background":
        bg = np.array([p <= OMNIGLOT_N_BACKGROUND for p in prefixes])
        return np.flatnonzero(bg), np.zeros(0, np.int64), np.flatnonzero(~bg)
    if split == "evaluation":
        # The participants' data is the evaluation alphabets alone, so that the background ones
        # can be declared public (a warm start): a quarter of the characters for meta-test, 50
        # for validation, the rest meta-train.
        ev = np.flatnonzero([p > OMNIGLOT_N_BACKGROUND for p in prefixes])
        if len(ev) < 100:
            raise DataError(f"{path}: the evaluation split needs the 659 evaluation characters; "
                            f"found {len(ev)}")  # fmt: skip
        perm = ev[np.random.default_rng([int(seed), 0xE7A]).permutation(len(ev))]
        n_test = len(ev) // 4
        return perm[n_test + 50 :], perm[n_test : n_test + 50], perm[:n_test]
    if split == "all":
        return np.arange(n_chars), np.zeros(0, np.int64), np.zeros(0, np.int64)
    raise ValueError(f"split must be 'dpmaml', 'background', 'evaluation' or 'all'; got {split!r}")


def _public_characters(split: str, prefixes: list[int]) -> np.ndarray | None:
    """The characters a split declares public: the background alphabets for ``"evaluation"``."""
    if split != "evaluation":
        return None
    return np.flatnonzero([p <= OMNIGLOT_N_BACKGROUND for p in prefixes])


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
            evaluation characters meta-test, empty validation; ``"evaluation"`` - the 659
            evaluation characters shuffled with ``seed``: 164 meta-test, 50 validation, 445
            meta-train, leaving the 964 background characters public
            (:func:`load_omniglot_public`); ``"all"`` - everything in ``train``.
        rotations: add rotations by 90/180/270 degrees as new classes (MAML), to every split.
        image_size: side of the resized images (28 as in MAML / DP-MAML).
        seed: seed of the ``"dpmaml"`` character shuffle.
        cache: True (default cache dir), False, or a cache directory.
        download: fetch the official zips into ``path`` first when no source is found there.
    """
    path = Path(path)
    if download:
        try:
            find_omniglot_sources(path)
        except DataError:
            download_omniglot(path)
    full, prefixes = _all_characters(path, image_size, cache)
    parts = _split_characters(path, split, full.n_classes, prefixes, seed)
    out = [full.subset(np.sort(p)) for p in parts]
    if rotations:
        out = [d.with_rotations() for d in out]
    return DataSplits(*out)


def load_omniglot_public(
    path: str | Path,
    *,
    split: str = "evaluation",
    rotations: bool = False,
    image_size: int = 28,
    cache: bool | str | Path = True,
) -> ClassDataset:
    """The characters ``split`` declares public: for ``"evaluation"``, the 964 background ones.

    They are disjoint from that split's meta-train, validation and meta-test characters (the
    evaluation alphabets); a public warm start (:mod:`metalearning.warm_start`) trains on them.
    Raises ValueError for a split that declares no public classes.
    """
    full, prefixes = _all_characters(Path(path), image_size, cache)
    chosen = _public_characters(split, prefixes)
    if chosen is None:
        raise ValueError(
            f"the Omniglot split {split!r} declares no public classes; use 'evaluation'"
        )
    public = full.subset(chosen)
    return public.with_rotations() if rotations else public


def _all_characters(
    path: Path, image_size: int, cache: bool | str | Path
) -> tuple[ClassDataset, list[int]]:
    """Every character (background, then evaluation) as one dataset, with its prefixes."""
    images, alphas, prefixes = _load_omniglot_all(path, image_size, cache)
    n_chars, n_draw = images.shape[:2]
    flat = images.reshape(n_chars * n_draw, *images.shape[2:])
    offsets = np.arange(n_chars + 1, dtype=np.int64) * n_draw
    names = [f"{p:04d}" for p in prefixes]
    from fedmeta.metalearning.omniglot_items import (  # it reads this module
        cached_looks,
        omniglot_item_ids,
    )

    items = omniglot_item_ids(path, cache=cache)
    looks = cached_looks(flat.numpy(), cache=cache)  # of the model input, as every loader's
    return ClassDataset(flat, offsets, names, alphas, str(path), items, looks), prefixes
