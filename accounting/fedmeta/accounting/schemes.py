"""Sampling schemes and the per-round Gaussian event, as small frozen validated dataclasses.

The style follows dp-accounting's ``dp_event.py`` (one class per object, a docstring stating the
mathematics), with one difference: every field is validated on construction, so an event can never
hold a negative noise multiplier or a rate of 1.5. Errors read
``"<field> must be ...; got <value>"``.

The same scheme object drives the sampler that runs (``accounting.sampler.TwoStageSampler``) and the
event the accountant composes (``GaussianRound``): one source of truth for sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, TypeVar

from fedmeta.accounting.checks import check_int, check_positive, check_rate

Unit: TypeAlias = Literal["task", "participant"]
UNITS: tuple[Unit, ...] = ("task", "participant")

#: The neighbouring relation a guarantee is stated for. ``add_remove``: one task is added to or
#: removed from a participant's data (per-participant task counts are private). ``replace_one``: one
#: task is replaced by another (counts are public; every stage is analysed as a substitution).
Neighbouring: TypeAlias = Literal["add_remove", "replace_one"]
ADD_REMOVE: Neighbouring = "add_remove"
REPLACE_ONE: Neighbouring = "replace_one"
NEIGHBOURING_RELATIONS: tuple[Neighbouring, ...] = (ADD_REMOVE, REPLACE_ONE)

_Choice = TypeVar("_Choice", bound=str)


def one_of(name: str, value: object, allowed: tuple[_Choice, ...]) -> _Choice:
    """``value`` as one of ``allowed``, for values read from JSON or a file (narrowed once)."""
    for choice in allowed:
        if value == choice:
            return choice
    raise ValueError(f"{name} must be one of {allowed}; got {value!r}")


def _check_stage_one(participants: int, participants_per_round: int) -> None:
    """Validate stage 1 of a two-stage scheme: ``n1`` of ``P`` participants without replacement."""
    check_int("participants", participants, minimum=1)
    check_int("participants_per_round", participants_per_round, minimum=1)
    if participants_per_round > participants:
        raise ValueError(
            f"participants_per_round must be <= participants ({participants}); "
            f"got {participants_per_round}"
        )


@dataclass(frozen=True)
class TwoStagePoissonScheme:
    """Stage 1: ``participants_per_round`` of ``participants``; stage 2: Poisson(``task_rate``).

    Stage 1 draws ``n1`` of ``P`` participants uniformly without replacement; stage 2 includes each
    task of a sampled participant independently with probability ``q2 = task_rate``.

    Task-level privacy loss per round (privacy-accounting note, section 2): the mixture
    ``(1 - q1) * [no loss] + q1 * PLD(Poisson-subsampled Gaussian, rate q2, noise z)`` with
    ``q1 = n1 / P``. Tight: the worst case (a participant whose other tasks reveal whether it was
    sampled) attains it. Under ``replace_one`` the stage-2 pair is the symmetric REPLACE pair
    ``(1-q2) N(0) + q2 N(C)`` vs ``(1-q2) N(0) + q2 N(-C)`` at noise ``z`` (see
    ``accounting.composition``).
    """

    participants: int
    participants_per_round: int
    task_rate: float

    def __post_init__(self) -> None:
        _check_stage_one(self.participants, self.participants_per_round)
        check_rate("task_rate", self.task_rate)

    @property
    def participant_rate(self) -> float:
        """Stage-1 inclusion probability ``q1 = n1 / P``."""
        return self.participants_per_round / self.participants

    @property
    def largest_inclusion_probability(self) -> float:
        """Tombs et al. (2022)'s ``eta``: the largest probability that a given task is used."""
        return self.participant_rate * self.task_rate


