"""The Flower side of a run: registration and one round's send-and-receive over a ``Grid``.

The only server module that builds or reads Flower messages (with server/fedmeta/server/app.py). It
turns a round's
requests into messages, sends them with one timeout, and hands back exactly one
:class:`~server.round.Delivery` per requested participant, with the *true* reason when there is no
usable reply. Replies are matched to requests by ``reply_to_message_id``, not by sender: Flower
answers a request to a dead node itself (error ``NODE_UNAVAILABLE``, sent from the SuperLink's own
node id), and that must count once, as ``node_unavailable``, not as a stray reply plus a timeout.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives import serialization
from flwr.app import Message
from flwr.supercore.inflatable.inflatable_utils import (
    ObjectPullError,
    ObjectPushError,
    ObjectUnavailableError,
)

from fedmeta import protocol as P
from fedmeta.server.releases import FAILURE_NODE_UNAVAILABLE
from fedmeta.server.round import Delivery, Exchange
from fedmeta.server.superlink_watch import StopRequest

log = logging.getLogger("fedmeta.server")
#: Flower's grid failing to move a round's objects: the SuperLink lost the push or pull session.
_GRID_ERRORS = (ObjectPushError, ObjectPullError, ObjectUnavailableError)

FAILURE_TIMEOUT = "timeout"
FAILURE_ERROR_REPLY = "error_reply"
STRAY_DUPLICATE = "duplicate_reply"
STRAY_UNEXPECTED = "unexpected_reply"

_NODE_UNAVAILABLE = 5  # flwr.common.constant.ErrorCode.NODE_UNAVAILABLE


class RegistrationError(RuntimeError):
    """Too few participants registered to run the planned rounds."""


@dataclass(frozen=True)
class Registered:
    """A participant as the server knows it (the count and fingerprint stay on the server)."""

    participant_id: str
    node_id: int
    task_count: int
    data_fingerprint: str
    node_key: str = ""  # the node's authentication-key fingerprint; "" without node auth


def key_fingerprint(public_key: bytes) -> str:
    """``SHA256:...`` of a node's PEM public key, as ``ssh-keygen -l`` prints it.

    "" when the node has no authentication key: Flower's simulation engine, and a SuperLink without
    node authentication, give each node random bytes instead of a PEM key. "" never matches a
    configured key, so an unauthenticated node cannot take a bound participant's place.
    """
    if not public_key.startswith(b"-----BEGIN"):
        return ""
    key = serialization.load_pem_public_key(public_key)
    blob = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    digest = hashlib.sha256(base64.b64decode(blob.split()[1])).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class GridTransport:
    """Registration and round exchanges over a Flower ``Grid`` (real, simulated or in-process)."""

    def __init__(self, grid: Any, *, register_timeout_s: float, round_timeout_s: float) -> None:
        """Wrap ``grid``; every wait is bounded by one of the two timeouts."""
        self.grid = grid
        self.register_timeout_s = register_timeout_s
        self.round_timeout_s = round_timeout_s
        #: An in-process grid (simulation) may hand replies over in shared memory (protocol's
        #: SHARED_STYPE); any other grid's replies must be in the wire format.
        self.shared = bool(getattr(grid, "shares_memory", False))

    # ------------------------------------------------------------------------------ registration

    def connected(self) -> list[int]:
        """The node ids Flower reports connected now."""
        return [int(n) for n in self.grid.get_node_ids()]

    def _keys(self) -> dict[int, str]:
        """Each connected node's authentication-key fingerprint ("" without node authentication)."""
        return {int(n.node_id): key_fingerprint(n.public_key) for n in self.grid.get_nodes()}

    def query(self, request: P.RegisterRequest, nodes: Iterable[int]) -> list[Registered]:
        """Ask ``nodes`` who they are; their valid registration replies (one bounded wait)."""
        content = P.encode_register_request(request)
        messages = [Message(content, int(n), P.MSG_REGISTER, group_id="register") for n in nodes]
        if not messages:
            return []
        replies = self.grid.send_and_receive(messages, timeout=self.register_timeout_s)
        keys = self._keys()
        out = []
        for reply in replies:
            registered = self._registration(reply, keys)
            if registered is not None:
                out.append(registered)
        return out

    @staticmethod
    def _registration(reply: Message, keys: Mapping[int, str]) -> Registered | None:
        node = int(reply.metadata.src_node_id)
        if reply.has_error():
            log.warning("registration error from node %s: %s", node, reply.error.reason)
            return None
        try:
            reg = P.decode_registration(reply.content)
        except P.ProtocolError as error:
            log.warning("registration refused from node %s: %s", node, error)
            return None
        return Registered(reg.participant_id, node, reg.task_count, reg.data_fingerprint,
                          keys.get(node, ""))  # fmt: skip

    # ------------------------------------------------------------------------------ a round

    def exchange(
        self,
        requests: Mapping[str, P.GradientRequest],
        nodes: Mapping[str, int],
        *,
        stop: threading.Event | None = None,
    ) -> Exchange:
        """Send each participant (at ``nodes[pid]``) its request; one delivery per participant.

        ``stop`` (the run's stop request, set on SIGINT/SIGTERM) ends the wait for replies at once:
        the round is then abandoned before its spend.
        """
        if not requests:
            return Exchange({}, {})
        group = str(next(iter(requests.values())).round_id)
        messages = []
        for pid, request in requests.items():
            content = P.encode_gradient_request(request)
            messages.append(Message(content, nodes[pid], P.MSG_TRAIN, group_id=group))
        try:
            ids = list(self.grid.push_messages(messages))
            pending = dict(zip(ids, requests, strict=True))
            replies = self._pull(pending, stop)
        except _GRID_ERRORS as error:
            if stop is None:
                raise
            return _lost_round(requests, error, stop)
        return self._deliveries(requests, pending, replies, self.shared)

    def _pull(self, pending: Mapping[str, str], stop: threading.Event | None) -> list[Message]:
        """Collect replies until every request has one or the round timeout passes."""
        deadline = time.monotonic() + self.round_timeout_s
        waiting = set(pending)
        replies: list[Message] = []
        while waiting:
            for reply in self.grid.pull_messages(list(waiting)):
                replies.append(reply)
                waiting.discard(reply.metadata.reply_to_message_id)
            if not waiting or time.monotonic() >= deadline:
                break
            if stop is not None and stop.is_set():
                break
            time.sleep(0.05)
        return replies

    @staticmethod
    def _deliveries(
        requests: Mapping[str, P.GradientRequest],
        pending: Mapping[str, str],
        replies: Iterable[Message],
        shared: bool = False,
    ) -> Exchange:
        deliveries: dict[str, Delivery] = {}
        strays: dict[str, int] = {}
        for reply in replies:
            pid = pending.get(reply.metadata.reply_to_message_id)
            stray = STRAY_UNEXPECTED if pid is None else STRAY_DUPLICATE
            if pid is None or pid in deliveries:
                strays[stray] = strays.get(stray, 0) + 1
                continue
            deliveries[pid] = _delivery(reply, shared)
        for pid in requests:
            deliveries.setdefault(pid, Delivery(None, FAILURE_TIMEOUT, "no reply in time"))
        return Exchange({pid: deliveries[pid] for pid in requests}, strays)


