"""A sample-level run's plan (issue 53): event, noise, normaliser, sampler, participants' part.

``privacy.level = "sample"`` (core/fedmeta/config_sample.py) runs DP-MAML's Algorithm 2 under the
contract of docs/privacy.md, "Sample level (issue 53): the bound". The server's share:

* **Stage 1** draws ``n1`` of the eligible participants without replacement
  (:class:`ParticipantSampler`), with the run's CSPRNG source, and sends each the model and no
  task ids; examples are drawn by the participant (stage 2: each example Poisson at
  ``example_rate``, client/fedmeta/client/sample_gradients.py). That is ``ExampleSampling(P, n1,
  q)``, the event's sampling, over the same population object as the task level's scheme.
* **The event** (:func:`sample_event`) is the ``SampleLevelRound`` of the configuration: ``z_out``
  = ``privacy.noise_multiplier`` and ``z_in`` = ``privacy.sample.inner_noise_multiplier`` (both
  given), or both calibrated to the run's target (``calibrate_sample_level``: first order, the
  only order a sample-level run has), or, on resume, ``z_out`` kept from the checkpoint.
* **The release**: the server adds ``N(0, (z_out C_out)^2 I)`` to the sum of the accepted
  per-example rows (each re-checked to ``C_out = privacy.clip``); :func:`outer_gaussian` is the
  Gaussian it draws, read from the recorded event so the noise and the spend cannot disagree.
* **Normalisers** are public constants of the configuration (a participant's example count is
  private under add/remove of one example): the inner step divides by the nominal support size
  ``ways x shots``, the outer sum by ``privacy.normaliser`` or the nominal query count of a round,
  ``n1 x m x tasks_per_pass x ways x query`` (:func:`sample_normaliser`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedmeta.accounting import RandomSource, TwoStageSampler, sample_without_replacement
from fedmeta.accounting.sample_level import ExampleSampling, SampleLevelRound
from fedmeta.accounting.sample_level_bound import calibrate_sample_level
from fedmeta.accounting.schemes import (
    FlatPoissonScheme,
    GaussianRound,
    TwoStageFixedScheme,
    TwoStagePoissonScheme,
)
from fedmeta.client_config import ClientSampleLevel
from fedmeta.config import Config

#: What ``summary.json``, the plan and the checkpoint call the level of a run.
TASK, SAMPLE = "task", "sample"


def sampling_of(scheme: TwoStagePoissonScheme) -> ExampleSampling:
    """The example sampling over ``scheme``'s population (its rate is the example rate)."""
    return ExampleSampling(scheme.participants, scheme.participants_per_round, scheme.task_rate)


def sample_event(
    cfg: Config, scheme: TwoStagePoissonScheme, resumed_z: float | None
) -> tuple[SampleLevelRound, bool]:
    """The run's round and whether its noise was calibrated (see the module docstring)."""
    p, k, m = cfg.privacy, cfg.training.inner_steps, cfg.privacy.sample.max_appearances
    sampling = sampling_of(scheme)
    z_out, z_in = p.noise_multiplier, p.sample.inner_noise_multiplier
    calibrated = z_out is None or z_in is None
    if calibrated:
        start = SampleLevelRound(sampling, 1.0, 1.0, k, m)
        target = float(p.target_epsilon or p.epsilon_budget)
        found = calibrate_sample_level(start, cfg.rounds, target, p.delta)
        z_out, z_in = found.outer_noise_multiplier, found.inner_noise_multiplier
        if resumed_z is not None and resumed_z != z_out:  # keep the recorded z_out (ratio kept)
            z_in, z_out = z_in * resumed_z / z_out, resumed_z
    assert z_out is not None and z_in is not None
    return SampleLevelRound(sampling, float(z_in), float(z_out), k, m), calibrated


def outer_gaussian(event: SampleLevelRound) -> GaussianRound:
    """The Gaussian the server adds to the outer sum, ``z_out`` read from the recorded event.

    Its scheme is no part of the noise (the noise reads ``noise_multiplier`` alone); it is never
    spent: the ledger records ``event`` itself.
    """
    return GaussianRound(FlatPoissonScheme(event.sampling.example_rate),
                         event.outer_noise_multiplier)  # fmt: skip


def support_normaliser(cfg: Config) -> int:
    """The public divisor of an inner step: the nominal support size ``ways x shots``."""
    return cfg.dataset.ways * cfg.dataset.shots


