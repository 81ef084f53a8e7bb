"""A task's effect stays within C on the participant: one failing task never removes its siblings.

The participant computes a request's tasks in one batch; when that raises, each task alone, and a
task that raises contributes a zero row with clip bit 0 (client/fedmeta/client/gradients.py
``isolated_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from fedmeta.client import gradients as gradients_mod
from fedmeta.client.gradients import gradient_reply, isolated_rows
from fedmeta.client_config import client_config
from fedmeta.config_io import load_config
from fedmeta.protocol import GradientRequest
from fedmeta.workload import build_model, initial_params

POISON = 2


def _compute(task_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    if POISON in task_ids:
        raise RuntimeError("task 2's data cannot be read")
    rows = np.array([[float(t), 1.0] for t in task_ids], dtype=np.float32)
    return rows, np.linalg.norm(rows.astype(np.float64), axis=1)


@pytest.mark.unit
def test_a_failing_task_contributes_zero_and_its_siblings_are_kept() -> None:
    rows, norms = isolated_rows(_compute, (0, 2, 3), 2)
    assert rows.tolist() == [[0.0, 1.0], [0.0, 0.0], [3.0, 1.0]]
    assert np.isnan(norms[1]) and np.isfinite(norms[[0, 2]]).all()
    assert gradients_mod.clip_bits(norms, 5.0) == (1, 0, 1)  # a failed task's bit is 0


@pytest.mark.unit
def test_when_every_task_fails_alone_the_error_is_the_reply() -> None:
    with pytest.raises(RuntimeError, match="task 2"):
        isolated_rows(_compute, (POISON,), 2)  # removes only this task: within C


@pytest.mark.integration
def test_the_real_participant_zeroes_only_the_failing_task(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(None, ["dataset.tasks_per_participant=8", "privacy.clip=1.0"])
    params = initial_params(cfg, build_model(cfg)).numpy().astype(np.float32)
    real = gradients_mod.participant_tasks

    class Poisoned:
        def __init__(self, tasks: Any) -> None:
            self.inner = tasks

        def tasks(self, ids: list[int]) -> Any:
            if POISON in ids:
                raise ValueError("unreadable task")
            return self.inner.tasks(ids)

    def request(ids: tuple[int, ...]) -> GradientRequest:
        return GradientRequest("r", 0, ids, 1.0, params, client_config(cfg).model_dump_json())

    honest = gradient_reply(request((0, 3)), "0")
    monkeypatch.setattr(gradients_mod, "participant_tasks", lambda *a: Poisoned(real(*a)))
    reply = gradient_reply(request((0, POISON, 3)), "0")
    assert reply.grads is not None and honest.grads is not None
    assert not reply.grads[1].any()
    # Each task alone gives what the batch gave, to float32 rounding of a per-task computation.
    np.testing.assert_allclose(reply.grads[[0, 2]], honest.grads, rtol=1e-5, atol=1e-6)
    assert honest.clip_bits is not None and reply.clip_bits is not None
    assert reply.clip_bits == (honest.clip_bits[0], 0, honest.clip_bits[1])


@pytest.mark.unit
def test_the_one_released_failure_is_the_transports_unavailable_node() -> None:
    from fedmeta.server import releases, transport

    assert releases.AVAILABILITY_FAILURES == {transport.FAILURE_NODE_UNAVAILABLE}
    split = releases.split_failures({"timeout": 2, "node_unavailable": 1}, private=True)
    assert (dict(split.released), dict(split.withheld)) == ({"node_unavailable": 1}, {"timeout": 2})
    assert dict(releases.split_failures({"timeout": 2}, private=False).released) == {"timeout": 2}
