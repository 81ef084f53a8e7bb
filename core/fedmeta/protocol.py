"""The wire protocol between the fedmeta ServerApp and ClientApp: typed payloads, encode and decode.

Every record name and key lives here and nowhere else; client and server call these functions
instead of reading or writing records by hand. Each decoder checks the protocol version first and
raises :class:`ProtocolError` (with a reason code the server counts) for anything malformed, so a
message from another fedmeta version is refused on both sides rather than misread.

Registration (Flower message type ``query``)::

    server -> client  ConfigRecord "fedmeta.register"     {version, run_id, config}
    client -> server  ConfigRecord "fedmeta.registration" {version, participant_id, task_count,
                                                           data_fingerprint}

Gradient request (message type ``train``)::

    server -> client  ArrayRecord  "fedmeta.weights" {params: float32 [dim]}
                      ConfigRecord "fedmeta.request" {version, run_id, round_id, task_ids, clip,
                                                      config}
    client -> server  ArrayRecord  "fedmeta.grads"   {grads: float32 [n_tasks, dim]}  (per_task)
                                                  or {grad_sum: float32 [dim]}    (sum_and_norms)
                      ConfigRecord "fedmeta.reply"   {version, run_id, round_id, participant_id,
                                                      task_ids, task_norms (sum_and_norms only),
                                                      clip_bits (private runs)}
                      MetricRecord "fedmeta.reply_metrics" {compute_seconds}

``config`` is the one configuration channel: the participant's part of the server's configuration
(:class:`fedmeta.client_config.ClientConfig`: the data's specification, the model and its inner
loop, the seed, the reply format; never budgets, the ledger, sampling or addresses) as JSON, which
the participant validates once (:func:`decode_client_config`; a key it is not sent, or a value out
of range, is refused as ``bad_config``). ``clip`` is a round parameter, not configuration (it is
absent in a non-private run); it is the round's bound, which adaptive clipping changes from round to
round.
Replies never carry pre-clip norms: those never leave the participant. In a private run a reply
carries ``clip_bits``, one bit per task, ``1`` when the task's pre-clip norm was at most ``clip``
(``[norm <= C]``): the input of adaptive clipping's noisy count (Andrew et al. 2021), which the
server releases only with noise and accounts (docs/privacy.md); any value but 0 or 1 is refused. An
empty ``task_ids`` is a valid request: every participant sampled in stage 1 is contacted, whether or
not it drew a task, so that contact reveals nothing about stage 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, ConfigRecordValues, MetricRecord, RecordDict

from fedmeta.client_config import ClientConfig, ClientConfigError, parse_client_config
from fedmeta.wire_arrays import DEVICE_STYPE as DEVICE_STYPE
from fedmeta.wire_arrays import SHARED_STYPE as SHARED_STYPE
from fedmeta.wire_arrays import device_array as device_array
from fedmeta.wire_arrays import device_values as device_values
from fedmeta.wire_arrays import npy_array as npy_array
from fedmeta.wire_arrays import npy_values as npy_values
from fedmeta.wire_arrays import shared_array as shared_array
from fedmeta.wire_arrays import shared_values as shared_values

#: 4: ``config`` is the participant's ClientConfig, not the whole tree; 3: replies carry
#: ``clip_bits`` (adaptive clipping); 2: typed request and reply records.
PROTOCOL_VERSION: Final = 4

# Flower message types (the ClientApp's handlers are @app.query() and @app.train()).
MSG_REGISTER: Final = "query"
MSG_TRAIN: Final = "train"

# Record names.
REGISTER_RECORD: Final = "fedmeta.register"
REGISTRATION_RECORD: Final = "fedmeta.registration"
WEIGHTS_RECORD: Final = "fedmeta.weights"
REQUEST_RECORD: Final = "fedmeta.request"
GRADS_RECORD: Final = "fedmeta.grads"
REPLY_RECORD: Final = "fedmeta.reply"
REPLY_METRICS_RECORD: Final = "fedmeta.reply_metrics"

#: How a participant returns its gradients: one row per task, or their sum and post-clip norms.
ReplyFormat: TypeAlias = Literal["per_task", "sum_and_norms"]
REPLY_PER_TASK: Final = "per_task"
REPLY_SUM_AND_NORMS: Final = "sum_and_norms"

# Flower node_config keys: simulation sets partition-id; a deployed SuperNode sets participant-id.
NODE_PARTITION_ID: Final = "partition-id"
NODE_PARTICIPANT_ID: Final = "participant-id"
NODE_DATA_PATH: Final = "data-path"  # a deployed participant's own data (overrides dataset.path)
#: Set by the in-process grid (simulation): replies share the participant's memory (SHARED_STYPE).
NODE_SHARED_MEMORY: Final = "fedmeta-shared-memory"

# Flower run_config keys read by server/fedmeta/server/app.py (`flwr run .`, pyproject
# [tool.flwr.app.config]).
RUN_CONFIG_FILE: Final = "config-file"
RUN_CONFIG_SET: Final = "set"
RUN_CONFIG_OUT: Final = "out"
RUN_CONFIG_RESUME: Final = "resume"
#: Flower-style typed run_config keys -> the configuration key each sets
# (server/fedmeta/server/app.py maps them,
#: after ``config-file`` and before ``set``). Their pyproject value 0 (or "") means "leave the
#: configuration's value": every mapped key's valid range excludes it.
RUN_CONFIG_TYPED: Final = {
    "num-server-rounds": "rounds",
    "epsilon": "privacy.target_epsilon",
    "epsilon-budget": "privacy.epsilon_budget",
    "delta": "privacy.delta",
    "noise-multiplier": "privacy.noise_multiplier",
    "clip": "privacy.clip",
    "participants-per-round": "sampling.participants_per_round",
    "task-rate": "sampling.task_rate",
    "meta-lr": "training.meta_lr",
    "dataset": "dataset.name",
    "dataset-path": "dataset.path",
    "ledger-path": "privacy.ledger_path",
    "experiment": "privacy.experiment",
}

# Reasons a message is refused; the server counts replies by these (and its own validation reasons).
REASON_PROTOCOL_VERSION: Final = "protocol_version"
REASON_MISSING_RECORD: Final = "missing_record"
REASON_BAD_DTYPE: Final = "bad_dtype"
REASON_BAD_SHAPE: Final = "bad_shape"
REASON_BAD_CONFIG: Final = "bad_config"


class ProtocolError(ValueError):
    """A message that does not follow this protocol; ``reason`` is one of the ``REASON_*`` codes."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# ------------------------------------------------------------------------------------- payloads


