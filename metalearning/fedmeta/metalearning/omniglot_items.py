"""Omniglot's item digests: each drawing's ink-mask digest, whatever the files' layout.

The budget's identity and the evaluation's seen/unseen split (metalearning/items.py) read the
drawings through here; a digest is the same from the npz, the official zips or PNG folders.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import numpy as np

from fedmeta.metalearning.items import (
    ITEM_FORMAT,
    LOOK_BYTES,
    LOOK_FORMAT,
    ink_digests,
    model_input_looks,
)
from fedmeta.metalearning.omniglot import (
    default_cache_dir,
    find_omniglot_sources,
    folder_pngs,
    read_folder,
    read_npz,
    read_zip,
)


def omniglot_item_ids(path: str | Path, *, cache: bool | str | Path = True) -> np.ndarray:
    """Each drawing's item digest (uint64), in the loader's order (characters, then drawings).

    The digest of a drawing is that of its binary ink mask at 105 x 105 (metalearning/items.py),
    so the npz, the official zips and the unpacked PNG folders give the same digests. Cached in
    the process and on disk (``cache``, as :func:`load_omniglot`'s) by every source file's
    absolute path, size and modification time: a second call on unchanged files costs one
    ``stat`` per file (one per drawing for folders).
    """
    root = Path(path)
    kind, sources = find_omniglot_sources(root)
    files = sources if kind != "folder" else [Path(f) for s in sources for f, _ in folder_pngs(s)]
    stamp = hashlib.sha256(f"{ITEM_FORMAT.decode()}|{kind}".encode())
    for f in files:
        st = os.stat(f)
        stamp.update(f"{os.path.abspath(f)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return _item_ids_by_stamp(str(root), kind, stamp.hexdigest()[:32], _cache_dir_of(cache))


def _cache_dir_of(cache: bool | str | Path) -> str | None:
    if not cache:
        return None
    return str(default_cache_dir() if cache is True else Path(cache))


@functools.lru_cache(maxsize=8)
def _item_ids_by_stamp(root: str, kind: str, stamp: str, cache_dir: str | None) -> np.ndarray:
    cached = None if cache_dir is None else Path(cache_dir) / f"omniglot-items-{stamp}.npy"
    if cached is not None and cached.is_file():
        try:
            loaded: np.ndarray = np.load(cached, allow_pickle=False)
            loaded.setflags(write=False)
            return loaded
        except (OSError, ValueError):
            cached.unlink(missing_ok=True)  # a broken cache is rebuilt
    reader = {"npz": read_npz, "zip": read_zip, "folder": read_folder}[kind]
    parts = []
    for f in find_omniglot_sources(Path(root))[1]:
        white = reader(f)[0]
        parts.append(ink_digests(white.reshape(-1, *white.shape[2:]), ink=False))
    items = np.concatenate(parts)
    items.setflags(write=False)
    if cached is not None:
        _save_quietly(cached, items)
    return items


def _save_quietly(target: Path, array: np.ndarray) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp.npy")
        np.save(tmp, array, allow_pickle=False)
        tmp.replace(target)
    except OSError:
        pass  # caching is an optimisation only


def cached_looks(images: np.ndarray, *, cache: bool | str | Path = True) -> np.ndarray:
    """:func:`~metalearning.items.model_input_looks` of ``images``, cached by their SHA-256.

    Hashing all 32,460 drawings takes seconds (docs/privacy.md); the resized drawings are the
    same on every load, so their looks are kept beside the resize cache, keyed by the pixels
    themselves (a changed image is a changed key) and the look's format.
    """
    key = hashlib.sha256(LOOK_FORMAT.encode() + repr(images.shape).encode())
    key.update(np.ascontiguousarray(images).data)
    return _looks_by_key(key.hexdigest()[:32], images, _cache_dir_of(cache))


_LOOKS: dict[str, np.ndarray] = {}  # this process's, by key: a second load costs the SHA-256


def _looks_by_key(key: str, images: np.ndarray, cache_dir: str | None) -> np.ndarray:
    if key in _LOOKS:
        return _LOOKS[key]
    cached = None if cache_dir is None else Path(cache_dir) / f"omniglot-looks-{key}.npy"
    looks = None
    if cached is not None and cached.is_file():
        try:
            looks = np.load(cached, allow_pickle=False)
        except (OSError, ValueError):
            cached.unlink(missing_ok=True)  # a broken cache is rebuilt
    if looks is None or looks.shape != (len(images), LOOK_BYTES):
        looks = model_input_looks(images)
        if cached is not None:
            _save_quietly(cached, looks)
    looks.setflags(write=False)
    _LOOKS[key] = looks
    return looks
