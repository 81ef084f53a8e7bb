"""Prototype ServerApp: fedmeta's ``execute`` over a Grid that polls for replies every 50 ms.

Flower 1.41's ``HttpGrid.send_and_receive`` (``flwr/superlink/grid/http_grid.py``, line 412) sleeps
3 s between two pulls, so every round lasts a multiple of 3 s on the server. ``FastGrid`` pushes the
messages with ``Grid.push_messages`` and pulls with ``Grid.pull_messages`` every ``reply-poll-s``
seconds instead, and records per round when the messages went out and when each reply came back
(``grid_timings.jsonl`` in the output directory), with the reply's error code if it is one. Objects
missing on the first pull are retried after 50 ms, not Flower's 1 s.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import flwr.superlink.grid.http_grid as _http_grid
from flwr.app import Context, Message
from flwr.serverapp import Grid, ServerApp

from server.app import config_from_run_config, execute

# A node stores its reply before uploading the reply's objects; Flower's pull then waits 1 s before
# retrying a missing object (doubling, capped at 10 s). Retry after 50 ms instead.
_http_grid.pull_objects = functools.partial(
    _http_grid.pull_objects, initial_backoff=0.05, backoff_cap=1.0
)


class FastGrid:
    """A Grid proxy whose ``send_and_receive`` polls every ``poll_s`` seconds."""

    def __init__(self, grid: Grid, poll_s: float, log_path: Path | None) -> None:
        self._grid = grid
        self._poll_s = poll_s
        self._log_path = log_path

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push, then pull every ``poll_s`` until every message has its reply or ``timeout``."""
        t0 = time.time()
        msgs = list(messages)
        dst = {}
        ids = list(self._grid.push_messages(msgs))
        for m, mid in zip(msgs, ids, strict=True):
            dst[mid] = m.metadata.dst_node_id
        t_pushed = time.time()
        pending = {i for i in ids if i}
        end = t0 + (timeout if timeout is not None else 1e9)
        out: list[Message] = []
        arrivals = []
        while pending and time.time() < end:
            got = list(self._grid.pull_messages(pending))
            now = time.time()
            for r in got:
                rid = r.metadata.reply_to_message_id
                pending.discard(rid)
                arrivals.append(
                    {
                        "dst": dst.get(rid),
                        "src": r.metadata.src_node_id,
                        "t": round(now - t0, 4),
                        "error": int(r.error.code) if r.has_error() else None,
                    }
                )
            out.extend(got)
            if pending:
                time.sleep(self._poll_s)
        if self._log_path is not None:
            rec = {
                "start": t0,
                "push_s": round(t_pushed - t0, 4),
                "n": len(msgs),
                "replies": arrivals,
                "missing": [dst.get(i) for i in pending],
                "end_s": round(time.time() - t0, 4),
            }
            with self._log_path.open("a") as fh:
                fh.write(json.dumps(rec) + "\n")
        return out


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """``flwr run deploy/prototype/app`` entry point."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    run_config = dict(context.run_config)
    cfg, out, resume = config_from_run_config(run_config)
    out_dir = Path(out or cfg.output.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    poll = float(run_config.get("reply-poll-s", 0.05) or 0)
    used = FastGrid(grid, poll, out_dir / "grid_timings.jsonl") if poll > 0 else grid
    execute(cfg, used, out_dir=out_dir, resume=resume)  # type: ignore[arg-type]
