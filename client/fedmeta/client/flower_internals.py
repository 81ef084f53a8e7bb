"""The one adapter between fedmeta's participant side and Flower's internals (checked: flwr 1.41.0).

fedmeta's warm worker (``client/fedmeta/client/worker.py``) speaks the SuperNode's Runtime API
itself instead of a per-message ``flwr-clientapp`` process, so it needs names below Flower's public
API (``flwr.app``, ``flwr.clientapp``, ``flwr.serverapp``, ``flwr.simulation`` and the CLIs). Every
one of them is reached here and nowhere else in the worker, each checked against flwr 1.41.0
(:data:`FLOWER_SERIES` is the series accepted):

* the Runtime API client: ``flwr.supercore.runtime.RuntimeHttpClient`` (``from_server_address``
  and its RPCs ``AcquireTask``, ``PullTaskInput``, ``PullMessages``, ``PullObject``,
  ``ConfirmMessageReceived``, ``SendTaskHeartbeat``, ``PushMessages``, ``PushObject``,
  ``PushTaskOutput``); ``flwr.supercore.interceptors.RuntimeVersionHttpInterceptor``,
  ``RuntimeTokenHttpInterceptor``, ``SuperExecAuthHttpInterceptor``;
  ``flwr.supercore.retry.RetryInvoker``, ``exponential``;
* the messages: ``flwr.proto.runtime_pb2.AcquireTaskRequest``, ``AcquireTaskResponse``,
  ``PullTaskInputRequest``, ``PullTaskInputResponse``, ``PullAppMessagesRequest``,
  ``SendTaskHeartbeatRequest``; ``flwr.proto.node_pb2.Node``;
  ``flwr.supercore.constant.TaskType.CLIENT_APP``;
* one task, as ``flwr/supernode/runtime/run_clientapp.py`` runs it:
  ``flwr.common.serde.context_from_proto``, ``run_from_proto``;
  ``flwr.supercore.inflatable.inflatable_utils.pull_and_inflate_object_from_tree`` with
  ``flwr.supercore.inflatable.inflatable_protobuf_utils.make_pull_object_fn_protobuf`` and
  ``make_confirm_message_received_fn_protobuf``; ``flwr.supercore.heartbeat.HeartbeatSender``;
  ``flwr.supernode.runtime.run_clientapp.push_message``, ``push_task_output``;
  ``flwr.common.constant.SubStatus`` (mirrored as :data:`COMPLETED`, :data:`FAILED`) and
  ``ErrorCode.CLIENT_APP_RAISED_EXCEPTION``;
* the task's identity and a message's private metadata: ``flwr.supercore.task_identity.
  TaskIdentity``; ``Message.metadata.__dict__["_message_id"]`` and ``["_src_node_id"]``
  (:func:`set_message_id`, :func:`set_src_node_id`: ``Metadata`` has no setter for them);
* ``--node-config``: ``flwr.common.config.parse_config_args``.

``tests/test_flower_internals.py`` lists every such name (its ``INTERNALS``) and checks that the
installed Flower has it as used here (keyword parameters, protobuf fields), and that the worker
reaches none of them but through this module; an upgrade that moves one fails with its name
(docs/deploy.md, "Moving to the next Flower release"). The SuperNode launcher
(``client/fedmeta/client/supernode.py``) patches ``flower-supernode``'s own module and lists its
internals there; ``simulation/fedmeta/simulation/local_grid.py`` uses the task identity and the
metadata writers below.

:func:`check_flower` is the version guard both launchers run at start: these internals change
between Flower minors (``flwr-clientapp`` spoke gRPC ``ClientAppIo`` in 1.30 and the HTTP Runtime
API with task tokens in 1.41), so a release is accepted only once it has been checked. Flower is
imported inside each function, so that ``--help`` and a refused version pay no Flower import.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

#: The Flower minor series fedmeta is written against; pyproject.toml's pin and the images'
#: constraints name the same series (``tests/test_flower_internals.py`` checks that they agree).
FLOWER_SERIES = "1.41."

#: Exit status of a launcher refused by :func:`check_flower` (EX_CONFIG: restarting cannot help).
EXIT_FLOWER_VERSION = 78

#: ``flwr.common.constant.SubStatus``'s values for a task's output (mirrored, so that a task's
#: result can be made without importing Flower; the test checks they equal Flower's).
COMPLETED = "completed"
FAILED = "failed"

#: The one Runtime API call the SuperExec's secret protects (``SuperExecAuthHttpInterceptor``).
_ACQUIRE_TASK_METHOD = "/flwr.proto.Runtime/AcquireTask"


class WrongFlower(SystemExit):
    """Exit status :data:`EXIT_FLOWER_VERSION`; ``str()`` is the one-line reason."""

    def __init__(self, reason: str) -> None:
        """``reason``: already printed to stderr by :func:`check_flower`."""
        super().__init__(EXIT_FLOWER_VERSION)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


def check_flower(component: str, version: str | None = None) -> None:
    """Refuse any Flower outside :data:`FLOWER_SERIES`: one line on stderr, exit status 78."""
    import flwr

    found = version if version is not None else flwr.__version__
    if not found.startswith(FLOWER_SERIES):
        reason = (
            f"fedmeta {component}: written against flwr {FLOWER_SERIES}x, found {found}; install "
            f"flwr=={FLOWER_SERIES}* (the version fedmeta pins) on this node"
        )
        print(reason, file=sys.stderr)
        raise WrongFlower(reason)


# ------------------------------------------------------------------ task identity, message metadata


def ensure_task_identity() -> None:
    """Give Flower's task identity a value where no Flower runtime has set one.

    Flower's ``Message()`` reads ``TaskIdentity`` (set by ``flwr-clientapp`` from the task it
    pulled). Outside a Flower runtime (the worker's warm-up, the in-process grid) it is unset and
    ``Message()`` raises; 0 stands for "no task" until a real task sets it. Through its
    ``run_id``/``task_id``/``node_id`` properties, not its private ``_run_id`` fields.
    """
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("task_id", "run_id", "node_id"):
        try:
            getattr(TaskIdentity, name)
        except RuntimeError:  # "TaskIdentity.<name> is not set."
            setattr(TaskIdentity, name, 0)


def set_message_id(message: Any, message_id: str) -> None:
    """Give ``message`` its id, as Flower's runtimes do: ``Metadata`` has no setter for it."""
    message.metadata.__dict__["_message_id"] = message_id


def set_src_node_id(message: Any, node_id: int) -> None:
    """Give ``message`` its sender, as the SuperLink does: ``Metadata`` has no setter for it."""
    message.metadata.__dict__["_src_node_id"] = node_id


def parse_node_config(text: str) -> dict[str, Any]:
    """``--node-config`` parsed exactly as ``flower-supernode`` parses it."""
    from flwr.common.config import parse_config_args

    return dict(parse_config_args([text]))


# ------------------------------------------------------------------ the Runtime API client


def _retry_invoker(max_time: float, stop: threading.Event | None = None) -> Any:
    """Retry transient transport errors and 502/503/504 for at most ``max_time`` seconds.

    Not once ``stop`` is set: a worker told to stop while its SuperNode is gone (the node exited
    first, and ``fedmeta deploy participant`` then ends the worker) stops within one backoff
    (at most 2 s), not after ``max_time`` or its supervisor's SIGKILL. Flower's own policy is not
    used: it retries forever and sends SIGINT to its own process on HTTP 401.
    """
    import httpx
    from flwr.supercore.retry import RetryInvoker, exponential

    def giveup(error: Exception) -> bool:
        if stop is not None and stop.is_set():
            return True
        if isinstance(error, httpx.HTTPStatusError):
            return error.response.status_code not in (502, 503, 504)
        return False

    return RetryInvoker(
        wait_gen_factory=lambda: exponential(base_delay=0.1, max_delay=2),
        recoverable_exceptions=(httpx.TransportError, httpx.HTTPStatusError),
        max_tries=None,
        max_time=max_time,
        should_giveup=giveup,
    )


def runtime_client(
    address: str,
    root_certificates: bytes | None,
    max_time: float,
    *interceptors: Any,
    stop: threading.Event | None = None,
) -> Any:
    """A Runtime API client whose every call (retries included) ends within ``max_time``.

    Or within one retry's backoff once ``stop`` is set. ``root_certificates`` None: plain HTTP.
    """
    from flwr.supercore.runtime import RuntimeHttpClient

    return RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=root_certificates is None,
        root_certificates=root_certificates,
        interceptors=list(interceptors),
        retry_invoker=_retry_invoker(max_time, stop),
    )


