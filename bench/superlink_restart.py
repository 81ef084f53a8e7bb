"""How long a SuperLink restart (to load a renewed certificate) interrupts a federation.

    sudo .venv/bin/python bench/superlink_restart.py --repeats 3

The federation of ``tests/deploy/test_cert_lifecycle_netns.py`` (one server host and three
participant hosts as network namespaces; the SuperLink with TLS, node authentication and its state
in ``--database``; participants through the Fleet-only proxy), idle between runs. Each repeat
renews the server certificate (make-certs.sh, same CA) and restarts the SuperLink as
docs/deploy.md says (SIGTERM, start on the same database), measuring from the signal: the old
process's exit, the new one's Control API answering (``flwr ls`` polled every 0.5 s, about 1 s
resolution) and every SuperNode's logged reconnection (Flower's retry backoff). Needs root (``ip
netns``) and nginx. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.deploy.netns import Network, netns_unavailable, nginx_unavailable  # noqa: E402
from tests.deploy.test_cert_lifecycle_netns import (  # noqa: E402
    make_certs,
    restart_superlink,
    start_federation,
)

from fedmeta.cli.deploy_local import LocalFederation  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    reason = netns_unavailable() or nginx_unavailable()
    if reason:
        sys.exit(f"bench/superlink_restart.py: {reason}")
    gaps: list[dict[str, float]] = []
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="fedmeta-restart-") as work:
        with Network(participants=3) as net:
            fed = LocalFederation(Path(work), net.server, port=8000, fleet_proxy=True)
            try:
                nodes, link = start_federation(fed, net)
                for _ in range(args.repeats):
                    (fed.certs / "server.crt").unlink()
                    make_certs(fed, net)  # a renewed certificate: what the restart is for
                    link, gap = restart_superlink(fed, link, nodes)
                    gaps.append(gap)
                    load.append(os.getloadavg()[0])
            finally:
                fed.close()
    summary = {
        key: {"mean": round(statistics.mean(g[key] for g in gaps), 2),
              "min": round(min(g[key] for g in gaps), 2),
              "max": round(max(g[key] for g in gaps), 2)}
        for key in ("stopped", "control", "nodes")
    }  # fmt: skip
    print(json.dumps({
        "bench": "superlink_restart", "repeats": args.repeats, "seconds": summary,
        "runs": [{k: round(v, 2) for k, v in g.items()} for g in gaps],
        "load_average_1min": [round(x, 1) for x in load], "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
