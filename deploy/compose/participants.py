#!/usr/bin/env python3
"""Set the number of participants of the compose federation: the one change it takes.

    python3 deploy/compose/participants.py 5

rewrites, between their ``# BEGIN participants`` / ``# END participants`` markers,

* docker-compose.yml: one ``participant-ID`` service per participant (SuperNode + warm worker,
  participant id ID, its own data volume ``data-ID``) and those volumes;
* deploy/compose/tls.yml: each participant's own node key (``certs/nodes/participant-ID.key``);
* deploy/compose/flower-images.yml: each participant's ``supernode-ID`` (Flower's image) and its
  worker ``participant-ID``; deploy/compose/flower-images-tls.yml: each SuperNode's CA and node key;
* deploy/compose/federation.toml: ``federation.participants``.

With TLS, make the new participants' keys afterwards (``deploy/tls/make-certs.sh --out certs
--nodes 5``); the overlay registers them when the federation starts. ``--check`` only verifies
that the files are what this script writes (used by the tests).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "# BEGIN participants", "# END participants"


def services(n: int) -> str:
    """docker-compose.yml's participant services."""
    return "".join(
        f"  participant-{i}:\n"
        f"    <<: *participant\n"
        f'    environment: {{<<: *participant-env, FEDMETA_PARTICIPANT_ID: "{i}"}}\n'
        f"    volumes: [data-{i}:/data]\n"
        for i in range(n)
    )


def volumes(n: int) -> str:
    """docker-compose.yml's participant data volumes."""
    return "".join(f"  data-{i}:\n" for i in range(n))


def tls_keys(n: int) -> str:
    """deploy/compose/tls.yml: each participant's node key and the TLS settings."""
    return "".join(
        f"  participant-{i}:\n"
        f"    <<: *participant-tls\n"
        f'    environment: {{<<: *participant-tls-env, FEDMETA_PARTICIPANT_ID: "{i}"}}\n'
        f"    volumes:\n"
        f"      - ${{FEDMETA_CERTS:-./certs}}/ca.crt:/certs/ca.crt:ro\n"
        f"      - ${{FEDMETA_CERTS:-./certs}}/nodes/participant-{i}.key:/certs/node.key:ro\n"
        for i in range(n)
    )


#: How a SuperNode in Flower's image reaches the SuperLink: without TLS (flower-images.yml), and
#: with the CA and its own node key (flower-images-tls.yml).
INSECURE_LINK = ('"--insecure", "--superlink", "superlink:8000",',)
TLS_LINK = ('"--root-certificates", "/certs/ca.crt", "--superlink", "superlink:8000",',
            '"--auth-supernode-private-key", "/certs/node.key",')  # fmt: skip


def supernode_command(i: int, *link: str) -> str:
    """A SuperNode's ``command`` in Flower's image, for participant ``i``.

    ``link`` are its flags to reach the SuperLink; then the Runtime API on the shared loopback and
    the node config (the data path is the worker's).
    """
    lines = [*link, '"--isolation", "process", "--host", "127.0.0.1", "--port", "9094",',
             f'"--node-config", "participant-id=\\"{i}\\" data-path=\\"/data\\""]']  # fmt: skip
    return "    command: [" + "\n              ".join(lines) + "\n"


def flower_nodes(n: int) -> str:
    """deploy/compose/flower-images.yml: Flower's SuperNode and fedmeta's worker per participant."""
    return "".join(
        f"  netns-{i}:\n"
        f"    <<: *netns\n"
        f"  supernode-{i}:\n"
        f"    <<: *supernode\n"
        + supernode_command(i, *INSECURE_LINK)
        + f"    network_mode: service:netns-{i}\n"
        f"  participant-{i}:\n"
        f"    <<: *worker\n"
        f"    network_mode: service:netns-{i}\n"
        f"    depends_on:\n"
        f"      supernode-{i}: {{condition: service_healthy}}\n"
        for i in range(n)
    )


def flower_tls(n: int) -> str:
    """deploy/compose/flower-images-tls.yml: each SuperNode's TLS flags and node key."""
    return "".join(
        f"  supernode-{i}:\n"
        f"    <<: *supernode-tls\n"
        + supernode_command(i, *TLS_LINK)
        + f"    volumes:\n"
        f"      - ${{FEDMETA_CERTS:-./certs}}/ca.crt:/certs/ca.crt:ro\n"
        f"      - ${{FEDMETA_CERTS:-./certs}}/nodes/participant-{i}.key:/certs/node.key:ro\n"
        f"  participant-{i}:\n"
        f"    volumes: !override [data-{i}:/data]\n"
        for i in range(n)
    )


def replace_block(text: str, block: str, which: int = 0) -> str:
    """``text`` with its ``which``-th marked block replaced by ``block``."""
    pattern = re.compile(rf"(^[ \t]*{re.escape(BEGIN)}[^\n]*\n)(.*?)(^[ \t]*{re.escape(END)})",
                         re.S | re.M)  # fmt: skip
    matches = list(pattern.finditer(text))
    if len(matches) <= which:
        raise SystemExit(f"participants.py: marker block {which + 1} not found")
    m = matches[which]
    return text[: m.start(2)] + block + text[m.end(2) :]


def rewrite(n: int) -> dict[Path, str]:
    """Each file's new text for ``n`` participants."""
    compose = ROOT / "docker-compose.yml"
    text = replace_block(compose.read_text(), services(n), 0)
    text = replace_block(text, volumes(n), 1)
    tls = ROOT / "deploy" / "compose" / "tls.yml"
    toml = ROOT / "deploy" / "compose" / "federation.toml"
    fed = re.sub(r"(?m)^participants = \d+", f"participants = {n}", toml.read_text())
    per_round = re.search(r"(?m)^participants_per_round = (\d+)", fed)
    if per_round and int(per_round.group(1)) > n:
        fed = fed.replace(per_round.group(0), f"participants_per_round = {n}")
    flower = ROOT / "deploy" / "compose" / "flower-images.yml"
    flower_tls_file = ROOT / "deploy" / "compose" / "flower-images-tls.yml"
    return {compose: text, tls: replace_block(tls.read_text(), tls_keys(n)),
            flower: replace_block(flower.read_text(), flower_nodes(n)),
            flower_tls_file: replace_block(flower_tls_file.read_text(), flower_tls(n)),
            toml: fed}  # fmt: skip


def main() -> int:
    """Rewrite (or ``--check``) the files."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("participants", type=int)
    p.add_argument("--check", action="store_true", help="exit 1 if a file would change")
    args = p.parse_args()
    if not 1 <= args.participants <= 200:
        raise SystemExit("participants.py: the number of participants must be in [1, 200]")
    changed = [path for path, text in rewrite(args.participants).items()
               if path.read_text() != text]  # fmt: skip
    if args.check:
        for path in changed:
            print(f"{path.relative_to(ROOT)} differs from {args.participants} participants")
        return 1 if changed else 0
    for path, text in rewrite(args.participants).items():
        path.write_text(text)
    names = ", ".join(str(path.relative_to(ROOT)) for path in changed)
    print(f"{args.participants} participants: {names or 'nothing to change'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
