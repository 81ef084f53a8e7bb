"""File digests: checksums of downloads, and the identity of a dataset's source files.

* :func:`verify_checksum` - check a file against known SHA-256 / MD5 digests.
* :func:`file_sha256` - a file's SHA-256, remembered per ``(path, size, mtime)`` for the life of the
  process, so asking again for an unchanged file costs one ``stat``.
* :func:`manifest_digest` - one SHA-256 over a set of files: each file's path relative to a root
  and its SHA-256, in sorted path order. The dataset loaders build their source digests
  (:func:`~metalearning.omniglot.omniglot_source_digest`,
  :func:`~metalearning.images.image_folder_source_digest`) from it, over exactly the files they
  read.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from fedmeta.metalearning.errors import ChecksumError, DataError

__all__ = ["file_digest", "file_sha256", "manifest_digest", "verify_checksum"]

# Changing what a manifest digest covers changes every dataset identity built on it: bump this so
# old and new identities can never be confused.
MANIFEST_FORMAT = "fedmeta-source-manifest-v1"


def file_digest(path: Path, algo: str = "sha256") -> str:
    """Hex digest of ``path``'s bytes, read in 1 MiB blocks."""
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file, cached by ``(absolute path, size, mtime)``.

    A changed file has a new size or mtime and is read again. A rewrite that keeps both (the same
    size within the filesystem's mtime resolution) is not noticed within one process: the cache
    guards against repeated work, not against tampering. The path is made absolute without
    resolving links (``Path.resolve`` costs several system calls per file, which dominated a
    second digest of the 32,460 unpacked Omniglot drawings); ``stat`` follows them.
    """
    p = os.path.abspath(path)
    st = os.stat(p)
    return _sha256_by_stat(p, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=1 << 16)
def _sha256_by_stat(path: str, size: int, mtime_ns: int) -> str:
    return file_digest(Path(path), "sha256")


def manifest_digest(root: Path, files: Iterable[str | Path]) -> str:
    """SHA-256 over ``files``' relative paths (to ``root``) and contents, in sorted path order.

    The hashed text is :data:`MANIFEST_FORMAT` and then one ``<sha256>  <relative/path>`` line per
    file (the ``sha256sum`` format, ``/``-separated): where the directory lives does not matter,
    renaming a file inside it does (the loaders read labels from names). Every file must lie under
    ``root``.
    """
    prefix = os.path.join(os.path.abspath(root), "")
    lines = []
    for f in files:
        path = os.path.abspath(f)
        if not path.startswith(prefix):
            raise ValueError(f"{path} is not under {root}; a manifest covers one directory")
        lines.append((path[len(prefix) :].replace(os.sep, "/"), file_sha256(path)))
    h = hashlib.sha256(f"{MANIFEST_FORMAT}\n".encode())
    for rel, digest in sorted(lines):
        h.update(f"{digest}  {rel}\n".encode())
    return h.hexdigest()


def verify_checksum(path: str | Path, *, sha256: str | None = None, md5: str | None = None) -> str:
    """Check ``path`` against the given digests; return its SHA-256 (or raise ChecksumError)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"expected a file at {path}; none found")
    got = file_digest(path, "sha256")
    if sha256 is not None and got != sha256.lower():
        raise ChecksumError(
            f"{path}: SHA-256 {got} does not match the expected {sha256.lower()}; the file is "
            "corrupted or not the official release - delete it and download again"
        )
    if md5 is not None:
        got_md5 = file_digest(path, "md5")
        if got_md5 != md5.lower():
            raise ChecksumError(
                f"{path}: MD5 {got_md5} does not match the expected {md5.lower()}; the file is "
                "corrupted or not the official release - delete it and download again"
            )
    return got
