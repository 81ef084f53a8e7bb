"""The release path audited on worst-case neighbours, with negative controls it must catch.

Scenarios (one private round each; gradients are 1-D, C = 1):

* **siblings** (two-stage, 8 of 16 tasks of 2 of 4 participants): the target's 15 siblings reveal
  whether its participant was sampled. Caught control: Tombs et al.'s Theorem 3 (accounts the
  round as Poisson sampling at eta = q1 * n2 / min_tasks).
* **substitution** (one participant, 1 of 2 tasks without replacement): adding a task to a fixed-
  size sample swaps it for another, moving the sum by 2C. Caught control: z not halved.
* **lone task** (two participants, everything sampled, the target participant's only task): the
  participant sends a canary of 5C. Caught control: re-clipping disabled. The same canary at
  z = 2 (delta 1e-2): caught control, noise of half the claimed standard deviation.
* **count** (one participant, the target's gradient is 0): only the number of tasks differs.
  Caught control: the noisy sum divided by the realised count.
* **adaptive clipping** (two participants, everything sampled; the target's gradient has norm
  exactly C, so its clip bit is 1 and its clipped contribution C): the round also releases the
  noisy count of clip bits, read back from the next round's bound. The count noise is set so the
  count carries most of the information (``s_b = 0.51`` at ``z = 1``: the gradient alone is at
  ``z_grad = 5.07``); the statistic projects both releases. Caught controls: an accountant that
  sees only the gradient's ``z_grad`` (the count unaccounted), the count released without noise,
  and (slow only: it needs more trials) the count of bits not centred.

Each check uses the claimed delta of its scenario (the accountant's claim holds for every delta):
1e-3, and 1e-2 for the substitution and halved-noise checks, where it gives these trial counts
more power (at 1e-3 their margins at 6,000 trials were within sampling error of the bar). A
control is **caught** when the audit's lower bound exceeds the epsilon the broken system claims by
at least 20% of that claim (:func:`caught`); the honest path must stay below the accountant's
epsilon. Windows and trial counts were fixed in advance from the mechanism's closed form, by a
power analysis (the 0.1% quantile of the lower bound over simulated counts at 6,000 trials), not
from the samples: siblings 2.30 against a bar of 1.77; substitution 2.57 against 1.74; noise
halved 1.44 against 1.10; the count not centred (slow, 20,000 trials) 4.01 against 3.77; the
others are caught by more than a whole epsilon.
"""

from __future__ import annotations

import pytest

from fedmeta.accounting import (
    FlatPoissonScheme,
    GaussianRound,
    TwoStageFixedScheme,
    TwoStagePoissonScheme,
    epsilon,
    gradient_noise_multiplier,
    tombs2022_published_epsilon,
)

from .release_audit import (
    HalvedNoise,
    Neighbours,
    adaptive_clipping,
    audit,
    count_not_centred,
    count_without_noise,
    divided_by_realised_count,
    projection,
    reclipping_disabled,
)

DELTA = 1e-3
LOUD_DELTA = 1e-2  # the substitution and halved-noise checks (see the module docstring)
#: A control is caught when the audit exceeds its claimed epsilon by this factor.
CAUGHT = 1.2
SIBLINGS = GaussianRound(TwoStageFixedScheme(4, 2, 8, 16), 1.0)
SIBLING_PAIR = Neighbours(
    {"t": [3.0] + [-3.0] * 15, **{f"p{i}": [1.0] * 16 for i in range(3)}},
    {"t": [-3.0] * 15, **{f"p{i}": [1.0] * 16 for i in range(3)}},
)
SUBSTITUTION = GaussianRound(TwoStageFixedScheme(1, 1, 1, 2), 1.0)
SUBSTITUTION_PAIR = Neighbours({"t": [2.0, -2.0]}, {"t": [-2.0]})
LONE = GaussianRound(TwoStagePoissonScheme(2, 2, 1.0), 3.0)
LONE_CANARY = Neighbours({"t": [5.0], "o": [0.0]}, {"t": [], "o": [0.0]})
# The halved-noise control's scenario: the lone canary at z = 2 (claims 0.92 at delta 1e-2; with
# half the noise the mechanism is z = 1, epsilon 3.14 there).
LOUD = GaussianRound(TwoStagePoissonScheme(2, 2, 1.0), 2.0)
COUNT = GaussianRound(TwoStagePoissonScheme(1, 1, 1.0), 4.0)
COUNT_PAIR = Neighbours({"t": [0.0, 1.0]}, {"t": [1.0]})


ADAPTIVE = GaussianRound(TwoStagePoissonScheme(2, 2, 1.0), 1.0)
COUNT_NOISE = 0.51
ADAPTIVE_PAIR = Neighbours({"t": [1.0], "o": [0.0]}, {"t": [], "o": [0.0]})
Z_GRAD = gradient_noise_multiplier(ADAPTIVE.noise_multiplier, COUNT_NOISE)
# Means of (sum, centred count) with and without the target: bits 1 and 1, then 1 (C_0 = 1).
WITH, WITHOUT, STDS = (1.0, 1.0), (0.0, 0.5), (Z_GRAD, COUNT_NOISE)


def eps(event: GaussianRound, delta: float = DELTA) -> float:
    return epsilon([(event, 1)], delta)


def caught(bound: float, claim: float) -> bool:
    """The audit refutes the claim by at least 20% of it (issue 18)."""
    return bound > CAUGHT * claim


def check(trials: int, subtle: int) -> dict[str, float]:
    """Every check; ``subtle`` trials where a control is caught by a small margin."""
    return {**check_loud(subtle), **check_plain(trials, subtle)}


