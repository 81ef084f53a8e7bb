"""Per-round privacy loss of a ``GaussianRound``, composition over rounds, and planning.

Accountants
-----------
* **PLD** (privacy loss distributions; Koskela et al. 2020; Doroshenko, Ghazi, Kamath, Kumar,
  Manurangsi 2022 "Connect the dots", Algorithm 1): each round's dominating pair is discretised with
  dp-accounting's pessimistic connect-the-dots construction, whose hockey-stick curve lies on or
  above the exact one at every epsilon, so the reported epsilon errs on the safe (too large) side.
* **RDP** (Mironov 2017; Mironov, Talwar, Zhang 2019; Wang, Balle, Kasiviswanathan 2019): an
  independent, looser upper bound, reported as a cross-check.

The enforced value (``method="pld"``) is the *minimum* of the PLD and RDP epsilons: both are valid
upper bounds, so their minimum is one. Where the PLD is cheap it is the smaller; where the grid must
be coarsened (below) RDP may take over.

Dominating pairs per round (privacy-accounting note, section 2; docs/privacy.md)
---------------------------------------------------------------------------------
Notation: ``PG(q, s)`` is the Poisson-subsampled Gaussian pair at rate ``q`` and noise ``s`` (in
units of the sensitivity), ``MIX(w, X)`` the pair ``(1 - w) * [no loss] + w * X`` (same law under
both datasets on the first branch). Zhu, Dong, Wang (2022, "Optimal accounting of differential
privacy via characteristic function", Definition 7 and the composition theorem for dominating
pairs) make a pair that dominates every round *for every order* composable by product; every pair
below is of that kind.

``add_remove`` (add or remove one task; the default):

* two-stage, Poisson stage 2: ``MIX(q1, PG(q2, z))``; fixed stage 2: ``MIX(q1, PG(n2/min_tasks,
  z/2))`` (adding a task to a fixed-size sample is a substitution inside it: the clipped sum moves
  by ``2C``); flat Poisson ``PG(q, z)``; fixed-size ``PG(m/n, z/2)``. The mixture is joint
  convexity of the hockey-stick divergence over the common "participant not sampled" branch. The
  direction of a neighbouring pair (add or remove) is the same in every round, so the remove and
  add PLDs are composed separately and the larger epsilon is taken (dp-accounting's convention).

``replace_one`` (one task replaced by another; counts public). Write ``E_a = exp(a.Z - |a|^2/2)``
with ``Z`` standard normal; for any ``alpha >= 0`` and reference ``N(h)``,
``H_alpha((1-w)N(h) + wN(g) || (1-w)N(h) + wN(g')) = E[((1-w)(1-alpha) + w E_a - alpha w E_b)_+]``
with ``a = (g-h)/s``, ``b = (g'-h)/s``. ``E_a`` grows in convex order with ``|a|`` (a lognormal
martingale), and a sum is largest in convex order when its terms are comonotone (Dhaene et al.
2002, "The concept of comonotonicity in actuarial science and finance: theory", Theorem 7). Hence:

* Poisson sampling (flat, or stage 2): the other tasks' inclusions are independent of the replaced
  task's, so after joint convexity over them ``h = 0``, ``|g|, |g'| <= C`` and the supremum over
  every pair and every ``alpha`` is at ``g = -g'``, ``|g| = C``: dp-accounting's REPLACE pair
  ``(1-q) N(0) + q N(C)`` vs ``(1-q) N(0) + q N(-C)`` (``privacy_loss_mechanism``'s
  ``AdditiveNoisePrivacyLoss``), at noise ``z``. It is symmetric, so one PMF serves both orders.
  Two-stage: ``MIX(q1, REPLACE(q2, z))``; flat: ``REPLACE(q, z)``.
* Sampling without replacement (fixed-size, or fixed stage 2), sampling ``m`` of ``n``, ``gamma =
  m/n``: couple a sample without the replaced task as ``R + {y}`` and one with it as ``R + {x}``
  (Balle, Barthe, Gaboardi 2018, "Privacy amplification by subsampling", proof of Theorem 9). Then
  ``h`` is another *sampled* task's gradient and ``|g - h|`` reaches ``2C``: the realisable pairs
  include ``((1-gamma)N(0) + gamma N(2C), N(0))``, the remove pair of ``PG(gamma, z/2)``, which the
  pair ``REPLACE(gamma, z)`` does not dominate (it is too small by 65x at epsilon 3 for m=1, n=2,
  z=1). Conversely advanced joint convexity (Balle et al. 2018, Theorem 2) bounds every realisable
  pair by that remove pair for ``alpha >= 1``. The tight pair valid for *every* order is the
  symmetrisation ``min(f, f^-1)**`` of its trade-off function ``f`` (Dong, Roth, Su 2022, Theorem
  4.2 for sampling without replacement; its hockey-stick curve is ``delta(eps) = delta_remove(eps)``
  for ``eps >= 0`` and ``1 - e^eps + e^eps delta_remove(-eps)`` below 0). Composing the remove and
  add PLDs separately would not be a valid bound here: under replacement a round's pair can lie
  between the two (e.g. ``g = -g' = C``, ``h = 0``). Two-stage: ``MIX(q1, SYM(n2/min_tasks,
  z/2))``; fixed-size: ``SYM(m/n, z/2)``.

Participant level (either relation): ``PG(q1, z / (2k))`` for a cap of ``k`` tasks per participant
per round (substitution of a participant inside the fixed-size stage 1).

RDP cross-check: ``add_remove`` uses dp-accounting's Poisson-subsampled Gaussian RDP; replace-one
with Poisson sampling uses Mironov (2017), Proposition 11 (weak triangle inequality, p = q = 2)
through the removal of the task: ``R(alpha) <= (alpha - 1/2)/(alpha - 1) * R_ar(2 alpha) +
R_ar(2 alpha - 1)`` (dp-accounting has no Poisson replace-one RDP); replace-one without replacement
uses dp-accounting's ``SampledWithoutReplacementDpEvent`` (Wang, Balle, Kasiviswanathan 2019,
Theorem 27) with the noise relative to ``2C`` (dp-accounting issue #378). The mixture with the
unsampled branch is exact for disjoint branches and an upper bound otherwise (joint convexity of
``x^alpha``). A negative RDP value (numerical trouble) drops that order instead of reading as 0.

Ranges and bounded cost
-----------------------
Accepted: ``1 <= rounds <= MAX_ROUNDS_LIMIT`` (1e9) in any query; noise multiplier in
``NOISE_MULTIPLIER_RANGE`` ([1e-4, 1e6]); delta in (0, 1). Every query (``epsilon``,
``calibrate_noise_multiplier``, ``max_rounds``, both units, both relations) takes seconds and well
under 1 GB for rounds up to 1e9, epsilon up to 1e3 and noise multipliers 0.1 to 100 (see
docs/benchmarks.md). How, erring only on the safe side:

* A PLD never holds more than ``MAX_ROUND_BINS`` points for one round nor ``MAX_PLD_BINS`` for a
  composition. The grid starts at ``discretization`` (1e-4) and doubles until both fit, the
  composed size being computed *before* any allocation. A coarser pessimistic grid is still an upper
  bound, only a looser one.
* If even a grid of ``MAX_GRID`` does not fit (tiny noise, huge counts), the PLD is skipped and the
  RDP bound, always cheap, is the answer.
* The tails that a self-composition cuts off (a Chernoff bound, at most ``TAIL_MASS`` in all) are
  added to the probability of an infinite loss, as dp-accounting does.
* ``max_rounds`` starts from the RDP answer (feasible by construction) and is exact to the round
  under the enforced accountant; ``calibrate_noise_multiplier`` brackets with RDP, then refines.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, TypeAlias

from fedmeta.accounting.levels import check_one_level, lowered
from fedmeta.accounting.pairs import ModelGroups, RoundModel, check_noise, round_components
from fedmeta.accounting.pmf import (
    MAX_GRID,
    MAX_PLD_BINS,
    delta_for_epsilon,
    epsilon_for_delta,
    pld_parts,
)
from fedmeta.accounting.rdp import rdp_delta, rdp_epsilon
from fedmeta.accounting.sample_level import SampleLevelRound
from fedmeta.accounting.schemes import (
    GaussianRound,
    TwoStageFixedScheme,
    TwoStagePoissonScheme,
    Unit,
    check_delta,
    check_unit,
)
from fedmeta.accounting.tuning_release import Recorded, holds_release, release_epsilon

if TYPE_CHECKING:
    # dp-accounting and scipy load where they compute (about 1.5 s), not with the package: the
    # ``fedmeta`` command's registration and a participant import accounting names only.
    from dp_accounting.pld import privacy_loss_distribution as pld_lib


Method: TypeAlias = Literal["pld", "rdp"]


METHODS: tuple[Method, ...] = ("pld", "rdp")


#: ``(event, count)`` pairs; an event may be a tuning release (composed by RDP, ``epsilon``).
RoundGroups: TypeAlias = Sequence[tuple[Recorded, int]]


#: Finest PLD grid (the note's reference numbers use 1e-4).
DEFAULT_DISCRETIZATION = 1e-4


#: Most rounds in one query (a range of the accountant, see the module docstring).
MAX_ROUNDS_LIMIT = 10**9


_PLD: TypeAlias = "pld_lib.PrivacyLossDistribution"


def check_method(method: object) -> None:
    """Refuse an accountant other than ``pld`` or ``rdp``."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")


