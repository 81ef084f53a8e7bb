#!/usr/bin/env python3
"""Container healthcheck for the fedmeta images (standard library only; exit 0 = healthy).

    fedmeta-healthcheck superlink      GET /health on the SuperLink's port (HTTPS when
                                       FEDMETA_TLS_CA names the CA file, else HTTP)
    fedmeta-healthcheck participant    GET /health on the SuperNode's local Runtime API, and the
                                       warm worker's liveness file is fresh (it is touched every 5 s
                                       while the worker polls, and with every task heartbeat)
    fedmeta-healthcheck worker         the worker alone (``fedmeta deploy worker``, its SuperNode
                                       in another container): GET /health on the Runtime API at
                                       FEDMETA_RUNTIME_API, and the liveness file is fresh
    fedmeta-healthcheck exporter       GET /metrics of the ledger exporter (port 9464, or
                                       FEDMETA_EXPORTER_PORT)

Environment: FEDMETA_SUPERLINK_PORT (8000), FEDMETA_RUNTIME_PORT (9094), FEDMETA_RUNTIME_API
(127.0.0.1:9094), FEDMETA_TLS_CA, FEDMETA_WORKER_ALIVE (/tmp/fedmeta-worker.alive),
FEDMETA_WORKER_ALIVE_MAX_AGE_S (60).
"""

from __future__ import annotations

import os
import ssl
import sys
import time
import urllib.request


def _get(url: str, ca: str | None) -> bool:
    ctx = ssl.create_default_context(cafile=ca) if url.startswith("https") else None
    try:
        with urllib.request.urlopen(url, timeout=4, context=ctx) as res:  # noqa: S310
            return bool(res.status == 200)
    except OSError as error:
        print(f"{url}: {error}", file=sys.stderr)
        return False


def _worker_alive() -> bool:
    """The warm worker touched its liveness file within FEDMETA_WORKER_ALIVE_MAX_AGE_S."""
    alive = os.environ.get("FEDMETA_WORKER_ALIVE", "/tmp/fedmeta-worker.alive")
    max_age = float(os.environ.get("FEDMETA_WORKER_ALIVE_MAX_AGE_S", "60"))
    try:
        age = time.time() - os.stat(alive).st_mtime
    except OSError:
        print(f"worker liveness file {alive} missing", file=sys.stderr)
        return False
    if age > max_age:
        print(f"worker liveness file {alive} is {age:.0f} s old", file=sys.stderr)
        return False
    return True


def main() -> int:
    """Check the role given as the first argument."""
    role = sys.argv[1] if len(sys.argv) > 1 else ""
    ca = os.environ.get("FEDMETA_TLS_CA") or None
    if role == "superlink":
        scheme = "https" if ca else "http"
        port = os.environ.get("FEDMETA_SUPERLINK_PORT", "8000")
        # The certificate names localhost (deploy/tls/make-certs.sh).
        return 0 if _get(f"{scheme}://localhost:{port}/health", ca) else 1
    if role in ("participant", "worker"):
        if role == "participant":
            address = "127.0.0.1:" + os.environ.get("FEDMETA_RUNTIME_PORT", "9094")
        else:
            address = os.environ.get("FEDMETA_RUNTIME_API", "127.0.0.1:9094")
        if not _get(f"http://{address}/health", None):
            return 1
        return 0 if _worker_alive() else 1
    if role == "exporter":
        port = os.environ.get("FEDMETA_EXPORTER_PORT", "9464")
        return 0 if _get(f"http://127.0.0.1:{port}/metrics", None) else 1
    print("usage: fedmeta-healthcheck superlink|participant|worker|exporter", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
