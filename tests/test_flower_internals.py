"""The Flower internals fedmeta relies on are present in the installed flwr, as fedmeta uses them.

:data:`INTERNALS` is the inventory (docs/deploy.md, "Moving to the next Flower release", explains
each): every name below Flower's public API that fedmeta's code calls, patches or mirrors. Run
this first after a Flower upgrade: each failure names the internal (``module.Name``), which of
fedmeta's modules uses it, and what changed (gone, a lost keyword parameter, a lost protobuf field,
a moved wait). Cheap: imports and source inspection only, no SuperNode.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from layout import SUBPACKAGES, module_of, package_files

from fedmeta.client import flower_internals as fi
from fedmeta.client import supernode, warm_up, worker
from fedmeta.server import transport

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Internal:
    """One name of Flower's that fedmeta uses although Flower does not document it.

    ``name``: an attribute path inside ``module`` (``Class.method``); ``keywords``: the keyword
    arguments fedmeta passes to it; ``fields``: for a protobuf message, the fields fedmeta reads.
    """

    module: str
    name: str
    used_by: str
    keywords: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """``module.name``, as a failure names it."""
        return f"{self.module}.{self.name}"


_RUNTIME = "flwr.supercore.runtime"
_PB = "flwr.proto.runtime_pb2"
_SCI = "flwr.supernode.start_client_internal"
#: The adapter (client/fedmeta/client/flower_internals.py): every internal the warm worker needs.
_W = "flower_internals"
_RPCS = ("AcquireTask", "PullTaskInput", "PullMessages", "PullObject", "ConfirmMessageReceived",
         "SendTaskHeartbeat", "PushMessages", "PushObject", "PushTaskOutput")  # fmt: skip

#: Every non-public Flower name fedmeta's code calls, patches or mirrors (docs/deploy.md, table
#: "Flower internals"). Public API (``flwr.app``, ``flwr.serverapp.Grid``, ...) is not listed.
INTERNALS: tuple[Internal, ...] = (
    # the warm worker: a Runtime API client as flwr-clientapp builds one
    Internal(_RUNTIME, "RuntimeHttpClient.from_server_address", _W,
             ("server_address", "insecure", "root_certificates", "interceptors",
              "retry_invoker")),
    *(Internal(_RUNTIME, f"RuntimeHttpClient.{rpc}", _W) for rpc in _RPCS),
    Internal("flwr.supercore.interceptors", "RuntimeVersionHttpInterceptor", _W,
             ("component_name",)),
    Internal("flwr.supercore.interceptors", "RuntimeTokenHttpInterceptor", _W, ("token",)),
    Internal("flwr.supercore.interceptors", "SuperExecAuthHttpInterceptor", _W,
             ("master_secret", "protected_methods")),
    Internal("flwr.supercore.retry", "RetryInvoker", _W,
             ("wait_gen_factory", "recoverable_exceptions", "max_tries", "max_time",
              "should_giveup")),
    Internal("flwr.supercore.retry", "exponential", _W, ("base_delay", "max_delay")),
    Internal(_PB, "AcquireTaskRequest", _W, fields=("supported_task_types",)),
    Internal(_PB, "AcquireTaskResponse", _W, fields=("task", "token")),
    Internal(_PB, "PullTaskInputRequest", _W),
    Internal(_PB, "PullTaskInputResponse", _W, fields=("task_id", "run", "context")),
    Internal(_PB, "PullAppMessagesRequest", _W),
    Internal(_PB, "SendTaskHeartbeatRequest", _W),
    Internal("flwr.supercore.constant", "TaskType.CLIENT_APP", _W),
    Internal("flwr.common.serde", "context_from_proto", _W),
    Internal("flwr.common.serde", "run_from_proto", _W),
    Internal("flwr.proto.node_pb2", "Node", _W, fields=("node_id",)),
    Internal("flwr.supercore.inflatable.inflatable_protobuf_utils",
             "make_pull_object_fn_protobuf", _W),
    Internal("flwr.supercore.inflatable.inflatable_protobuf_utils",
             "make_confirm_message_received_fn_protobuf", _W),
    Internal("flwr.supercore.inflatable.inflatable_utils", "pull_and_inflate_object_from_tree",
             _W, ("return_type", "max_time", "initial_backoff", "backoff_cap")),
    Internal("flwr.supercore.heartbeat", "HeartbeatSender", _W, ("heartbeat_fn",)),
    Internal("flwr.supernode.runtime.run_clientapp", "push_message", _W,
             ("client", "message", "context")),
    Internal("flwr.supernode.runtime.run_clientapp", "push_task_output", _W,
             ("client", "context", "sub_status", "details")),
    Internal("flwr.common.constant", "SubStatus.COMPLETED", _W),
    Internal("flwr.common.constant", "SubStatus.FAILED", _W),
    Internal("flwr.common.constant", "ErrorCode.CLIENT_APP_RAISED_EXCEPTION", _W),
    Internal("flwr.common.config", "parse_config_args", _W),
    # the worker's warm-up and the in-process grid: Flower's Message() reads the task identity
    Internal("flwr.supercore.task_identity", "TaskIdentity", _W),
    # the SuperNode launcher: module globals it replaces, and the entry point it calls
    Internal(_SCI, "time", "supernode"),
    Internal(_SCI, "pull_objects", "supernode", ("initial_backoff", "backoff_cap")),
    Internal(_SCI, "_push_messages", "supernode"),
    Internal("flwr.supernode.cli.flower_supernode", "flower_supernode", "supernode"),
    # the in-process grid answers for a lost node as the SuperLink does
    Internal("flwr.proto.node_pb2", "NodeInfo", "local_grid",
             fields=("node_id", "public_key", "name", "status", "last_activated_at")),
    # server/fedmeta/server/transport.py copies ErrorCode.NODE_UNAVAILABLE (5): its reason
    # node_unavailable
    Internal("flwr.common.constant", "ErrorCode.NODE_UNAVAILABLE", "transport"),
    # the ServerApp's watch on its SuperLink: the task's heartbeat, sent once, from HttpGrid's
    # address, TLS and token (its _addr, _insecure, _cert, _token: tests/federation/
    # test_superlink_watch.py builds a real HttpGrid and probes a server with them)
    Internal("flwr.superlink.grid", "HttpGrid", "superlink_watch",
             ("runtime_api_address", "insecure", "root_certificates", "token")),
    Internal(_RUNTIME, "RuntimeHttpClient.SendTaskHeartbeat", "superlink_watch"),
    # the round's push or pull failing with the SuperLink's session (a restart mid-push): the
    # exchange stops the run with the reason (server/fedmeta/server/transport.py)
    Internal("flwr.supercore.inflatable.inflatable_utils", "ObjectPushError", "transport"),
    Internal("flwr.supercore.inflatable.inflatable_utils", "ObjectPullError", "transport"),
    Internal("flwr.supercore.inflatable.inflatable_utils", "ObjectUnavailableError", "transport"),
    Internal(_PB, "SendTaskHeartbeatResponse", "superlink_watch", fields=("success",)),
    # the Control API in-process (cli/fedmeta/cli/control_api.py): `fedmeta deploy status`'s node
    # public keys, which `flwr supernode list` does not print, and `deploy run`'s status polls
    Internal("flwr.cli.flower_config", "read_superlink_connection", "control_api"),
    Internal("flwr.cli.utils", "init_http_client_from_connection", "control_api"),
    Internal("flwr.proto.control_pb2", "ListNodesRequest", "deploy_status"),
    Internal("flwr.proto.control_pb2", "ListRunsRequest", "control_api", fields=("run_id",)),
    Internal("flwr.supercore.control", "ControlHttpClient.ListRuns", "control_api"),
    Internal("flwr.proto.control_pb2", "ListRunsResponse", "control_api", fields=("run_dict",)),
    Internal("flwr.proto.run_pb2", "RunStatus", "control_api",
             fields=("status", "sub_status", "details")),
)  # fmt: skip

#: Metadata fields that fedmeta sets through ``Message.metadata.__dict__`` as Flower's own
#: runtimes do (no setter exists), in the adapter alone (``set_message_id``, ``set_src_node_id``):
#: the message id (worker, warm-up, local_grid) and the sender (local_grid).
METADATA_PRIVATE_FIELDS = ("_message_id", "_src_node_id")

#: Flower's public API: what a module may import from Flower without going through the adapter.
PUBLIC_FLOWER = ("flwr.app", "flwr.clientapp", "flwr.serverapp", "flwr.simulation")
#: The worker's modules: they reach Flower's internals only through the adapter.
WORKER_MODULES = (worker, warm_up)


def _resolve(internal: Internal) -> Any:
    obj: Any = importlib.import_module(internal.module)
    for part in internal.name.split("."):
        obj = getattr(obj, part)
    return obj


def problem(internal: Internal) -> str | None:
    """Why the installed Flower does not offer ``internal`` as fedmeta uses it; None if it does."""
    try:
        obj = _resolve(internal)
    except (ImportError, AttributeError) as error:
        return f"{internal.label} (used by {internal.used_by}) is gone: {error}"
    if internal.keywords:
        params = inspect.signature(obj).parameters
        lost = [k for k in internal.keywords if k not in params]
        if lost:
            return f"{internal.label} (used by {internal.used_by}) lost parameters {lost}"
    if internal.fields:
        known = obj.DESCRIPTOR.fields_by_name
        lost = [f for f in internal.fields if f not in known]
        if lost:
            return f"{internal.label} (used by {internal.used_by}) lost fields {lost}"
    return None


def missing(internals: tuple[Internal, ...] = INTERNALS) -> list[str]:
    """One line per internal the installed Flower lacks or changed (empty: all present)."""
    return [line for line in map(problem, internals) if line is not None]


def supernode_sleeps() -> list[tuple[str, float]]:
    """``(function, seconds)`` of every ``time.sleep(constant)`` in Flower's SuperNode loop.

    client/fedmeta/client/supernode.py tells Flower's waits apart by their length: 3 s is the idle
    poll of the
    SuperLink (the only sleep of 3 s or more), 0.5 s the waits for the worker's reply. A release
    that adds, moves or changes one of these makes the shim shorten the wrong wait.
    """
    finder = _SleepFinder()
    finder.visit(ast.parse(inspect.getsource(importlib.import_module(_SCI))))
    return finder.found


class _SleepFinder(ast.NodeVisitor):
    """Constant ``time.sleep`` calls, each with its innermost enclosing function."""

    def __init__(self) -> None:
        self.functions: list[str] = []
        self.found: list[tuple[str, float]] = []

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:  # noqa: N802 - ast's naming
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    def visit_Call(self, node: ast.Call) -> None:  # noqa: N802 - ast's naming
        arg = node.args[0] if node.args else None
        sleep = ast.unparse(node.func) == "time.sleep" and bool(self.functions)
        if sleep and isinstance(arg, ast.Constant) and isinstance(arg.value, int | float):
            self.found.append((self.functions[-1], float(arg.value)))
        self.generic_visit(node)


@pytest.mark.parametrize("internal", INTERNALS, ids=lambda i: i.label)
def test_internal_is_present_as_used(internal: Internal) -> None:
    assert problem(internal) is None, problem(internal)


def test_a_removed_or_changed_internal_is_named() -> None:
    """The check can fail, and says which internal and why."""
    gone = Internal("flwr.supercore.runtime", "RuntimeHttpClient.NoSuchRpc", "worker")
    lost = Internal("flwr.supercore.heartbeat", "HeartbeatSender", "worker", ("interval",))
    field = Internal("flwr.proto.node_pb2", "NodeInfo", "local_grid", fields=("no_field",))
    lines = missing((gone, lost, field))
    assert len(lines) == 3, lines
    assert "RuntimeHttpClient.NoSuchRpc (used by worker) is gone" in lines[0]
    assert "HeartbeatSender (used by worker) lost parameters ['interval']" in lines[1]
    assert "NodeInfo (used by local_grid) lost fields ['no_field']" in lines[2]


def test_supernode_waits_are_where_the_shim_expects_them() -> None:
    """client/fedmeta/client/supernode.py's TimeShim: a sleep of >= 3 s is the idle poll of the
    SuperLink, in the main loop; every shorter one is a wait for the worker's reply, inside
    ``_push_messages``."""
    sleeps = supernode_sleeps()
    idle = [(f, s) for f, s in sleeps if s >= 3]
    assert idle == [("start_client_internal", 3.0)], sleeps
    local = [(f, s) for f, s in sleeps if s < 3]
    assert local and all(s == 0.5 for _, s in local), sleeps
    assert {f for f, _ in local} <= {"_push_messages", "yield_object_contents"}, sleeps
    import flwr.supernode.start_client_internal as sci

    assert sci.time is time, "start_client_internal no longer reads the time module as `time`"


def test_sleep_finder_sees_each_wait_in_its_innermost_function() -> None:
    """A release whose idle poll became 1 s would show as ("start_client_internal", 1.0) and fail
    the test above (no wait of >= 3 s left for the shim to shorten)."""
    finder = _SleepFinder()
    finder.visit(ast.parse(
        "def loop():\n    time.sleep(1)\n    def inner():\n        time.sleep(0.5)\n"
        "    time.sleep(delay)\n"
    ))  # fmt: skip
    assert finder.found == [("loop", 1.0), ("inner", 0.5)]


def test_message_metadata_keeps_the_private_fields_fedmeta_sets() -> None:
    """The adapter's writers set these through ``metadata.__dict__``, as Flower's runtimes do."""
    from flwr.app import Message, RecordDict

    fi.ensure_task_identity()
    message = Message(RecordDict(), 1, "query")
    for name in METADATA_PRIVATE_FIELDS:
        assert name in message.metadata.__dict__, f"flwr.app.Metadata has no {name}"
    fi.set_message_id(message, "m")
    fi.set_src_node_id(message, 7)
    assert (message.metadata.message_id, message.metadata.src_node_id) == ("m", 7)


def test_task_statuses_mirror_flowers() -> None:
    from flwr.common.constant import SubStatus

    assert (fi.COMPLETED, fi.FAILED) == (SubStatus.COMPLETED, SubStatus.FAILED)


def flower_imports(source: str) -> list[tuple[str, str]]:
    """``(module, name)`` of every import from Flower in ``source`` (``name`` "" for ``import``)."""
    found: list[tuple[str, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "flwr":
            found += [(node.module or "", alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name.split(".")[0] == "flwr"]
    return found


def non_public(imports: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The imports below Flower's public API (``flwr`` itself: its ``__version__``)."""
    return [(module, name) for module, name in imports
            if module != "flwr" and not module.startswith(PUBLIC_FLOWER)]  # fmt: skip