def check_rounds(name: str, value: object, *, minimum: int) -> int:
    """``value`` if it is a round count in ``[minimum, MAX_ROUNDS_LIMIT]``, else a ValueError."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not (minimum <= value <= MAX_ROUNDS_LIMIT)
    ):
        raise ValueError(
            f"{name} must be an integer in [{minimum}, {MAX_ROUNDS_LIMIT}]; got {value!r}"
        )
    return value


def _check_groups(rounds: RoundGroups) -> list[tuple[GaussianRound, int]]:
    """Merge identical rounds (so they compose by count) and validate counts and relation."""
    merged: dict[GaussianRound, int] = {}
    for item in rounds:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ValueError(f"rounds must be a sequence of (GaussianRound, count); got {item!r}")
        if not isinstance(item[0], GaussianRound | SampleLevelRound):
            raise ValueError(f"rounds entries must start with a GaussianRound; got {item[0]!r}")
        event, count = lowered(item[0]), item[1]  # a sample-level round: its dominating pair
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"round count must be an integer >= 0; got {count!r}")
        if count:
            merged[event] = merged.get(event, 0) + count
    check_one_level(item[0] for item in rounds if item[1])
    total = sum(merged.values())
    if total > MAX_ROUNDS_LIMIT:
        raise ValueError(f"round count must be at most {MAX_ROUNDS_LIMIT} in all; got {total}")
    relations = sorted({event.neighbouring for event in merged})
    if len(relations) > 1:
        # A guarantee is stated for one relation; composing rounds of two would state neither.
        raise ValueError(f"neighbouring must be the same for all rounds; got {relations}")
    return sorted(merged.items(), key=lambda kv: repr(kv[0]))


def model_groups(rounds: RoundGroups, unit: Unit) -> ModelGroups:
    """Validated groups as ``(RoundModel, count)``, rounds with the same pair merged."""
    merged: dict[RoundModel, int] = {}
    for event, count in _check_groups(rounds):
        model = round_components(event, unit)
        merged[model] = merged.get(model, 0) + count
    return tuple(sorted(merged.items(), key=lambda kv: repr(kv[0])))


def check_discretization(discretization: float) -> None:
    """Refuse a PLD grid that is not a float in ``(0, MAX_GRID]``."""
    if not (isinstance(discretization, float) and 0.0 < discretization <= MAX_GRID):
        raise ValueError(
            f"discretization must be a float in (0, {MAX_GRID}]; got {discretization!r}"
        )


def round_pld(
    event: GaussianRound, unit: Unit = "task", *, discretization: float = DEFAULT_DISCRETIZATION
) -> _PLD:
    """The pessimistic PLD of one round, on ``discretization`` or the finest coarser grid that fits.

    Raises ValueError when no grid up to ``MAX_GRID`` fits (tiny noise): use ``epsilon``.
    """
    return _require(composed_pld([(event, 1)], unit, discretization=discretization))


def composed_pld(
    rounds: RoundGroups, unit: Unit = "task", *, discretization: float = DEFAULT_DISCRETIZATION
) -> _PLD | None:
    """PLD of all rounds (identical rounds self-composed by count), or None for no rounds.

    A dp-accounting ``PrivacyLossDistribution`` (pessimistic). Raises ValueError when no grid up to
    ``MAX_GRID`` fits the size limits (use ``epsilon``, which then answers with RDP).
    """
    from dp_accounting.pld import pld_pmf
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    check_discretization(discretization)
    groups = model_groups(rounds, unit)
    if not groups:
        return None
    found = pld_parts(groups, discretization)
    if found is None:
        return _require(None)
    parts, grid = found
    pmfs = [pld_pmf.DensePLDPmf(grid, p.lower, p.probs, p.infinity_mass, True) for p in parts]
    return pld_lib.PrivacyLossDistribution(pmfs[0], pmfs[1] if len(pmfs) > 1 else None)


def _require(pld: _PLD | None) -> _PLD:
    if pld is None:
        raise ValueError(
            f"rounds need a PLD grid coarser than {MAX_GRID} to stay within {MAX_PLD_BINS} points "
            "(tiny noise or very many rounds); epsilon() answers with the RDP bound instead"
        )
    return pld


def groups_epsilon(
    groups: ModelGroups, delta: float, method: Method, discretization: float
) -> float:
    """Epsilon of checked groups: PLD (when a grid fits) and RDP, the smaller; or RDP alone."""
    if not groups:
        return 0.0
    rdp = rdp_epsilon(groups, delta)
    if method == "rdp":
        return rdp
    found = pld_parts(groups, discretization)
    if found is None:
        return rdp
    parts, grid = found
    pld_eps = max(epsilon_for_delta(part, grid, delta) for part in parts)
    return min(max(0.0, pld_eps), rdp)


def epsilon(
    rounds: RoundGroups,
    delta: float,
    unit: Unit = "task",
    method: Method = "pld",
    *,
    discretization: float = DEFAULT_DISCRETIZATION,
) -> float:
    """Return epsilon at ``delta`` after ``rounds``, a list of ``(GaussianRound, count)``.

    ``method="pld"`` is the value fedmeta enforces: the pessimistic PLD on the finest grid within
    the size limits, or the RDP bound where that is smaller (both are upper bounds).
    ``method="rdp"`` is the RDP bound alone, the looser independent cross-check. May be ``inf``
    (no finite bound).
    """
    check_delta(delta)
    check_unit(unit)
    check_method(method)
    check_discretization(discretization)
    if holds_release(rounds):  # a tuning release has an RDP curve only (tuning_release.py)
        return release_epsilon(rounds, delta, unit)
    return groups_epsilon(model_groups(rounds, unit), delta, method, discretization)


def pld_delta(
    rounds: RoundGroups,
    epsilon_value: float,
    unit: Unit = "task",
    *,
    discretization: float = DEFAULT_DISCRETIZATION,
) -> float:
    """Smallest delta (pessimistic PLD, or RDP where smaller) with the rounds (eps, delta)-DP."""
    check_unit(unit)
    check_discretization(discretization)
    if not (isinstance(epsilon_value, int | float) and epsilon_value >= 0):
        raise ValueError(f"epsilon_value must be a number >= 0; got {epsilon_value!r}")
    groups = model_groups(rounds, unit)
    if not groups:
        return 0.0
    rdp = rdp_delta(groups, float(epsilon_value))
    found = pld_parts(groups, discretization)
    if found is None:
        return rdp
    parts, grid = found
    return min(rdp, max(delta_for_epsilon(part, grid, float(epsilon_value)) for part in parts))


def tombs2022_published_epsilon(
    event: GaussianRound,
    rounds: int,
    delta: float,
    *,
    discretization: float = DEFAULT_DISCRETIZATION,
) -> float:
    """AS PUBLISHED, NOT A VALID GUARANTEE: Tombs et al. (2022), Theorem 3, for a two-stage scheme.

    Theorem 3 claims two-stage sampling amplifies like Poisson sampling at ``eta``, the largest
    inclusion probability of a task (``eta = q1 * n2 / min_i |T_i|`` or ``q1 * q2``), with the
    Gaussian's sensitivity ``C`` (``z`` unhalved). The privacy-accounting note (section 1) gives a
    one-round dataset where the true delta is ~1e4 times larger. This number is reported beside the
    valid one for comparison and is never used to enforce a budget (add/remove form, whatever the
    event's relation: it is the published statement).
    """
    check_delta(delta)
    scheme = event.scheme
    if not isinstance(scheme, TwoStagePoissonScheme | TwoStageFixedScheme):
        raise ValueError(
            "scheme must be two-stage for the Tombs et al. (2022) Theorem-3 value; "
            f"got {type(scheme).__name__}"
        )
    rounds = check_rounds("rounds", rounds, minimum=0)
    if rounds == 0:
        return 0.0
    check_noise(float(event.noise_multiplier))
    model = RoundModel(
        1.0, scheme.largest_inclusion_probability, float(event.noise_multiplier), "add_remove"
    )
    return groups_epsilon(((model, rounds),), delta, "pld", discretization)
