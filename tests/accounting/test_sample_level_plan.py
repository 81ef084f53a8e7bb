"""``fedmeta privacy plan --level sample`` (issue 53): calibrated rows, the inner cap, the ranking.

Every row is calibrated with the valid example-level bound (sample_level_bound.py), so it meets
the budget; rows whose inner noise exceeds the cap are dropped with a note; the rest are ranked by
the outer noise on the averaged gradient over sqrt(rounds) (docs/privacy.md, "Planning commands").
Flags of the other level are one line naming the flag, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math

import pytest

from fedmeta.accounting.sample_level import ExampleSampling, SampleLevelRound
from fedmeta.accounting.sample_level_bound import calibrate_sample_level, sample_level_epsilon
from fedmeta.accounting.sample_level_plan import SamplePlanRequest, plan_sample_level
from fedmeta.cli import privacy

EPS, DELTA, P, N, K, M = 2.0, 1e-5, 20, 400, 2, 1


def _request(**changes: object) -> SamplePlanRequest:
    fields: dict[str, object] = {
        "epsilon": EPS, "delta": DELTA, "participants": P, "examples_per_participant": N,
        "inner_steps": K, "max_appearances": M, "example_rates": (0.1, 0.4),
        "participants_per_round": (5,), "rounds": (20,), "max_inner_noise_multiplier": 100.0,
    }  # fmt: skip
    return SamplePlanRequest(**{**fields, **changes})  # type: ignore[arg-type]


@pytest.mark.integration
def test_rows_are_calibrated_to_the_budget_and_ranked_by_outer_noise_over_sqrt_rounds() -> None:
    result = plan_sample_level(_request(clip=2.0))
    assert len(result.rows) == 2 and result.notes == ()
    for row in result.rows:
        q = row.event.sampling.example_rate
        alone = calibrate_sample_level(
            SampleLevelRound(ExampleSampling(P, 5, q), 1.0, 1.0, K, M), 20, EPS, DELTA
        )
        assert row.event == alone  # the accountant's calibration, nothing of the planner's own
        assert row.epsilon == pytest.approx(sample_level_epsilon(alone, 20, DELTA), rel=1e-12)
        assert row.epsilon <= EPS * (1 + 1e-9)
        assert row.expected_examples == pytest.approx(5 * N * q)
        assert row.noise_std == pytest.approx(alone.outer_noise_multiplier * 2.0 / (5 * N * q))
        assert row.proxy == pytest.approx(row.noise_std / math.sqrt(20))
    assert [r.proxy for r in result.rows] == sorted(r.proxy for r in result.rows)
    # A larger rate needs more noise (less amplification) yet averages over a larger lot.
    low, high = sorted(result.rows, key=lambda r: r.event.sampling.example_rate)
    assert high.event.inner_noise_multiplier > low.event.inner_noise_multiplier


@pytest.mark.integration
def test_the_inner_noise_cap_drops_rows_with_a_note() -> None:
    free = plan_sample_level(_request())
    noisiest = max(r.event.inner_noise_multiplier for r in free.rows)
    capped = plan_sample_level(_request(max_inner_noise_multiplier=noisiest * 0.999))
    assert len(capped.rows) == 1 and capped.rows[0].event.inner_noise_multiplier < noisiest
    (note,) = capped.notes
    assert "z_in" in note and "--max-inner-noise-multiplier" in note


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "field"),
    [({"example_rates": (0.0,)}, "example_rates"), ({"participants_per_round": (21,)},
     "participants_per_round"), ({"rounds": ()}, "rounds"), ({"inner_steps": 0}, "inner_steps"),
     ({"max_inner_noise_multiplier": -1.0}, "max_inner_noise_multiplier"),
     ({"delta": 1.0}, "delta")],
)  # fmt: skip
def test_a_bad_request_names_its_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} must"):
        _request(**change)


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fedmeta")
    privacy.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["privacy", "plan", *argv])
    return int(args.func(args))


SAMPLE = ["--level", "sample", "--epsilon", "2", "--participants", "20",
          "--examples-per-participant", "400", "--inner-steps", "2", "--max-appearances", "1",
          "--max-inner-noise-multiplier", "100", "--rounds", "20"]  # fmt: skip


@pytest.mark.integration
def test_the_command_prints_the_accountants_rows(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*SAMPLE, "--example-rate", "0.1", "--participants-per-round", "5", "--json"]
    assert _cli(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["level"] == "sample" and out["delta"] == 1e-5 and out["notes"] == []
    (row,) = out["rows"]
    event = SampleLevelRound.from_dict(row["event"])
    expected = calibrate_sample_level(
        SampleLevelRound(ExampleSampling(20, 5, 0.1), 1.0, 1.0, 2, 1), 20, 2.0, 1e-5
    )
    assert event == expected and row["rounds"] == 20 and row["epsilon"] <= 2.0 * (1 + 1e-9)
    assert _cli([*SAMPLE, "--example-rate", "0.1", "--participants-per-round", "5"]) == 0
    text = capsys.readouterr().out
    assert "n1/P 5/20" in text and "ranked by" in text


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "flag"),
    [([*SAMPLE, "--example-rate", "0.1", "--tasks-per-participant", "5"],
      "--tasks-per-participant"),
     ([*SAMPLE, "--example-rate", "0.1", "--write-config", "x.toml"], "--write-config"),
     ([*SAMPLE], "--example-rate"),
     ([*SAMPLE, "--example-rate", "0.1,x"], "--example-rate"),
     (["--epsilon", "2", "--participants", "20", "--tasks-per-participant", "5",
       "--example-rate", "0.1"], "--example-rate")],
)  # fmt: skip
def test_a_flag_of_the_other_level_or_a_missing_one_is_one_line(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedmeta privacy plan: error:") and flag in err
    assert len(err.splitlines()) == 1