@pytest.mark.parametrize("module", WORKER_MODULES, ids=lambda m: m.__name__)
def test_the_worker_reaches_flower_internals_only_through_the_adapter(module: Any) -> None:
    found = non_public(flower_imports(Path(module.__file__).read_text()))
    assert found == [], f"{module.__name__} imports Flower internals {found}: use flower_internals"


def test_every_internal_the_adapter_imports_is_listed_and_named_with_the_version() -> None:
    """The inventory covers the adapter: each internal it imports is an ``INTERNALS`` row whose
    module and name its docstring names, beside the Flower version they were checked against."""
    listed = {(i.module, i.name.split(".")[0]) for i in INTERNALS if i.used_by == _W}
    imported = set(non_public(flower_imports(Path(fi.__file__).read_text())))
    assert imported - listed == set(), f"not in INTERNALS: {imported - listed}"
    doc = fi.__doc__ or ""
    assert f"flwr {fi.FLOWER_SERIES}" in doc, "the adapter names the Flower version it checked"
    unnamed = [i.label for i in INTERNALS if i.used_by == _W
               and not (i.module in doc and i.name.split(".")[-1] in doc)]  # fmt: skip
    assert unnamed == [], f"the adapter's docstring does not name {unnamed}"


def test_the_import_check_sees_internals_and_lets_the_public_api_pass() -> None:
    """Negative control for the two tests above."""
    source = (
        "import flwr\nfrom flwr.app import Message\nimport flwr.supernode.start_client_internal\n"
        "def f():\n    from flwr.supercore.retry import RetryInvoker\n"
    )
    assert non_public(flower_imports(source)) == [
        ("flwr.supernode.start_client_internal", ""), ("flwr.supercore.retry", "RetryInvoker")
    ]  # fmt: skip


