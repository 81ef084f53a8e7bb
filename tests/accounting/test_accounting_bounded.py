"""Bounded cost: sizes known before allocation, the ranges' ends, safe-side fallbacks, and the
array-level PLD operations checked against dp-accounting's own.

No timing assertions here: speed is measured in bench/accounting.py (docs/benchmarks.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
from dp_accounting.pld import common, pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld import privacy_loss_mechanism as plm
from scipy import fft as scipy_fft

from fedmeta.accounting import (
    FixedSizeScheme,
    FlatPoissonScheme,
    GaussianRound,
    TwoStageFixedScheme,
    TwoStagePoissonScheme,
    calibrate_noise_multiplier,
    composed_pld,
    epsilon,
    max_rounds,
    pairs,
    pld_delta,
    rdp,
)
from fedmeta.accounting import composition as comp
from fedmeta.accounting import pmf as engine

REPLACE = "replace_one"


@pytest.fixture
def fft_lengths(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Record the length of every FFT the accountant runs."""
    seen: list[int] = []
    real_rfft = scipy_fft.rfft

    def rfft(x: np.ndarray, n: int | None = None) -> np.ndarray:
        seen.append(int(n if n is not None else len(x)))
        return real_rfft(x, n)

    monkeypatch.setattr(scipy_fft, "rfft", rfft)  # the accountant imports scipy.fft when it runs
    yield seen


def _clear_caches() -> None:
    for cached in (engine._round_pmfs, engine._window, engine._window_size, engine._composed_on):
        cached.cache_clear()


# ------------------------------------------------------------------- the reported failures


@pytest.mark.unit
@pytest.mark.parametrize(
    ("event", "rounds"),
    [
        # `fedmeta privacy epsilon ... --rounds 1000000000` tried to allocate 30.9 GiB.
        (GaussianRound(FlatPoissonScheme(0.01), 1.0), 10**9),
        (GaussianRound(TwoStagePoissonScheme(100, 10, 0.1), 5.0), 10**9),
        (GaussianRound(TwoStageFixedScheme(100, 10, 5, 50), 0.1, None, REPLACE), 10**9),
        (GaussianRound(FixedSizeScheme(1600, 400_000), 100.0, None, REPLACE), 10**9),
    ],
)
@pytest.mark.integration
def test_a_billion_rounds_stay_within_the_size_limits(
    event: GaussianRound, rounds: int, fft_lengths: list[int]
) -> None:
    _clear_caches()
    value = epsilon([(event, rounds)], 1e-5)
    assert value > 0  # a number (possibly inf: no finite bound), never an exception
    assert value <= epsilon([(event, rounds)], 1e-5, method="rdp")
    limit = scipy_fft.next_fast_len(engine.MAX_PLD_BINS, real=True)
    assert all(n <= limit for n in fft_lengths), max(fft_lengths, default=0)


@pytest.mark.integration
def test_max_rounds_with_a_large_budget_is_exact_or_at_the_limit() -> None:
    # `--set privacy.epsilon_budget=1000 --set privacy.noise_multiplier=5` died with MemoryError.
    event = GaussianRound(TwoStagePoissonScheme(100, 10, 0.1), 5.0)
    rounds = max_rounds(event, 1000.0, 1e-5)
    assert 0 < rounds <= comp.MAX_ROUNDS_LIMIT
    if rounds < comp.MAX_ROUNDS_LIMIT:
        assert epsilon([(event, rounds)], 1e-5) <= 1000.0 < epsilon([(event, rounds + 1)], 1e-5)
    # The same query for a cheap event lands on the range's end.
    cheap = GaussianRound(FlatPoissonScheme(1e-4), 50.0)
    assert max_rounds(cheap, 1000.0, 1e-5) == comp.MAX_ROUNDS_LIMIT


@pytest.mark.unit
@pytest.mark.parametrize("unit", ["task", "participant"])
@pytest.mark.parametrize("relation", ["add_remove", REPLACE])
def test_tiny_noise_gives_an_answer_never_an_overflow(unit: str, relation: str) -> None:
    scheme = TwoStageFixedScheme(100, 10, 5, 50)
    event = GaussianRound(scheme, 1e-4, 1000, relation)
    value = epsilon([(event, 1000)], 1e-5, unit)
    assert value > 1e3  # (possibly inf)
    assert max_rounds(event, 10.0, 1e-5, unit) == 0
    with pytest.raises(ValueError, match="noise_multiplier must be in"):
        epsilon([(GaussianRound(scheme, 1e-5, 1000, relation), 1)], 1e-5, unit)