@dataclass(frozen=True)
class TwoStageFixedScheme:
    """``participants_per_round`` of ``participants``, then ``tasks_per_round`` of each one's tasks.

    Both stages sample without replacement. ``min_tasks`` is the smallest task count of any
    registered participant (counting the protected task): the smallest participant has the largest
    stage-2 rate.

    Task-level privacy loss per round (privacy-accounting note, section 2): the mixture
    ``(1 - q1) * [no loss] + q1 * PLD(Poisson-subsampled Gaussian, rate n2/min_tasks, noise z/2)``.
    The ``z/2`` is because adding a task to a fixed-size sample is a substitution inside the sample
    and a sum of vectors clipped to ``C`` moves by up to ``2C`` (dp-accounting issue #378). Tight.
    Under ``replace_one`` the stage-2 pair is the symmetrisation of that remove pair (still ``z/2``:
    the replaced task's gradient can differ from a co-sampled task's by ``2C``).
    """

    participants: int
    participants_per_round: int
    tasks_per_round: int
    min_tasks: int

    def __post_init__(self) -> None:
        _check_stage_one(self.participants, self.participants_per_round)
        check_int("tasks_per_round", self.tasks_per_round, minimum=1)
        check_int("min_tasks", self.min_tasks, minimum=1)
        if self.tasks_per_round > self.min_tasks:
            raise ValueError(
                "tasks_per_round must be <= min_tasks, the smallest participant's task count "
                f"({self.min_tasks}); got {self.tasks_per_round}"
            )

    @property
    def participant_rate(self) -> float:
        """Stage-1 inclusion probability ``q1 = n1 / P``."""
        return self.participants_per_round / self.participants

    @property
    def task_rate(self) -> float:
        """Worst-case stage-2 rate ``n2 / min_i |T_i|``."""
        return self.tasks_per_round / self.min_tasks

    @property
    def largest_inclusion_probability(self) -> float:
        """Tombs et al. (2022)'s ``eta = q1 * n2 / min_i |T_i|``."""
        return self.participant_rate * self.task_rate


@dataclass(frozen=True)
class FlatPoissonScheme:
    """Single stage: every task is included independently with probability ``rate``.

    Privacy loss per round: the Poisson-subsampled Gaussian (Abadi et al. 2016; tight PLD by
    Koskela et al. 2020 / dp-accounting); under ``replace_one`` its symmetric REPLACE pair. There
    are no participants, so no participant-level unit.
    """

    rate: float

    def __post_init__(self) -> None:
        check_rate("rate", self.rate)


@dataclass(frozen=True)
class FixedSizeScheme:
    """Single stage: ``sample_size`` of ``population`` tasks uniformly without replacement.

    Privacy loss per round: the Poisson-subsampled Gaussian at rate ``sample_size / population`` and
    noise multiplier ``z/2`` (substitution inside the sample moves the clipped sum by ``2C``;
    privacy-accounting note, section 2). This is the dominating pair the note calls tight. Under
    ``replace_one``: the symmetrisation of that pair's remove direction, also at ``z/2``.
    """

    sample_size: int
    population: int

    def __post_init__(self) -> None:
        check_int("sample_size", self.sample_size, minimum=1)
        check_int("population", self.population, minimum=1)
        if self.sample_size > self.population:
            raise ValueError(
                f"sample_size must be <= population ({self.population}); got {self.sample_size}"
            )

    @property
    def rate(self) -> float:
        """Inclusion probability ``m / n``."""
        return self.sample_size / self.population


Scheme: TypeAlias = (
    TwoStagePoissonScheme | TwoStageFixedScheme | FlatPoissonScheme | FixedSizeScheme
)
TwoStageScheme: TypeAlias = TwoStagePoissonScheme | TwoStageFixedScheme
_SCHEME_TYPES: dict[str, type[Any]] = {
    "two_stage_poisson": TwoStagePoissonScheme,
    "two_stage_fixed": TwoStageFixedScheme,
    "flat_poisson": FlatPoissonScheme,
    "fixed_size": FixedSizeScheme,
}
_SCHEME_NAMES: dict[type[Any], str] = {v: k for k, v in _SCHEME_TYPES.items()}


