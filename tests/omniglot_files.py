"""Omniglot's release format in tests: its PNG drawings, written as its zips or unpacked folders.

The official release is two parts (``images_background``, ``images_evaluation``), each a zip of
``<part>/<alphabet>/characterNN/<id>_<drawing>.png`` files, or those files unpacked. Tests that
make such data (loaders, item digests, budgets by content) build the file names and write them here.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from PIL import Image


def png(white: np.ndarray, mode: str = "1") -> bytes:
    """A white-True drawing mask (the npz convention) as PNG bytes in ``mode``."""
    buf = io.BytesIO()
    Image.fromarray(white).convert(mode).save(buf, format="PNG")
    return buf.getvalue()


def write_release(root: Path, part: str, files: Mapping[str, bytes], *, as_zip: bool) -> None:
    """``files`` (names below ``part/``) as ``root/<part>.zip``, or unpacked below ``root``."""
    if as_zip:
        root.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(root / f"{part}.zip", "w") as z:
            for name, data in files.items():
                z.writestr(name, data)
        return
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
