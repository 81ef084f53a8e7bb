"""What a participant is told: the small typed configuration a request carries (``ClientConfig``).

A participant computes the clipped query gradients of the tasks it is asked for. For that it needs
the data's specification (to rebuild its numbered tasks), the model and its inner loop, the public
seed, and how to reply; nothing else of the server's configuration. Budgets, the ledger, sampling,
noise, the meta-optimizer, evaluation, outputs, metrics, node keys and addresses stay with the
server: they are not sent (:func:`client_config` is the one place that picks what is).

Every key keeps its dotted name in the server's tree (``dataset.ways``, ``federation.reply_format``)
and every field is the server's own field (type, bounds, default and description are taken from
it, so the two cannot drift; a test compares the types). The participant validates what it
receives once (:func:`parse_client_config`), strictly: an unknown key, such as a server-only one,
or a value out of range is refused with one line naming the field. Rules that join several
sections (an image data set needs ``dataset.path``, ...) were checked by the server's
configuration this one is made from.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from fedmeta.config import Config, DatasetConfig
from fedmeta.config_federation import FederationConfig
from fedmeta.config_section import Section
from fedmeta.config_training import TrainingConfig


class ClientConfigError(ValueError):
    """A client configuration that is not valid; the message names the field, on one line."""


def _server_field(section: type[BaseModel], name: str) -> Any:
    """The server's declaration of ``section.name`` (bounds, default, description), shared."""
    return section.model_fields[name]


class ClientDatasetConfig(Section):
    """The task data's specification: what a participant rebuilds its numbered tasks from."""

    name: Literal["sinusoid", "omniglot", "image_folder"] = _server_field(DatasetConfig, "name")
    path: str | None = _server_field(DatasetConfig, "path")
    tasks_per_participant: int = _server_field(DatasetConfig, "tasks_per_participant")
    ways: int = _server_field(DatasetConfig, "ways")
    shots: int = _server_field(DatasetConfig, "shots")
    query: int = _server_field(DatasetConfig, "query")
    image_size: int = _server_field(DatasetConfig, "image_size")
    split: Literal["dpmaml", "background", "evaluation"] = _server_field(DatasetConfig, "split")
    rotations: bool = _server_field(DatasetConfig, "rotations")
    partition: Literal["auto", "group", "even"] = _server_field(DatasetConfig, "partition")
    disjoint_examples: bool = _server_field(DatasetConfig, "disjoint_examples")
    download: bool = _server_field(DatasetConfig, "download")
    norm: Literal["batch", "group"] = _server_field(DatasetConfig, "norm")
    filters: int = _server_field(DatasetConfig, "filters")


class ClientTrainingConfig(Section):
    """The model's shape and the inner loop of training (the meta-optimizer is the server's)."""

    inner_steps: int = _server_field(TrainingConfig, "inner_steps")
    inner_lr: float = _server_field(TrainingConfig, "inner_lr")
    first_order: bool = _server_field(TrainingConfig, "first_order")
    inner_grad_clip: float | None = _server_field(TrainingConfig, "inner_grad_clip")
    inner_step_check: bool = _server_field(TrainingConfig, "inner_step_check")
    zero_head: bool = _server_field(TrainingConfig, "zero_head")
    meta_sgd: bool = _server_field(TrainingConfig, "meta_sgd")
    trained_parameters: Literal["all", "head", "norm_and_head"] = _server_field(
        TrainingConfig, "trained_parameters"
    )
    chunk_size: int | None = _server_field(TrainingConfig, "chunk_size")
    precision: Literal["fp32", "tf32", "bf16"] = _server_field(TrainingConfig, "precision")


class ClientFederationConfig(Section):
    """How the data is partitioned, how to reply and where to compute."""

    participants: int = _server_field(FederationConfig, "participants")  # the partition's parts
    reply_format: Literal["per_task", "sum_and_norms"] = _server_field(
        FederationConfig, "reply_format"
    )
    client_device: str = _server_field(FederationConfig, "client_device")


class ClientSampleLevel(Section):
    """A sample-level round's part for the participant (privacy.level = "sample", issue 53).

    The slot rule (``metalearning.example_slots.SlotRule``: ``ways`` from the dataset, ``passes =
    max_appearances``) and the inner DP-SGD's constants, resolved by the server's plan (a
    calibrated ``inner_noise_multiplier`` included). The inner noise is the participant's to draw:
    from its own CSPRNG, or, in the reproducible test mode, from ``insecure_test_seed``.
    """

    example_rate: float = Field(gt=0, le=1)
    max_appearances: int = Field(ge=1, le=1000)
    tasks_per_pass: int = Field(ge=1, le=100_000)
    support_share: float = Field(gt=0, lt=1)
    inner_clip: float = Field(gt=0, le=1e6)
    inner_noise_multiplier: float = Field(gt=0)
    support_normaliser: int = Field(ge=1)
    insecure_test_seed: int | None = Field(None, ge=0)


class ClientConfig(Section):
    """Everything a participant reads: the ``config`` of a registration or gradient request."""

    seed: int = _server_field(Config, "seed")
    dataset: ClientDatasetConfig = ClientDatasetConfig()
    training: ClientTrainingConfig = ClientTrainingConfig()
    federation: ClientFederationConfig = ClientFederationConfig()
    sample: ClientSampleLevel | None = None  # None: a task-level (or non-private) round


def client_config(cfg: Config, sample: ClientSampleLevel | None = None) -> ClientConfig:
    """The part of the server's configuration its participants are sent (the one place it is cut).

    Each section keeps the server's values of the keys it declares, under the same names;
    ``sample``: a sample-level run's part, resolved by its plan (server/sample_plan.py).
    """
    return ClientConfig(
        seed=cfg.seed,
        sample=sample,
        dataset=ClientDatasetConfig.model_validate(_declared(cfg.dataset, ClientDatasetConfig)),
        training=ClientTrainingConfig.model_validate(_declared(cfg.training, ClientTrainingConfig)),
        federation=ClientFederationConfig.model_validate(
            _declared(cfg.federation, ClientFederationConfig)
        ),
    )


def _declared(section: BaseModel, kind: type[BaseModel]) -> dict[str, Any]:
    """The values of ``section`` that ``kind`` declares."""
    return section.model_dump(include=set(kind.model_fields))


def parse_client_config(text: str) -> ClientConfig:
    """A received configuration (JSON), validated once; raises :class:`ClientConfigError`."""
    try:
        return ClientConfig.model_validate_json(text)
    except ValidationError as error:
        raise ClientConfigError(_one_line(error)) from None


def _one_line(error: ValidationError) -> str:
    """Every problem on one line: keys a participant is not sent, then each invalid value."""
    unknown, problems = [], []
    for e in error.errors():
        field = ".".join(["config", *(str(part) for part in e["loc"])])
        if e["type"] == "extra_forbidden":
            unknown.append(field)
            continue
        got = e.get("input")
        shown = "" if isinstance(got, dict | str) and len(str(got)) > 60 else f"; got {got!r}"
        problems.append(f"{field}: {e['msg']}{shown}")
    if unknown:
        more = f" and {len(unknown) - 4} more" if len(unknown) > 4 else ""
        named = ", ".join(unknown[:4]) + more
        problems.insert(0, f"{named}: not a participant's setting (a participant is sent "
                           f"{', '.join(ClientConfig.model_fields)} only): run the same fedmeta "
                           "version on the server and every participant")  # fmt: skip
    return "; ".join(problems)
