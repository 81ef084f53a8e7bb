"""A participant's work, free of Flower: registration facts and one round's clipped gradients.

Called by the thin ClientApp (client/app.py) with decoded requests (fedmeta.protocol). The
participant computes the MAML query gradient of exactly the requested tasks, clips each to the
round's bound C, and returns them (or their sum and post-clip norms). Pre-clip norms never leave
the participant; in a private run one bit per task does, ``[pre-clip norm <= C]``, which the server
releases only as a noisy, accounted count (adaptive clipping, docs/privacy.md).
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from fedmeta.config import Config
from fedmeta.protocol import (
    REPLY_SUM_AND_NORMS,
    GradientReply,
    GradientRequest,
    RegisterRequest,
    Registration,
)
from fedmeta.workload import data_fingerprint, own_data, participant_tasks, workload


def registration(
    request: RegisterRequest, participant_id: str, data_path: str | None = None
) -> Registration:
    """This participant's id, task count and data fingerprint (for the trusted server only)."""
    cfg = Config.model_validate_json(request.config_json)
    tasks = participant_tasks(cfg, participant_id, data_path)
    return Registration(
        participant_id, int(tasks.num_tasks), data_fingerprint(own_data(cfg, data_path))
    )


def gradient_reply(
    request: GradientRequest, participant_id: str, data_path: str | None = None
) -> GradientReply:
    """The clipped per-task query gradients of the requested tasks (a pure function of them)."""
    from fedmeta.metalearning import per_task_clipped_grads

    from fedmeta.adaptation import inner_kwargs

    cfg = Config.model_validate_json(request.config_json)
    dim = int(request.params.shape[0])
    started = time.perf_counter()
    bits: tuple[int, ...] | None = None if request.clip is None else ()
    if request.task_ids:
        grads, pre_clip_norms = per_task_clipped_grads(
            workload(cfg).model,
            torch.from_numpy(np.ascontiguousarray(request.params, dtype=np.float32)),
            participant_tasks(cfg, participant_id, data_path).tasks(list(request.task_ids)),
            **inner_kwargs(cfg.training, evaluation=False),
            first_order=cfg.training.first_order,
            clip=math.inf if request.clip is None else request.clip,
            device=cfg.federation.client_device,
            chunk_size=cfg.training.chunk_size,
            nonfinite="zero",
        )
        rows = grads.detach().to("cpu", torch.float32).numpy()
        if request.clip is not None:
            bits = clip_bits(pre_clip_norms.detach().to("cpu", torch.float64).numpy(), request.clip)
    else:
        rows = np.zeros((0, dim), dtype=np.float32)  # sampled in stage 1, drew no task
    seconds = time.perf_counter() - started
    if cfg.federation.reply_format == REPLY_SUM_AND_NORMS:
        norms = tuple(float(x) for x in np.linalg.norm(rows.astype(np.float64), axis=1))
        return GradientReply(request.run_id, request.round_id, participant_id, request.task_ids,
                             None, rows.sum(0, dtype=np.float32), norms, seconds, bits)  # fmt: skip
    return GradientReply(request.run_id, request.round_id, participant_id, request.task_ids,
                         rows, None, None, seconds, bits)  # fmt: skip


def clip_bits(pre_clip_norms: np.ndarray, clip: float) -> tuple[int, ...]:
    """Andrew et al. (2021)'s bits ``[norm <= C]``, one per task; a non-finite norm is over C."""
    norms = np.asarray(pre_clip_norms, dtype=np.float64).reshape(-1)
    return tuple(int(b) for b in (np.isfinite(norms) & (norms <= clip)))