def control_interceptors(secret: bytes | None) -> list[Any]:
    """The SuperExec's headers, as ``flower-superexec`` sends them (``secret``: its HMAC key)."""
    from flwr.supercore.interceptors import (
        RuntimeVersionHttpInterceptor,
        SuperExecAuthHttpInterceptor,
    )

    found: list[Any] = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
    if secret:
        auth = SuperExecAuthHttpInterceptor(
            master_secret=secret, protected_methods=frozenset({_ACQUIRE_TASK_METHOD})
        )
        found.append(auth)
    return found


def task_interceptors(token: str) -> list[Any]:
    """One task's headers, as ``flwr-clientapp`` sends them: its version and the task token."""
    from flwr.supercore.interceptors import (
        RuntimeTokenHttpInterceptor,
        RuntimeVersionHttpInterceptor,
    )

    return [
        RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
        RuntimeTokenHttpInterceptor(token),
    ]


def acquire_task(control: Any) -> str | None:
    """The token of the next ClientApp task the SuperNode hands out, or None when it has none."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType

    res = control.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
    return str(res.token) if res.HasField("task") and res.token else None


# ------------------------------------------------------------------ one task


def heartbeat(client: Any, refused: threading.Event, alive: Callable[[], None]) -> Any:
    """A started task heartbeat (``.stop()`` ends it), minus Flower's SIGINT to this process.

    The SuperNode fails a claimed task after 60 s without a beat. ``refused`` is set when the
    SuperNode dropped the task; ``alive`` is called with every beat (a long task keeps the
    worker's liveness file fresh).
    """
    import httpx
    from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest
    from flwr.supercore.heartbeat import HeartbeatSender

    def beat() -> bool:
        alive()
        try:
            res = client.SendTaskHeartbeat(SendTaskHeartbeatRequest())
        except httpx.TransportError:
            return False
        except httpx.HTTPStatusError:
            refused.set()
            return True
        if not res.success:
            refused.set()  # the SuperNode dropped the task: its reply will be refused too
        return True

    sender = HeartbeatSender(heartbeat_fn=beat)
    sender.start()
    return sender


def pull_task_input(client: Any, max_time: float, backoff_s: float) -> tuple[Any, Any, Any]:
    """(message, context, run) of the claimed task, as ``run_clientapp.pull_task_input``.

    Differs from Flower's only in the object pulls: the SuperNode announces a task before it has
    stored the message's objects, and Flower retries a missing object after 1 s (doubling); here
    after ``backoff_s``, and for at most ``max_time`` seconds.
    """
    from flwr.app import Message
    from flwr.common.serde import context_from_proto, run_from_proto
    from flwr.proto.node_pb2 import Node
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullTaskInputRequest
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf,
        make_pull_object_fn_protobuf,
    )
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
    from flwr.supercore.task_identity import TaskIdentity

    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id = res.task_id
    TaskIdentity.run_id = res.run.run_id
    TaskIdentity.node_id = res.context.node_id
    context, run = context_from_proto(res.context), run_from_proto(res.run)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("the SuperNode handed out a task without a message")
    node, tree = Node(node_id=context.node_id), pulled.message_object_trees[0]
    message = pull_and_inflate_object_from_tree(
        tree,
        make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(
            client.ConfirmMessageReceived, node, context.run_id
        ),
        return_type=Message,
        max_time=max_time,
        initial_backoff=backoff_s,
        backoff_cap=1.0,
    )
    set_message_id(message, tree.object_id)  # as Flower does: the id is not in the tree
    return message, context, run


def push_reply(client: Any, reply: Any, context: Any) -> None:
    """Send the task's reply message (``PushMessages``, then its objects)."""
    from flwr.supernode.runtime.run_clientapp import push_message

    push_message(client=client, message=reply, context=context)


def push_output(client: Any, context: Any, status: str, details: str) -> None:
    """End the task: its context and :data:`COMPLETED` or :data:`FAILED` (``PushTaskOutput``)."""
    from flwr.supernode.runtime.run_clientapp import push_task_output

    push_task_output(client=client, context=context, sub_status=status, details=details)


def error_reply(message: Any, reason: str) -> Any:
    """The reply Flower's runtime sends for a ClientApp that raised, with ``reason``."""
    from flwr.app import Error, Message
    from flwr.common.constant import ErrorCode

    return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=message)
