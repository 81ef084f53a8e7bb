"""What a ServerApp sees of nodes as they join, die and come back.

Flower 1.41, loopback, TLS and node authentication. Timeline (seconds after the run started):
node 0 up from the start; node 1 joins at 10; node 1 is SIGKILLed at 30; node 1 restarts with the
same key at 110; node 0 stops gracefully (SIGTERM) at 130; the probe ends at 150. Writes the
probe's records and prints a summary.

    python deploy/prototype/probe_nodes.py --out /tmp/probe
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def main() -> None:
    """Run the timeline."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    certs = out / "certs"
    subprocess.run(
        ["bash", str(ROOT / "deploy/tls/make-certs.sh"), "--out", str(certs), "--nodes", "2"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    home = out / "home"
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "p"\n\n[superlink.p]\naddress = "127.0.0.1:8000"\n'
        f'root-certificates = "{certs / "ca.crt"}"\n'
    )
    env = dict(os.environ, FLWR_HOME=str(home), PATH=f"{BIN}:{os.environ['PATH']}",
               FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1")  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []

    def start(cmd: list[str], log: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(cmd, env=env, stdout=(out / log).open("w"),
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        procs.append(proc)
        return proc

    def node(i: int) -> subprocess.Popen[bytes]:
        return start(
            [str(BIN / "flower-supernode"), "--superlink", "127.0.0.1:8000",
             "--root-certificates", str(certs / "ca.crt"),
             "--auth-supernode-private-key", str(certs / "nodes" / f"participant-{i}.key"),
             "--port", str(9201 + i), "--node-config", f"participant-id={i}"],
            f"supernode{i}-{len(procs)}.log",
        )  # fmt: skip

    events: list[tuple[float, str]] = []
    try:
        start([str(BIN / "flower-superlink"), "--ssl-ca-certfile", str(certs / "ca.crt"),
               "--ssl-certfile", str(certs / "server.crt"),
               "--ssl-keyfile", str(certs / "server.key"),
               "--enable-supernode-auth", "--disable-runtime-dependency-installation"],
              "superlink.log")  # fmt: skip
        time.sleep(8)
        for i in range(2):
            subprocess.run(
                [str(BIN / "flwr"), "supernode", "register",
                 str(certs / "nodes" / f"participant-{i}.key.pub"), "p",
                 "--name", f"participant-{i}"],
                env=env, check=True, capture_output=True, timeout=120,
            )  # fmt: skip
        n0 = node(0)
        time.sleep(10)
        records = out / "probe.jsonl"
        records.unlink(missing_ok=True)
        subprocess.run(
            [str(BIN / "flwr"), "run", str(ROOT / "deploy/prototype/probe_app"), "p",
             "--run-config", f'seconds=150 out="{records}"'],
            env=env, check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        while not records.is_file():
            time.sleep(0.2)
        t0 = time.time()
        plan = [(10, "start 1"), (30, "kill 1"), (110, "restart 1"), (130, "term 0"), (152, "end")]
        n1 = None
        for at, what in plan:
            time.sleep(max(0, t0 + at - time.time()))
            events.append((round(time.time() - t0, 1), what))
            if what in ("start 1", "restart 1"):
                n1 = node(1)
            elif what == "kill 1" and n1 is not None:
                os.killpg(n1.pid, signal.SIGKILL)
            elif what == "term 0":
                os.killpg(n0.pid, signal.SIGTERM)
        rows = [json.loads(line) for line in records.read_text().splitlines()]
        print("events:", events)
        last = None
        for r in rows:
            view = [(str(n["id"])[-4:], n["status"], n["name"], n["key"][:15]) for n in r["nodes"]]
            state = (tuple(str(i)[-4:] for i in r["ids"]), tuple(view))
            if state != last:
                print(f"t={r['t'] - t0:6.1f}  get_node_ids={list(state[0])}  get_nodes={view}")
                last = state
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