def check_loud(subtle: int) -> dict[str, float]:
    """The two checks at delta 1e-2 (the substitution, the noise halved), each caught by a small
    margin: a file of their own (test_release_audit_loud.py), so that the default suite's two
    workers, which take tests by file, run them beside the rest."""
    bounds = {
        "substitution": audit(SUBSTITUTION, SUBSTITUTION_PAIR, subtle, (2.0, float("inf")),
                              LOUD_DELTA),
        "lone, noise halved": audit(LOUD, LONE_CANARY, subtle, (2.25, float("inf")), LOUD_DELTA,
                                    noise=HalvedNoise),
    }  # fmt: skip
    # The real path stays within the accountant's epsilon; each control is caught by >= 20%.
    assert bounds["substitution"] < eps(SUBSTITUTION, LOUD_DELTA), bounds
    unhalved = GaussianRound(FlatPoissonScheme(SUBSTITUTION.scheme.task_rate), 1.0)
    assert caught(bounds["substitution"], eps(unhalved, LOUD_DELTA)), bounds
    assert caught(bounds["lone, noise halved"], eps(LOUD, LOUD_DELTA)), bounds
    return bounds


def check_plain(trials: int, subtle: int) -> dict[str, float]:
    """The checks at delta 1e-3: the siblings (``subtle`` trials), the others ``trials``."""
    bounds = {
        "siblings": audit(SIBLINGS, SIBLING_PAIR, subtle, (3.0, 9.0), DELTA),
        "lone canary": audit(LONE, LONE_CANARY, trials, (3.5, float("inf")), DELTA),
        "count": audit(COUNT, COUNT_PAIR, trials, (-float("inf"), -7.0), DELTA,
                       positive_is_without=True),
    }  # fmt: skip
    # A canary of 5C shows far in the tail: its own window, fixed like the others in advance.
    bounds["lone canary, far tail"] = audit(LONE, LONE_CANARY, trials, (9.0, float("inf")), DELTA)
    with reclipping_disabled():
        bounds["lone canary, no re-clip"] = audit(LONE, LONE_CANARY, trials, (9.0, float("inf")),
                                                  DELTA)  # fmt: skip
    with divided_by_realised_count():
        bounds["count, divided by count"] = audit(COUNT, COUNT_PAIR, trials, (-float("inf"), -7.0),
                                                  DELTA, positive_is_without=True)  # fmt: skip
    # The real path stays within the accountant's epsilon.
    assert bounds["siblings"] < eps(SIBLINGS), bounds
    assert bounds["lone canary"] < eps(LONE) and bounds["lone canary, far tail"] < eps(LONE), bounds
    assert bounds["count"] < eps(COUNT), bounds
    # Each negative control is caught, by at least 20% of what it claims.
    assert caught(bounds["siblings"], tombs2022_published_epsilon(SIBLINGS, 1, DELTA)), bounds
    assert caught(bounds["lone canary, no re-clip"], eps(LONE)), bounds
    assert caught(bounds["count, divided by count"], eps(COUNT)), bounds
    return bounds


def check_adaptive(trials: int, controls: int, *, slow: bool = False) -> dict[str, float]:
    """Adaptive clipping on: both releases audited together, and its controls."""
    on = adaptive_clipping(ADAPTIVE, COUNT_NOISE)
    both = lambda v: projection(v, WITH, WITHOUT, STDS)  # noqa: E731
    count_only = lambda v: v[:, 1]  # noqa: E731
    bounds = {
        "adaptive, sum and count": audit(ADAPTIVE, ADAPTIVE_PAIR, trials, (2.5, float("inf")),
                                         DELTA, adaptive=on, statistic=both),
    }  # fmt: skip
    with count_without_noise():
        bounds["adaptive, count without noise"] = audit(
            ADAPTIVE, ADAPTIVE_PAIR, controls, (0.75, float("inf")), DELTA, adaptive=on,
            statistic=count_only,
        )  # fmt: skip
    if slow:  # sum b_i: means (1, 2) and (0, 1), the same noise
        uncentred = lambda v: projection(v, (1.0, 2.0), (0.0, 1.0), STDS)  # noqa: E731
        with count_not_centred():
            bounds["adaptive, count not centred"] = audit(
                ADAPTIVE, ADAPTIVE_PAIR, trials, (1.8, float("inf")), DELTA, adaptive=on,
                statistic=uncentred,
            )  # fmt: skip
        assert caught(bounds["adaptive, count not centred"], eps(ADAPTIVE)), bounds
    # The real path stays within the accountant's epsilon for the total z ...
    assert bounds["adaptive, sum and count"] < eps(ADAPTIVE), bounds
    # ... and shows more than the gradient alone could: the count must be accounted.
    gradient_only = GaussianRound(ADAPTIVE.scheme, Z_GRAD)
    assert caught(bounds["adaptive, sum and count"], eps(gradient_only)), bounds
    assert caught(bounds["adaptive, count without noise"], eps(ADAPTIVE)), bounds
    return bounds


@pytest.mark.integration
def test_release_path_audit_with_adaptive_clipping() -> None:
    check_adaptive(trials=2_000, controls=1_000)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_release_path_audit_with_adaptive_clipping_full() -> None:
    bounds = check_adaptive(trials=20_000, controls=5_000, slow=True)
    print({k: round(v, 3) for k, v in bounds.items()})


@pytest.mark.integration
def test_release_path_audit_catches_every_control() -> None:
    """The checks at delta 1e-3; those at 1e-2 are test_release_audit_loud.py's."""
    check_plain(trials=2_000, subtle=6_000)


@pytest.mark.slow
def test_release_path_audit_full() -> None:
    bounds = check(trials=50_000, subtle=200_000)
    print({k: round(v, 3) for k, v in bounds.items()})
