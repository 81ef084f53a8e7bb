"""The Flower version fedmeta accepts, and Flower's task identity outside Flower's runtimes.

fedmeta's participant side reaches below Flower's public API (``flwr.app``, ``flwr.clientapp``,
``flwr.serverapp``, ``flwr.simulation`` and the CLIs) in two places: the warm worker
(``client/fedmeta/client/worker.py``) speaks the SuperNode's Runtime API itself instead of a
per-message
``flwr-clientapp`` process, and the SuperNode launcher (``client/fedmeta/client/supernode.py``)
shortens
``flower-supernode``'s fixed waits. A few smaller uses sit in
``simulation/fedmeta/simulation/local_grid.py``,
``server/fedmeta/server/transport.py`` and ``cli/fedmeta/cli/deploy_status.py``.
``tests/test_flower_internals.py`` lists
every such name and checks that the installed Flower has it as fedmeta uses it (keyword
parameters, protobuf fields, the SuperNode's waits), so that an upgrade that moves one fails with
its name; docs/deploy.md, "Moving to the next Flower release", explains each.

:func:`check_flower` is the version guard both launchers run at start: these internals change
between Flower minors (``flwr-clientapp`` spoke gRPC ``ClientAppIo`` in 1.30 and the HTTP Runtime
API with task tokens in 1.41), so a release is accepted only once it has been checked.
"""

from __future__ import annotations

import sys

#: The Flower minor series fedmeta is written against; pyproject.toml's pin and the images'
#: constraints name the same series (``tests/test_flower_internals.py`` checks that they agree).
FLOWER_SERIES = "1.41."


#: Exit status of a launcher refused by :func:`check_flower` (EX_CONFIG: restarting cannot help).
EXIT_FLOWER_VERSION = 78


class WrongFlower(SystemExit):
    """Exit status :data:`EXIT_FLOWER_VERSION`; ``str()`` is the one-line reason."""

    def __init__(self, reason: str) -> None:
        """``reason``: already printed to stderr by :func:`check_flower`."""
        super().__init__(EXIT_FLOWER_VERSION)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


def check_flower(component: str, version: str | None = None) -> None:
    """Refuse any Flower outside :data:`FLOWER_SERIES`: one line on stderr, exit status 78."""
    import flwr

    found = version if version is not None else flwr.__version__
    if not found.startswith(FLOWER_SERIES):
        reason = (
            f"fedmeta {component}: written against flwr {FLOWER_SERIES}x, found {found}; install "
            f"flwr=={FLOWER_SERIES}* (the version fedmeta pins) on this node"
        )
        print(reason, file=sys.stderr)
        raise WrongFlower(reason)


def ensure_task_identity() -> None:
    """Give Flower's task identity a value where no Flower runtime has set one.

    Flower's ``Message()`` reads ``TaskIdentity`` (set by ``flwr-clientapp`` from the task it
    pulled). Outside a Flower runtime (the worker's warm-up, the in-process grid) it is unset and
    ``Message()`` raises; 0 stands for "no task" until a real task sets it. Through its
    ``run_id``/``task_id``/``node_id`` properties, not its private ``_run_id`` fields.
    """
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("task_id", "run_id", "node_id"):
        try:
            getattr(TaskIdentity, name)
        except RuntimeError:  # "TaskIdentity.<name> is not set."
            setattr(TaskIdentity, name, 0)
