"""The one typed configuration tree of fedmeta: its root, data and output sections, cross-checks.

The tree is validated once, at the edge (``fedmeta.config_io.load_config``: a TOML file plus
``--set key=value`` overrides), and then passed explicitly; models are frozen, so nothing mutates
it. Every validation error names the dotted field and the allowed range, e.g.
``privacy.delta must be in (0, 1); got 2.0``.

The sections live by concept: ``privacy`` in ``fedmeta.config_privacy``, ``sampling`` and
``federation`` in ``fedmeta.config_federation``, ``public`` and ``training`` in
``fedmeta.config_training``; ``dataset``, ``metrics``, ``output`` and the root :class:`Config`,
whose checks span sections, here. Import each name from the module that defines it.

Keys that scripts rely on (part of the interface): ``rounds``, ``seed``, ``privacy.epsilon_budget``,
``privacy.delta``, ``privacy.noise_multiplier``, ``privacy.enabled``, ``dataset.name``,
``dataset.path``, ``federation.participants``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from fedmeta.config_federation import FederationConfig, SamplingConfig
from fedmeta.config_privacy import PrivacyConfig
from fedmeta.config_sample import check_sample_level
from fedmeta.config_section import Section
from fedmeta.config_training import PublicConfig, TrainingConfig


class ConfigError(ValueError):
    """A configuration problem; the message names the field and the allowed values."""


#: GroupNorm's groups in ConvNet4 (its default; dataset.norm = "group").
GROUP_NORM_GROUPS = 32


class DatasetConfig(Section):
    """Task data (see metalearning/)."""

    name: Literal["sinusoid", "omniglot", "image_folder"] = "sinusoid"
    path: str | None = Field(None, description="data directory (omniglot, image_folder)")
    tasks_per_participant: int = Field(200, ge=1, le=10_000_000)
    ways: int = Field(5, ge=2, le=1000)
    shots: int = Field(10, ge=1, le=1000, description="support examples per class (K for sinusoid)")
    query: int = Field(
        10, ge=1, le=10_000, description="query examples per class (per task for sinusoid)"
    )
    image_size: int = Field(28, ge=4, le=512)
    validation_tasks: int = Field(100, ge=1, le=100_000)
    test_tasks: int = Field(600, ge=1, le=100_000)
    probe_tasks: int = Field(
        32, ge=0, le=100_000, description="held-out tasks scored every round (loss)"
    )
    split: Literal["dpmaml", "background", "evaluation"] = Field(
        "dpmaml",
        description="Omniglot class split: DP-MAML's 1150/50/423 characters, Lake et al.'s "
        "background (meta-train) / evaluation (meta-test) alphabets, or the evaluation alphabets "
        "alone (445/50/164 characters), leaving the background ones public (public.warm_start)",
    )
    rotations: bool = Field(
        False, description="Omniglot: each rotation by 90/180/270 degrees is a new class (MAML)"
    )
    partition: Literal["auto", "group", "even"] = Field(
        "auto",
        description="how classes are split among participants: group = whole alphabets (Omniglot's "
        "natural non-IID split), even = an even random split; auto = group for Omniglot, else even",
    )
    disjoint_examples: bool = Field(
        False, description="build each participant's tasks so that no two share an example"
    )
    download: bool = Field(
        False, description="Omniglot: fetch the official zips into dataset.path (checksum checked)"
    )
    norm: Literal["batch", "group"] = Field(
        "batch",
        description="ConvNet4 normalisation: per-task batch statistics (no running statistics) or "
        "GroupNorm",
    )
    # 64: MAML's and DP-MAML's Omniglot network. Fewer filters mean fewer meta-parameters, and the
    # norm of the DP noise on the averaged gradient grows with their square root.
    filters: int = Field(64, ge=1, le=1024, description="ConvNet4 filters per conv block")

    @model_validator(mode="after")
    def _group_norm_divides_the_filters(self) -> DatasetConfig:
        if self.norm == "group" and self.filters % GROUP_NORM_GROUPS:
            raise ValueError(
                f"dataset.filters must be a multiple of {GROUP_NORM_GROUPS} with dataset.norm = "
                f"'group' (GroupNorm's groups); got {self.filters}: set dataset.filters to 32, 64, "
                "... or dataset.norm = 'batch'"
            )
        return self


class MetricsConfig(Section):
    """Prometheus metrics of a live run (server/fedmeta/server/monitoring/live.py)."""

    port: int | None = Field(None, ge=0, le=65535, description="None = metrics off")
    bind: str = "127.0.0.1"
    private_diagnostics: bool = Field(
        False,
        description="export clip fraction and norm quantiles (not covered by the DP guarantee)",
    )


class OutputConfig(Section):
    """Where and how results are written."""

    dir: str = "runs/fedmeta"
    progress: bool = True
    plots: bool = True


class Config(Section):
    """The whole configuration of a federation run."""

    rounds: int = Field(200, ge=1, le=10_000_000, description="planned rounds, [1, 1e7]")
    seed: int = Field(
        0, ge=0, le=2**63 - 1, description="public seed: model init, data, partitions"
    )
    privacy: PrivacyConfig = PrivacyConfig()
    sampling: SamplingConfig = SamplingConfig()
    federation: FederationConfig = FederationConfig()
    dataset: DatasetConfig = DatasetConfig()
    training: TrainingConfig = TrainingConfig()
    public: PublicConfig = PublicConfig()
    metrics: MetricsConfig = MetricsConfig()
    output: OutputConfig = OutputConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        if self.sampling.participants_per_round is None:
            # Resolved once here, so every reader sees an int; the section is a fresh copy (frozen).
            every = {"participants_per_round": self.federation.participants}
            object.__setattr__(self, "sampling", self.sampling.model_copy(update=every))
        if self.n1 > self.federation.participants:
            raise ValueError(
                "sampling.participants_per_round must be in [1, federation.participants="
                f"{self.federation.participants}]; got {self.sampling.participants_per_round}"
            )
        if self.privacy.experiment is not None and "dir" not in self.output.model_fields_set:
            # An experiment's outputs go apart from the main job's by default (runs/NAME).
            mine = {"dir": f"runs/{self.privacy.experiment}"}
            object.__setattr__(self, "output", self.output.model_copy(update=mine))
        if self.privacy.experiment is not None and self.dataset.name == "image_folder":
            raise ValueError(
                "privacy.experiment is for public benchmark data (sinusoid, omniglot); "
                "dataset.name = 'image_folder' is the participants' own data, which spends from "
                "its own budget: leave privacy.experiment unset"
            )
        if self.public.warm_start and (self.dataset.name, self.dataset.split) != (
            "omniglot",
            "evaluation",
        ):
            raise ValueError(
                "public.warm_start needs dataset.name = 'omniglot' and dataset.split = "
                "'evaluation': the public data is Omniglot's background alphabets, and only that "
                f"split keeps them out of the participants' data (got dataset.name = "
                f"{self.dataset.name!r}, dataset.split = {self.dataset.split!r})"
            )
        if self.training.trained_parameters == "norm_and_head" and self.dataset.name == "sinusoid":
            raise ValueError(
                "training.trained_parameters = 'norm_and_head' needs a model with normalisation "
                "layers, which the sinusoid's MLP has not: use 'head' or 'all'"
            )
        if self.dataset.name in ("omniglot", "image_folder") and not self.dataset.path:
            raise ValueError(f"dataset.path must be set for dataset.name = {self.dataset.name!r}")
        n2 = self.sampling.tasks_per_round
        if self.sampling.stage2 == "fixed" and n2 is not None and n2 > self.min_tasks:
            raise ValueError(
                f"sampling.tasks_per_round must be in [1, sampling.min_tasks={self.min_tasks}] "
                f"(the public lower bound on task counts); got {n2}"
            )
        check_sample_level(self)  # first: what sample level refuses, before its details
        self._check_normaliser_is_computable()
        self._check_subspace()
        self._check_model_selection()
        self._check_learned_rate_scale()
        return self

    def _check_learned_rate_scale(self) -> None:
        # Adam moves every coordinate by about meta_lr a round whatever the gradient's scale, and
        # under DP noise in a random direction: a learned rate random-walks about
        # meta_lr x sqrt(rounds) (measured: spread 0.053 after 300 rounds at 0.003,
        # docs/results.md). Four such spreads below inner_lr keep the rates positive (downhill).
        t = self.training
        if not t.meta_sgd or t.optimizer == "sgd":
            return
        walk = t.meta_lr * math.sqrt(self.rounds)
        if walk > t.inner_lr / 4:
            raise ValueError(
                f"training.meta_sgd with optimizer = '{t.optimizer}': meta_lr x sqrt(rounds) = "
                f"{walk:.3g} must be at most inner_lr / 4 = {t.inner_lr / 4:.3g}, or the learned "
                "rates can turn negative; lower training.meta_lr, raise training.inner_lr, or use "
                "training.optimizer = 'sgd'"
            )

    def _check_subspace(self) -> None:
        # The basis is computed on public data alone (that is what makes it free of privacy cost),
        # and the noise-aware optimizers assume noise on every coordinate, which it no longer is.
        if self.privacy.subspace.dimension is None:
            return
        if not self.public.warm_start:
            raise ValueError(
                "privacy.subspace.dimension needs public data for its basis: set "
                "public.warm_start = true (dataset.name = 'omniglot', dataset.split = "
                "'evaluation'), or unset privacy.subspace.dimension"
            )
        if self.training.optimizer in ("adam_bc", "adam_floor"):
            raise ValueError(
                f"privacy.subspace.dimension with training.optimizer = "
                f"'{self.training.optimizer}': that optimizer corrects for noise of one variance "
                "on every parameter, which the subspace's noise is not; use 'adam' or 'sgd'"
            )

    def _check_model_selection(self) -> None:
        # Omniglot's Lake et al. split has no validation characters: validation would use the test
        # ones, and choosing on them biases the test result. image_folder: the run checks its data.
        ds = self.dataset
        if self.training.model_selection == "best_validation" and (ds.name, ds.split) == (
            "omniglot",
            "background",
        ):
            raise ValueError(
                "training.model_selection = 'best_validation' needs validation classes apart from "
                "the test classes, and dataset.split = 'background' has none: use dataset.split = "
                "'evaluation' or 'dpmaml', or training.model_selection = 'last'"
            )

    def _check_normaliser_is_computable(self) -> None:
        # With disjoint examples tasks_per_participant only caps a count the data decides, so the
        # expected lot cannot come from the configuration, and the real counts are private.
        p, ds = self.privacy, self.dataset
        if not (p.enabled and p.normaliser is None and self.sampling.stage2 == "poisson"):
            return
        if ds.disjoint_examples and ds.name != "sinusoid":
            raise ValueError(
                "privacy.normaliser must be set with dataset.disjoint_examples = true: "
                f"dataset.tasks_per_participant ({ds.tasks_per_participant}) only caps the tasks "
                "a participant can build without sharing an example, so the expected lot (the "
                "public divisor of the noisy sum) cannot be computed from the configuration. Set "
                "privacy.normaliser = participants_per_round x sampling.task_rate x the task "
                "count you expect each participant to hold (a public estimate; the real counts "
                "stay private)"
            )

    @property
    def n1(self) -> int:
        """Participants sampled per round (``sampling.participants_per_round``, resolved)."""
        assert self.sampling.participants_per_round is not None  # resolved by _cross_checks
        return self.sampling.participants_per_round

    @property
    def min_tasks(self) -> int:
        """The public lower bound on a participant's task count (fixed-size stage 2)."""
        return self.sampling.min_tasks or self.dataset.tasks_per_participant

    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible dict (for checkpoints and summaries)."""
        return self.model_dump(mode="json")


def dotted_keys(model: Any = None, prefix: str = "") -> list[str]:
    """Every settable key of the tree, dotted (``privacy.adaptive_clipping.enabled``, ...)."""
    keys = []
    for name, info in (model or Config).model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            keys += dotted_keys(info.annotation, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys
