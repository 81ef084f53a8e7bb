"""Adaptive clipping (Andrew et al. 2021) in the server: tracking, protocol, noise, plan, resume.

The privacy of the joint release is audited in test_release_audit.py; its mathematics is tested in
tests/accounting/test_accounting_adaptive.py.
"""

from __future__ import annotations

import csv
import math
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedmeta import protocol as P
from fedmeta.accounting import GaussianRound, TwoStagePoissonScheme, gradient_noise_multiplier
from fedmeta.client.gradients import clip_bits
from fedmeta.config import ConfigError
from fedmeta.config_io import load_config
from fedmeta.server.noise import NoiseSource, noised_release
from fedmeta.server.plan import AdaptiveClipping, build_plan
from fedmeta.server.validation import REASON_BAD_SHAPE, Expectation, Rejected, validate_reply

from .release_audit import clip_trajectory

# ------------------------------------------------------------------------------ tracking


def _lognormal_population(seed: int, participants: int = 4, tasks: int = 500) -> dict[str, list]:
    """1-D task gradients whose norms are lognormal(0, 1) (median 1), with random signs."""
    rng = np.random.default_rng(seed)
    return {
        str(p): list(rng.lognormal(0.0, 1.0, tasks) * rng.choice([-1.0, 1.0], tasks))
        for p in range(participants)
    }


@pytest.mark.unit
@pytest.mark.parametrize("gamma", [0.5, 0.9])
def test_the_bound_tracks_the_target_quantile_of_task_norms(gamma: float) -> None:
    """From C_0 = 0.05 (far below the median, 1) the bound climbs and settles at the quantile.

    Expected lot 100 (4 participants, 500 tasks each, q2 = 0.05), count noise E[lot]/20 = 5,
    eta = 0.2, total z = 1: Andrew et al.'s defaults. Through the real round pipeline.
    """
    grads = _lognormal_population(seed=int(gamma * 10))
    norms = np.abs(np.concatenate([np.asarray(g) for g in grads.values()]))
    target = float(np.quantile(norms, gamma))
    event = GaussianRound(TwoStagePoissonScheme(4, 4, 0.05), 1.0)
    z_grad = gradient_noise_multiplier(1.0, 5.0)
    adaptive = AdaptiveClipping(gamma, 0.2, 5.0, z_grad, 0.05, 1e-6, 1e6)
    clips = clip_trajectory(event, grads, 250, adaptive, normaliser=100.0)
    settled = np.asarray(clips[150:])
    # The noise and the sampling come from the CSPRNG, so the settled level varies run to run: over
    # 30 runs at gamma 0.9 the log ratio had sd 0.0245 (largest 0.068). 0.12 is about 5 sd, a
    # chance under 1e-6 of failing a run that tracks; the former 0.08 (3.3 sd) failed one CI run.
    assert abs(math.log(float(np.exp(np.log(settled).mean())) / target)) < 0.12, (target, clips)
    # The share of all task norms under the settled bound is the target quantile.
    share = float(np.mean(norms[:, None] <= settled[None, :]))
    assert abs(share - gamma) < 0.03, share
    assert clips[0] == 0.05 and max(clips[:20]) < target  # it had to climb


# ------------------------------------------------------------------------------ protocol


def _reply_content(bits: object) -> RecordDict:
    import numpy as np
    from flwr.app import Array

    meta = {"version": P.PROTOCOL_VERSION, "run_id": "r", "round_id": 1, "participant_id": "p",
            "task_ids": [1, 2], "clip_bits": bits}  # fmt: skip
    return RecordDict(
        {
            P.GRADS_RECORD: ArrayRecord({"grads": Array(np.zeros((2, 3), np.float32))}),
            P.REPLY_RECORD: ConfigRecord(meta),  # type: ignore[arg-type]
        }
    )


@pytest.mark.unit
def test_clip_bits_round_trip_and_a_bad_bit_is_refused() -> None:
    reply = P.GradientReply("r", 1, "p", (1, 2), np.zeros((2, 3), np.float32), None, None, None,
                            (1, 0))  # fmt: skip
    assert P.decode_gradient_reply(P.encode_gradient_reply(reply)).clip_bits == (1, 0)
    assert P.decode_gradient_reply(_reply_content([0, 1])).clip_bits == (0, 1)
    for bad in ([2, 0], [1, -1], [True, False], [0.5, 1.0], ["1", "0"], "10"):
        with pytest.raises(P.ProtocolError, match="clip_bits") as info:
            P.decode_gradient_reply(_reply_content(bad))
        assert info.value.reason == P.REASON_BAD_DTYPE


@pytest.mark.unit
def test_the_client_bit_is_the_pre_clip_norm_under_the_bound() -> None:
    assert clip_bits(np.array([0.5, 1.0, 1.0000001, math.inf, math.nan]), 1.0) == (1, 1, 0, 0, 0)


@pytest.mark.unit
def test_a_reply_without_one_bit_per_task_is_dropped_when_clipping_adapts() -> None:
    exp = Expectation("r", 1, "p", (1, 2), 3, 1.0, P.REPLY_PER_TASK, 1e-4, clip_bits=True)
    grads = np.ones((2, 3), np.float32)
    for bits in (None, (1,), (1, 0, 1)):
        reply = P.GradientReply("r", 1, "p", (1, 2), grads, None, None, None, bits)
        result = validate_reply(reply, exp)
        assert isinstance(result, Rejected) and result.reason == REASON_BAD_SHAPE
    accepted = validate_reply(P.GradientReply("r", 1, "p", (1, 2), grads, None, None, None,
                                              (1, 0)), exp)  # fmt: skip
    assert not isinstance(accepted, Rejected) and accepted.under_clip == 1


# ------------------------------------------------------------------------------ noise and plan


@pytest.mark.unit
def test_the_joint_release_returns_the_total_event_and_splits_the_noise() -> None:
    event = GaussianRound(TwoStagePoissonScheme(4, 2, 0.5), 1.0)
    source = NoiseSource.insecure_for_tests(5)
    counts = []
    for _ in range(2000):
        out = noised_release(torch.zeros(3, dtype=torch.float64), 2.5, clip=2.0, event=event,
                             count_noise=1.0, source=source)  # fmt: skip
        counts.append(out.count)
    assert out.event is event and out.count_std == 1.0
    assert out.noise_std == pytest.approx(2.0 * 2 / math.sqrt(3), rel=1e-12)  # z_grad C
    assert np.mean(counts) == pytest.approx(2.5, abs=0.1)
    assert np.std(counts) == pytest.approx(1.0, rel=0.06)
    with pytest.raises(ValueError, match="count_noise"):
        noised_release(torch.zeros(3), 0.0, clip=1.0, event=event, count_noise=0.5, source=source)


