"""A participant's data as its items: what a budget's identity is made of (issues 39 and 52).

On the floor, so that a participant (which computes and sends it) imports neither the accountant
nor SQLite, and the ledger (which matches it, accounting/.../ledger/overlap.py) imports it from
here (issue 54). Numpy and the standard library only.

Each item has two names, computed by the loaders (metalearning/items.py):

* its **digest**: 64 bits of its exact content at source resolution (a drawing's ink mask, other
  images' RGB pixels). Equal digests are one item.
* its **look**: a 256-bit perceptual hash of the model's input made from it (after the loader's
  decoding, resizing and binarisation; the same canonical form for every loader). Two looks within
  ``LOOK_TOLERANCE`` bits of each other are one item: a JPEG, resized, cropped or grey-level copy
  of a recorded drawing is the recorded drawing (issue 52, items 2-3). Erring towards charging: a
  distinct drawing that close is charged as the recorded one (the measured rate: docs/privacy.md).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = ["EVALUATION_TOLERANCE", "ITEMS_TEXT_PREFIX", "LOOK_BYTES", "LOOK_TOLERANCE", "DataItems"]

#: How a participant's item set travels as text (its registration's data fingerprint).
ITEMS_TEXT_PREFIX = "items-v2:"
#: The set before looks (issue 52): digests only, still read (a participant of an older fedmeta).
_V1_PREFIX = "items-v1:"
LOOK_BYTES = 32
#: Looks at most this many bits apart (of 256) are one item. Chosen on Omniglot (docs/privacy.md,
#: bench/item_looks.py): every JPEG q95, grey-level and 1-pixel-border-cropped copy measured lies
#: within it, and distinct drawings this close are rare (their rate is stated there).
LOOK_TOLERANCE = 40
#: Looks at most this many bits apart make a validation or test item a recorded private item
#: (server/fedmeta/server/data_budget.py). Narrower than charging's, which errs towards charging:
#: at 40 bits, 16 to 30 of Omniglot's 9,460 held-out drawings of a split lie near some drawing
#: of *other* characters among the same split's participants (seeds 0-2), which would refuse every
#: second run on the same data; at 20 none does, while JPEG q95, grey-level and image-folder
#: copies still lie within it (docs/privacy.md states the gap).
EVALUATION_TOLERANCE = 20


@dataclass(frozen=True)
class DataItems:
    """A participant's items: digests (8 bytes each) and, aligned, looks (32 bytes each).

    Rows are unique and sorted by digest then look. ``looks`` empty: a set of digests alone (sent
    by a participant older than issue 52), matched exactly.
    """

    packed: bytes  # big-endian uint64 digests, one per row
    looks: bytes = b""  # LOOK_BYTES per row, or empty

    def __post_init__(self) -> None:
        if not isinstance(self.packed, bytes) or not self.packed or len(self.packed) % 8:
            raise ValueError("packed must be a non-empty whole number of 8-byte digests")
        if self.looks and len(self.looks) != len(self.packed) // 8 * LOOK_BYTES:
            raise ValueError(f"looks must hold one {LOOK_BYTES}-byte look per digest")

    @classmethod
    def of(cls, digests: Iterable[int] | np.ndarray, looks: np.ndarray | None = None) -> DataItems:
        """From item digests (and their looks, uint8 ``[N, 32]``) in any order, repeats allowed."""
        arr = np.asarray(list(digests) if not isinstance(digests, np.ndarray) else digests,
                         dtype=np.uint64)  # fmt: skip
        if looks is None:
            return cls(np.unique(arr).astype(">u8").tobytes())
        looks = np.asarray(looks, dtype=np.uint8).reshape(len(arr), LOOK_BYTES)
        rows = np.concatenate([arr.astype(">u8").view(np.uint8).reshape(-1, 8), looks], axis=1)
        rows = np.unique(rows, axis=0)  # sorted by digest (big-endian bytes), then look
        return cls(rows[:, :8].tobytes(), rows[:, 8:].tobytes())

    def array(self) -> np.ndarray:
        """The distinct digests, uint64 ascending."""
        return np.unique(np.frombuffer(self.packed, dtype=">u8").astype(np.uint64))

    def digest_rows(self) -> np.ndarray:
        """Each row's digest as 8 big-endian bytes (uint8 ``[N, 8]``), aligned with the looks."""
        return np.frombuffer(self.packed, dtype=np.uint8).reshape(-1, 8)

    def look_array(self) -> np.ndarray | None:
        """Each row's look (uint8 ``[N, 32]``); None for a set of digests alone."""
        if not self.looks:
            return None
        return np.frombuffer(self.looks, dtype=np.uint8).reshape(-1, LOOK_BYTES)

    def __len__(self) -> int:
        return len(self.packed) // 8

    @functools.cached_property
    def set_digest(self) -> str:
        """SHA-256 (32 hex digits) of the distinct digests: names the record this data starts."""
        packed = self.array().astype(">u8").tobytes()
        return hashlib.sha256(b"fedmeta-item-set-v1\n" + packed).hexdigest()[:32]

    def to_text(self) -> str:
        """``items-v2:<base64 digests>:<base64 looks>``: what a participant sends the server."""

        def b64(raw: bytes) -> str:
            return base64.b64encode(raw).decode("ascii")

        return f"{ITEMS_TEXT_PREFIX}{b64(self.packed)}:{b64(self.looks)}"

    @staticmethod
    def from_text(text: str) -> DataItems | None:
        """The items ``text`` carries; None when it is another kind of fingerprint."""
        if text.startswith((ITEMS_TEXT_PREFIX, _V1_PREFIX)):
            return _from_text(text)
        return None


@functools.lru_cache(maxsize=256)
def _from_text(text: str) -> DataItems:
    """Decoded once per text: every round names the same participants."""
    prefix, _, body = text.partition(":")
    digest_text, _, look_text = body.partition(":")
    try:
        packed = base64.b64decode(digest_text, validate=True)
        raw_looks = base64.b64decode(look_text, validate=True) if prefix == "items-v2" else b""
        digests = np.frombuffer(packed, dtype=">u8")
        if not raw_looks:
            return DataItems.of(digests)
        return DataItems.of(digests, np.frombuffer(raw_looks, np.uint8).reshape(-1, LOOK_BYTES))
    except (ValueError, binascii.Error) as error:
        raise ValueError(f"an item set must be {ITEMS_TEXT_PREFIX}<base64 of 8-byte digests>:"
                         f"<base64 of {LOOK_BYTES}-byte looks>; {error}") from None  # fmt: skip
