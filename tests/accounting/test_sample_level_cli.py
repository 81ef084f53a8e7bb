"""``fedmeta privacy epsilon|calibrate|max-rounds --level sample`` (issue 53), through the CLI.

Each command prints the valid example-level epsilon of the accountant (sample_level_bound.py)
and, beside it, DP-MAML's own reading labelled NOT A GUARANTEE; a bad parameter or a flag of the
other level is one line naming the flag, exit status 2.
"""

from __future__ import annotations

import argparse
import json

import pytest

from fedmeta.accounting.dpmaml_reading import (
    NOT_A_GUARANTEE,
    dpmaml_moments_epsilon,
    dpmaml_per_update_epsilon,
)
from fedmeta.accounting.sample_level import ExampleSampling, SampleLevelRound
from fedmeta.accounting.sample_level_bound import (
    calibrate_sample_level,
    sample_level_epsilon,
    sample_level_max_rounds,
)
from fedmeta.cli import privacy

SAMPLE = ["--level", "sample", "--example-rate", "0.01", "--inner-steps", "2",
          "--max-appearances", "2"]  # fmt: skip
NOISE = ["--inner-noise-multiplier", "3", "--outer-noise-multiplier", "4"]
EVENT = SampleLevelRound(ExampleSampling(1, 1, 0.01), 3.0, 4.0, 2, 2)
READING = ["--dpmaml-tasks-per-lot", "10", "--dpmaml-tasks", "400000"]


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fedmeta")
    privacy.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.func(args))


def _json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert _cli([*argv, "--json"]) == 0
    out: dict[str, object] = json.loads(capsys.readouterr().out)
    return out


