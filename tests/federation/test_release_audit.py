"""The release path audited on worst-case neighbours, with negative controls it must catch.

Scenarios (one private round each; gradients are 1-D, C = 1):

* **siblings** (two-stage, 8 of 16 tasks of 2 of 4 participants): the target's 15 siblings reveal
  whether its participant was sampled. Caught control: Tombs et al.'s Theorem 3 (accounts the
  round as Poisson sampling at eta = q1 * n2 / min_tasks).
* **substitution** (one participant, 1 of 2 tasks without replacement): adding a task to a fixed-
  size sample swaps it for another, moving the sum by 2C. Caught control: z not halved.
* **lone task** (two participants, everything sampled, the target participant's only task): the
  participant sends a canary of 5C. Caught controls: re-clipping disabled, noise halved.
* **count** (one participant, the target's gradient is 0): only the number of tasks differs.
  Caught control: the noisy sum divided by the realised count.

Each check uses the claimed delta of its scenario (the accountant's claim holds for every delta;
1e-3 gives these trial counts their power). Windows were fixed in advance from the mechanism's
closed form, not from the samples.
"""

from __future__ import annotations

import pytest

from accounting import (
    FlatPoissonScheme,
    GaussianRound,
    TwoStageFixedScheme,
    TwoStagePoissonScheme,
    epsilon,
    tombs2022_published_epsilon,
)

from .release_audit import (
    HalvedNoise,
    Neighbours,
    audit,
    divided_by_realised_count,
    reclipping_disabled,
)

DELTA = 1e-3
SIBLINGS = GaussianRound(TwoStageFixedScheme(4, 2, 8, 16), 1.0)
SIBLING_PAIR = Neighbours(
    {"t": [3.0] + [-3.0] * 15, **{f"p{i}": [1.0] * 16 for i in range(3)}},
    {"t": [-3.0] * 15, **{f"p{i}": [1.0] * 16 for i in range(3)}},
)
SUBSTITUTION = GaussianRound(TwoStageFixedScheme(1, 1, 1, 2), 1.0)
SUBSTITUTION_PAIR = Neighbours({"t": [2.0, -2.0]}, {"t": [-2.0]})
LONE = GaussianRound(TwoStagePoissonScheme(2, 2, 1.0), 3.0)
LONE_CANARY = Neighbours({"t": [5.0], "o": [0.0]}, {"t": [], "o": [0.0]})
COUNT = GaussianRound(TwoStagePoissonScheme(1, 1, 1.0), 4.0)
COUNT_PAIR = Neighbours({"t": [0.0, 1.0]}, {"t": [1.0]})


def eps(event: GaussianRound) -> float:
    return epsilon([(event, 1)], DELTA)


def check(trials: int, subtle: int) -> dict[str, float]:
    """Every check; ``subtle`` trials where a control is caught by a small margin."""
    bounds = {
        "siblings": audit(SIBLINGS, SIBLING_PAIR, subtle, (3.0, 9.0), DELTA),
        "substitution": audit(SUBSTITUTION, SUBSTITUTION_PAIR, subtle, (2.25, float("inf")), DELTA),
        "lone canary": audit(LONE, LONE_CANARY, trials, (3.5, float("inf")), DELTA),
        "lone, noise halved": audit(LONE, LONE_CANARY, subtle, (3.5, float("inf")), DELTA,
                                    noise=HalvedNoise),
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
    assert bounds["substitution"] < eps(SUBSTITUTION), bounds
    assert bounds["lone canary"] < eps(LONE) and bounds["lone canary, far tail"] < eps(LONE), bounds
    assert bounds["count"] < eps(COUNT), bounds
    # Each negative control is caught.
    assert bounds["siblings"] > tombs2022_published_epsilon(SIBLINGS, 1, DELTA) + 0.5, bounds
    unhalved = GaussianRound(FlatPoissonScheme(SUBSTITUTION.scheme.task_rate), 1.0)
    assert bounds["substitution"] > eps(unhalved) + 0.5, bounds
    assert bounds["lone, noise halved"] > eps(LONE) + 0.1, bounds
    assert bounds["lone canary, no re-clip"] > eps(LONE) + 1.0, bounds
    assert bounds["count, divided by count"] > eps(COUNT) + 1.0, bounds
    return bounds


@pytest.mark.integration
def test_release_path_audit_catches_every_control() -> None:
    check(trials=2_000, subtle=6_000)


@pytest.mark.slow
def test_release_path_audit_full() -> None:
    bounds = check(trials=50_000, subtle=200_000)
    print({k: round(v, 3) for k, v in bounds.items()})
