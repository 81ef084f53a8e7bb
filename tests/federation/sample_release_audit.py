"""The example-level audit's pipeline: a real sample-level round on a worst-case canary example.

Each trial is one private round through ``server.round.run_round`` with the sample-level release
the run chooses (``PrivateRound`` over a ``SampleLevelRound``): stage 1 by the run's
``ParticipantSampler`` on the operating system's CSPRNG, the participant's examples and slots by
``metalearning.example_slots.build_round_slots`` and its noisy inner loop and clipped query rows by
``metalearning.sample_level.query_gradient_rows`` (the functions the ClientApp's
``client.sample_gradients`` calls, with the same AES-CTR generator), each row re-checked by
``server/fedmeta/server/validation.py``, the sum noised by ``server/fedmeta/server/noise.py``.

The model is one weight ``w`` predicting ``w x`` under squared error (``loss_kind = "mse"``), so a
query example ``(x, y) = (1, 1000)`` has the gradient ``2 (w - 1000)``: far over any clip, and
negative for every parameter the run can reach. Clipped, it is exactly ``-C_out`` in each of its
``m`` query slots: the released sum moves by ``m C_out``, the worst case of the outer release
(docs/privacy.md, "Sample level (issue 53): the bound"). Every example is a query example
(``support_share`` near 0), so the inner loop adapts on noise alone and the audit sees the outer
release, which is what leaves the server.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from fedmeta.accounting import SystemRandomSource, TwoStagePoissonScheme
from fedmeta.accounting.sample_level import ExampleSampling, SampleLevelRound
from fedmeta.client.sample_gradients import round_generator
from fedmeta.client_config import ClientSampleLevel
from fedmeta.metalearning.example_slots import SlotRule, build_round_slots, masked_tasks
from fedmeta.metalearning.sample_level import SampleLevelSteps, query_gradient_rows
from fedmeta.protocol import REPLY_PER_TASK, GradientReply, GradientRequest
from fedmeta.server.noise import NoiseSource
from fedmeta.server.plan import PrivatePlan
from fedmeta.server.release_strategy import PrivateRound
from fedmeta.server.round import Delivery, Exchange, RoundContext, RoundSetup, run_round
from fedmeta.server.sample_plan import ParticipantSampler

from .fakes import fake_ledger
from .release_audit import _Released

#: The canary: a query example whose gradient is far over the clip whatever the model.
CANARY = (1.0, 1000.0)
#: Almost every example a query example (the slot rule needs a share in (0, 1)).
QUERY_ONLY = 1e-12


class Line(nn.Module):
    """``w x`` under squared error: one parameter, so the released sum is one number."""

    loss_kind = "mse"

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * x


def event(m: int, z_out: float, z_in: float = 1000.0) -> SampleLevelRound:
    """One participant, every example sampled (rate 1), ``m`` passes, one inner step."""
    return SampleLevelRound(ExampleSampling(1, 1, 1.0), z_in, z_out, 1, m)


def _participant(examples: Sequence[tuple[float, float]], round_event: SampleLevelRound,
                 outer_clip: float | None) -> Any:  # fmt: skip
    """The participant's computation of one request (``outer_clip``: None = the request's)."""
    xs = np.array([x for x, _ in examples], np.float32).reshape(-1, 1)
    ys = np.array([y for _, y in examples], np.float32).reshape(-1, 1)
    ids = np.arange(len(examples), dtype=np.int64)
    model = Line()
    part = ClientSampleLevel(example_rate=1.0, max_appearances=round_event.max_appearances,
                             tasks_per_pass=1, support_share=QUERY_ONLY, inner_clip=1.0,
                             inner_noise_multiplier=round_event.inner_noise_multiplier,
                             support_normaliser=1)  # fmt: skip

    def rows(req: GradientRequest) -> np.ndarray:
        rule = SlotRule(1, part.max_appearances, part.example_rate, part.support_share, 1)
        rng = round_generator(part, req.round_id, "t")
        slots = build_round_slots(ids, np.zeros(ids.size, np.int64), 1, rule, rng)
        tasks = masked_tasks(slots, lambda p: torch.from_numpy(xs[p]),
                             lambda p, _labels: torch.from_numpy(ys[p]))  # fmt: skip
        assert req.clip is not None
        clip = req.clip if outer_clip is None else outer_clip
        steps = SampleLevelSteps(1, 0.01, part.inner_clip, part.inner_noise_multiplier,
                                 part.support_normaliser, clip)  # fmt: skip
        params = torch.from_numpy(req.params)
        out = query_gradient_rows(model, params, tasks, steps, rng, device="cpu")
        return out.numpy()

    def exchange(requests: Any) -> Exchange:
        replies = {}
        for pid, req in requests.items():
            r = rows(req)
            replies[pid] = Delivery(GradientReply(req.run_id, req.round_id, pid,
                                                  tuple(range(len(r))), r, None, None))
        return Exchange(replies, {})

    return exchange


def released(
    round_event: SampleLevelRound,
    examples: Sequence[tuple[float, float]],
    trials: int,
    noise: NoiseSource,
    *,
    participant_clip: float | None = None,
) -> np.ndarray:
    """What one private sample-level round releases, ``trials`` times (the noisy sum, C_out = 1).

    ``participant_clip``: the participant's outer clip, None for the request's (a huge one is the
    clip-skipped control: the server's re-check is then all that bounds a row).
    """
    plan = PrivatePlan(round_event, 1.0, 1e9, 1e-5, False)
    ledger = fake_ledger(1e12, 1e-12)
    context = RoundContext("audit", "audit", _participant(examples, round_event, participant_clip),
                           "{}", 1, REPLY_PER_TASK, 1e-4, False)  # fmt: skip
    sampler = ParticipantSampler(TwoStagePoissonScheme(1, 1, 1.0), SystemRandomSource())
    out = _Released(1.0)
    for index in range(trials):
        release = PrivateRound(plan, 1.0, ledger, noise, "audit", 1, 1.0)
        run_round(context, RoundSetup({"t": 1}, sampler, release), out, index)  # type: ignore[arg-type]
    return np.asarray(out.values)