@pytest.mark.unit
def test_range_ends_are_one_line_errors_naming_the_field() -> None:
    event = GaussianRound(FlatPoissonScheme(0.01), 1.0)
    with pytest.raises(ValueError, match="round count must be at most 1000000000"):
        epsilon([(event, 10**9), (GaussianRound(FlatPoissonScheme(0.02), 1.0), 1)], 1e-5)
    with pytest.raises(ValueError, match="rounds must be an integer in \\[1, 1000000000\\]"):
        calibrate_noise_multiplier(FlatPoissonScheme(0.01), 2 * 10**9, 1.0, 1e-5)
    with pytest.raises(ValueError, match="target_epsilon must be reachable"):
        calibrate_noise_multiplier(FlatPoissonScheme(1.0), 10**9, 1e-9, 1e-5, method="rdp")
    with pytest.raises(ValueError, match="target_epsilon must be below"):
        calibrate_noise_multiplier(FlatPoissonScheme(1.0), 1, 1e9, 1e-5)
    with pytest.raises(ValueError, match="noise_multiplier must be in"):
        epsilon([(GaussianRound(FlatPoissonScheme(0.01), 2e6), 1)], 1e-5)


@pytest.mark.integration
def test_calibration_at_the_extremes_is_feasible() -> None:
    scheme = TwoStagePoissonScheme(100, 10, 0.1)
    for rounds, target in ((10**9, 1000.0), (1, 1000.0), (10**9, 1.0)):
        z = calibrate_noise_multiplier(scheme, rounds, target, 1e-5, relative_tolerance=1e-2)
        assert epsilon([(GaussianRound(scheme, z), rounds)], 1e-5) <= target


# ------------------------------------------------------------------------- safe side


@pytest.mark.integration
def test_a_coarser_grid_is_never_below_a_finer_one() -> None:
    # Connect-the-dots on a grid that refines another is below it at every epsilon (chords of a
    # convex curve), so coarsening to stay within the size limits only loosens the bound. That
    # holds for the exact compositions; each computed one is within [0, 3 R + TAIL_MASS] of its
    # exact one in delta (R its FFT rounding bound, composition.py), so the finer grid's value at
    # delta + 3 R + TAIL_MASS is below its exact value, hence below the coarser grid's.
    for event in (
        GaussianRound(TwoStageFixedScheme(100, 10, 5, 50), 1.0),
        GaussianRound(FixedSizeScheme(2, 20), 1.0, None, REPLACE),
    ):
        groups = comp.model_groups([(event, 300)], "task")
        previous = None
        for grid in (1e-4, 4e-4, 1.6e-3):
            parts = engine._composed_on(groups, grid)
            value = max(engine.epsilon_for_delta(p, grid, 1e-6) for p in parts)
            if previous is not None:
                assert previous <= value, (grid, previous, value)
            previous = max(
                engine.epsilon_for_delta(p, grid, 1e-6 + 3 * p.rounding + engine.TAIL_MASS)
                for p in parts
            )
            assert previous <= value


@pytest.mark.unit
def test_the_grid_doubles_until_the_composition_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    event = GaussianRound(FlatPoissonScheme(0.01), 1.0)
    groups = comp.model_groups([(event, 100_000)], "task")
    assert engine._plan_grid(groups, 1e-4) == 1e-4
    monkeypatch.setattr(engine, "MAX_PLD_BINS", 50_000)
    grid = engine._plan_grid(groups, 1e-4)
    assert grid is not None and grid > 1e-4 and math.log2(grid / 1e-4).is_integer()
    assert engine._window_size(groups[0][0], grid, 100_000) <= 50_000
    monkeypatch.setattr(engine, "MAX_GRID", grid / 2)
    assert engine._plan_grid(groups, 1e-4) is None
    _clear_caches()
    # No PLD fits: epsilon answers with RDP, composed_pld says why in one line.
    assert epsilon([(event, 100_000)], 1e-5) == epsilon([(event, 100_000)], 1e-5, method="rdp")
    with pytest.raises(ValueError, match="epsilon\\(\\) answers with the RDP bound"):
        composed_pld([(event, 100_000)])
    _clear_caches()


