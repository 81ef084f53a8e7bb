"""Records what ``Grid.get_nodes()`` tells a ServerApp, once a second.

Node id, status, the name given at registration, the SHA256 fingerprint of the node's
authentication key (OpenSSH form, as ``ssh-keygen -lf`` prints it) and ``online_until``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

app = ServerApp()
client = ClientApp()


def fingerprint(pem: bytes) -> str:
    """``SHA256:...`` of a PEM SubjectPublicKeyInfo key, as OpenSSH prints it."""
    if not pem:
        return ""
    key = serialization.load_pem_public_key(pem)
    blob = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    raw = base64.b64decode(blob.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(raw).digest()).decode().rstrip("=")


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Poll get_nodes() for ``seconds`` seconds."""
    out = Path(str(context.run_config["out"]))
    end = time.time() + float(context.run_config["seconds"])  # type: ignore[arg-type]
    with out.open("a") as fh:
        while time.time() < end:
            nodes = [
                {
                    "id": n.node_id,
                    "status": n.status,
                    "name": n.name if n.HasField("name") else None,
                    "key": fingerprint(n.public_key),
                    "online_until": n.online_until if n.HasField("online_until") else None,
                }
                for n in grid.get_nodes()
            ]
            fh.write(
                json.dumps({"t": time.time(), "ids": sorted(grid.get_node_ids()), "nodes": nodes})
                + "\n"
            )
            fh.flush()
            time.sleep(1)


@client.query()
def query(message: Message, context: Context) -> Message:
    """Unused."""
    return Message(message.content, reply_to=message)
