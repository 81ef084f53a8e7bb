"""Where fedmeta keeps state that outlives a run: the default budget ledger.

The privacy budget belongs to the data, not to a run's output directory, so by default every run
spends from one ledger in fedmeta's state directory: ``$FEDMETA_STATE_DIR`` if set, else
``$XDG_STATE_HOME/fedmeta``, else ``~/.local/state/fedmeta`` (the XDG Base Directory default).
Runs in the reproducible test mode (noise not private) use a separate ledger file, so they never
spend from the ledger a secure run uses.
"""

from __future__ import annotations

import os
from pathlib import Path

STATE_DIR_ENV = "FEDMETA_STATE_DIR"
WITNESS_DIR_ENV = "FEDMETA_WITNESS_DIR"
CACHE_DIR_ENV = "FEDMETA_CACHE_DIR"
EPSILON_CACHE_NAME = "epsilons.sqlite"
LEDGER_NAME = "ledger.sqlite"
INSECURE_LEDGER_NAME = "insecure-test-ledger.sqlite"


def state_dir() -> Path:
    """Fedmeta's state directory (not created here)."""
    explicit = os.environ.get(STATE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser().resolve()
    xdg = os.environ.get("XDG_STATE_HOME")
    base = (
        Path(xdg).expanduser()
        if xdg and Path(xdg).is_absolute()
        else Path.home() / ".local" / "state"
    )
    return (base / "fedmeta").resolve()


def default_ledger_path(*, secure: bool) -> Path:
    """The default ledger: one per state directory for secure runs, another for test-mode runs."""
    return state_dir() / (LEDGER_NAME if secure else INSECURE_LEDGER_NAME)


def experiment_ledger_path(name: str, *, secure: bool) -> Path:
    """An experiment's own ledger (``privacy.experiment``), beside the default one.

    Test-mode runs keep theirs apart as well, as the default ledgers are kept apart.
    """
    folder = "experiments" if secure else "insecure-test-experiments"
    return state_dir() / folder / f"{name}.sqlite"


def epsilon_cache_path() -> Path:
    """Where ``fedmeta ledger show`` keeps the epsilons it composed, by their inputs' hash.

    ``$FEDMETA_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/fedmeta``, else ``~/.cache/fedmeta``:
    derived data, safe to delete (accounting/fedmeta/accounting/ledger/epsilon_cache.py), and
    never beside a ledger.
    """
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser().resolve() / EPSILON_CACHE_NAME
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return (base / "fedmeta").resolve() / EPSILON_CACHE_NAME


def witness_dir() -> Path:
    """Where the ledgers' witnesses live: outside the state directory.

    ``$FEDMETA_WITNESS_DIR`` if set (in a deployment: storage a restore of the state directory
    does not reach, e.g. the SuperLink host's or the exporter's), else a sibling of the state
    directory, ``<state>-witness`` (``~/.local/state/fedmeta-witness`` by default): restoring the
    whole state directory leaves it alone (server/fedmeta/server/ledger_witness.py). The registry
    of ledgers is elsewhere, at one place per account (server/fedmeta/server/ledger_registry.py).
    """
    explicit = os.environ.get(WITNESS_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser().resolve()
    state = state_dir()
    return state.with_name(state.name + "-witness")
