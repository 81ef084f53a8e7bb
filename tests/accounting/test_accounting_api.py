"""Schemes, the sampler, import isolation and the CLI."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from fedmeta.accounting import (
    BudgetLedger,
    FixedSizeScheme,
    FlatPoissonScheme,
    GaussianRound,
    InsecureSeededSource,
    TwoStageFixedScheme,
    TwoStagePoissonScheme,
    TwoStageSampler,
    epsilon,
)
from fedmeta.cli import arguments, ledger, privacy

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: TwoStagePoissonScheme(10, 11, 0.1),
            "participants_per_round must be <= participants",
        ),
        (
            lambda: TwoStagePoissonScheme(10, 2, 1.5),
            "task_rate must be a number in \\(0, 1\\]; got 1.5",
        ),
        (lambda: TwoStagePoissonScheme(0, 0, 0.1), "participants must be an integer >= 1; got 0"),
        (lambda: TwoStageFixedScheme(10, 2, 6, 5), "tasks_per_round must be <= min_tasks"),
        (lambda: FlatPoissonScheme(0.0), "rate must be a number in \\(0, 1\\]; got 0.0"),
        (lambda: FixedSizeScheme(5, 4), "sample_size must be <= population"),
        (lambda: GaussianRound(FlatPoissonScheme(0.1), -1.0), "noise_multiplier must be"),
        (lambda: GaussianRound(FlatPoissonScheme(0.1), float("nan")), "noise_multiplier must be"),
        (lambda: TwoStagePoissonScheme(True, 1, 0.1), "participants must be an integer"),
    ],
)
def test_validation_names_the_field(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]


@pytest.mark.unit
def test_round_round_trips_and_is_frozen() -> None:
    event = GaussianRound(TwoStageFixedScheme(10, 2, 3, 5), 1.3, 4)
    assert GaussianRound.from_dict(json.loads(json.dumps(event.to_dict()))) == event
    with pytest.raises(AttributeError):
        event.noise_multiplier = 2.0  # type: ignore[misc]


@pytest.mark.unit
def test_contract_no_rounds_is_zero_and_units() -> None:
    assert epsilon([], 1e-6) == 0.0
    with pytest.raises(ValueError, match="max_tasks_per_participant must be set"):
        epsilon([(GaussianRound(TwoStagePoissonScheme(10, 2, 0.5), 1.0), 1)], 1e-6, "participant")
    with pytest.raises(ValueError, match="unit must be 'task' for single-stage"):
        epsilon([(GaussianRound(FlatPoissonScheme(0.5), 1.0), 1)], 1e-6, "participant")
    with pytest.raises(ValueError, match="delta must be"):
        epsilon([], 0.0)


@pytest.mark.unit
def test_sampler_runs_the_scheme() -> None:
    scheme = TwoStageFixedScheme(
        participants=5, participants_per_round=2, tasks_per_round=3, min_tasks=4
    )
    counts = {f"p{i}": 4 + i for i in range(5)}
    sampler = TwoStageSampler(scheme, InsecureSeededSource(1))  # test seed
    seen: Counter[str] = Counter()
    for _ in range(2000):
        out = sampler.sample(counts)
        assert len(out) == 2
        for pid, tasks in out.items():
            assert tasks == sorted(set(tasks)) and len(tasks) == 3
            assert all(0 <= t < counts[pid] for t in tasks)
            seen[pid] += 1
    for pid in counts:  # stage 1 is uniform: 2/5 of the rounds each
        assert seen[pid] / 2000 == pytest.approx(0.4, abs=0.05)
    with pytest.raises(ValueError, match="min_tasks"):
        sampler.check_task_counts({"small": 3})
    with pytest.raises(ValueError, match="at least participants_per_round"):
        sampler.sample({"only": 5})


@pytest.mark.unit
def test_sampler_poisson_rate() -> None:
    scheme = TwoStagePoissonScheme(participants=3, participants_per_round=3, task_rate=0.3)
    sampler = TwoStageSampler(scheme, InsecureSeededSource(7))  # test seed
    total = sum(
        len(t) for _ in range(500) for t in sampler.sample({"a": 10, "b": 10, "c": 10}).values()
    )
    assert total / (500 * 30) == pytest.approx(0.3, abs=0.02)


@pytest.mark.integration
def test_import_loads_no_torch_flwr_or_prometheus() -> None:
    code = (
        "import sys, fedmeta.accounting, fedmeta.cli.privacy, fedmeta.cli.ledger\n"
        "import fedmeta.accounting.sampler, fedmeta.accounting.randomness\n"
        "import fedmeta.accounting.tuning\n"
        "bad = [m for m in ('torch', 'flwr', 'prometheus_client') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fedmeta")
    sub = parser.add_subparsers(dest="command")
    privacy.register(sub)
    ledger.register(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


TWO_STAGE = [
    "--participants",
    "100",
    "--participants-per-round",
    "10",
    "--noise-multiplier",
    "1.0",
    "--rounds",
    "2000",
    "--delta",
    "1e-6",
]


@pytest.mark.integration
def test_cli_epsilon_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["privacy", "epsilon", *TWO_STAGE, "--task-rate", "0.1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["epsilon"] == pytest.approx(11.35, rel=0.01)
    assert out["epsilon_rdp"] >= out["epsilon"]
    assert out["delta"] == 1e-6
    assert out["epsilon_tombs2022_published"] == pytest.approx(2.96, rel=0.01)
    assert (
        _cli(["privacy", "epsilon", *TWO_STAGE, "--tasks-per-round", "5", "--min-tasks", "50"]) == 0
    )
    assert "51.0" in capsys.readouterr().out


@pytest.mark.integration
def test_cli_calibrate_and_max_rounds(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        _cli(
            [
                "privacy",
                "calibrate",
                "--flat-poisson-rate",
                "0.01",
                "--rounds",
                "2000",
                "--delta",
                "1e-6",
                "--target-epsilon",
                "1.5",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["noise_multiplier"] == pytest.approx(1.51, rel=0.01)
    assert (
        _cli(
            [
                "privacy",
                "max-rounds",
                "--flat-poisson-rate",
                "0.01",
                "--noise-multiplier",
                "1",
                "--delta",
                "1e-6",
                "--epsilon",
                "1.0",
                "--json",
            ]
        )
        == 0
    )
    rounds = json.loads(capsys.readouterr().out)["rounds"]
    event = GaussianRound(FlatPoissonScheme(0.01), 1.0)
    assert epsilon([(event, rounds)], 1e-6) <= 1.0 < epsilon([(event, rounds + 1)], 1e-6)


@pytest.mark.integration
def test_cli_compare_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "privacy",
        "compare",
        "--participants",
        "100",
        "--participants-per-round",
        "10",
        "--tasks-per-round",
        "5",
        "--min-tasks",
        "50",
        "--noise-multiplier",
        "1",
        "--rounds",
        "200",
        "--json",
    ]
    assert _cli(argv) == 0
    designs = json.loads(capsys.readouterr().out)["designs"]
    assert len(designs) == 5
    assert [d["valid"] for d in designs] == [True, True, True, True, False]
    assert "not a valid guarantee" in designs[-1]["design"]


@pytest.mark.integration
def test_cli_neighbouring_is_a_flag_and_printed(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["privacy", "epsilon", *TWO_STAGE, "--tasks-per-round", "5", "--min-tasks", "50"]
    assert _cli([*base, "--neighbouring", "replace_one", "--json"]) == 0
    replace = json.loads(capsys.readouterr().out)
    assert replace["neighbouring"] == "replace_one"
    assert "epsilon_tombs2022_published" not in replace  # an add/remove statement
    assert _cli([*base, "--json"]) == 0
    default = json.loads(capsys.readouterr().out)
    assert default["neighbouring"] == "add_remove"
    assert replace["epsilon"] > default["epsilon"]
    assert _cli([*base, "--neighbouring", "replace_one"]) == 0
    assert "replace_one" in capsys.readouterr().out
    compare = ["privacy", "compare", *TWO_STAGE, "--tasks-per-round", "5", "--min-tasks", "50"]
    assert _cli([*compare, "--rounds", "50", "--neighbouring", "replace_one", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["neighbouring"] == "replace_one" and all(d["valid"] for d in out["designs"])


@pytest.mark.unit
def test_cli_default_delta_is_the_configurations(capsys: pytest.CaptureFixture[str]) -> None:
    from fedmeta.config_privacy import PrivacyConfig

    assert arguments.DEFAULT_DELTA == PrivacyConfig().delta
    argv = ["privacy", "epsilon", "--flat-poisson-rate", "0.01", "--noise-multiplier", "1"]
    assert _cli([*argv, "--rounds", "10", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["delta"] == PrivacyConfig().delta


@pytest.mark.integration
def test_cli_max_rounds_says_where_the_range_ends(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["privacy", "max-rounds", "--flat-poisson-rate", "0.0001", "--noise-multiplier", "50"]
    assert _cli([*argv, "--epsilon", "1000"]) == 0
    assert "1000000000 or more (the accountant's range ends at 1000000000)" in (
        capsys.readouterr().out
    )


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["privacy", "epsilon", *TWO_STAGE, "--task-rate", "1.5"], "--task-rate"),
        (["privacy", "epsilon", *TWO_STAGE], "--task-rate"),
        (["privacy", "epsilon", *TWO_STAGE, "--tasks-per-round", "5"], "--min-tasks"),
        (
            [
                "privacy",
                "epsilon",
                "--flat-poisson-rate",
                "0.1",
                "--noise-multiplier",
                "-1",
                "--rounds",
                "3",
            ],
            "--noise-multiplier",
        ),
        (
            [
                "privacy",
                "epsilon",
                "--flat-poisson-rate",
                "0.1",
                "--noise-multiplier",
                "1",
                "--rounds",
                "3",
                "--delta",
                "2",
            ],
            "--delta",
        ),
        (["ledger", "show", "--db", "/nonexistent/ledger.db"], "no ledger"),
        (
            ["privacy", "epsilon", "--flat-poisson-rate", "0.1", "--noise-multiplier", "1"]
            + ["--rounds", "2000000000"],
            "--rounds must be an integer in [1, 1000000000]",
        ),
        (
            ["privacy", "epsilon", "--flat-poisson-rate", "0.1", "--noise-multiplier", "1e-5"]
            + ["--rounds", "3"],
            "--noise-multiplier: noise_multiplier must be in [0.0001, 1e+06]",
        ),
        (
            ["privacy", "calibrate", "--flat-poisson-rate", "1", "--rounds", "1000000000"]
            + ["--target-epsilon", "0.001"],
            "--epsilon: target_epsilon must be reachable",
        ),
    ],
)
def test_cli_bad_input_exit_2_names_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _cli(argv) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err


@pytest.mark.integration
def test_cli_ledger_show_and_console_script(tmp_path: Path) -> None:
    db = tmp_path / "l.db"
    event = GaussianRound(FlatPoissonScheme(0.01), 1.0)
    with BudgetLedger.open(db, "fed", 5.0, 1e-6) as ledger:
        for i in range(3):
            ledger.spend(event, "run-1", i)
    result = subprocess.run(
        [sys.executable, "-m", "fedmeta.cli", "ledger", "show", "--db", str(db), "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    out = json.loads(result.stdout)["federations"][0]
    assert out["records"] == 3 and out["runs"]["run-1"]["spends"] == 3
    assert out["epsilon"] == pytest.approx(epsilon([(event, 3)], 1e-6))
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedmeta.cli",
            "privacy",
            "epsilon",
            "--flat-poisson-rate",
            "7",
            "--noise-multiplier",
            "1",
            "--rounds",
            "3",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "--flat-poisson-rate" in bad.stderr
    assert "Traceback" not in bad.stderr