@pytest.mark.integration
def test_epsilon_is_the_accountants_beside_dpmamls_reading(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["privacy", "epsilon", *SAMPLE, *NOISE, "--rounds", "500", *READING]
    out = _json(argv, capsys)
    assert out["level"] == "sample" and out["neighbouring"] == "add_remove"
    assert SampleLevelRound.from_dict(out["event"]) == EVENT  # type: ignore[arg-type]
    assert out["epsilon"] == pytest.approx(sample_level_epsilon(EVENT, 500, 1e-5), rel=1e-12)
    assert out["epsilon_rdp"] == pytest.approx(
        sample_level_epsilon(EVENT, 500, 1e-5, "rdp"), rel=1e-12
    )
    reading = out["dpmaml_reading"]
    assert isinstance(reading, dict) and reading["note"] == NOT_A_GUARANTEE
    # DP-MAML's reading uses the outer noise multiplier, its one z per meta-update.
    assert reading["moments_epsilon"] == dpmaml_moments_epsilon(10, 400000, 4.0, 500, 1e-5)
    assert reading["per_update_epsilon"] == dpmaml_per_update_epsilon(10, 400000, 4.0, 500, 1e-5)
    assert _cli(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    labelled = [line for line in lines if line.startswith("DP-MAML's")]
    assert len(labelled) == 2 and all("(NOT A GUARANTEE)" in line for line in labelled)
    assert any(line.startswith("epsilon (PLD, enforced, valid)") for line in lines)


@pytest.mark.integration
def test_calibrate_and_max_rounds_are_the_accountants(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(["privacy", "calibrate", *SAMPLE, "--rounds", "300", "--epsilon", "2"], capsys)
    expected = calibrate_sample_level(EVENT, 300, 2.0, 1e-5)
    assert out["inner_noise_multiplier"] == expected.inner_noise_multiplier
    assert out["outer_noise_multiplier"] == expected.outer_noise_multiplier
    assert isinstance(out["epsilon"], float) and out["epsilon"] <= 2.0
    assert out["dpmaml_reading"] is None
    out = _json(["privacy", "max-rounds", *SAMPLE, *NOISE, "--epsilon", "1"], capsys)
    assert out["rounds"] == sample_level_max_rounds(EVENT, 1.0, 1e-5)
    assert isinstance(out["epsilon"], float) and out["epsilon"] <= 1.0


@pytest.mark.integration
def test_two_stage_example_sampling(capsys: pytest.CaptureFixture[str]) -> None:
    stage = ["--participants", "20", "--participants-per-round", "5"]
    out = _json(["privacy", "epsilon", *SAMPLE, *NOISE, *stage, "--rounds", "50"], capsys)
    event = SampleLevelRound(ExampleSampling(20, 5, 0.01), 3.0, 4.0, 2, 2)
    assert out["epsilon"] == pytest.approx(sample_level_epsilon(event, 50, 1e-5), rel=1e-12)
    assert out["sampling"] == "two-stage: 5 of 20 participants, Poisson examples q2=0.01"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["calibrate", *SAMPLE, "--rounds", "9", "--epsilon", "2", "--order", "second",
          "--query-cap", "5"], "--order: order must be 'first' to calibrate"),
        (["epsilon", *SAMPLE, *NOISE, "--rounds", "9", "--order", "second"], "--query-cap"),
        (["epsilon", *SAMPLE, "--noise-multiplier", "1", "--rounds", "9"],
         "--noise-multiplier is a task-level flag"),
        (["epsilon", *SAMPLE, *NOISE, "--flat-poisson-rate", "0.1", "--rounds", "9"],
         "--flat-poisson-rate is a task-level flag"),
        (["epsilon", "--flat-poisson-rate", "0.1", "--noise-multiplier", "1", "--inner-steps",
          "2", "--rounds", "9"], "--inner-steps is a sample-level flag; add --level sample"),
        (["epsilon", "--flat-poisson-rate", "0.1", "--rounds", "9"], "--noise-multiplier must"),
        (["epsilon", *SAMPLE, "--inner-noise-multiplier", "0", "--outer-noise-multiplier", "1",
          "--rounds", "9"], "--inner-noise-multiplier: inner_noise_multiplier must be"),
        (["epsilon", *SAMPLE, "--outer-noise-multiplier", "1", "--rounds", "9"],
         "--inner-noise-multiplier must be given"),
        (["epsilon", "--level", "sample", *NOISE, "--inner-steps", "1", "--max-appearances", "1",
          "--rounds", "9"], "--example-rate must be given"),
        (["epsilon", *SAMPLE, *NOISE, "--example-rate", "1.5", "--rounds", "9"],
         "--example-rate: example_rate must be"),
        (["epsilon", *SAMPLE, *NOISE, "--unit", "participant", "--rounds", "9"], "--unit must"),
        (["epsilon", *SAMPLE, *NOISE, "--neighbouring", "replace_one", "--rounds", "9"],
         "--neighbouring must be add_remove"),
        (["epsilon", *SAMPLE, *NOISE, "--participants", "20", "--rounds", "9"],
         "--participants and --participants-per-round must be given together"),
        (["epsilon", *SAMPLE, *NOISE, "--dpmaml-tasks", "100", "--rounds", "9"],
         "--dpmaml-tasks-per-lot and --dpmaml-tasks must be given together"),
        (["epsilon", *SAMPLE, "--inner-noise-multiplier", "1e-6", "--outer-noise-multiplier",
          "1e-6", "--rounds", "9"], "effective noise multiplier 1/mu must be"),
        (["max-rounds", *SAMPLE, *NOISE, "--epsilon", "1", "--max-appearances", "0"],
         "--max-appearances: max_appearances must be an integer >= 1"),
    ],
)  # fmt: skip
def test_bad_parameters_are_one_line_exit_2(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _cli(["privacy", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], lines
    assert lines[0].startswith(f"fedmeta privacy {argv[0]}: error: ")


@pytest.mark.unit
def test_calibrate_takes_no_noise_flags() -> None:
    with pytest.raises(SystemExit) as caught:  # argparse: unknown flag, status 2
        _cli(["privacy", "calibrate", *SAMPLE, *NOISE, "--rounds", "9", "--epsilon", "1"])
    assert caught.value.code == 2