def test_only_the_adapter_writes_message_metadata() -> None:
    """``metadata.__dict__`` is written in one function per field, in the adapter alone."""
    writers = [
        module_of(path)
        for package in ("fedmeta", *SUBPACKAGES)
        for path in package_files(package)
        if "metadata.__dict__" in path.read_text()
    ]
    assert writers == [fi.__name__], writers


def test_task_identity_is_set_through_its_properties_and_never_overwritten() -> None:
    from flwr.supercore.task_identity import TaskIdentity

    fi.ensure_task_identity()
    before = TaskIdentity.run_id
    TaskIdentity.run_id = 41  # as a real task sets it
    try:
        fi.ensure_task_identity()
        assert TaskIdentity.run_id == 41 and isinstance(TaskIdentity.task_id, int)
    finally:
        TaskIdentity.run_id = before


def test_transport_copy_of_node_unavailable_matches_flower() -> None:
    from flwr.common.constant import ErrorCode

    assert transport._NODE_UNAVAILABLE == ErrorCode.NODE_UNAVAILABLE


def test_version_guard_pin_and_image_constraints_name_one_series() -> None:
    """Bumping Flower means changing these together (docs/deploy.md, the procedure's step 1)."""
    series = fi.FLOWER_SERIES  # "1.41."
    major, minor = (int(x) for x in series.rstrip(".").split("."))
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    flwr = [d for d in deps if d.startswith("flwr")]
    assert flwr == [f"flwr[simulation]>={major}.{minor},<{major}.{minor + 1}"], flwr
    constraints = (REPO / "deploy" / "images" / "constraints.txt").read_text()
    pinned = re.search(r"^flwr==(\S+)$", constraints, re.MULTILINE)
    assert pinned is not None and pinned.group(1).startswith(series), pinned
    # Flower's images (the compose overlay and the stand-ins' default) are that same release.
    overlay = (REPO / "deploy" / "compose" / "flower-images.yml").read_text()
    tags = set(re.findall(r"docker\.io/flwr/super(?:link|node):(\S+?)\}", overlay))
    assert tags == {pinned.group(1)}, tags
    standin = (REPO / "deploy" / "images" / "flower-standin.Dockerfile").read_text()
    assert f"ARG FLWR_VERSION={pinned.group(1)}" in standin
    assert worker.FLOWER_SERIES == series
    import flwr as installed

    assert installed.__version__.startswith(series), (
        f"installed flwr {installed.__version__} is outside the series {series}x fedmeta pins"
    )


def test_both_launchers_refuse_another_flower(monkeypatch: pytest.MonkeyPatch) -> None:
    fi.check_flower("worker", fi.FLOWER_SERIES + "9")
    with pytest.raises(SystemExit, match=r"fedmeta supernode: written against flwr") as refused:
        fi.check_flower("supernode", "9.0.0")
    assert refused.value.code == fi.EXIT_FLOWER_VERSION == 78  # EX_CONFIG, as docs/deploy.md says
    import flwr

    monkeypatch.setattr(flwr, "__version__", "9.0.0")
    with pytest.raises(SystemExit, match=r"fedmeta supernode: .* found 9\.0\.0"):
        supernode.install(supernode.Polls(), 0.05)
    with pytest.raises(SystemExit, match=r"fedmeta worker: .* found 9\.0\.0"):
        worker.check_flower()
