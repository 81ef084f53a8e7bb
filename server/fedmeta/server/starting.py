"""The model a run starts from (round 0): what it is, and its scores, named for what they are.

A run's curves and its summary compare the released model with the model the private rounds began
at. That model is either untrained (a public seed) or a public warm start (``public.warm_start``:
pre-trained without privacy on declared public classes); a summary that called a warm start's
score "untrained" made a private curve that stayed under its warm start look like progress. Both
starting models are public, and their validation tasks are server-held classes, so scoring them is
post-processing of public data: it costs no privacy.

``StartingModel`` is recorded once, before round 1, in every checkpoint (a resumed run keeps the
round-0 point of its first invocation), and read by the summary and the plots.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypeAlias

Source: TypeAlias = Literal["untrained", "public warm start"]
SOURCES: tuple[Source, ...] = ("untrained", "public warm start")


@dataclass(frozen=True)
class StartingModel:
    """Round 0: the starting model's source, validation score and the data's epsilon before it.

    ``epsilon_before``: the task-level epsilon the data's ledger held before this run's first round
    (``None`` in a non-private run, which has no ledger).
    """

    source: Source
    validation_metric: float | None
    epsilon_before: float | None

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}; got {self.source!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; :meth:`from_dict` inverts it."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> StartingModel | None:
        """The record a checkpoint holds (``None``: a checkpoint written before it existed)."""
        if not data:
            return None
        validation, before = data.get("validation_metric"), data.get("epsilon_before")
        return cls(
            source=data["source"],
            validation_metric=None if validation is None else float(validation),
            epsilon_before=None if before is None else float(before),
        )


def source_of(public_warm_start: bool) -> Source:
    """What the starting model is: a public warm start, or untrained."""
    return "public warm start" if public_warm_start else "untrained"


def starting_metric_of(summary: Mapping[str, Any]) -> float | None:
    """The starting model's test metric from any ``summary.json``, old or new.

    Summaries written before ``starting_metric`` named it ``untrained_metric``, even where the
    start was a public warm start (their ``public_warm_start`` says which).
    """
    value = summary.get("starting_metric", summary.get("untrained_metric"))
    return None if value is None else float(value)


def model_start_fields(
    public: Mapping[str, Any] | None,
    trained: Mapping[str, Any] | None,
    selection: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What was public, which meta-parameters the rounds trained, which model was tested.

    ``selection``: server/fedmeta/server/selection.py's ``ModelSelection.summary`` (None: the last
    model).
    """
    return {
        "public_warm_start": None if public is None else dict(public),
        "trained_parameters": None if trained is None else dict(trained),
        "model_selection": dict(selection) if selection else {"rule": "last"},
    }


def starting_fields(
    public_warm_start: bool, test: float | None, start: StartingModel | None
) -> dict[str, Any]:
    """The starting model's scores, named for what it is (``untrained_metric`` before).

    ``start`` is None for a run resumed from a checkpoint written before round 0 was recorded;
    its source is then ``public.warm_start``'s (``public_warm_start``).
    """
    source = start.source if start is not None else source_of(public_warm_start)
    return {
        "starting_metric": test,
        "starting_model": {
            "source": source,
            "test_metric": test,
            "validation_metric": None if start is None else start.validation_metric,
            "epsilon_before": None if start is None else start.epsilon_before,
        },
    }
