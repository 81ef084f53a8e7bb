#!/usr/bin/env python3
"""Start a Flower run and exit with its outcome (``flwr run`` exits 0 when the ServerApp fails).

    scripts/flwr-run-wait.py APP CONNECTION [--run-config ...] [--timeout S] [--stream]

Submits with ``flwr run APP CONNECTION --format json``, then polls ``flwr ls CONNECTION --run-id ID
--format json`` every ``--poll`` seconds until the status is ``finished:*``. Exit status: 0 for
``finished:completed``; 1 for ``finished:failed`` or ``finished:stopped`` (the SuperLink's
``status-details``, e.g. the ServerApp's exception, is printed); 2 when the run could not be
submitted; 124 when ``--timeout`` passes first (the run is then stopped with ``flwr stop``).
``--stream`` follows the run's logs (``flwr log ID CONNECTION --stream``) meanwhile. Uses the
``flwr`` beside this interpreter, else the one on PATH; ``FLWR_HOME`` selects the configuration.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _flwr() -> str:
    beside = Path(sys.executable).parent / "flwr"
    found = str(beside) if beside.is_file() else shutil.which("flwr")
    if found is None:
        sys.exit("flwr-run-wait: flwr CLI not found")
    return found


def _json(out: str) -> dict[str, Any]:
    """The JSON object in ``out`` (flwr may print a line before it)."""
    start = out.find("{")
    if start < 0:
        raise ValueError(f"no JSON in flwr's output: {out[-500:]!r}")
    loaded: dict[str, Any] = json.loads(out[start:])
    return loaded


def main() -> int:
    """CLI entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("app")
    p.add_argument("connection")
    p.add_argument("--run-config", action="append", default=[])
    p.add_argument("--timeout", type=float, default=24 * 3600, help="seconds (default one day)")
    p.add_argument("--poll", type=float, default=2.0)
    p.add_argument("--stream", action="store_true")
    args = p.parse_args()
    flwr = _flwr()
    cmd = [flwr, "run", args.app, args.connection, "--format", "json"]
    for rc in args.run_config:
        cmd += ["--run-config", rc]
    sub = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    try:
        submitted = _json(sub.stdout)
        run_id = str(submitted["run-id"])
    except (ValueError, KeyError) as error:
        print(f"flwr-run-wait: submission failed: {error}\n{sub.stderr[-2000:]}", file=sys.stderr)
        return 2
    print(f"run {run_id} submitted", flush=True)
    follower = None
    if args.stream:
        follower = subprocess.Popen([flwr, "log", run_id, args.connection, "--stream"])
    deadline = time.monotonic() + args.timeout
    status = ""
    details = None
    try:
        while time.monotonic() < deadline:
            ls = subprocess.run(
                [flwr, "ls", args.connection, "--run-id", run_id, "--format", "json"],
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            if ls.returncode == 0:
                runs = _json(ls.stdout).get("runs", [])
                if runs:
                    status = str(runs[0].get("status", ""))
                    details = runs[0].get("status-details")
                    if status.startswith("finished"):
                        break
            time.sleep(args.poll)
        else:
            subprocess.run([flwr, "stop", run_id, args.connection], timeout=120, check=False)
            print(f"flwr-run-wait: run {run_id} not finished after {args.timeout:.0f} s (stopped)",
                  file=sys.stderr)  # fmt: skip
            return 124
    finally:
        if follower is not None:
            follower.terminate()
            try:
                follower.wait(timeout=10)
            except subprocess.TimeoutExpired:
                follower.kill()
    print(f"run {run_id}: {status}" + (f" ({details})" if details and details != "N/A" else ""))
    return 0 if status == "finished:completed" else 1


if __name__ == "__main__":
    sys.exit(main())