def sample_normaliser(cfg: Config) -> float:
    """The public divisor of the noisy outer sum (module docstring)."""
    if cfg.privacy.normaliser is not None:
        return float(cfg.privacy.normaliser)
    s, ds = cfg.privacy.sample, cfg.dataset
    return float(cfg.n1 * s.max_appearances * s.tasks_per_pass * ds.ways * ds.query)


def client_sample(cfg: Config, event: SampleLevelRound) -> ClientSampleLevel:
    """What a participant needs of the round: the slot rule and the inner loop's constants."""
    ds, s = cfg.dataset, cfg.privacy.sample
    return ClientSampleLevel(
        example_rate=event.sampling.example_rate,
        max_appearances=event.max_appearances,
        tasks_per_pass=s.tasks_per_pass,
        support_share=ds.shots / (ds.shots + ds.query),
        inner_clip=s.inner_clip,
        inner_noise_multiplier=event.inner_noise_multiplier,
        support_normaliser=support_normaliser(cfg),
        insecure_test_seed=cfg.privacy.insecure_test_seed,
    )


class ParticipantSampler:
    """Stage 1 alone: ``n1`` of the eligible participants, each sent no task ids.

    The participants draw their examples themselves (module docstring); the result has the shape
    of ``TwoStageSampler.sample``'s (every sampled participant, an empty task list).
    """

    def __init__(self, scheme: TwoStagePoissonScheme, source: RandomSource) -> None:
        """Draw ``scheme.participants_per_round`` participants from ``source``."""
        self.scheme = scheme
        self._source = source

    def sample(self, task_counts: Mapping[str, int]) -> dict[str, list[int]]:
        """``n1`` of the available participants (sorted ids: independent of dict order)."""
        ids = sorted(task_counts)
        n1 = self.scheme.participants_per_round
        if len(ids) < n1:
            raise ValueError(f"task_counts must list at least participants_per_round ({n1}) "
                             f"available participants; got {len(ids)}")  # fmt: skip
        return {ids[i]: [] for i in sorted(sample_without_replacement(self._source, len(ids), n1))}

    def check_task_counts(self, task_counts: Mapping[str, int]) -> None:
        """Nothing to check: no task is sampled at sample level."""



def round_sampler(
    level: str | None, scheme: TwoStagePoissonScheme | TwoStageFixedScheme, source: RandomSource
) -> TwoStageSampler | ParticipantSampler:
    """A round's sampler: stage 1 alone at sample level, else both stages over ``scheme``."""
    if level == "sample" and isinstance(scheme, TwoStagePoissonScheme):
        return ParticipantSampler(scheme, source)
    return TwoStageSampler(scheme, source)


def level_label(event: object) -> str:
    """How the plan and summary name a run's epsilon: ``task-level`` or ``example-level``."""
    return "example-level" if isinstance(event, SampleLevelRound) else "task-level"


def sample_plan_lines(event: object, cfg: Config) -> list[str]:
    """The printed plan's sample-level lines (none at task level): configuration and the event."""
    if not isinstance(event, SampleLevelRound):
        return []
    s = cfg.privacy.sample
    return [
        f"sample level (DP-MAML Algorithm 2, first order): example rate q = "
        f"{event.sampling.example_rate:g}, at most m = {event.max_appearances} slots per example "
        f"a round, {s.tasks_per_pass} task(s) a pass",
        f"inner loop: K = {event.inner_steps} DP-SGD steps, per-example clip C_in = "
        f"{s.inner_clip:g}, z_in = {event.inner_noise_multiplier:.4f}; outer: per-example clip "
        f"C_out = privacy.clip, z_out = z below",
    ]


def sample_summary(level: str | None, event: object, cfg: Config) -> dict[str, Any]:
    """``summary.json``'s ``level`` (None: a non-private run) and a sample-level run's constants.

    All of them configuration, or calibrated from it and the registered population (public).
    """
    if not isinstance(event, SampleLevelRound):
        return {"level": level, "sample_level": None}
    return {"level": level, "sample_level": {
        "example_rate": event.sampling.example_rate, "max_appearances": event.max_appearances,
        "tasks_per_pass": cfg.privacy.sample.tasks_per_pass, "inner_steps": event.inner_steps,
        "inner_clip": cfg.privacy.sample.inner_clip,
        "inner_noise_multiplier": event.inner_noise_multiplier,
        "outer_noise_multiplier": event.outer_noise_multiplier, "order": event.order,
        "support_normaliser": support_normaliser(cfg),
    }}  # fmt: skip
