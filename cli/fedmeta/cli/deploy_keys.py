"""``fedmeta deploy register``: register node public keys with a SuperLink (idempotent).

Through the Control API, so it runs on the server host; a key already registered is reported,
not an error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedmeta import exitcodes
from fedmeta.cli.deploy_args import add_connection_args
from fedmeta.cli.deploy_flwr import CONNECTION, DeployError, flwr, flwr_home, refused, tls_settings


def register(sub: Any) -> None:
    """Add ``fedmeta deploy register``."""
    p = sub.add_parser(
        "register", help="register node public keys with the SuperLink (idempotent)",
        description="Register each node's public key (OpenSSH, NAME.key.pub) with a SuperLink "
        "started with --enable-supernode-auth, under the name NAME; a key already registered is "
        "reported, not an error. Uses the Control API: run it on the server host.",
    )  # fmt: skip
    add_connection_args(p, "Control API (the server host's own)")
    p.add_argument("keys", nargs="+", type=Path, help="NAME.key.pub files, or directories of them")
    p.set_defaults(func=_handle_register)


def _public_keys(paths: Sequence[Path]) -> list[Path]:
    keys: list[Path] = []
    for path in paths:
        keys += sorted(path.glob("*.key.pub")) if path.is_dir() else [path]
    missing = [str(k) for k in keys if not k.is_file()]
    if missing or not keys:
        raise DeployError(f"no such public key file: {', '.join(missing) or paths}",
                          exitcodes.BAD_INPUT)  # fmt: skip
    return keys


def _handle_register(args: argparse.Namespace) -> int:
    try:
        ca, _insecure = tls_settings(args)
        keys = _public_keys(args.keys)
    except DeployError as error:
        return refused("register", error)
    failed = 0
    with flwr_home(args.superlink, ca) as env:
        for key in keys:
            name = key.name.removesuffix(".pub").removesuffix(".key")
            res = flwr(env, "supernode", "register", str(key), CONNECTION, "--name", name,
                       "--format", "json")  # fmt: skip
            text = " ".join((res.stdout + res.stderr).split())
            if res.returncode == 0 and '"success": true' in text.replace("'", '"').lower():
                print(f"registered {name}")
            elif "already in use" in text.lower():
                print(f"already    {name}")
            else:
                failed += 1
                print(f"FAILED     {name}: {text[-300:]}", file=sys.stderr)
    return exitcodes.UNAVAILABLE if failed else exitcodes.OK
