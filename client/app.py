"""The fedmeta ClientApp (Flower Message API): registration and per-task clipped MAML gradients.

Thin glue: it reads the request (keys from :mod:`fedmeta.protocol`), asks the workload package for
the clipped per-task query gradients of exactly the requested task ids, and replies. The participant
id comes from the node config (``partition-id`` in simulation, ``participant-id`` in deployment).
Pre-clip norms never leave the participant.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedmeta import protocol as P
from fedmeta.config import Config

app = ClientApp()


def participant_id(context: Context) -> str:
    """This node's participant id, from its node config."""
    nc = context.node_config
    for key in (P.NODE_PARTICIPANT_ID, P.NODE_PARTITION_ID):
        if key in nc:
            return str(nc[key])
    raise ValueError(
        f"node_config must hold {P.NODE_PARTICIPANT_ID!r} or {P.NODE_PARTITION_ID!r}; "
        f"got {dict(nc)}"
    )


def _config(rec: ConfigRecord) -> Config:
    return Config.model_validate_json(str(rec["config_json"]))


def _value(rec: ConfigRecord, key: str) -> Any:
    """Return a request value (its type is checked by the conversion at the call site)."""
    return rec[key]


def handle_register(message: Message, context: Context) -> Message:
    """Reply with this participant's id and its (public) task count."""
    from client.workload import workload

    req = message.content.config_records[P.REGISTER_REQUEST]
    cfg = _config(req)
    pid = participant_id(context)
    count = workload(cfg).task_set.participant(pid).num_tasks
    reply = ConfigRecord(
        {P.PARTICIPANT_ID: pid, P.TASK_COUNT: int(count), P.VERSION: P.PROTOCOL_VERSION,
         P.RUN_ID: str(req[P.RUN_ID])}
    )  # fmt: skip
    return Message(RecordDict({P.REGISTER_REPLY: reply}), reply_to=message)


def compute_reply(content: RecordDict, pid: str) -> RecordDict:
    """The reply content for a gradient request (a pure function of the request and local data)."""
    import torch

    from client.workload import workload
    from metalearning import per_task_clipped_grads

    torch.set_num_threads(1)
    req = content.config_records[P.REQUEST]
    cfg = _config(req)
    wl = workload(cfg)
    task_ids = [int(t) for t in _value(req, P.TASK_IDS)]
    weights = content.array_records[P.WEIGHTS][P.PARAMS].numpy()
    params = torch.from_numpy(weights.astype(np.float32, copy=False))
    private = bool(req[P.PRIVATE])
    clip = float(_value(req, P.CLIP)) if private else math.inf
    t0 = time.perf_counter()
    dim = int(params.numel())
    if task_ids:
        tasks = wl.task_set.participant(pid).tasks(task_ids)
        grads, _norms = per_task_clipped_grads(
            wl.model,
            params,
            tasks,
            inner_steps=int(_value(req, P.INNER_STEPS)),
            inner_lr=float(_value(req, P.INNER_LR)),
            first_order=bool(req[P.FIRST_ORDER]),
            clip=clip,
            device=cfg.federation.client_device,
            chunk_size=cfg.training.chunk_size,
            nonfinite="zero",
        )
        grads = grads.detach().to("cpu", torch.float32)
    else:
        grads = torch.zeros((0, dim), dtype=torch.float32)
    seconds = time.perf_counter() - t0
    fmt = str(req[P.REPLY_FORMAT])
    meta: dict[str, Any] = {
        P.RUN_ID: str(req[P.RUN_ID]),
        P.ROUND_ID: int(_value(req, P.ROUND_ID)),
        P.PARTICIPANT_ID: pid,
        P.TASK_IDS: task_ids,
    }
    if fmt == P.REPLY_SUM_AND_NORMS:
        arrays = ArrayRecord({P.GRAD_SUM: Array(grads.sum(0).numpy())})
        # Post-clip norms only (<= C by construction): the server checks them against the bound.
        meta[P.TASK_NORMS] = [float(x) for x in torch.linalg.vector_norm(grads, dim=1)]
    else:
        arrays = ArrayRecord({P.GRADS_ARRAY: Array(grads.numpy())})
    return RecordDict(
        {
            P.GRADS: arrays,
            P.REPLY: ConfigRecord(meta),
            P.REPLY_METRICS: MetricRecord({P.COMPUTE_SECONDS: float(seconds)}),
        }
    )


def handle_train(message: Message, context: Context) -> Message:
    """Compute and return the clipped per-task query gradients of the requested tasks."""
    return Message(compute_reply(message.content, participant_id(context)), reply_to=message)


@app.query()
def query(message: Message, context: Context) -> Message:
    """Registration."""
    return handle_register(message, context)


@app.train()
def train(message: Message, context: Context) -> Message:
    """One round's work."""
    return handle_train(message, context)