@pytest.mark.unit
def test_tail_window_holds_all_but_the_allowed_mass() -> None:
    pmf = engine._round_pmfs(
        pairs.round_components(GaussianRound(FlatPoissonScheme(0.3), 2.0)), 0.05
    )
    probs = pmf[0].probs
    exact = probs.copy()
    for _ in range(29):  # the exact 30-fold convolution
        exact = np.convolve(exact, probs)
    lo, hi = engine._tail_window(probs, 30)
    outside = float(exact[:lo].sum() + exact[hi + 1 :].sum())
    assert outside <= engine.TAIL_MASS
    assert hi - lo + 1 < exact.size  # and it does cut something


@pytest.mark.unit
def test_negative_rdp_values_drop_the_order_instead_of_reading_as_zero() -> None:
    # dp-accounting maps a negative RDP value (numerical trouble) to epsilon 0.
    cleaned = rdp._sanitize([0.5, -1e-3, float("nan"), 2.0])
    assert cleaned[0] == 0.5 and cleaned[3] == 2.0
    assert math.isinf(cleaned[1]) and math.isinf(cleaned[2])


# ------------------------------------------------- array-level PLD against dp-accounting


MODELS = [
    pairs.RoundModel(1.0, 0.01, 1.0, "add_remove"),
    pairs.RoundModel(0.1, 0.1, 0.5, "add_remove"),
    pairs.RoundModel(1.0, 1.0, 2.0, "add_remove"),
    pairs.RoundModel(1.0, 0.2, 1.0, "replace"),
    pairs.RoundModel(0.3, 0.05, 3.0, "replace"),
]


def _library_pld(model: pairs.RoundModel, grid: float) -> pld_lib.PrivacyLossDistribution:
    relation = (
        pld_lib.NeighborRel.REPLACE_ONE
        if model.pair == "replace"
        else pld_lib.NeighborRel.ADD_OR_REMOVE_ONE
    )
    pld = pld_lib.from_gaussian_mechanism(
        model.sigma,
        value_discretization_interval=grid,
        sampling_prob=model.rate,
        neighboring_relation=relation,
    )
    if model.weight < 1.0:
        pld = pld.compute_mixture(pld_lib.identity(grid), model.weight)
    return pld


@pytest.mark.unit
@pytest.mark.parametrize("direction", ["remove", "add", "replace"])
@pytest.mark.parametrize(("sigma", "q"), [(0.3, 0.01), (1.0, 0.1), (4.0, 0.9), (1.0, 1.0)])
def test_vectorised_deltas_match_dp_accounting(direction: str, sigma: float, q: float) -> None:
    mech = plm.GaussianPrivacyLoss(
        sigma, sampling_prob=q, adjacency_type=pairs._adjacency(direction)
    )
    bounds = mech.connect_dots_bounds()
    eps = np.linspace(bounds.epsilon_lower, bounds.epsilon_upper, 257)
    ours = pairs._stage_deltas(direction, sigma, q, eps)  # type: ignore[arg-type]
    assert np.allclose(ours, mech.get_delta_for_epsilon(eps), rtol=1e-9, atol=1e-15)