@dataclass(frozen=True)
class GaussianRound:
    """One round of ``sum(clip_C(g_i) for sampled tasks i) + N(0, (z*C)^2 I)`` under ``scheme``.

    ``noise_multiplier`` is ``z`` relative to the clip norm ``C`` (``C`` itself cancels from the
    privacy analysis). ``max_tasks_per_participant`` is the most tasks one participant can
    contribute in a round (the participant-level sensitivity is that times ``C``); it defaults to
    ``tasks_per_round`` for the fixed-size stage 2 and must be given for participant-level
    accounting with a Poisson stage 2 (the server passes the largest participant's task count:
    nothing smaller caps a participant's tasks per round, so that participant-level bound is valid
    but vacuous).

    ``neighbouring`` is the relation the task-level guarantee is stated for (``add_remove`` or
    ``replace_one``); the accountant composes only rounds of one relation. The participant-level
    guarantee is the same under both (substitution of a participant inside the fixed-size stage 1).

    This is the event the server's noise step returns and the ledger records; once recorded it is
    never reinterpreted.
    """

    scheme: Scheme
    noise_multiplier: float
    max_tasks_per_participant: int | None = None
    neighbouring: Neighbouring = ADD_REMOVE

    def __post_init__(self) -> None:
        if not isinstance(self.scheme, tuple(_SCHEME_TYPES.values())):
            raise ValueError(
                "scheme must be one of TwoStagePoissonScheme, TwoStageFixedScheme, "
                f"FlatPoissonScheme, FixedSizeScheme; got {self.scheme!r}"
            )
        check_positive("noise_multiplier", self.noise_multiplier)
        if self.neighbouring not in NEIGHBOURING_RELATIONS:
            raise ValueError(
                f"neighbouring must be one of {NEIGHBOURING_RELATIONS}; got {self.neighbouring!r}"
            )
        if self.max_tasks_per_participant is not None:
            check_int("max_tasks_per_participant", self.max_tasks_per_participant, minimum=1)
            if (
                isinstance(self.scheme, TwoStageFixedScheme)
                and self.max_tasks_per_participant < self.scheme.tasks_per_round
            ):
                raise ValueError(
                    "max_tasks_per_participant must be >= tasks_per_round "
                    f"({self.scheme.tasks_per_round}); got {self.max_tasks_per_participant}"
                )

    @property
    def participant_cap(self) -> int | None:
        """The most tasks one participant contributes per round, when known."""
        if self.max_tasks_per_participant is not None:
            return self.max_tasks_per_participant
        if isinstance(self.scheme, TwoStageFixedScheme):
            return self.scheme.tasks_per_round
        return None

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready description; ``GaussianRound.from_dict`` inverts it exactly."""
        scheme_fields = dict(vars(self.scheme))
        return {
            "scheme": _SCHEME_NAMES[type(self.scheme)],
            "scheme_params": scheme_fields,
            "noise_multiplier": float(self.noise_multiplier),
            "max_tasks_per_participant": self.max_tasks_per_participant,
            "neighbouring": self.neighbouring,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GaussianRound:
        """Rebuild (and re-validate) a round from ``to_dict`` output."""
        try:
            scheme_type = _SCHEME_TYPES[data["scheme"]]
        except KeyError as error:
            raise ValueError(
                f"scheme must be one of {sorted(_SCHEME_TYPES)}; got {data!r}"
            ) from error
        scheme = scheme_type(**data["scheme_params"])
        return cls(
            scheme=scheme,
            noise_multiplier=data["noise_multiplier"],
            max_tasks_per_participant=data.get("max_tasks_per_participant"),
            # Records written before the relation was recorded were all add/remove.
            neighbouring=one_of(
                "neighbouring", data.get("neighbouring", ADD_REMOVE), NEIGHBOURING_RELATIONS
            ),
        )


#: The caveat printed instead of a participant-level epsilon with a Poisson stage 2.
PARTICIPANT_LEVEL_NOT_MEANINGFUL = (
    "not meaningful: no per-participant cap with Poisson stage 2 (the bound assumes a participant "
    "may send all its tasks in a round); use sampling.stage2=fixed for a participant-level "
    "guarantee"
)
#: The caveat for single-stage schemes, which have no participants.
PARTICIPANT_LEVEL_UNDEFINED = (
    "not defined: a single-stage scheme has no participants (task level only)"
)


def participant_level_note(event: GaussianRound) -> str | None:
    """Why the participant-level epsilon of ``event`` is not meaningful, or None when it is.

    The one definition of this caveat (the plan, the run summary and ``ledger show`` print it).
    A Poisson stage 2 never caps how many tasks a participant sends in a round, so the only sound
    participant-level sensitivity is a participant's whole task count times ``C``: without
    ``max_tasks_per_participant`` there is no bound at all, and with it (the server passes the
    largest participant's task count) the bound is valid but vacuous (~1e7 in the default run). A
    fixed-size stage 2 caps it at ``tasks_per_round``: meaningful, None.
    """
    if not isinstance(event, GaussianRound):
        raise ValueError(f"event must be a GaussianRound; got {event!r}")
    if isinstance(event.scheme, TwoStagePoissonScheme):
        return PARTICIPANT_LEVEL_NOT_MEANINGFUL
    if isinstance(event.scheme, TwoStageFixedScheme):
        return None
    return PARTICIPANT_LEVEL_UNDEFINED


def check_delta(delta: float) -> None:
    """Refuse a delta outside (0, 1), naming it."""
    if isinstance(delta, bool) or not isinstance(delta, int | float) or not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be a number in (0, 1); got {delta!r}")


def check_unit(unit: object) -> None:
    """Refuse a privacy unit other than ``task`` or ``participant``."""
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}; got {unit!r}")
