"""Cost of the item digests that name a budget's data (issue 39): `python bench/item_digests.py
--omniglot DIR [--runs 3] [--folders]`.

DIR holds Omniglot's ``images_background.npz`` + ``images_evaluation.npz``. Measures
``omniglot_item_ids`` (metalearning/omniglot.py) on all 32,460 drawings:

* cold: nothing cached (read, decode, ink masks, one BLAKE2b per drawing);
* disk cache: a new process on unchanged files (``stat`` + one ``.npy`` read);
* in process: asked again (one ``stat`` per source file);
* with ``--folders``: the same drawings written once as the official unpacked PNG folders
  (32,460 files), then cold (every PNG decoded) and disk-cached (a ``stat`` per file);

and checks that every layout gives the same digests. Prints markdown; no assertion on time.
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# Run as a script, bench/ would come first on sys.path; put the repository root first instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import numpy as np  # noqa: E402

from fedmeta.metalearning import omniglot  # noqa: E402


def _timed(fn: Callable[[], np.ndarray], runs: int, before: Callable[[], None]) -> list[float]:
    out = []
    for _ in range(runs):
        before()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _row(name: str, times: list[float]) -> str:
    cells = ", ".join(f"{t:.3f}" for t in times)
    return f"| {name} | {cells} | {statistics.median(times):.3f} |"


def _write_folders(src: Path, dest: Path) -> None:
    """The npz drawings as the official layout: <part>/<alphabet>/characterNN/<NNNN>_<DD>.png."""
    from PIL import Image

    for part in ("images_background", "images_evaluation"):
        white, alphas, prefixes = omniglot.read_npz(src / f"{part}.npz")
        for c, (alpha, prefix) in enumerate(zip(alphas, prefixes, strict=True)):
            folder = dest / part / alpha / f"character{c + 1:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            for d in range(white.shape[1]):
                buf = io.BytesIO()
                Image.fromarray(white[c, d]).convert("1").save(buf, format="PNG")
                (folder / f"{prefix:04d}_{d + 1:02d}.png").write_bytes(buf.getvalue())


def _measure(path: Path, runs: int, cache: Path, label: str) -> tuple[list[str], np.ndarray]:
    clear = omniglot._item_ids_by_stamp.cache_clear

    def wipe() -> None:
        clear()
        for f in cache.glob("omniglot-items-*.npy"):
            f.unlink()

    ids = omniglot.omniglot_item_ids(path, cache=cache)
    rows = [
        _row(f"{label}: cold (no cache)", _timed(
            lambda: omniglot.omniglot_item_ids(path, cache=cache), runs, wipe)),
        _row(f"{label}: disk cache (a new process)", _timed(
            lambda: omniglot.omniglot_item_ids(path, cache=cache), runs, clear)),
        _row(f"{label}: asked again in process", _timed(
            lambda: omniglot.omniglot_item_ids(path, cache=cache), runs, lambda: None)),
    ]  # fmt: skip
    return rows, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--omniglot", type=Path, required=True, help="folder with the two npz files")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--folders", action="store_true", help="also the unpacked PNG folders")
    args = ap.parse_args()
    load = os.getloadavg()
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, numpy {np.__version__}, "
          f"load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")  # fmt: skip
    print("| what | seconds per run | median |\n|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        rows, ids = _measure(args.omniglot, args.runs, Path(tmp) / "cache", "npz")
        if args.folders:
            folders = Path(tmp) / "folders"
            _write_folders(args.omniglot, folders)
            more, same = _measure(folders, args.runs, Path(tmp) / "cache", "PNG folders")
            rows += more
            if not np.array_equal(ids, same):
                sys.exit("the PNG folders gave other digests than the npz")
        print("\n".join(rows))
    print(f"\n{len(ids)} drawings, {len(np.unique(ids))} distinct digests; load average at end "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