@dataclass(frozen=True)
class RegisterRequest:
    """The server asks a node who it is and how many tasks it holds."""

    run_id: str
    config_json: str  # the participant's ClientConfig as JSON (fedmeta.client_config)


@dataclass(frozen=True)
class Registration:
    """A node's answer: its participant id, its task count and a fingerprint of its data.

    The task count and fingerprint go to the trusted server only; under the add/remove relation the
    server never releases anything that depends on them.
    """

    participant_id: str
    task_count: int
    data_fingerprint: str


@dataclass(frozen=True)
class GradientRequest:
    """One round's work for one participant: the meta-parameters and the task ids to compute."""

    run_id: str
    round_id: int
    task_ids: tuple[int, ...]
    clip: float | None  # None: a non-private run, no clipping
    params: np.ndarray  # float32 [dim]
    config_json: str  # the participant's ClientConfig as JSON (fedmeta.client_config)


@dataclass(frozen=True)
class GradientReply:
    """A participant's clipped per-task query gradients (or their sum and post-clip norms)."""

    run_id: str
    round_id: int
    participant_id: str
    task_ids: tuple[int, ...]
    # float32 [n_tasks, dim] (per_task); a tensor on the participant's device only within one
    # process (DEVICE_STYPE, the in-process grid), an array everywhere else.
    grads: np.ndarray | torch.Tensor | None
    grad_sum: np.ndarray | None  # float32 [dim] (sum_and_norms)
    task_norms: tuple[float, ...] | None  # post-clip, one per task (sum_and_norms)
    compute_seconds: float | None = None
    clip_bits: tuple[int, ...] | None = None  # [pre-clip norm <= C] per task (private runs)

    @property
    def reply_format(self) -> ReplyFormat:
        """``per_task`` or ``sum_and_norms``."""
        return REPLY_PER_TASK if self.grads is not None else REPLY_SUM_AND_NORMS


# ------------------------------------------------------------------------------------- helpers


def _record(content: RecordDict, name: str) -> ConfigRecord:
    record = content.config_records.get(name)
    if record is None:
        raise ProtocolError(REASON_MISSING_RECORD, f"message lacks the record {name!r}")
    version = record.get("version")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            REASON_PROTOCOL_VERSION,
            f"protocol version {version!r}, this fedmeta speaks {PROTOCOL_VERSION}: run the same "
            "fedmeta version on the server and every participant",
        )
    return record


