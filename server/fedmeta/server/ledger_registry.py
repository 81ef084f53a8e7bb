"""The registry of ledgers: one per account at a fixed place, or one shared (issues 39 and 52).

A budget lives in one ledger file; another file would hold a fresh budget for the same data. So
every ledger a production run opens is remembered here, and a run is refused a ledger when another
remembered ledger records any of its data (server/fedmeta/server/ledger_witness.py). That only
works if every run of the account reads the *same* registry, whatever state directory, ``HOME``,
``XDG_STATE_HOME`` or ``privacy.ledger_path`` it was given:

* ``$FEDMETA_LEDGER_REGISTRY`` (an absolute file path), where several accounts or machines serve
  the same data: a file on storage all of them read and write (a shared volume, NFS);
* else one per account at a fixed place, ``~/.local/state/fedmeta-registry/ledgers.json`` under
  the home directory the **passwd database** gives the account's uid: not ``$HOME`` or any
  variable a shell can change, so another ``HOME`` or state directory reads the same registry.

Before issue 52 the registry lived in the witness directory, which follows the state directory:
each state directory had its own, and another one opened a fresh budget. Entries of that older
place are still read (:func:`known_ledgers`).

Updates take an exclusive ``flock`` on ``<registry>.lock``, read the file, add the ledger, write a
temporary file beside it, fsync it and rename it over the registry: concurrent runs never lose an
entry, and a reader (which takes no lock) sees the old file or the new one, never half of one. A
registry that cannot be read or written refuses the run in one line (the check would be void).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fedmeta.accounting import LedgerError
from fedmeta.paths import witness_dir

REGISTRY_ENV = "FEDMETA_LEDGER_REGISTRY"
REGISTRY_NAME = "ledgers.json"
#: 2: ``{"version": 2, "ledgers": [{"path": ..., "ledger_id": ...}]}``; 1: ``{"ledgers": [path]}``.
REGISTRY_VERSION = 2


class RegistryUnusable(LedgerError):
    """The registry of ledgers cannot be read or written: the one-ledger check would be void."""


def registry_file() -> Path:
    """The registry this account's runs share (module docstring): the variable, else passwd."""
    explicit = os.environ.get(REGISTRY_ENV)
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_absolute():
            raise RegistryUnusable(
                f"{REGISTRY_ENV}={explicit} is a relative path: each working directory would "
                "have its own registry of ledgers; set it to an absolute file path"
            )
        return path
    home = Path(pwd.getpwuid(os.getuid()).pw_dir)
    return home / ".local" / "state" / "fedmeta-registry" / REGISTRY_NAME


def known_ledgers() -> list[Path]:
    """Every remembered ledger path: the registry's, then the older per-state-directory one's."""
    paths = [Path(e["path"]) for e in _entries(registry_file(), strict=True)]
    older = [Path(e["path"]) for e in _entries(witness_dir() / REGISTRY_NAME, strict=False)]
    return list(dict.fromkeys([*paths, *older]))


def check_writable() -> None:
    """Refuse (``RegistryUnusable``) a registry that cannot be updated, before any ledger exists."""
    with _locked(registry_file()):
        pass


def remember(path: Path, ledger_id: str | None) -> None:
    """Add the ledger at ``path`` (absolute) to the registry, under its lock, atomically."""
    registry = registry_file()
    with _locked(registry):
        entries = _entries(registry, strict=True)
        if any(e["path"] == str(path) for e in entries):
            return
        entries.append({"path": str(path), "ledger_id": ledger_id})
        _replace(registry, {"version": REGISTRY_VERSION, "ledgers": entries})


def _entries(registry: Path, *, strict: bool) -> list[dict[str, Any]]:
    """The registry's entries; an unreadable registry is refused (``strict``) or read as empty."""
    try:
        data = json.loads(registry.read_text(encoding="utf-8"))
        rows = data["ledgers"]
        return [{"path": r, "ledger_id": None} if isinstance(r, str)
                else {"path": str(r["path"]), "ledger_id": r.get("ledger_id")}
                for r in rows]  # fmt: skip
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        if not strict:
            return []
        raise RegistryUnusable(
            f"the registry of ledgers {registry} cannot be read ({error}); restore it from a "
            f"backup, or set {REGISTRY_ENV} to the registry this data's runs use; nothing was spent"
        ) from error


@contextlib.contextmanager
def _locked(registry: Path) -> Iterator[None]:
    """An exclusive lock on ``<registry>.lock`` (created with its folder if need be)."""
    lock = registry.with_name(registry.name + ".lock")
    try:
        registry.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as error:
        raise RegistryUnusable(
            f"the registry of ledgers {registry} cannot be written ({error.strerror}); set "
            f"{REGISTRY_ENV} to a writable file path (shared storage where several accounts or "
            "machines serve the same data); nothing was spent"
        ) from error
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _replace(registry: Path, data: dict[str, Any]) -> None:
    """Write ``data`` beside ``registry``, fsync, rename over it (readers see old or new)."""
    tmp = registry.with_name(f".{registry.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, registry)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise RegistryUnusable(
            f"the registry of ledgers {registry} cannot be written ({error.strerror}); set "
            f"{REGISTRY_ENV} to a writable file path; the ledger is unchanged"
        ) from error
