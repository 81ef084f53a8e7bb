"""A participant's sample-level round (issue 53; DP-MAML's Algorithm 2): examples, slots, rows.

A sample-level request names no task (server/fedmeta/server/sample_plan.py): the participant draws
its own examples and builds its tasks by the slot rule (metalearning/example_slots.py: each
example Poisson at ``example_rate``, at most one slot a pass, ``max_appearances`` passes, slots
that depend on no other example), runs the noisy inner DP-SGD on each task's support set and
returns each query example's gradient at the adapted parameters clipped to the round's ``clip``
(``C_out``), one row per query example (metalearning/sample_level.py ``query_gradient_rows``).
The server re-checks every row against ``C_out``, sums them and adds the outer noise.

**Randomness.** The round key of the slot rule, the class permutations and the inner noise come
from one numpy ``Generator`` over an AES-128-CTR keystream keyed from the operating system's
CSPRNG (``randomgen.AESCounter``, as the server's ``NoiseSource``), fresh for every request: the
inner noise is secret to the participant. Only the reproducible test mode
(``privacy.insecure_test_seed``) derives the key from (seed, round, participant).

An example's identity is its row in the participant's data (stable from round to round; the
declared classes, in order, give its label position). A participant with fewer classes than
``ways`` builds no task and replies with no row.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import randomgen
import torch

from fedmeta.client_config import ClientConfig, ClientSampleLevel
from fedmeta.metalearning.example_slots import SlotRule, build_round_slots, masked_tasks
from fedmeta.metalearning.federated import ParticipantTasks
from fedmeta.metalearning.sample_level import SampleLevelSteps, query_gradient_rows
from fedmeta.protocol import GradientRequest
from fedmeta.workload import Workload


def round_generator(
    sample: ClientSampleLevel, round_id: int, participant_id: str
) -> np.random.Generator:
    """The request's generator: a fresh CSPRNG key, or the test mode's derived one (docstring)."""
    if sample.insecure_test_seed is None:
        key = os.urandom(16)
    else:
        text = f"fedmeta-insecure-sample:{sample.insecure_test_seed}:{round_id}:{participant_id}"
        key = hashlib.sha256(text.encode()).digest()[:16]
    return np.random.Generator(randomgen.AESCounter(key=int.from_bytes(key, "little")))


def participant_examples(tasks: ParticipantTasks) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, labels)``: the participant's example rows and their class positions (docstring)."""
    offsets = tasks.dataset.offsets
    parts = [np.arange(offsets[c], offsets[c + 1], dtype=np.int64) for c in tasks.classes]
    labels = [np.full(p.size, j, np.int64) for j, p in enumerate(parts)]
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(parts), np.concatenate(labels)


def sample_level_rows(
    cfg: ClientConfig, wl: Workload, tasks: ParticipantTasks, request: GradientRequest,
    participant_id: str,
) -> np.ndarray:  # fmt: skip
    """The clipped query-example rows ``float32 [n, dim]`` of this participant's round."""
    sample = cfg.sample
    if sample is None or request.clip is None:
        raise ValueError("a sample-level round needs the request's sample part and its clip")
    ids, labels = participant_examples(tasks)
    n_classes, ways = len(tasks.classes), cfg.dataset.ways
    dim = wl.trained_dim
    if n_classes < ways:
        return np.zeros((0, dim), np.float32)
    rule = SlotRule(ways, sample.max_appearances, sample.example_rate, sample.support_share,
                    sample.tasks_per_pass)  # fmt: skip
    rng = round_generator(sample, request.round_id, participant_id)
    slots = build_round_slots(ids, labels, n_classes, rule, rng)
    batch = masked_tasks(slots, lambda pos: tasks.dataset.example(ids[pos]))
    steps = SampleLevelSteps(cfg.training.inner_steps, cfg.training.inner_lr, sample.inner_clip,
                             sample.inner_noise_multiplier, sample.support_normaliser,
                             request.clip)  # fmt: skip
    params = torch.from_numpy(np.ascontiguousarray(request.params, dtype=np.float32))
    rows = query_gradient_rows(wl.model, params, batch, steps, rng,
                               device=cfg.federation.client_device,
                               chunk_size=cfg.training.chunk_size or 32)  # fmt: skip
    return rows.detach().to("cpu", torch.float32).numpy()