def _get(record: ConfigRecord, key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in record:
        raise ProtocolError(REASON_MISSING_RECORD, f"record lacks the key {key!r}")
    value = record[key]
    # bool is an int: a True task id or round id is a malformed message, not 1.
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise ProtocolError(REASON_BAD_DTYPE, f"{key} must be {kind}; got {type(value).__name__}")
    return value


def _task_ids(record: ConfigRecord) -> tuple[int, ...]:
    raw = _get(record, "task_ids", list)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        raise ProtocolError(REASON_BAD_DTYPE, "task_ids must be a list of int")
    return tuple(int(t) for t in raw)


def _array(
    content: RecordDict, record_name: str, key: str, *, copy: bool = True, shared: bool = False
) -> Any:
    """The named float32 array; with ``copy=False`` a read-only view of the message's bytes.

    ``shared``: a :data:`SHARED_STYPE` array is accepted too, and a :data:`DEVICE_STYPE` one (a
    tensor on the participant's device, returned as it is; the in-process grid).
    """
    arrays = content.array_records.get(record_name)
    if arrays is None or key not in arrays:
        raise ProtocolError(REASON_MISSING_RECORD, f"message lacks the array {record_name}/{key}")
    array = arrays[key]
    if str(getattr(array, "dtype", None)) != "float32":
        raise ProtocolError(REASON_BAD_DTYPE, f"{key}: dtype {array.dtype}, expected float32")
    if array.stype in (SHARED_STYPE, DEVICE_STYPE) and not shared:
        raise ProtocolError(REASON_BAD_DTYPE, f"{key}: an in-process array outside a process")
    try:
        if array.stype == DEVICE_STYPE:
            return device_values(array)  # only read by the server (server/recheck.py)
        values = shared_values(array) if array.stype == SHARED_STYPE else npy_values(array)
    except Exception as error:  # noqa: BLE001 - any undecodable array is a malformed message
        raise ProtocolError(REASON_BAD_DTYPE, f"{key}: cannot decode ({error})") from None
    if values.dtype != np.float32:
        raise ProtocolError(REASON_BAD_DTYPE, f"{key}: decoded {values.dtype}, expected float32")
    return values.copy() if copy else values



# ------------------------------------------------------------------------------------- registration


def encode_register_request(request: RegisterRequest) -> RecordDict:
    """The registration query's content."""
    record: dict[str, ConfigRecordValues] = {
        "version": PROTOCOL_VERSION,
        "run_id": request.run_id,
        "config": request.config_json,
    }
    return RecordDict({REGISTER_RECORD: ConfigRecord(record)})


def decode_register_request(content: RecordDict) -> RegisterRequest:
    """Parse a registration query (raises :class:`ProtocolError`)."""
    record = _record(content, REGISTER_RECORD)
    return RegisterRequest(_get(record, "run_id", str), _get(record, "config", str))


def encode_registration(registration: Registration) -> RecordDict:
    """A node's registration reply."""
    record: dict[str, ConfigRecordValues] = {
        "version": PROTOCOL_VERSION,
        "participant_id": registration.participant_id,
        "task_count": int(registration.task_count),
        "data_fingerprint": registration.data_fingerprint,
    }
    return RecordDict({REGISTRATION_RECORD: ConfigRecord(record)})


def decode_registration(content: RecordDict) -> Registration:
    """Parse a registration reply (raises :class:`ProtocolError`)."""
    record = _record(content, REGISTRATION_RECORD)
    count = _get(record, "task_count", int)
    if count < 0:
        raise ProtocolError(REASON_BAD_DTYPE, f"task_count must be >= 0; got {count}")
    return Registration(
        _get(record, "participant_id", str), count, _get(record, "data_fingerprint", str)
    )


# ------------------------------------------------------------------------------------- gradients


def encode_gradient_request(request: GradientRequest) -> RecordDict:
    """A round's request to one participant."""
    params = np.ascontiguousarray(request.params, dtype=np.float32)
    record: dict[str, ConfigRecordValues] = {
        "version": PROTOCOL_VERSION,
        "run_id": request.run_id,
        "round_id": int(request.round_id),
        "task_ids": [int(t) for t in request.task_ids],
        "config": request.config_json,
    }
    if request.clip is not None:
        record["clip"] = float(request.clip)
    return RecordDict(
        {
            WEIGHTS_RECORD: ArrayRecord({"params": npy_array(params)}),
            REQUEST_RECORD: ConfigRecord(record),
        }
    )


def decode_gradient_request(content: RecordDict) -> GradientRequest:
    """Parse a round's request (raises :class:`ProtocolError`)."""
    record = _record(content, REQUEST_RECORD)
    clip = record.get("clip")
    if clip is not None and not (isinstance(clip, float) and math.isfinite(clip) and clip > 0):
        raise ProtocolError(REASON_BAD_DTYPE, f"clip must be a finite float > 0; got {clip!r}")
    params = _array(content, WEIGHTS_RECORD, "params")
    if params.ndim != 1:
        raise ProtocolError(REASON_BAD_SHAPE, f"params: shape {params.shape}, expected [dim]")
    return GradientRequest(
        run_id=_get(record, "run_id", str),
        round_id=_get(record, "round_id", int),
        task_ids=_task_ids(record),
        clip=clip,
        params=params,
        config_json=_get(record, "config", str),
    )


def decode_client_config(config_json: str) -> ClientConfig:
    """A request's ``config``, validated (raises :class:`ProtocolError` naming the field)."""
    try:
        return parse_client_config(config_json)
    except ClientConfigError as error:
        raise ProtocolError(REASON_BAD_CONFIG, str(error)) from None


def encode_gradient_reply(reply: GradientReply, *, shared: bool = False) -> RecordDict:
    """A participant's reply to a round's request.

    ``shared``: the arrays share the reply's memory (:data:`SHARED_STYPE`, the in-process grid),
    and rows that are a tensor stay where they are (:data:`DEVICE_STYPE`).
    """
    to_array = shared_array if shared else npy_array
    meta: dict[str, ConfigRecordValues] = {
        "version": PROTOCOL_VERSION,
        "run_id": reply.run_id,
        "round_id": int(reply.round_id),
        "participant_id": reply.participant_id,
        "task_ids": [int(t) for t in reply.task_ids],
    }
    grads = reply.grads
    if isinstance(grads, torch.Tensor) and not shared:  # the wire carries host bytes
        grads = grads.detach().to("cpu", torch.float32).numpy()
    if isinstance(grads, torch.Tensor):
        arrays = {"grads": device_array(grads.to(torch.float32))}
    elif grads is not None:
        arrays = {"grads": to_array(np.asarray(grads, dtype=np.float32))}
    elif reply.grad_sum is not None and reply.task_norms is not None:
        arrays = {"grad_sum": to_array(np.asarray(reply.grad_sum, dtype=np.float32))}
        meta["task_norms"] = [float(x) for x in reply.task_norms]
    else:
        raise ValueError("a GradientReply needs grads, or grad_sum with task_norms")
    if reply.clip_bits is not None:
        meta["clip_bits"] = [int(b) for b in reply.clip_bits]
    record = ArrayRecord()  # filled by key: ArrayRecord(arrays) rebuilds each Array from bytes
    for name, array in arrays.items():
        record[name] = array
    content: dict[str, ArrayRecord | MetricRecord | ConfigRecord] = {
        GRADS_RECORD: record,
        REPLY_RECORD: ConfigRecord(meta),
    }
    if reply.compute_seconds is not None:
        content[REPLY_METRICS_RECORD] = MetricRecord(
            {"compute_seconds": float(reply.compute_seconds)}
        )
    return RecordDict(content)


def decode_gradient_reply(content: RecordDict, *, shared: bool = False) -> GradientReply:
    """Parse a reply (raises :class:`ProtocolError`); its values are checked by the server.

    ``shared``: the reply came through an in-process grid, whose arrays may share memory.
    """
    meta = _record(content, REPLY_RECORD)
    arrays = content.array_records.get(GRADS_RECORD)
    grads = grad_sum = None
    norms: tuple[float, ...] | None = None
    if arrays is not None and "grad_sum" in arrays:
        grad_sum = _array(content, GRADS_RECORD, "grad_sum", copy=False, shared=shared)
        raw = _get(meta, "task_norms", list)
        if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in raw):
            raise ProtocolError(REASON_BAD_DTYPE, "task_norms must be numbers")
        norms = tuple(float(x) for x in raw)
    else:
        # A view of the message's bytes: the server only reads a reply (server/validation).
        grads = _array(content, GRADS_RECORD, "grads", copy=False, shared=shared)
    return GradientReply(
        run_id=_get(meta, "run_id", str),
        round_id=_get(meta, "round_id", int),
        participant_id=_get(meta, "participant_id", str),
        task_ids=_task_ids(meta),
        grads=grads,
        grad_sum=grad_sum,
        task_norms=norms,
        compute_seconds=_compute_seconds(content),
        clip_bits=_clip_bits(meta),
    )


def _clip_bits(meta: ConfigRecord) -> tuple[int, ...] | None:
    """The reply's ``clip_bits``: absent (None), or a list of 0 and 1 (anything else is refused)."""
    if "clip_bits" not in meta:
        return None
    raw = _get(meta, "clip_bits", list)
    if not all(type(b) is int and b in (0, 1) for b in raw):
        raise ProtocolError(REASON_BAD_DTYPE, "clip_bits must be a list of 0 and 1")
    return tuple(raw)


def _compute_seconds(content: RecordDict) -> float | None:
    metrics = content.metric_records.get(REPLY_METRICS_RECORD)
    value = None if metrics is None else metrics.get("compute_seconds")
    if isinstance(value, int | float) and math.isfinite(value) and value >= 0:
        return float(value)
    return None