def _lost_round(
    requests: Mapping[str, P.GradientRequest], error: Exception, stop: threading.Event
) -> Exchange:
    """Stop the run: the round's messages were lost with the SuperLink's session.

    A restart mid-push. The round is then abandoned before its spend (server/round.py), as when
    the SuperLink watch notices a restart; the error is what ``SuperLinkLost`` then says.
    """
    said = " ".join(str(error).split())[:200]
    reason = (f"the SuperLink lost the round's messages ({type(error).__name__}: {said}); it "
              "restarted or dropped the session")  # fmt: skip
    log.warning("ending the run: %s", reason)
    if isinstance(stop, StopRequest):
        stop.lost(reason)
    else:  # fedmeta simulate's own stop (its grids raise none of these)
        stop.set()
    failed = Delivery(None, FAILURE_TIMEOUT, "the SuperLink lost the round")
    return Exchange(dict.fromkeys(requests, failed), {})


def _delivery(reply: Message, shared: bool = False) -> Delivery:
    if reply.has_error():
        code = int(reply.error.code)
        reason = FAILURE_NODE_UNAVAILABLE if code == _NODE_UNAVAILABLE else FAILURE_ERROR_REPLY
        return Delivery(None, reason, f"code {code}: {reply.error.reason}")
    try:
        return Delivery(P.decode_gradient_reply(reply.content, shared=shared))
    except P.ProtocolError as error:
        return Delivery(None, error.reason, error.detail)
