"""The deployment files fedmeta runs itself: ``fedmeta.deploy``, data with one finder.

``tls/make-certs.sh`` (with ``tls/register-nodes.sh``, which it calls) and
``proxy/fleet-only.conf.template`` are used by ``fedmeta deploy local`` from an installed wheel as
well as from a checkout. A checkout keeps them with the other deployment files, in ``deploy/tls``
and ``deploy/proxy`` (two folders above this package's source root); the wheel carries them inside
this package (pyproject.toml, ``force-include``). :func:`data_file` looks in the package first.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

#: This package's folder: ``site-packages/fedmeta/deploy`` or ``deploy/fedmeta/deploy``.
_PACKAGE = Path(__file__).resolve().parent


def data_file(parts: Sequence[str]) -> Path:
    """The deployment file at ``parts`` (e.g. ``("tls", "make-certs.sh")``), installed or not."""
    installed = _PACKAGE.joinpath(*parts)
    if installed.is_file():
        return installed
    # A checkout: deploy/fedmeta/deploy -> deploy/.
    return _PACKAGE.parents[1].joinpath(*parts)
