"""``fedmeta deploy``: start a deployed run and wait for its outcome; run a participant node.

``fedmeta deploy run`` submits fedmeta's ServerApp to a SuperLink and exits with the run's outcome,
where ``flwr run`` exits 0 even when the ServerApp fails. It

* validates the configuration here first (a bad key is exit status 2 before anything is sent) and
  sends it *with the run*, as ``set`` overrides, so the ServerApp never reads a config file path
  that exists only on the operator's machine;
* submits a Flower app that holds no code (``pyproject.toml`` alone, named ``fedmeta/fedmeta`` at
  this fedmeta's version): the ServerApp process imports the fedmeta *installed* on the server, and
  the participants' workers accept only runs of their own fedmeta version;
* gives every run its own output directory (``--runs-dir``/UTC time-random) unless ``--out`` names
  one, so a second run never collides with the first;
* polls the run's status (what ``flwr ls --run-id`` shows, asked in this process: control_api.py)
  until it finishes, then exits with fedmeta's exit status (core/fedmeta/exitcodes.py), and prints
  where the outputs and the ledger are.

``fedmeta deploy participant`` runs one participant: a SuperNode
(``python -m fedmeta.client.supernode``, fast polls, ``--isolation process``) and its warm worker
(``python -m fedmeta.client.worker``) beside it,
sharing the node's loopback. If either ends, the other is stopped and the command exits with the
first one's status, so a supervisor (systemd, a container's restart policy) restarts both.
``fedmeta deploy worker`` runs the warm worker alone, for a SuperNode started elsewhere (Flower's
``flwr/supernode`` image: ``deploy/compose/flower-images.yml``).

Nothing here imports torch or ``server``, and Flower only to poll a run's status (control_api.py):
the commands drive subprocesses (``worker`` replaces its own process with the worker's). The modules
they launch are imported (``client.supernode``, ``client.worker``: both import Flower only when
they run), so the launched names follow the code.

The commands live in modules of their own, one concept each: deploy_flwr.py (the connection to a
SuperLink and the ``flwr`` CLI), deploy_args.py (the flags several commands share, with one
default each), deploy_run_config.py and deploy_run.py (what ``run`` sends, and
its run-and-wait), deploy_participant.py (``participant``, ``worker``), deploy_keys.py
(``register``), deploy_local.py (``local``) and deploy_status.py (``status``, ``runs``).
"""

from __future__ import annotations

from typing import Any

from fedmeta.cli import (
    deploy_keys,
    deploy_local,
    deploy_participant,
    deploy_run,
    deploy_status,
)


def register(subparsers: Any) -> None:
    """Add ``fedmeta deploy`` and its commands (run, participant, worker, register, ...)."""
    deploy = subparsers.add_parser(
        "deploy", help="deployed federations (Flower SuperLink / SuperNodes): run, worker, ...",
        description="Start a run on a deployed federation and wait for it, or run a participant "
        "node. See docs/deploy.md.",
    )  # fmt: skip
    sub = deploy.add_subparsers(dest="deploy_command", metavar="COMMAND")
    sub.required = True
    deploy_run.register(sub)
    deploy_participant.register(sub)
    deploy_keys.register(sub)
    deploy_local.register(sub)
    deploy_status.register(sub)
