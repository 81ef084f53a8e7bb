"""An in-process Flower ``Grid``: the same ClientApp called directly, no Ray, no SuperLink.

Used by the tests (runs are tested against it, with handlers that misbehave on purpose) and by
``federation.backend = "inprocess"`` (benchmarks of the server's own overhead). Each node gets its
own ``Context`` with ``partition-id`` in its node config, as in Flower's simulation. A handler may
return ``None`` (no reply: a timeout) or a list of messages (duplicates).

Server and participants share one process, so a reply's rows cross without being copied: the
node config's ``fedmeta-shared-memory`` tells the ClientApp to put its rows' own buffer in the
message (``protocol.SHARED_STYPE``), and ``shares_memory`` tells the server's transport to accept
that; everything else about the message (records, keys, validation) is the deployed one.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.proto.node_pb2 import NodeInfo
from flwr.serverapp import Grid

from fedmeta import protocol as P
from fedmeta.client.flower_internals import ensure_task_identity, set_message_id, set_src_node_id

Handler = Callable[[Message, Context], Any]


class InProcessGrid(Grid):
    """Routes each message to ``handler(message, context)`` of its destination, synchronously."""

    #: Read by the server's transport: replies may share the participants' memory.
    shares_memory = True

    def __init__(
        self, num_nodes: int, handler: Handler | None = None, *, first_node_id: int = 1000
    ) -> None:
        """``num_nodes`` nodes answering with ``handler`` (default: fedmeta's ClientApp)."""
        ensure_task_identity()
        if handler is None:
            from fedmeta.client.app import app as client_app

            handler = client_app
        self.handler = handler
        self.node_ids = [first_node_id + i for i in range(num_nodes)]
        self.contexts = {
            nid: Context(
                run_id=1,
                node_id=nid,
                node_config={P.NODE_PARTITION_ID: i, "num-partitions": num_nodes,
                             P.NODE_SHARED_MEMORY: True},  # fmt: skip
                state=RecordDict(),
                run_config={},
            )
            for i, nid in enumerate(self.node_ids)
        }
        self._replies: dict[str, list[Message]] = {}
        self.client_seconds = 0.0  # time spent inside handlers (client compute)
        self._run: Any = None
        #: Nodes connected now (tests take nodes away and bring them back, as a deployment does).
        self.online: set[int] = set(self.node_ids)
        #: Node id -> PEM public key, as a SuperLink with node authentication reports it.
        self.public_keys: dict[int, bytes] = {}

    def set_run(self, run: Any) -> None:  # noqa: D102
        self._run = run

    @property
    def run(self) -> Any:  # noqa: D102
        return self._run

    def create_message(  # noqa: D102
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102
        return [n for n in self.node_ids if n in self.online]

    def get_nodes(self) -> Iterable[NodeInfo]:  # noqa: D102
        return [
            NodeInfo(node_id=n, public_key=self.public_keys.get(n, b""))
            for n in self.get_node_ids()
        ]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # noqa: D102
        ids = []
        for msg in messages:
            mid = uuid.uuid4().hex
            set_message_id(msg, mid)
            ids.append(mid)
            dst = msg.metadata.dst_node_id
            ctx = self.contexts.get(dst)
            if ctx is None:
                continue
            if dst not in self.online:  # what the SuperLink answers for a node it lost
                gone = Message(Error(code=5, reason="node unavailable"), reply_to=msg)
                set_src_node_id(gone, 1)
                self._replies[mid] = [gone]
                continue
            t0 = time.perf_counter()
            try:
                out = self.handler(msg, ctx)
            except Exception as error:  # noqa: BLE001 - a crashing ClientApp becomes an error reply
                out = Message(
                    Error(code=1, reason=f"{type(error).__name__}: {error}"), reply_to=msg
                )
            self.client_seconds += time.perf_counter() - t0
            if out is None:
                continue
            outs = out if isinstance(out, list) else [out]
            for o in outs:
                set_src_node_id(o, dst)
            self._replies[mid] = outs
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: D102
        out: list[Message] = []
        for mid in message_ids:
            out.extend(self._replies.pop(mid, []))
        return out

    def send_and_receive(  # noqa: D102
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))
