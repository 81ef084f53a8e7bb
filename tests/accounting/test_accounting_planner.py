"""fedmeta.accounting.planner and `fedmeta privacy plan`: contracts, properties, the CLI."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedmeta.accounting import epsilon
from fedmeta.accounting.plan_request import (
    DESIGNS,
    Candidate,
    ComputeBudget,
    Federation,
    PlanBudget,
    PlanRequest,
    PlanRow,
    expected_lot,
)
from fedmeta.accounting.planner import _gradient_share, _Precision, design_candidate, evaluate, plan
from fedmeta.cli import privacy as privacy_cli

GRID = 1e-3  # coarser pessimistic PLD grid: still a valid bound, and fast
FAST = settings(max_examples=4, deadline=None, derandomize=True)


def tiny(eps: float = 4.0, **kw: object) -> PlanRequest:
    """Six participants of 20 tasks, 30 rounds, at most 12 tasks per round."""
    args: dict[str, object] = {
        "budget": PlanBudget(eps, 1e-5),
        "federation": Federation(6, (20,)),
        "compute": ComputeBudget(max_tasks_per_round=12),
        "rounds": (30,),
        **kw,
    }
    return PlanRequest(**args)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- unit: no calibration


@pytest.mark.unit
def test_adaptive_clipping_takes_its_share_of_the_noise() -> None:
    z, sigma_b = 1.0, 2.0
    z_grad = _gradient_share(z, sigma_b)
    assert z_grad > z
    # Andrew et al. 2021, Thm 1: gradient at z_grad plus count at sigma_b compose to z.
    assert (z_grad**-2 + (2 * sigma_b) ** -2) ** -0.5 == pytest.approx(z, rel=1e-12)
    assert _gradient_share(z, None) == z
    assert _gradient_share(z, 1e6) == pytest.approx(z, rel=1e-9)
    with pytest.raises(ValueError, match=r"adaptive_count_noise must be > z/2 = 0.5 .*; got 0.5"):
        _gradient_share(z, 0.5)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: PlanBudget(0.0, 1e-5), "epsilon must be a number in"),
        (lambda: PlanBudget(1.0, 1.0), "delta must be a number in"),
        (lambda: PlanBudget(1.0, 1e-5, "swap"), "neighbouring must be one of"),  # type: ignore[arg-type]
        (lambda: Federation(3, (5, 5)), "tasks_per_participant must hold one count or one per"),
        (lambda: Federation(3, (0,)), "tasks_per_participant must be an integer"),
        (lambda: ComputeBudget(max_tasks_per_round=0.5), "max_tasks_per_round must be"),
        (lambda: ComputeBudget(max_task_gradients=-1), "max_task_gradients must be"),
        (lambda: tiny(rounds=None), "rounds must be given unless both"),
        (
            lambda: tiny(participants_per_round=(7,)),
            "participants_per_round must be <= participants",
        ),
        (lambda: tiny(designs=("flat",)), "designs must be a non-empty subset"),
        (lambda: tiny(clip=0.0), "clip must be a number in"),
        (lambda: tiny(dimension=100), "signal_norm must be given too"),
        (lambda: tiny(signal_norm=0.5), "dimension must be given too"),
        (lambda: tiny(dimension=0, signal_norm=0.5), "dimension must be an integer in"),
        (lambda: tiny(dimension=10, signal_norm=-1.0), "signal_norm must be a number in"),
        (lambda: tiny(dimension=10, signal_norm=2.0), "signal_norm must be at most the clip"),
        (lambda: Candidate("two_stage_fixed", 2, 10, task_rate=0.1), "tasks_per_round must be set"),
    ],
)
def test_validation_names_the_field(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]


@pytest.mark.unit
def test_grids() -> None:
    req = tiny(compute=ComputeBudget(80, 24_000), rounds=None)
    assert req.rounds_grid() == (75, 150, 300, 600, 1200)  # around the knee 24000 / 80
    assert PlanRequest(PlanBudget(8, 1e-5), Federation(20, (200,)), rounds=(1,)).stage_one_grid() \
        == (20, 10, 5, 3, 2, 1)  # fmt: skip
    capped = tiny(compute=ComputeBudget(max_participants_per_round=2))
    assert capped.stage_one_grid() == (2, 1)


@pytest.mark.unit
def test_candidates_use_the_largest_lot_the_compute_allows() -> None:
    req = PlanRequest(
        PlanBudget(8, 1e-6), Federation(20, (200,)), ComputeBudget(200), rounds=(400,)
    )
    flat = design_candidate(req, "flat_poisson", 20, 400)
    assert flat is not None and flat.task_rate == 0.05 and expected_lot(flat, req.federation) == 200
    assert design_candidate(req, "flat_poisson", 5, 400) is None  # flat contacts everyone
    assert design_candidate(req, "two_stage_poisson", 20, 400) is None
    five = design_candidate(req, "two_stage_poisson", 5, 400)
    assert five is not None and five.task_rate == 0.2
    fixed = design_candidate(req, "two_stage_fixed", 3, 400)
    assert fixed is not None and fixed.tasks_per_round == 66  # 198 <= 200: rounded down
    uneven = Federation(3, (10, 20, 30))
    assert uneven.min_tasks == 10 and uneven.total_tasks == 60 and not uneven.uniform


@pytest.mark.unit
@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    participants=st.integers(1, 50),
    tasks=st.integers(1, 500),
    lot_cap=st.one_of(st.none(), st.floats(1, 5000)),
    gradients=st.one_of(st.none(), st.floats(1, 1e6)),
    rounds=st.integers(1, 5000),
    design=st.sampled_from(DESIGNS),
    n1_fraction=st.floats(0, 1),
)
def test_compute_caps_are_respected(
    participants: int,
    tasks: int,
    lot_cap: float | None,
    gradients: float | None,
    rounds: int,
    design: str,
    n1_fraction: float,
) -> None:
    req = tiny(federation=Federation(participants, (tasks,)),
               compute=ComputeBudget(lot_cap, gradients), rounds=(rounds,))  # fmt: skip
    n1 = max(1, round(n1_fraction * participants))
    c = design_candidate(req, design, n1, rounds)  # type: ignore[arg-type]
    if c is None:
        return
    lot = expected_lot(c, req.federation)
    assert lot <= (lot_cap or math.inf) * (1 + 1e-9)
    assert rounds * lot <= (gradients or math.inf) * (1 + 1e-9)
    assert lot <= participants * tasks * (1 + 1e-9)
    if c.tasks_per_round is not None:
        assert c.tasks_per_round <= tasks
    else:
        assert c.task_rate is not None and 0 < c.task_rate <= 1


# ------------------------------------------------------------------------ integration: calibration


@pytest.mark.integration
def test_rows_agree_with_the_accountant() -> None:
    """Each row meets the budget under the enforced accountant, and 0.1% less noise does not."""
    req = tiny(
        participants_per_round=(6,), baseline=Candidate("two_stage_poisson", 2, 30, task_rate=0.1)
    )
    result = plan(req, top=3, discretization=GRID)
    assert result.rows and result.baseline is not None
    assert [r.proxy for r in result.rows] == sorted(r.proxy for r in result.rows)
    # Flat Poisson, fixed size with everyone contacted, and two-stage Poisson (the baseline).
    assert [r.candidate.design for r in result.rows] == ["flat_poisson", "two_stage_fixed"]
    for row in (*result.rows, result.baseline):
        t, z = row.candidate.rounds, row.noise_multiplier
        assert epsilon([(row.event, t)], 1e-5, discretization=GRID) <= 4.0
        less = type(row.event)(
            row.event.scheme, z * (1 - 1e-3), row.event.max_tasks_per_participant
        )
        assert epsilon([(less, t)], 1e-5, discretization=GRID) > 4.0
        assert row.expected_lot <= 12 and row.noise_std == pytest.approx(z / row.expected_lot)


@pytest.mark.integration
def test_adaptive_clipping_cost_is_shown_and_infeasible_count_noise_is_named() -> None:
    req = tiny(designs=("flat_poisson",), adaptive_count_noise=1.0)
    row = plan(req, discretization=GRID).rows[0]
    assert row.gradient_noise_multiplier > row.noise_multiplier
    assert row.noise_std == pytest.approx(row.gradient_noise_multiplier / row.expected_lot)
    with pytest.raises(ValueError, match="adaptive_count_noise must be > z/2"):
        plan(tiny(designs=("flat_poisson",), adaptive_count_noise=0.05), discretization=GRID)


@pytest.mark.integration
@FAST
@given(eps=st.sampled_from([1.0, 2.0, 4.0]), more=st.sampled_from([1.0, 1.5, 4.0]))
def test_more_budget_never_makes_the_best_noise_worse(eps: float, more: float) -> None:
    def best(e: float) -> float:
        return plan(tiny(e, designs=("flat_poisson",)), discretization=GRID).rows[0].noise_std

    # Calibration is to 0.1% (rounded up): equal budgets may differ by that much.
    assert best(eps * more) <= best(eps) * (1 + 2e-3)


@pytest.mark.integration
def test_the_compute_budget_caps_every_row_of_a_searched_plan() -> None:
    req = tiny(compute=ComputeBudget(12, 360), rounds=None, designs=("flat_poisson",))
    rows = plan(req, top=5, discretization=GRID).rows
    assert rows
    for row in rows:
        assert row.expected_lot <= 12 + 1e-9 and row.task_gradients <= 360 + 1e-6


# ---------------------------------------------------------------------------------------- CLI


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """The command as users run it: fedmeta's dispatcher, which makes usage errors one line."""
    from fedmeta.cli import main

    try:
        code = main(argv)
    except SystemExit as stopped:
        code = int(stopped.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


PLAN = ["privacy", "plan", "--epsilon", "4", "--participants", "6", "--tasks-per-participant",
        "20", "--max-tasks-per-round", "12", "--jobs", "1"]  # fmt: skip


@pytest.mark.unit
@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--rounds", "30", "--epsilon", "-1"], "--epsilon: must be in (0, 1000]"),
        (["--rounds", "3x"], "--rounds must be integers separated by commas; got '3x'"),
        ([], "--rounds: rounds must be given unless both max_tasks_per_round"),
        (["--rounds", "30", "--participants-per-round", "9"], "--participants-per-round: "),
        (["--rounds", "30", "--tasks-per-participant", "5,5"], "--tasks-per-participant: "),
        (["--rounds", "30", "--delta", "2"], "--delta: delta must be"),
        (["--rounds", "30", "--designs", "flat"], "--designs: designs must be"),
        (["--rounds", "30", "--baseline", "n=3"], "--baseline must be key=value pairs"),
        (["--rounds", "30", "--base-config", "x.toml"], "--base-config must come with"),
        (["--rounds", "30", "--top", "0"], "--top: top must be an integer"),
        (["--rounds", "30", "--dimension", "10"], "--signal-norm: signal_norm must be given"),
        (["--rounds", "30", "--signal-norm", "0.5"], "--dimension: dimension must be given"),
        (["--rounds", "30", "--dimension", "0", "--signal-norm", "0.5"], "--dimension: "),
        (["--rounds", "30", "--dimension", "9", "--signal-norm", "nan"], "--signal-norm: "),
        (["--rounds", "30", "--dimension", "9", "--signal-norm", "1.5"], "--signal-norm: "),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(
    extra: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli([*PLAN, *extra], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("fedmeta privacy plan: error: ")
    assert expected in err


@pytest.mark.unit
def test_write_config_needs_fedmeta(capsys: pytest.CaptureFixture[str]) -> None:
    """The privacy commands registered without a configuration writer cannot write a config."""
    parser = argparse.ArgumentParser(prog="fedmeta")
    privacy_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args([*PLAN, "--rounds", "30", "--write-config", "x.toml"])
    assert int(args.func(args)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--write-config must be run as" in err


@pytest.mark.integration
def test_cli_table_and_json_agree(capsys: pytest.CaptureFixture[str]) -> None:
    args = [*PLAN, "--rounds", "30", "--designs", "flat_poisson,two_stage_poisson",
            "--participants-per-round", "6,3",
            "--baseline", "participants_per_round=3,task_rate=0.1"]  # fmt: skip
    code, table, _ = run_cli(args, capsys)
    assert code == 0
    lines = table.splitlines()
    assert lines[0].startswith("budget: epsilon 4, delta 1e-05, add_remove; federation: 6")
    assert "all participants, Poisson" in lines[3] and lines[3].startswith("1 ")
    assert lines[5].startswith("base ")
    code, text, _ = run_cli([*args, "--json"], capsys)
    data = json.loads(text)
    first = data["rows"][0]
    assert first["design"] == "flat_poisson" and first["participants_per_round"] == 6
    assert first["task_rate"] == 0.1 and first["expected_lot"] == pytest.approx(12)
    assert f"{first['noise_multiplier']:.4f}" in lines[3]
    assert data["baseline"]["noise_vs_baseline"] == 1.0
    assert first["noise_vs_baseline"] > 1.0
    assert first["epsilon"] <= 4.0


@pytest.mark.integration
def test_cli_shows_adaptive_clippings_share(capsys: pytest.CaptureFixture[str]) -> None:
    args = [*PLAN, "--rounds", "30", "--designs", "flat_poisson", "--adaptive-count-noise", "1"]
    code, table, _ = run_cli(args, capsys)
    assert code == 0 and " z_grad " in table.splitlines()[2]
    code, text, _ = run_cli([*args, "--json"], capsys)
    row = json.loads(text)["rows"][0]
    assert row["gradient_noise_multiplier"] > row["noise_multiplier"]
    assert row["noise_std"] == pytest.approx(row["gradient_noise_multiplier"] / row["expected_lot"])
    code, _, err = run_cli([*args[:-1], "0.05"], capsys)
    # Off a terminal the planner may report a finished stage first; the error is one line.
    assert code == 2
    assert err.splitlines()[-1].startswith("fedmeta privacy plan: error: --adaptive-count-noise: ")


# ------------------------------------------------------------------ the signal-to-noise proxy


def _row(req: PlanRequest, rounds: int, q: float) -> PlanRow:
    row = evaluate(req, Candidate("flat_poisson", 6, rounds, task_rate=q), _Precision("pld", GRID,
                   True))  # fmt: skip
    assert isinstance(row, PlanRow)
    return row


@pytest.mark.integration
def test_snr_is_its_formula_and_without_signal_nothing_changes() -> None:
    plain = _row(tiny(), 30, 0.1)
    assert plain.round_snr is None and plain.run_snr is None and plain.rank_key == plain.proxy
    # G = C: every clipped task gradient is the mean, no sampling term; SNR = E[lot]/(sqrt(d) z).
    row = _row(tiny(dimension=400, signal_norm=1.0), 30, 0.1)
    assert row.round_snr == pytest.approx(row.expected_lot / (20 * row.noise_multiplier))
    assert row.run_snr == pytest.approx(row.round_snr * math.sqrt(30))
    assert row.noise_multiplier == plain.noise_multiplier and row.epsilon == plain.epsilon
    half = _row(tiny(dimension=400, signal_norm=0.5), 30, 0.1)
    expected = 0.5 / math.sqrt(400 * half.noise_std**2 + (1 - 0.25) / half.expected_lot)
    assert half.round_snr == pytest.approx(expected)


@pytest.mark.integration
def test_the_sampling_term_reorders_rows_only_when_it_matters() -> None:
    """Few rounds at every task against 4x the rounds at half the rate (tiny federation, eps 4).

    The old proxy prefers the first (less noise per coordinate over sqrt(T)); with a small ``d``
    the sampling noise dominates and twice the task-gradients win; with a large ``d`` the DP
    noise dominates again and the SNR ranks as the old proxy does.
    """
    few, many = (10, 1.0), (40, 0.5)
    old = [_row(tiny(), *c) for c in (few, many)]
    assert old[0].rank_key < old[1].rank_key
    small_d = [_row(tiny(dimension=1, signal_norm=0.5), *c) for c in (few, many)]
    assert small_d[0].rank_key > small_d[1].rank_key
    large_d = [_row(tiny(dimension=10_000, signal_norm=0.5), *c) for c in (few, many)]
    assert large_d[0].rank_key < large_d[1].rank_key


@pytest.mark.integration
def test_plan_ranks_by_snr_when_given() -> None:
    req = tiny(rounds=(10, 40, 160), designs=("flat_poisson",), dimension=1, signal_norm=0.5,
               compute=ComputeBudget(max_tasks_per_round=120))  # fmt: skip
    rows = plan(req, top=3, discretization=GRID).rows
    snrs = [r.run_snr for r in rows]
    assert all(s is not None for s in snrs)
    assert snrs == sorted(snrs, reverse=True)  # type: ignore[type-var]
    assert rows[0].candidate.rounds == 160  # sampling-dominated: the most task-gradients


@pytest.mark.integration
def test_cli_shows_the_snr_columns(capsys: pytest.CaptureFixture[str]) -> None:
    args = [*PLAN, "--rounds", "30", "--designs", "flat_poisson", "--dimension", "400",
            "--signal-norm", "0.5"]  # fmt: skip
    code, table, _ = run_cli(args, capsys)
    lines = table.splitlines()
    assert code == 0 and "not a privacy quantity" in lines[1] and "SNR*sqrtT" in lines[2]
    code, text, _ = run_cli([*args, "--json"], capsys)
    data = json.loads(text)
    assert data["dimension"] == 400 and data["ranked_by"].startswith("run_snr")
    row = data["rows"][0]
    assert row["run_snr"] == pytest.approx(row["round_snr"] * math.sqrt(30))


def _die(_: int) -> str:
    os._exit(3)  # a worker that crashes without any signal


@pytest.mark.integration
def test_a_pool_broken_without_a_signal_is_still_an_error() -> None:
    """A pool broken by a crashed worker is an error, never reported as an interruption."""
    from concurrent.futures.process import BrokenProcessPool

    from fedmeta.accounting import planner

    with pytest.raises(BrokenProcessPool):
        planner._pool_map(_die, [(1,), (2,)], workers=2)


def _interrupt_parent_then_die(_: int) -> str:
    os.kill(os.getppid(), signal.SIGINT)  # the terminal's Ctrl-C reaches the parent too
    time.sleep(0.5)
    os._exit(3)  # ... and the worker dies of it


@pytest.mark.integration
def test_a_ctrl_c_whose_keyboard_interrupt_was_lost_is_still_an_interruption(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C whose KeyboardInterrupt was lost in a fork (seen in CI) is no broken pool."""
    from fedmeta.accounting import planner

    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setattr(planner, "_default_interrupt", lambda *a: None)  # the raise gets lost
    try:
        with pytest.raises(KeyboardInterrupt):
            planner._pool_map(_interrupt_parent_then_die, [(1,), (2,)], workers=2)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.unit
def test_workers_die_on_ctrl_c_only_where_the_parent_reports_it() -> None:
    """A parent that ignores SIGINT (nohup, a script's background job) keeps its workers."""
    import signal

    from fedmeta.accounting import planner

    before = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        planner._worker_init()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        planner._worker_init()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
