"""``fedmeta exporter``: a long-lived process serving the budget ledger's cumulative state.

A run's ServerApp (and its live /metrics) lives only as long as the run; the privacy budget outlives
runs. This exporter re-reads the SQLite ledger on every scrape (a custom collector in
``server.monitoring.ledger``) and serves, per federation: epsilon spent (task and participant
level), budget, remaining fraction, rounds affordable left, spends recorded, plus the latest run
records (``summary.json`` under ``--runs-dir``), and ``fedmeta_ledger_readable{db, reason}``, which
says when the ledger cannot be read and why. The ledger is opened read-only (it works on a read-only
mount and never writes the file) and followed when it is replaced on disk. Why an exporter rather
than a Pushgateway: see docs/monitoring.md. Registration imports nothing heavy; prometheus_client is
imported (through ``server.monitoring``) only when the command runs.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from typing import Any

DEFAULT_PORT = 9464
DEFAULT_BIND = "127.0.0.1"


def register(subparsers: Any) -> None:
    """Add ``fedmeta exporter`` to the CLI."""
    p = subparsers.add_parser(
        "exporter",
        help="serve the budget ledger's cumulative state as Prometheus metrics",
        description=(
            "Serve the privacy-budget ledger (per federation) and the latest run summaries as "
            "Prometheus metrics, re-read on every scrape. Binds to localhost by default."
        ),
    )
    p.add_argument(
        "--db",
        required=True,
        help="the SQLite ledger (privacy.ledger_path); opened read-only, a read-only mount is fine",
    )
    p.add_argument(
        "--runs-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="run output directory (or a parent of run directories) holding summary.json; "
        "repeatable",
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}")
    p.add_argument("--bind", default=DEFAULT_BIND, help=f"address to bind (default {DEFAULT_BIND})")
    p.add_argument(
        "--no-rounds-affordable",
        action="store_true",
        help="skip the rounds-affordable gauge (a PLD search per new spend) on huge ledgers",
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT."""
    from fedmeta.server.monitoring.ledger import exporter_registry
    from fedmeta.server.monitoring.live import serve

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log = logging.getLogger("fedmeta.exporter")
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"--port must be in [0, 65535]; got {args.port}")
    registry, collector = exporter_registry(
        args.db, args.runs_dir, affordable=not args.no_rounds_affordable
    )
    server, port = serve(registry, args.port, args.bind)
    # The bound port on one line, for scripts and tests that pass --port 0.
    print(
        f"fedmeta exporter serving http://{args.bind}:{port}/metrics (ledger {args.db})", flush=True
    )
    stop = threading.Event()

    def _stop(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        while not stop.wait(3600):
            pass
    finally:
        server.shutdown()
        server.server_close()
        collector.close()
    return 0
