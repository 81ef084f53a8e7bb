"""Build the shipped digest set of Omniglot's public release (metalearning/public_releases.py).

`python scripts/public_items.py --omniglot DIR` reads DIR/images_background.npz and
DIR/images_evaluation.npz (the official archives in npz form; zips or unpacked folders work as
well) and writes metalearning/fedmeta/metalearning/public_items/omniglot.bin, printing its size.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

from fedmeta.metalearning import omniglot_item_ids  # noqa: E402
from fedmeta.metalearning.public_releases import to_bytes  # noqa: E402

TARGET = Path(_HERE).parent / "metalearning/fedmeta/metalearning/public_items/omniglot.bin"


def main() -> None:
    """Write the digest set and print its size."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--omniglot", type=Path, required=True, help="folder with the release")
    args = ap.parse_args()
    items = omniglot_item_ids(args.omniglot, cache=False)
    data = to_bytes(items)
    TARGET.write_bytes(data)
    print(f"{TARGET.name}: {len(items)} drawings, {len(data) // 6} distinct digests, "
          f"{len(data):,} bytes")  # fmt: skip


if __name__ == "__main__":
    main()
