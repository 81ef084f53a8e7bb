"""The sampled participants' tasks computed together: one gradient call for a round, not one each.

The in-process grid calls each participant's ClientApp in turn; on a GPU each call is a small
batch (DP-MAML's round: 20 calls of 80 tasks), and the device waits between them. Here the grid
decodes a round's requests first, gives every sampled participant's tasks to one
:func:`~fedmeta.client.gradients.clipped_rows` call, and hands each participant's ClientApp reply
its own rows. Each task's gradient and clip are computed exactly as in its participant's own call
(per-task clipping is per task whatever the batch). On the CPU the rows are bit for bit those of
the per-participant path (a test pins that): the conv net's loop computes each task alone, and a
model that takes ``vmap`` on the CPU (the sinusoid MLP) keeps one batch per participant, since a
vmap batch's matrix products sum in an order that depends on the batch size. On CUDA ``vmap``
batches the whole round in chunks sized from free memory, so rows agree with the
per-participant path to float32 rounding (a few units in the last place of the reductions'
partial sums), as the per-participant path's rows already do between two chunk sizes; the
``gpu`` test bounds the difference by 1e-5 of the clip bound.

Nothing else changes: the reply's fields, clip bits and format are the ClientApp's
(client/fedmeta/client/gradients.py). The round falls back to the ClientApp's own per-message
path, with its per-task failure isolation, whenever the batch cannot be formed or computed
(requests that differ in anything but their tasks, another reply format, a handler that is not
fedmeta's ClientApp, an exception). Rows kept on an accelerator are bounded: the batch is cut into
parts of at most :func:`device_rows` tasks, so a lot larger than the device's memory is computed
in parts rather than refused.

Where the round fits in one part on a GPU, its rows stay there: each participant's reply holds a
slice of the one tensor (``wire_arrays.DEVICE_STYPE``), the server re-checks, clips and sums it on
that GPU (server/recheck.py) and only the sum, one vector per participant, reaches the host,
where the noise is drawn from the CSPRNG. A round computed in parts goes through the host as a
deployed participant's rows do.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import Message

from fedmeta import protocol as P
from fedmeta.simulation.local_grid import InProcessGrid

if TYPE_CHECKING:
    from fedmeta.client_config import ClientConfig
    from fedmeta.workload import Workload

#: The share of an accelerator's free memory the rows of one part of a batch may take; the rest
#: is the gradient computation's own (vmap's chunks size themselves from what is free).
ROWS_SHARE_OF_FREE = 0.25


def device_rows(device: torch.device, dim: int) -> int | None:
    """The most float32 rows of ``dim`` values one part may keep on ``device``; None: no bound.

    On the CPU the rows are the reply itself (server/capacity.py refuses a round that cannot fit).
    """
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, int(ROWS_SHARE_OF_FREE * free // (4 * dim)))


class BatchedGrid(InProcessGrid):
    """An in-process grid whose rounds compute every sampled participant's tasks in one call."""

    def __init__(self, num_nodes: int, *, first_node_id: int = 1000) -> None:
        """``num_nodes`` nodes running fedmeta's ClientApp (the only handler it batches)."""
        super().__init__(num_nodes, first_node_id=first_node_id)
        #: Rounds computed as one batch, and rounds that fell back (for tests and benchmarks).
        self.batched_rounds = 0
        self.fallback_rounds = 0

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # noqa: D102
        messages = list(messages)
        ready = self._batched_replies(messages)
        if not ready:
            return super().push_messages(messages)
        handler = self.handler

        def answer(message: Message, context: Any) -> Any:
            reply = ready.pop(id(message), None)
            if reply is None:
                return handler(message, context)
            return Message(P.encode_gradient_reply(reply, shared=True), reply_to=message)

        self.handler = answer
        try:
            return super().push_messages(messages)
        finally:
            self.handler = handler

    def _batched_replies(self, messages: list[Message]) -> dict[int, P.GradientReply]:
        """Each batched train message's reply, keyed by ``id(message)``; {} to fall back."""
        trains = [m for m in messages if m.metadata.message_type == P.MSG_TRAIN
                  and m.metadata.dst_node_id in self.online]  # fmt: skip
        if len(trains) < 2:
            return {}
        try:
            requests = {id(m): P.decode_gradient_request(m.content) for m in trains}
            pids = {id(m): str(self.contexts[m.metadata.dst_node_id].node_config[
                P.NODE_PARTITION_ID]) for m in trains}  # fmt: skip
            t0 = time.perf_counter()
            replies = batched_replies(requests, pids)
        except Exception:  # noqa: BLE001 - the ClientApp's own path decides what a failure is
            replies = {}
        if replies:
            self.batched_rounds += 1
            self.client_seconds += time.perf_counter() - t0
        else:
            self.fallback_rounds += 1
        return replies