@pytest.mark.unit
def test_the_plan_splits_the_total_z_and_names_the_field_when_it_cannot() -> None:
    base = ["federation.participants=4", "sampling.participants_per_round=2",
            "sampling.task_rate=0.5", "dataset.tasks_per_participant=40",
            "privacy.noise_multiplier=1.0", "privacy.adaptive_clipping.enabled=true"]  # fmt: skip
    counts = {str(i): 40 for i in range(4)}
    plan = build_plan(load_config(None, base), counts).privacy
    assert plan is not None
    a = plan.adaptive
    assert a is not None and plan.event.noise_multiplier == 1.0
    assert a.count_noise == pytest.approx(40 / 20)  # E[lot] = 2 * 0.5 * 40, / 20
    assert a.gradient_noise_multiplier == pytest.approx((1 - 1 / 16) ** -0.5)
    assert plan.clip == 1.0 and a.initial_clip == 1.0
    # A small lot: Andrew et al.'s E[lot] / 20 = 0.2 would exceed the round's noise; the default
    # never goes below z, so the run starts and pays at most 15.5% more gradient noise.
    small_lot = build_plan(load_config(None, [*base, "sampling.task_rate=0.05"]), counts).privacy
    assert small_lot is not None and small_lot.adaptive is not None
    assert small_lot.adaptive.count_noise == 1.0
    assert small_lot.adaptive.gradient_noise_multiplier == pytest.approx((3 / 4) ** -0.5)
    # A configured count noise too small for the calibrated z is refused, naming the field.
    calibrated = [*base[:4], "privacy.adaptive_clipping.count_noise=0.05"]
    with pytest.raises(
        ValueError, match=r"privacy\.adaptive_clipping\.count_noise must be > z / 2"
    ):
        build_plan(load_config(None, calibrated), counts)
    with pytest.raises(ConfigError, match=r"privacy\.adaptive_clipping\.count_noise"):
        load_config(None, [*base, "privacy.adaptive_clipping.count_noise=0.5"])
    with pytest.raises(ConfigError, match=r"privacy\.adaptive_clipping\.target_quantile"):
        load_config(None, [*base, "privacy.adaptive_clipping.target_quantile=1"])
    with pytest.raises(ConfigError, match=r"privacy\.adaptive_clipping\.initial_clip"):
        load_config(None, [*base, "privacy.adaptive_clipping.initial_clip=5",
                           "privacy.adaptive_clipping.max_clip=2"])  # fmt: skip
    # A non-private run clips nothing: the section is unused there, not an error.
    assert load_config(None, [*base, "privacy.enabled=false"]).privacy.adaptive_clipping.enabled
    on = build_plan(load_config(None, base[:-1]), counts).privacy
    assert on is not None and on.adaptive is not None  # on by default
    off = build_plan(load_config(None, [*base[:-1], "privacy.adaptive_clipping.enabled=false"]),
                     counts).privacy  # fmt: skip
    assert off is not None and off.adaptive is None


# ------------------------------------------------------------------------------ checkpoint, resume


@pytest.mark.integration
def test_the_bound_survives_checkpoint_and_resume_exactly(tmp_path: Path) -> None:
    """Test mode: a run stopped after 1 round and resumed equals one that ran straight through."""
    from fedmeta.server.app import execute
    from fedmeta.simulation.local_grid import InProcessGrid

    from .fakes import fake_ledger, opener
    from .test_reliability import StopAfter
    from .test_round import run, small

    cfg = small("rounds=3", "training.checkpoint_every=100", "privacy.insecure_test_seed=7",
                "privacy.adaptive_clipping.enabled=true",
                "privacy.adaptive_clipping.count_noise=1.0")  # fmt: skip
    straight = run(cfg, tmp_path / "straight", fake_ledger(100.0, 0.1))
    ledger, stop = fake_ledger(100.0, 0.1), threading.Event()
    execute(cfg, InProcessGrid(6), out_dir=tmp_path / "resumed", observers=[StopAfter(1, stop)],
            echo=False, open_ledger=opener(ledger), stop=stop)  # fmt: skip
    ckpt = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)
    assert ckpt["next_round"] == 1 and ckpt["clip"] != 1.0  # the bound moved and was saved
    resumed = run(cfg, tmp_path / "resumed", ledger, resume=True)
    assert resumed.rounds_run == 2  # rounds 2 and 3

    def clips(out: Path) -> list[str]:
        return [row["clip"] for row in csv.DictReader((out / "rounds.csv").open())]

    assert clips(tmp_path / "straight") == clips(tmp_path / "resumed")
    assert len(set(clips(tmp_path / "straight"))) == 3  # one bound per round, each released
    assert clips(tmp_path / "straight")[1] == str(ckpt["clip"])
    final = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)
    before = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=True)
    assert torch.equal(final["params"], before["params"]) and final["clip"] == before["clip"]
    assert straight.summary["adaptive_clipping"]["last_clip"] == float(
        clips(tmp_path / "straight")[-1]
    )
