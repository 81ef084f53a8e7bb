"""What an item's look costs and how well it tells drawings apart (issue 52): `python
bench/item_looks.py --omniglot DIR [--sample 400] [--stored 1000000]`.

DIR holds Omniglot's ``images_background.npz`` + ``images_evaluation.npz``. On the model's input
(28x28 stroke intensity, as ``load_omniglot`` makes it) this measures:

* the time to compute the looks of all 32,460 drawings (``model_input_looks``);
* false matches: every pair of distinct drawings whose looks lie within each tolerance (exact
  range search with faiss over all 32,460 x 32,459 / 2 pairs), split into pairs of one character
  (two people drawing the same symbol) and pairs of different characters;
* the distance from a drawing's look to the look of each copy the issue lists (JPEG q95, resized
  to 28x28 before loading, a one-pixel border crop, grey levels; through the Omniglot loader and
  as an image folder), on ``--sample`` drawings: the largest, the 99th percentile and the share
  within the tolerance;
* the ledger's search: a range search of 32,460 looks against 32,460 and against ``--stored``
  random recorded looks (time and the index's memory).

Prints markdown; no assertion.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import faiss  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image, ImageFilter  # noqa: E402

from fedmeta.item_identity import LOOK_BYTES, LOOK_TOLERANCE  # noqa: E402
from fedmeta.metalearning.items import model_input_looks  # noqa: E402
from fedmeta.metalearning.omniglot import decode_png, resize_strokes  # noqa: E402

TOLERANCES = (24, 32, 36, 40, 44, 48, 56)


def _png(image: Image.Image, fmt: str = "PNG", **kw: int) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def _omniglot_loader(files: list[bytes]) -> np.ndarray:
    """As load_omniglot reads a PNG: threshold at 127, then the anti-aliased resize to 28."""
    return resize_strokes(np.stack([decode_png(f, "copy") for f in files]), 28).numpy()


def _folder_loader(files: list[bytes]) -> np.ndarray:
    """As load_image_folder reads it: RGB, bilinear resize to 28, channels first."""
    out = []
    for f in files:
        image = Image.open(io.BytesIO(f)).convert("RGB")
        if image.size != (28, 28):
            image = image.resize((28, 28), Image.Resampling.BILINEAR)
        out.append(np.asarray(image).transpose(2, 0, 1))
    return np.stack(out)


def copies(white: np.ndarray) -> dict[str, np.ndarray]:
    """Each copy the issue lists, as each loader gives it to the model."""
    src = [Image.fromarray(w).convert("L") for w in white]
    jpeg = [_png(s.convert("RGB"), "JPEG", quality=95) for s in src]
    small = [_png(s.resize((28, 28), Image.Resampling.LANCZOS)) for s in src]
    crop = [_png(s.crop((1, 1, 104, 104))) for s in src]
    grey = [_png(s.filter(ImageFilter.GaussianBlur(1))) for s in src]
    return {
        "the same PNG as an image folder": _folder_loader([_png(s) for s in src]),
        "JPEG q95, Omniglot loader": _omniglot_loader(jpeg),
        "JPEG q95, image folder": _folder_loader(jpeg),
        "resized to 28x28 first, Omniglot loader (thresholded at 28)": _omniglot_loader(small),
        "resized to 28x28 first, image folder": _folder_loader(small),
        "1-pixel border cropped, Omniglot loader": _omniglot_loader(crop),
        "1-pixel border cropped, image folder": _folder_loader(crop),
        "grey levels (blurred), Omniglot loader": _omniglot_loader(grey),
        "grey levels (blurred), image folder": _folder_loader(grey),
    }


def _distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    bits: np.ndarray = np.unpackbits(a ^ b, axis=1).sum(axis=1)
    return bits


def false_matches(looks: np.ndarray, chars: np.ndarray) -> dict[int, tuple[int, int]]:
    """Tolerance -> (pairs of one character, pairs of different characters) within it."""
    index = faiss.IndexBinaryFlat(LOOK_BYTES * 8)
    index.add(looks)
    lims, dist, labels = index.range_search(looks, max(TOLERANCES) + 1)
    counts = lims[1:].astype(np.int64) - lims[:-1].astype(np.int64)
    rows = np.repeat(np.arange(len(looks)), counts)
    keep = rows < labels  # each pair once, no drawing with itself
    same = chars[rows[keep]] == chars[labels[keep]]
    d = dist[keep]
    return {t: (int((same & (d <= t)).sum()), int((~same & (d <= t)).sum())) for t in TOLERANCES}


def search_cost(queries: np.ndarray, stored: int) -> tuple[float, float]:
    """Seconds of one range search of ``queries`` against ``stored`` random looks; index MiB."""
    rng = np.random.default_rng(0)
    index = faiss.IndexBinaryFlat(LOOK_BYTES * 8)
    index.add(rng.integers(0, 256, (stored, LOOK_BYTES), dtype=np.uint8))
    start = time.perf_counter()
    index.range_search(queries, LOOK_TOLERANCE + 1)
    return time.perf_counter() - start, stored * LOOK_BYTES / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--omniglot", type=Path, required=True)
    parser.add_argument("--sample", type=int, default=400)
    parser.add_argument("--stored", type=int, default=1_000_000)
    args = parser.parse_args()
    parts = [np.load(args.omniglot / f"images_{p}.npz")["images"]
             for p in ("background", "evaluation")]  # fmt: skip
    white = np.concatenate([p.reshape(-1, 105, 105) for p in parts])
    chars = np.repeat(np.arange(sum(len(p) for p in parts)), 20)
    model_input = resize_strokes(white, 28).numpy()
    start = time.perf_counter()
    looks = model_input_looks(model_input)
    print(f"looks of {len(looks)} drawings: {time.perf_counter() - start:.1f} s\n")
    pairs = len(looks) * (len(looks) - 1) // 2
    print("| tolerance (bits of 256) | same-character pairs | other pairs | rate over all pairs |")
    print("|---|---|---|---|")
    for t, (same, other) in false_matches(looks, chars).items():
        print(f"| {t} | {same} | {other} | {(same + other) / pairs:.2e} |")
    pick = np.random.default_rng(1).choice(len(white), args.sample, replace=False)
    print(f"\n| copy ({args.sample} drawings) | largest | 99th pct | within {LOOK_TOLERANCE} |")
    print("|---|---|---|---|")
    for name, copy in copies(white[pick]).items():
        d = _distance(model_input_looks(copy), looks[pick])
        within = (d <= LOOK_TOLERANCE).mean()
        print(f"| {name} | {d.max()} | {np.percentile(d, 99):.0f} | {within:.1%} |")
    for stored in (len(looks), args.stored):
        seconds, mib = search_cost(looks, stored)
        print(f"\nrange search, {len(looks)} looks against {stored:,} stored: {seconds:.2f} s, "
              f"index {mib:.0f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