def _same_round(requests: Iterable[P.GradientRequest]) -> bool:
    """Whether the requests differ in their task ids alone (one model, bound, configuration)."""
    first, *rest = requests
    key = (first.run_id, first.round_id, first.clip, first.config_json)
    return all((r.run_id, r.round_id, r.clip, r.config_json) == key
               and np.array_equal(r.params, first.params) for r in rest)  # fmt: skip


def batched_replies(
    requests: Mapping[int, P.GradientRequest], pids: Mapping[int, str]
) -> dict[int, P.GradientReply]:
    """The per_task replies of a round's requests from one gradient call; {} when not batchable.

    ``requests`` and ``pids``: each message's decoded request and its participant id.
    """
    from fedmeta.client.gradients import clip_bits, received_workload

    if not _same_round(requests.values()):
        return {}
    first = next(iter(requests.values()))
    cfg, wl = received_workload(first.config_json, None)
    if cfg.federation.reply_format != P.REPLY_PER_TASK or cfg.sample is not None:
        return {}  # sample level: each participant draws its own examples (its ClientApp)
    torch.set_num_threads(1)  # as the ClientApp: one participant per core in simulation
    started = time.perf_counter()
    rows, norms = _rows(cfg, wl, first, [(pids[k], r.task_ids) for k, r in requests.items()])
    seconds = time.perf_counter() - started
    total = max(1, len(rows))
    out: dict[int, P.GradientReply] = {}
    start = 0
    for key, request in requests.items():
        n = len(request.task_ids)
        mine, bits = rows[start : start + n], None
        if request.clip is not None:
            bits = clip_bits(norms[start : start + n], request.clip) if n else ()
        out[key] = P.GradientReply(request.run_id, request.round_id, pids[key], request.task_ids,
                                   mine, None, None, seconds * n / total, bits)  # fmt: skip
        start += n
    return out


def _rows(
    cfg: ClientConfig,
    wl: Workload,
    request: P.GradientRequest,
    asked: list[tuple[str, tuple[int, ...]]],
) -> tuple[np.ndarray | torch.Tensor, np.ndarray]:
    """Every asked task's clipped row and pre-clip norm, in order, in parts that fit the device.

    On an accelerator, a batch that fits in one part keeps its rows there (a tensor).
    """
    from fedmeta.client.gradients import clipped_rows, device_clipped_rows
    from fedmeta.metalearning import Task, resolve_device, resolve_method
    from fedmeta.workload import participant_tasks

    dim = wl.trained_dim
    device = resolve_device(cfg.federation.client_device)
    # On a GPU the tasks are gathered there from a copy of the images made once.
    tasks = [participant_tasks(wl, pid, None).tasks(list(ids), device)
             for pid, ids in asked if ids]  # fmt: skip
    if not tasks:
        return np.zeros((0, dim), dtype=np.float32), np.zeros(0, dtype=np.float64)
    params = torch.from_numpy(np.ascontiguousarray(request.params, dtype=np.float32))
    if device.type == "cpu" and resolve_method(wl.model, device) == "vmap":
        # A CPU vmap batch's rows depend on its size in their last bits (its matrix products
        # sum in another order): each participant's tasks stay one batch, as in its own call.
        parts = [clipped_rows(cfg, wl, params, t, request.clip) for t in tasks]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    joined = Task(*(torch.cat(parts) for parts in zip(*tasks, strict=True)))
    count = joined.num_tasks
    part = device_rows(device, dim) or count
    if part >= count and device.type != "cpu":
        # The device lane: the rows stay on the GPU, where the server re-checks and sums them.
        kept, kept_norms = device_clipped_rows(cfg, wl, params, joined, request.clip)
        return kept, kept_norms.to("cpu", torch.float64).numpy()
    if part >= count:
        return clipped_rows(cfg, wl, params, joined, request.clip)
    rows = np.zeros((count, dim), dtype=np.float32)
    norms = np.zeros(count, dtype=np.float64)
    for start in range(0, count, part):
        chunk = Task(*(t[start : start + part] for t in joined))
        got, pre = clipped_rows(cfg, wl, params, chunk, request.clip)
        rows[start : start + len(got)], norms[start : start + len(got)] = got, pre
    return rows, norms
