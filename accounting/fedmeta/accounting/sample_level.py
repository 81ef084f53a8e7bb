"""Sample-level DP-MAML (issue 53): the per-round event and its Gaussian-DP parameter ``mu``.

Neighbouring relation: add or remove one example ``x`` of one participant's data (participants
fixed). The mechanism of one round, which a ``SampleLevelRound`` describes, is DP-MAML's
Algorithm 2 with a cap on appearances:

1. Examples are sampled first (``ExampleSampling``: ``n1`` of ``P`` participants without
   replacement, then each example of a sampled participant independently with probability
   ``example_rate``), and tasks are built from the sampled examples so that **x fills at most
   ``max_appearances`` (m) slots of the round**, a slot being one task's support set or one task's
   query set, and so that the slots of every *other* example do not depend on whether x is
   present (each example's slots are a function of that example and of the round's randomness).
   m is fixed by construction and public.
2. Inner loop, per task: ``inner_steps`` (K) steps of DP-SGD on its support set, per-example clip
   ``C_in``, noise ``N(0, (z_in C_in)^2 I)`` on the sum. Each step is a Gaussian mechanism with
   sensitivity ``C_in`` with respect to x when x is in that support set (once). The noisy adapted
   parameters are treated as released.
3. Outer loop: every query example's gradient, clipped to ``C_out``, summed over all tasks, noise
   ``N(0, (z_out C_out)^2 I)`` at the server. ``order="first"``: the gradient is taken with respect
   to the (released) adapted parameters, so a support example reaches the outer release only
   through them (post-processing) and the sensitivity is ``a_q C_out``, ``a_q`` being x's query
   appearances. ``order="second"``: the Hessian path makes *every* query gradient of a task depend
   on its support set, so one support appearance moves up to ``query_cap`` clipped vectors by up
   to ``2 C_out`` each: sensitivity ``(a_q + 2 query_cap a_s) C_out``. Covered, not refused; the
   bound is valid and, for any real query set, far larger (see ``gdp_mu``).

Conditional on x being sampled, the round is an adaptive composition of Gaussian mechanisms: the
Gaussian mechanism with sensitivity ``s`` and noise ``sigma`` is ``s/sigma``-GDP (Dong, Roth, Su
2022, "Gaussian differential privacy", Theorem 2.7; numbers as in arXiv:1905.02383, the JRSS-B
version may number differently) and ``mu^2`` adds under adaptive composition (their Corollary 3.3,
a consequence of their composition theorem for trade-off functions), so the round is ``mu``-GDP
with ``gdp_mu``'s ``mu``: no approximation. Over the round's own randomness (which split of
appearances x gets) the pair is a mixture with the same weights under both datasets, bounded by
the worst split (joint convexity of the hockey-stick divergence). ``accounting.sample_level_bound``
adds the amplification by sampling.

Nothing here imports dp-accounting, torch or flwr: the event is a small frozen validated value,
as ``accounting.schemes`` (errors read ``"<field> must be ...; got <value>"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from fedmeta.accounting.checks import check_int, check_positive, check_rate
from fedmeta.accounting.pairs import NOISE_MULTIPLIER_RANGE
from fedmeta.accounting.schemes import (
    ADD_REMOVE,
    FlatPoissonScheme,
    GaussianRound,
    Neighbouring,
    TwoStagePoissonScheme,
    one_of,
)

Order: TypeAlias = Literal["first", "second"]
ORDERS: tuple[Order, ...] = ("first", "second")
#: The ``kind`` a recorded sample-level round's JSON carries (a task-level round carries none).
KIND = "sample_level_round"


@dataclass(frozen=True)
class ExampleSampling:
    """``participants_per_round`` of ``participants`` (without replacement), then Poisson examples.

    Every example of a sampled participant is included independently with probability
    ``example_rate``. ``participants_per_round == participants`` is single-stage Poisson sampling
    over all examples. Only Poisson sampling of examples is modelled: a fixed number of examples
    would make removing x a substitution inside the sample, and the substitute's own slots would
    join x's (about twice the appearances), which this event does not describe.

    ``accounting.sampler.TwoStageSampler`` with ``TwoStagePoissonScheme(participants,
    participants_per_round, example_rate)`` over each participant's example count draws exactly
    this sample (it is indifferent to what the units are).
    """

    participants: int
    participants_per_round: int
    example_rate: float

    def __post_init__(self) -> None:
        check_int("participants", self.participants, minimum=1)
        check_int("participants_per_round", self.participants_per_round, minimum=1)
        if self.participants_per_round > self.participants:
            raise ValueError(
                f"participants_per_round must be <= participants ({self.participants}); "
                f"got {self.participants_per_round}"
            )
        check_rate("example_rate", self.example_rate)

    @property
    def participant_rate(self) -> float:
        """Stage-1 inclusion probability ``q1 = n1 / P``."""
        return self.participants_per_round / self.participants

    @property
    def inclusion_probability(self) -> float:
        """Probability that a given example is used in a round: ``q1 * example_rate``."""
        return self.participant_rate * self.example_rate


@dataclass(frozen=True)
class SampleLevelRound:
    """One round of sample-level DP-MAML (module docstring) under ``sampling``.

    ``inner_noise_multiplier`` (``z_in``) and ``outer_noise_multiplier`` (``z_out``) are relative to
    their clip norms (which cancel from the analysis). ``inner_steps`` (K) is the number of noisy
    inner steps per task; ``max_appearances`` (m) the most slots x fills in one round (a task's
    support set holds x at most once; a task holding x in its support and its query set counts
    twice). ``query_cap`` is the most query examples in one task, required for ``order="second"``
    and refused for ``"first"`` (where it plays no part).

    The relation is add/remove only (no replace-one form). Once recorded this event is never
    reinterpreted.
    """

    sampling: ExampleSampling
    inner_noise_multiplier: float
    outer_noise_multiplier: float
    inner_steps: int
    max_appearances: int
    order: Order = "first"
    query_cap: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, ExampleSampling):
            raise ValueError(f"sampling must be an ExampleSampling; got {self.sampling!r}")
        check_positive("inner_noise_multiplier", self.inner_noise_multiplier)
        check_positive("outer_noise_multiplier", self.outer_noise_multiplier)
        check_int("inner_steps", self.inner_steps, minimum=1)
        check_int("max_appearances", self.max_appearances, minimum=1)
        one_of("order", self.order, ORDERS)
        if self.order == "second":
            check_int("query_cap", self.query_cap, minimum=1)
        elif self.query_cap is not None:
            raise ValueError(
                "query_cap must be None for order 'first' (a support example reaches the outer "
                f"release only through the released adapted parameters); got {self.query_cap!r}"
            )

    @property
    def neighbouring(self) -> Neighbouring:
        """Always add/remove one example: the only relation this event describes."""
        return ADD_REMOVE

    @property
    def participant_cap(self) -> None:
        """No participant-level bound (the unit is one example), as a recorded event says."""
        return None

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready description; ``SampleLevelRound.from_dict`` inverts it exactly.

        It carries ``"kind": "sample_level_round"``, so a ledger record says its level and code
        that predates sample-level records refuses it (``unreadable event``) rather than reading
        it as a task-level round.
        """
        return {
            "kind": KIND,
            "sampling": dict(vars(self.sampling)),
            "inner_noise_multiplier": float(self.inner_noise_multiplier),
            "outer_noise_multiplier": float(self.outer_noise_multiplier),
            "inner_steps": self.inner_steps,
            "max_appearances": self.max_appearances,
            "order": self.order,
            "query_cap": self.query_cap,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SampleLevelRound:
        """Rebuild (and re-validate) a round from ``to_dict`` output; every key is required."""
        keys = {"kind", *cls.__dataclass_fields__}
        if not isinstance(data, dict) or set(data) != keys or data["kind"] != KIND:
            raise ValueError(
                f"sample-level round must have exactly the keys {sorted(keys)}; got {data!r}"
            )
        sampling = data["sampling"]
        if not isinstance(sampling, dict):
            raise ValueError(f"sampling must be a mapping; got {sampling!r}")
        return cls(
            sampling=ExampleSampling(**sampling),
            inner_noise_multiplier=data["inner_noise_multiplier"],
            outer_noise_multiplier=data["outer_noise_multiplier"],
            inner_steps=data["inner_steps"],
            max_appearances=data["max_appearances"],
            order=one_of("order", data["order"], ORDERS),
            query_cap=data["query_cap"],
        )


def split_mu_squared(event: SampleLevelRound, support: int, query: int) -> float:
    """``mu^2`` of the round when x fills ``support`` support slots and ``query`` query slots.

    Dong, Roth, Su (2022; arXiv:1905.02383 numbering), Theorem 2.7 and Corollary 3.3:
    ``support * K`` inner Gaussian steps at ``1/z_in`` each (x is in ``support`` different tasks'
    support sets, one step's sum each) and one outer Gaussian whose sensitivity is
    ``query * C_out`` (first order) or ``(query + 2 query_cap support) C_out`` (second order).
    Exact for the Gaussian releases.
    """
    check_int("support", support, minimum=0)
    check_int("query", query, minimum=0)
    reach = 2 * event.query_cap * support if event.order == "second" and event.query_cap else 0
    outer = (query + reach) / event.outer_noise_multiplier
    return outer * outer + support * event.inner_steps / event.inner_noise_multiplier**2


def gdp_mu(event: SampleLevelRound) -> float:
    """``mu`` such that the round, conditional on x being sampled, is ``mu``-GDP.

    ``mu^2`` is the largest ``split_mu_squared`` over ``a_s + a_q <= m``. It grows in each count, so
    the maximum lies on ``a_s + a_q = m``; there, with ``a_s = m - a_q``, it is a quadratic in
    ``a_q`` with leading coefficient ``(1 - 2 query_cap)^2 / z_out^2 >= 0`` (``query_cap = 0`` at
    first order): convex, so its maximum over ``0..m`` is at an endpoint (a test checks every
    split).
    First order: ``mu^2 = max(m^2 / z_out^2, m K / z_in^2)``.
    """
    m = event.max_appearances
    return math.sqrt(max(split_mu_squared(event, 0, m), split_mu_squared(event, m, 0)))


def effective_noise_multiplier(event: SampleLevelRound) -> float:
    """``1 / mu``: the noise multiplier of the one Gaussian that dominates a sampled round."""
    if not isinstance(event, SampleLevelRound):
        raise ValueError(f"event must be a SampleLevelRound; got {event!r}")
    return 1.0 / gdp_mu(event)


def dominating_round(event: SampleLevelRound) -> GaussianRound:
    """The task-level round with this round's dominating pair; an accounting device, never recorded.

    ``accounting.sample_level_bound`` (module docstring) derives it: the Poisson-subsampled
    Gaussian at ``1/mu`` for one stage, the two-stage Poisson mixture for two. Here, beside the
    event, so that composition and the ledger can compose recorded sample-level rounds without
    importing the calibration that imports them. Raises ValueError when ``1/mu`` lies outside the
    accountant's ``NOISE_MULTIPLIER_RANGE``.
    """
    z = effective_noise_multiplier(event)
    low, high = NOISE_MULTIPLIER_RANGE
    if not low <= z <= high:
        raise ValueError(
            f"effective noise multiplier 1/mu must be in [{low:g}, {high:g}] (raise the noise or "
            f"lower max_appearances / inner_steps); got {z!r}"
        )
    sampling = event.sampling
    if sampling.participants_per_round == sampling.participants:
        return GaussianRound(FlatPoissonScheme(sampling.example_rate), z)
    scheme = TwoStagePoissonScheme(
        sampling.participants, sampling.participants_per_round, sampling.example_rate
    )
    return GaussianRound(scheme, z)