@pytest.mark.unit
@pytest.mark.parametrize("model", MODELS)
def test_pmfs_and_their_queries_match_dp_accounting(model: pairs.RoundModel) -> None:
    grid = 1e-3
    ours = engine._round_pmfs(model, grid)
    library = _library_pld(model, grid)
    lib_pmfs = [library._pmf_remove.to_dense_pmf(), library._pmf_add.to_dense_pmf()]
    for mine, theirs in zip(ours, lib_pmfs, strict=False):
        assert mine.lower == theirs._lower_loss
        # Equal up to rounding in delta (1e-16) divided by expm1(grid) in connect-the-dots.
        assert np.allclose(mine.probs, theirs._probs, rtol=1e-9, atol=1e-11)
        assert mine.infinity_mass == pytest.approx(theirs._infinity_mass, rel=1e-9, abs=1e-15)
    # Composition (self and pairwise) and the epsilon/delta queries, through our arrays.
    count = 300
    parts = tuple(engine._self_compose(p, count, engine._tail_window(p.probs, count)) for p in ours)
    lib_composed = library.self_compose(count)
    lib_parts = [lib_composed._pmf_remove, lib_composed._pmf_add]
    # The tolerance, from the FFT's error bound (composition.py, above _fft_error), not from one
    # machine. At every epsilon: exact <= ours <= exact + 3 R + TAIL_MASS (R, our `rounding`, is
    # added to delta; the negative noise we count as 0 is at most R again; the tails cut), and
    # |dp-accounting's - exact| <= L + TAIL_MASS, L the same bound for its complex FFT power. The
    # final sums (cumsum, lfilter) add a relative error of at most 4 u per point.
    for mine, lib_pmf, lib_single in zip(parts, lib_parts, lib_pmfs, strict=False):
        lib_error = _library_rounding(lib_single, count)
        below = lib_error + engine.TAIL_MASS
        above = 3 * mine.rounding + lib_error + 2 * engine.TAIL_MASS
        relative = 4 * engine._UNIT_ROUNDOFF * (mine.probs.size + len(lib_pmf._probs))
        for delta in (1e-3, 1e-6, 1e-9):
            mine_eps = engine.epsilon_for_delta(mine, grid, delta)
            low = lib_pmf.get_epsilon_for_delta(delta * (1 + relative) + below)
            high = lib_pmf.get_epsilon_for_delta(delta * (1 - relative) - above)
            assert low <= mine_eps <= high, (delta, low, mine_eps, high)
        for eps in (0.0, 0.5, 2.0):
            mine_delta = engine.delta_for_epsilon(mine, grid, eps)
            theirs_delta = lib_pmf.get_delta_for_epsilon(eps)
            slack = relative * max(mine_delta, theirs_delta)
            assert theirs_delta - below - slack <= mine_delta <= theirs_delta + above + slack
    pair = engine._compose(parts[0], ours[0])
    lib_pair = pld_pmf.compose_pmfs(
        lib_composed._pmf_remove, library._pmf_remove, tail_mass_truncation=engine.TAIL_MASS
    )
    # The pair's rounding holds ours and its convolution's; dp-accounting's convolution has the
    # same bound (scipy's fftconvolve, the same lengths), its power the one above.
    convolution = pair.rounding - parts[0].rounding
    lib_error = _library_rounding(lib_pmfs[0], count)
    below = lib_error + convolution + 2 * engine.TAIL_MASS
    above = 3 * pair.rounding + below
    mine_eps = engine.epsilon_for_delta(pair, grid, 1e-6)
    assert lib_pair.get_epsilon_for_delta(1e-6 + below) <= mine_eps
    assert mine_eps <= lib_pair.get_epsilon_for_delta(1e-6 - above)


def _library_rounding(single: pld_pmf.DensePLDPmf, count: int) -> float:
    """Our FFT error bound (composition.py) applied to dp-accounting's own power of ``single``.

    dp-accounting composes by ``ifft(fft(p, L) ** count)`` with a complex FFT of a fast length at
    least its window; numpy's complex power for exponents above 100 is ``exp(count log z)``: the
    same error terms as ours, here on the full spectrum (the factor sqrt(2) only errs large).
    """
    probs = np.asarray(single._probs, dtype=np.float64)
    lo, hi = common.compute_self_convolve_bounds(probs, count, engine.TAIL_MASS)
    length = scipy_fft.next_fast_len(max(hi - lo + 1, probs.size))
    spectrum = scipy_fft.fft(probs, length)
    powered = spectrum**count
    kappa = engine._fft_error(length)
    return engine._power_rounding(spectrum, powered, count, kappa, float(np.abs(probs).sum()))


@pytest.mark.unit
def test_connect_the_dots_is_dp_accountings_bit_for_bit() -> None:
    rng = np.random.default_rng(4)  # a random convex, decreasing curve in e^eps
    eps = np.arange(-50, 301) * 0.01
    deltas = np.clip(
        np.exp(-np.cumsum(rng.uniform(0.0, 0.05, eps.size))) - np.exp(eps) * 1e-4, 0, 1
    )
    deltas = np.minimum.accumulate(deltas)
    ours = engine._connect_dots(0.01, -50, deltas)
    theirs = pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(0.01, -50, 300, deltas)
    dense = theirs.to_dense_pmf()
    assert ours.lower == dense._lower_loss and ours.infinity_mass == dense._infinity_mass
    assert np.array_equal(ours.probs, np.asarray(dense._probs))


