"""A participant's work, free of Flower: registration facts and one round's clipped gradients.

Called by the thin ClientApp (client/fedmeta/client/app.py) with decoded requests
(fedmeta.protocol). The
participant computes the MAML query gradient of exactly the requested tasks, clips each to the
round's bound C, and returns them (or their sum and post-clip norms). Pre-clip norms never leave
the participant; in a private run one bit per task does, ``[pre-clip norm <= C]``, which the server
releases only as a noisy, accounted count (adaptive clipping, docs/privacy.md).

Failures stay per task: a task whose gradient is non-finite, or whose computation raises,
contributes a zero row (:func:`isolated_rows`), so one task never removes its siblings.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fedmeta.adaptation import training_inner_kwargs
from fedmeta.client.sample_gradients import sample_level_rows
from fedmeta.client_config import ClientConfig
from fedmeta.metalearning.federated import ParticipantTasks
from fedmeta.protocol import (
    REPLY_SUM_AND_NORMS,
    GradientReply,
    GradientRequest,
    RegisterRequest,
    Registration,
    decode_client_config,
)
from fedmeta.workload import (
    Workload,
    build_workload,
    own_data,
    participant_fingerprint,
    participant_tasks,
)


@functools.lru_cache(maxsize=4)
def received_workload(config_json: str, data_path: str | None) -> tuple[ClientConfig, Workload]:
    """The configuration a request carries and its workload on this participant's data.

    Validated and built once per configuration received (keyed by the request's own text), so a
    participant's rounds reuse its tasks and model, and its registration's data read. A
    configuration that is not a valid ClientConfig raises ``ProtocolError`` (``bad_config``),
    naming the field: the ClientApp answers with an error reply, as for any malformed message.
    """
    cfg = decode_client_config(config_json)
    return cfg, build_workload(own_data(cfg, data_path))

log = logging.getLogger("fedmeta.client")


def registration(
    request: RegisterRequest, participant_id: str, data_path: str | None = None
) -> Registration:
    """This participant's id, task count and data fingerprint (for the trusted server only)."""
    cfg, wl = received_workload(request.config_json, data_path)
    tasks = participant_tasks(wl, participant_id, data_path)
    return Registration(
        participant_id, int(tasks.num_tasks), participant_fingerprint(cfg, tasks, data_path)
    )


def gradient_reply(
    request: GradientRequest, participant_id: str, data_path: str | None = None
) -> GradientReply:
    """The clipped per-task query gradients of the requested tasks (a pure function of them)."""
    cfg, wl = received_workload(request.config_json, data_path)
    dim = wl.trained_dim  # a row holds the privately trained coordinates only
    started = time.perf_counter()
    bits: tuple[int, ...] | None = None if request.clip is None else ()
    if cfg.sample is not None:  # sample level: no task ids; one row per query example
        tasks = participant_tasks(wl, participant_id, data_path)
        if not isinstance(tasks, ParticipantTasks):
            raise ValueError("a sample-level round needs class data (the sinusoid has none)")
        rows = sample_level_rows(cfg, wl, tasks, request, participant_id)
        ids = tuple(range(len(rows)))
        return GradientReply(request.run_id, request.round_id, participant_id, ids, rows, None,
                             None, time.perf_counter() - started, None)  # fmt: skip
    if request.task_ids:
        compute = _task_gradients(cfg, wl, request, participant_id, data_path)
        rows, pre_clip_norms = isolated_rows(compute, request.task_ids, dim)
        if request.clip is not None:
            bits = clip_bits(pre_clip_norms, request.clip)
    else:
        rows = np.zeros((0, dim), dtype=np.float32)  # sampled in stage 1, drew no task
    seconds = time.perf_counter() - started
    if cfg.federation.reply_format == REPLY_SUM_AND_NORMS:
        norms = tuple(float(x) for x in np.linalg.norm(rows.astype(np.float64), axis=1))
        return GradientReply(request.run_id, request.round_id, participant_id, request.task_ids,
                             None, rows.sum(0, dtype=np.float32), norms, seconds, bits)  # fmt: skip
    return GradientReply(request.run_id, request.round_id, participant_id, request.task_ids,
                         rows, None, None, seconds, bits)  # fmt: skip


#: Computes the clipped gradient rows and pre-clip norms of some of a request's task ids.
TaskGradients = Callable[[Sequence[int]], tuple[np.ndarray, np.ndarray]]


def _task_gradients(
    cfg: ClientConfig,
    wl: Workload,
    request: GradientRequest,
    participant_id: str,
    data_path: str | None,
) -> TaskGradients:
    """The workload's batched per-task clipped gradients (non-finite rows zeroed) for some ids."""
    params = torch.from_numpy(np.ascontiguousarray(request.params, dtype=np.float32))

    def compute(task_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        tasks = participant_tasks(wl, participant_id, data_path).tasks(list(task_ids))
        return clipped_rows(cfg, wl, params, tasks, request.clip)

    return compute


def clipped_rows(
    cfg: ClientConfig, wl: Workload, params: torch.Tensor, tasks: Any, clip: float | None
) -> tuple[np.ndarray, np.ndarray]:
    """(float32 clipped rows, float64 pre-clip norms) of a batch of ``wl``'s tasks, on the host.

    The one gradient call of a participant, and of the simulation's batched round
    (simulation/fedmeta/simulation/batched.py), which gives it every sampled participant's tasks.
    """
    grads, norms = device_clipped_rows(cfg, wl, params, tasks, clip)
    return grads.to("cpu").numpy(), norms.to("cpu", torch.float64).numpy()


def device_clipped_rows(
    cfg: ClientConfig, wl: Workload, params: torch.Tensor, tasks: Any, clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`clipped_rows` where they were computed: float32 rows and the pre-clip norms.

    On the CPU the same tensors :func:`clipped_rows` returns as arrays; on a GPU they stay there
    (the in-process grid's device lane, wire_arrays.DEVICE_STYPE).
    """
    from fedmeta.metalearning import per_task_clipped_grads

    grads, norms = per_task_clipped_grads(
        wl.model,
        params,
        tasks,
        **training_inner_kwargs(cfg.training),  # the guards, as at test time
        first_order=cfg.training.first_order,
        clip=math.inf if clip is None else clip,
        device=cfg.federation.client_device,
        chunk_size=cfg.training.chunk_size,
        nonfinite="zero",
        coordinates=wl.trained_coordinates,
        precision=cfg.training.precision,
    )
    return grads.detach().to(torch.float32), norms.detach()


def isolated_rows(
    compute: TaskGradients, task_ids: Sequence[int], dim: int
) -> tuple[np.ndarray, np.ndarray]:
    """Every requested task's clipped row and pre-clip norm, one task's failure kept to itself.

    The batch is computed at once; if that raises, each task is computed alone, and a task that
    raises contributes a zero row (within the clip) with a non-finite pre-clip norm (its clip bit
    is 0, as for a non-finite gradient). Dropping the whole reply instead would let one task
    remove all its siblings: an effect up to ``n_i * C``, not ``C`` (docs/privacy.md, "A task's
    effect stays within C"). If every task fails alone the cause is not one task (or there is only
    one): the error propagates and the server gets an error reply, which removes only those tasks.
    """
    try:
        return compute(task_ids)
    except Exception as error:  # noqa: BLE001 - one task's failure must not decide its siblings'
        log.warning("the batch of %d tasks failed (%s); computing them one by one",
                    len(task_ids), type(error).__name__)  # fmt: skip
    rows = np.zeros((len(task_ids), dim), dtype=np.float32)
    norms = np.full(len(task_ids), math.nan)
    failed: list[Exception] = []
    for i, task_id in enumerate(task_ids):
        try:
            row, norm = compute((task_id,))
            rows[i], norms[i] = row[0], norm[0]
        except Exception as error:  # noqa: BLE001 - the task contributes zero (see above)
            failed.append(error)
    if len(failed) == len(task_ids):
        raise failed[0]
    if failed:
        log.warning("%d of %d tasks failed and contribute zero", len(failed), len(task_ids))
    return rows, norms


def clip_bits(pre_clip_norms: np.ndarray, clip: float) -> tuple[int, ...]:
    """Andrew et al. (2021)'s bits ``[norm <= C]``, one per task; a non-finite norm is over C."""
    norms = np.asarray(pre_clip_norms, dtype=np.float64).reshape(-1)
    return tuple(int(b) for b in (np.isfinite(norms) & (norms <= clip)))
