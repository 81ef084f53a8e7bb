"""Known public releases, by their items' content digests: what an experiment may run on.

An experiment ledger (``privacy.experiment``) holds spends that never touch a data's production
budget, so it is only for data *proven* public (issue 39, item 2): every item of it must be an item
of a known public release. Names and file checksums prove nothing (an altered npz keeps its name);
item digests do (metalearning/items.py: a mirrored or shifted drawing is another ink mask).

Known releases:

* **Omniglot** (Lake, Salakhutdinov and Tenenbaum 2015; MIT licence): the 32,460 drawings of the
  official ``images_background.zip`` and ``images_evaluation.zip``. Shipped as
  ``public_items/omniglot.bin``: the item digests' top 48 bits, sorted, 6 bytes each (194,754
  bytes for 32,459 distinct drawings; two drawings of the release are identical). Built from the
  npz form of the archives by ``python scripts/public_items.py --omniglot DIR``. 48 bits: an item
  outside the release matches one of them by chance with probability about 1.2e-10, and an
  experiment is refused when *any* item is outside, so a changed data set passes only if every
  changed drawing collides.
* **The sinusoid family** (Finn et al. 2017): generated from its specification, no files, public
  by construction; it has no items to check.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

__all__ = ["PUBLIC_RELEASES", "TRUNCATED_BITS", "not_public", "truncate"]

#: Each known image release: its description and the shipped digest file.
PUBLIC_RELEASES: dict[str, tuple[str, str]] = {
    "omniglot": ("Omniglot's official images_background.zip and images_evaluation.zip",
                 "omniglot.bin"),
}  # fmt: skip
TRUNCATED_BITS = 48


def truncate(items: np.ndarray) -> np.ndarray:
    """The shipped form of item digests: their top ``TRUNCATED_BITS`` bits (uint64)."""
    return np.asarray(items, dtype=np.uint64) >> np.uint64(64 - TRUNCATED_BITS)


def to_bytes(items: np.ndarray) -> bytes:
    """Sorted unique truncated digests, 6 bytes each, big-endian: the shipped file's content."""
    values = np.unique(truncate(items))
    wide = values.astype(">u8").view(np.uint8).reshape(-1, 8)
    return wide[:, 8 - TRUNCATED_BITS // 8 :].tobytes()


@functools.cache
def _release(file: str) -> np.ndarray:
    raw = (Path(__file__).parent / "public_items" / file).read_bytes()  # wheel data beside us
    width = TRUNCATED_BITS // 8
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(-1, width)
    wide = np.zeros((len(rows), 8), dtype=np.uint8)
    wide[:, 8 - width :] = rows
    return wide.view(">u8").reshape(-1).astype(np.uint64)


def not_public(items: np.ndarray) -> tuple[int, str | None]:
    """How many of ``items`` belong to no single known release, and the release the rest are in.

    ``(0, name)``: every item is an item of release ``name``. Otherwise the count outside the
    release that holds the most of them (``None`` if none holds any).
    """
    want = np.unique(truncate(items))
    best: tuple[int, str | None] = (len(want), None)
    for name, (_, file) in PUBLIC_RELEASES.items():
        known = _release(file)
        pos = np.minimum(np.searchsorted(known, want), len(known) - 1)
        outside = int((known[pos] != want).sum())
        if outside < best[0]:
            best = (outside, name)
    return best