@pytest.mark.integration
def test_our_window_is_about_dp_accountings() -> None:
    # The same Chernoff bound at fewer orders (cheaper), plus orders near the optimum: within a
    # few percent of dp-accounting's window (its size is what the plan bounds).
    for model in MODELS:
        for pmf in engine._round_pmfs(model, 1e-3):
            for count in (10, 10_000, 10**7):
                lo, hi = engine._tail_window(pmf.probs, count)
                lib_lo, lib_hi = common.compute_self_convolve_bounds(
                    pmf.probs, count, engine.TAIL_MASS
                )
                assert hi - lo <= 1.05 * (lib_hi - lib_lo)


@pytest.mark.unit
def test_pld_delta_is_the_smaller_valid_bound() -> None:
    event = GaussianRound(FlatPoissonScheme(0.01), 1.0)
    value = pld_delta([(event, 1000)], 1.0)
    # Equal up to the FFT noise below 0 that we count as 0 (dp-accounting subtracts it).
    assert 0 < value <= composed_pld([(event, 1000)]).get_delta_for_epsilon(1.0) + 1e-12
    assert value <= rdp.rdp_delta(comp.model_groups([(event, 1000)], "task"), 1.0)


@pytest.mark.integration
def test_epsilon_for_delta_beyond_exp_overflow() -> None:
    # Losses around 1000 (e^-loss underflows): dp-accounting's walk answers infinity here. Two
    # points, 1000 and 1000.5; delta(eps) = P(inf) + sum over losses above eps of p (1 - e^(eps-l)).
    grid, inf = 0.5, 1e-9
    p1, p2 = 0.4, 0.6 - inf
    pmf = engine._Pmf(2000, np.array([p1, p2]), inf)
    roots = {
        0.1: 1000.5 + math.log((inf + p2 - 0.1) / p2),  # root in [1000, 1000.5)
        0.3: 1000.0 + math.log(0.7) - math.log(p1 + p2 * math.exp(-0.5)),  # root below 1000
    }
    for delta, expected in roots.items():
        assert engine.epsilon_for_delta(pmf, grid, delta) == pytest.approx(expected, rel=1e-12)
        assert engine.delta_for_epsilon(pmf, grid, expected) == pytest.approx(delta, rel=1e-9)
    # ... and a composition whose epsilon crosses 709 stays continuous in T.
    event = GaussianRound(TwoStageFixedScheme(100, 10, 5, 50), 100.0, 200)
    values = [epsilon([(event, t)], 1e-5, "participant") for t in (832, 833, 834, 835)]
    steps = np.diff(values)
    assert np.all(steps > 0) and steps.max() < 2 * steps.min(), values


@pytest.mark.unit
@pytest.mark.parametrize("model", [MODELS[0], MODELS[4]])
def test_self_composition_is_never_below_the_exact_one(model: pairs.RoundModel) -> None:
    # The accountant's claim, checked against an oracle with no cancellation: 32 rounds by five
    # direct squarings of a non-negative array, each entry a sum of non-negative products, so
    # every entry is within a relative 2 n u of exact per squaring (n the terms summed; Higham
    # 2002, section 3.1), and delta, a sum of non-negative terms, within another n u. With neither
    # the FFT rounding bound nor the cut tails added to delta, ours falls below it on this range.
    grid, count = 1e-2, 32
    for pmf in engine._round_pmfs(model, grid):
        exact = pmf.probs
        relative = 0.0
        for _ in range(5):
            relative += 2 * exact.size * engine._UNIT_ROUNDOFF
            exact = np.convolve(exact, exact)
        relative += 2 * exact.size * engine._UNIT_ROUNDOFF
        infinity = -math.expm1(count * math.log1p(-pmf.infinity_mass))
        oracle = engine._Pmf(count * pmf.lower, exact, infinity)
        mine = engine._self_compose(pmf, count, engine._tail_window(pmf.probs, count))
        for eps in np.linspace(0.0, 60.0, 121):
            exact_delta = engine.delta_for_epsilon(oracle, grid, eps)
            mine_delta = engine.delta_for_epsilon(mine, grid, eps)
            assert mine_delta >= exact_delta * (1 - relative), eps
            slack = 3 * mine.rounding + engine.TAIL_MASS + relative * mine_delta
            assert mine_delta <= exact_delta * (1 + relative) + slack, eps
