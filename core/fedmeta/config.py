"""The one typed configuration tree of fedmeta: its sections, their ranges and cross-checks.

The tree is validated once, at the edge (``fedmeta.config_io.load_config``: a TOML file plus
``--set key=value`` overrides), and then passed explicitly; models are frozen, so nothing mutates
it. Every validation error names the dotted field and the allowed range, e.g.
``privacy.delta must be in (0, 1); got 2.0``.

Keys that scripts rely on (part of the interface): ``rounds``, ``seed``, ``privacy.epsilon_budget``,
``privacy.delta``, ``privacy.noise_multiplier``, ``privacy.enabled``, ``dataset.name``,
``dataset.path``, ``federation.participants``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ConfigError(ValueError):
    """A configuration problem; the message names the field and the allowed values."""


class _Section(BaseModel):
    # strict: no bool read as a number, no string read as a number (a TOML `rounds = true` or
    # `epsilon_budget = "8"` is refused, not run); an integer is a valid float.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, strict=True)


class AdaptiveClippingConfig(_Section):
    """Accounted adaptive clipping (Andrew et al. 2021): a private quantile estimate of task norms.

    Each round the sampled tasks report whether their norm was under the bound, the server releases
    the noisy count of those bits together with the gradient sum, both from the one lot and both in
    the round's accounting event (``privacy.noise_multiplier`` is the *total* z), and moves the
    bound geometrically toward ``target_quantile`` (docs/privacy.md, "Adaptive clipping").
    """

    # On by default: on the default sinusoid job at epsilon 8 it took the test MSE from 0.44 to 0.32
    # (non-private 0.28), for 0.08% more gradient noise (docs/results.md).
    enabled: bool = Field(True, description="adapt the clip bound C every round (off = fixed C)")
    target_quantile: float = Field(
        0.5, gt=0, lt=1, description="gamma: the quantile of per-task norms C tracks, (0, 1)"
    )
    learning_rate: float = Field(
        0.2, gt=0, le=10, description="eta_C of the geometric update C *= exp(-eta (b~ - gamma))"
    )
    count_noise: float | None = Field(
        None,
        gt=0,
        le=1e9,
        description="standard deviation of the noise on the count of tasks under the bound, in "
        "tasks; must exceed z / 2; None = max(public expected lot / 20 (Andrew et al.), z)",
    )
    initial_clip: float | None = Field(
        None, gt=0, le=1e6, description="C in the first round; None = privacy.clip"
    )
    min_clip: float = Field(1e-6, gt=0, le=1e6, description="C never goes below this")
    max_clip: float = Field(1e6, gt=0, le=1e6, description="C never goes above this")

    @model_validator(mode="after")
    def _bounds(self) -> AdaptiveClippingConfig:
        if self.min_clip >= self.max_clip:
            raise ValueError(
                "privacy.adaptive_clipping.min_clip must be < privacy.adaptive_clipping.max_clip "
                f"({self.max_clip:g}); got {self.min_clip:g}"
            )
        c = self.initial_clip
        if c is not None and not self.min_clip <= c <= self.max_clip:
            raise ValueError(
                f"privacy.adaptive_clipping.initial_clip must be in [min_clip={self.min_clip:g}, "
                f"max_clip={self.max_clip:g}]; got {c:g}"
            )
        return self


class SubspaceConfig(_Section):
    """Private training in a subspace learned from public data (docs/privacy.md, "The subspace").

    Gradient embedding perturbation (Yu, Zhang, Chen, Yin, Liu 2021) and projected DP-SGD (Zhou, Wu,
    Banerjee 2021): the server projects the round's clipped sum onto the top ``dimension``
    directions of clipped MAML gradients computed on public tasks at the released model, adds the
    noise there (``dimension`` values instead of one per parameter) and drops the residual. The
    basis reads public data and the released model only, so it costs no privacy; a round is the
    same Gaussian event, with the same sensitivity C.
    """

    dimension: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description="k: the subspace's dimension; None = off (noise on every trained parameter)",
    )
    # 50: one basis per validation interval of the CPU designs (training.eval_every); not tuned.
    refresh_every: int = Field(
        50,
        ge=1,
        le=10_000_000,
        description="recompute the basis at the released model every k rounds",
    )
    basis_tasks: int = Field(
        1000,
        ge=1,
        le=100_000,
        description="public tasks whose clipped gradients span the basis; at least dimension",
    )

    @model_validator(mode="after")
    def _enough_tasks(self) -> SubspaceConfig:
        if self.dimension is not None and self.basis_tasks < self.dimension:
            raise ValueError(
                f"privacy.subspace.basis_tasks must be >= privacy.subspace.dimension="
                f"{self.dimension} (k gradients span at most k directions); got {self.basis_tasks}"
            )
        return self


#: An experiment's name (``privacy.experiment``): it names a file in the state directory.
EXPERIMENT_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class PrivacyConfig(_Section):
    """Task-level (epsilon, delta)-DP: budget, noise, clipping and the durable ledger."""

    enabled: bool = Field(
        True, description="false = non-private baseline: no clip, no noise, no ledger"
    )
    # The budget belongs to the data (docs/ledger.md): these two set it when a run first spends
    # on this data; afterwards the recorded budget rules, and a different value given here is
    # refused, never applied (`fedmeta ledger new-budget` is the one way to another budget).
    epsilon_budget: float = Field(
        8.0,
        gt=0,
        le=1000,
        description="task-level epsilon budget of the data, (0, 1000]; set when a run first "
        "spends on this data, then fixed (unset: the recorded one)",
    )
    delta: float = Field(
        1e-5, gt=0, lt=1, description="delta, (0, 1); fixed per budget (unset: the budget's)"
    )
    noise_multiplier: float | None = Field(
        None,
        ge=1e-4,
        le=1000,
        description="z; None = calibrate z so that `rounds` rounds spend the budget",
    )
    target_epsilon: float | None = Field(
        None,
        gt=0,
        le=1000,
        description="this run's own epsilon: z is calibrated to it, and the run starts only if "
        "it fits what every participant has left of the budget; None = the whole budget",
    )
    experiment: str | None = Field(
        None,
        pattern=EXPERIMENT_NAME,
        description="an experiment on public benchmark data: a ledger of its own "
        "(experiments/NAME.sqlite in the state directory) and every output marked as an "
        "experiment; None = the data's own budget",
    )
    clip: float = Field(1.0, gt=0, le=1e6, description="per-task L2 clip bound C, (0, 1e6]")
    clip_tolerance: float = Field(
        1e-4, ge=0, le=0.1, description="relative slack before a reply's norm counts as a violation"
    )
    report_every: int = Field(
        1,
        ge=1,
        le=1_000_000,
        description="task-level epsilon in the record of every k-th round (and of round 1, the "
        "evaluated rounds and the last), computed in the background (a PLD composition, up to 2 s "
        "of one core each); raise it only to save that CPU",
    )
    neighbouring: Literal["add_remove", "replace_one"] = Field(
        "add_remove",
        description="the relation the guarantee is stated for: add or remove one task (task "
        "counts stay private), or replace one task by another (task counts are public)",
    )
    normaliser: float | None = Field(
        None,
        gt=0,
        le=1e9,
        description="public divisor of the noisy sum; None = the expected number of tasks per "
        "round computed from this configuration (never from the participants' real counts)",
    )
    ledger_path: str | None = Field(
        None,
        description="SQLite budget ledger; None = ledger.sqlite in fedmeta's state directory "
        "($FEDMETA_STATE_DIR, else $XDG_STATE_HOME/fedmeta, else ~/.local/state/fedmeta)",
    )
    insecure_test_seed: int | None = Field(
        None, ge=0, description="TESTS ONLY: seeds noise and sampling reproducibly (not private)"
    )
    adaptive_clipping: AdaptiveClippingConfig = AdaptiveClippingConfig()
    subspace: SubspaceConfig = SubspaceConfig()

    @model_validator(mode="after")
    def _one_ledger(self) -> PrivacyConfig:
        if self.experiment is not None and self.ledger_path is not None:
            raise ValueError(
                "privacy.experiment and privacy.ledger_path both name a ledger: give one (an "
                "experiment's ledger is experiments/NAME.sqlite in the state directory)"
            )
        return self

    @model_validator(mode="after")
    def _adaptive(self) -> PrivacyConfig:
        adaptive = self.adaptive_clipping
        if not adaptive.enabled:
            return self
        if not self.enabled:
            # A non-private run clips nothing, so the section (on by default) is simply unused; an
            # error here would also break every saved non-private configuration read back.
            return self
        start = adaptive.initial_clip if adaptive.initial_clip is not None else self.clip
        if not adaptive.min_clip <= start <= adaptive.max_clip:
            raise ValueError(
                "privacy.clip must be in [privacy.adaptive_clipping.min_clip="
                f"{adaptive.min_clip:g}, max_clip={adaptive.max_clip:g}] when it is the initial "
                f"clip; got {start:g}"
            )
        z, sb = self.noise_multiplier, adaptive.count_noise
        if z is not None and sb is not None and not 2 * sb > z:
            raise ValueError(
                f"privacy.adaptive_clipping.count_noise must be > privacy.noise_multiplier / 2 = "
                f"{z / 2:g} (the count alone would spend the round's whole noise); got {sb:g}"
            )
        return self


class SamplingConfig(_Section):
    """Two-stage sampling: n1 participants without replacement, then tasks within each."""

    # Unset: every participant every round. At equal expected lot this needs less noise than
    # sampling a few participants (docs/privacy.md, "Planning a run"; measured in docs/results.md).
    participants_per_round: int | None = Field(
        None, ge=1, le=100_000, description="n1, [1, participants]; unset = all participants"
    )
    stage2: Literal["poisson", "fixed"] = "poisson"
    task_rate: float = Field(0.05, gt=0, le=1, description="q2 for Poisson stage 2, (0, 1]")
    tasks_per_round: int | None = Field(
        None, ge=1, le=1_000_000, description="n2 for the fixed stage 2 (tasks per participant)"
    )
    min_tasks: int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description="fixed stage 2: public lower bound on every participant's task count (the "
        "accounted rate is n2 / min_tasks; a participant with fewer is refused at registration); "
        "None = dataset.tasks_per_participant",
    )

    @model_validator(mode="after")
    def _fixed_needs_n2(self) -> SamplingConfig:
        if self.stage2 == "fixed" and self.tasks_per_round is None:
            raise ValueError(
                "sampling.tasks_per_round must be set (>= 1) when sampling.stage2 = 'fixed'"
            )
        return self


class FederationConfig(_Section):
    """Participants and the transport."""

    participants: int = Field(
        20, ge=1, le=100_000, description="number of participants P, [1, 100000]"
    )
    backend: Literal["ray", "inprocess"] = Field(
        # In-process by default: the same ServerApp Grid API and ClientApp, without Ray's start-up
        # and actor hops (faster on the default job, docs/benchmarks.md "Simulation backend").
        "inprocess",
        description="inprocess = the ClientApp called in the ServerApp's process through a Flower "
        "Grid; ray = Flower's Ray simulation engine (one actor per client_num_cpus)",
    )
    round_timeout_s: float = Field(
        120.0, gt=0, le=86_400, description="per-round reply timeout (s)"
    )
    register_timeout_s: float = Field(
        120.0, gt=0, le=86_400, description="longest wait for min_participants at the start (s)"
    )
    superlink_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="deployed runs: end the run (summary, exit 1, resume command) once the "
        "SuperLink has restarted, forgotten this run, or not answered for this long (s)",
    )
    min_participants: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description="start once this many participants registered (None = "
        "sampling.participants_per_round); later joiners are sampled from their next round",
    )
    node_keys: dict[str, str] = Field(
        default_factory=dict,
        description="participant id -> node public-key fingerprint (SHA256:...); when set, only "
        "nodes with a bound key are admitted, and only as their bound participant",
    )
    max_consecutive_failures: int = Field(
        3,
        ge=1,
        le=1_000_000,
        description="suspend a participant after this many consecutive timeouts or unavailable "
        "replies, until its node reconnects",
    )
    round_min_seconds: float = Field(
        0.0,
        ge=0,
        le=86_400,
        description="pad every round to at least this long, so that when rounds end does not "
        "depend on how many tasks were sampled (0 = no padding)",
    )
    reply_format: Literal["per_task", "sum_and_norms"] = "per_task"
    client_num_cpus: float = Field(
        1.0, gt=0, le=1024, description="Ray resources per ClientApp actor"
    )
    client_num_gpus: float = Field(0.0, ge=0, le=64)
    ray_address: str | None = Field(
        None,
        description="attach to this running Ray cluster (host:port of its head, or "
        "ray://host:10001) instead of starting a private Ray instance; selects backend ray; "
        "None = private",
    )
    client_device: str = Field("auto", description="auto (CUDA when present), cpu or cuda")

    @model_validator(mode="before")
    @classmethod
    def _a_ray_address_means_ray(cls, data: Any) -> Any:
        # A cluster address is only read by the Ray backend: with the in-process default it was
        # ignored, and the run stayed on this machine. Given without a backend, it selects Ray.
        # Beside an explicit in-process backend it is refused where a run starts
        # (simulation/fedmeta/simulation/simulate.py), not here: saved configurations state their
        # backend, and one
        # written before this rule must still load (evaluate, resume with backend = 'ray').
        if not isinstance(data, dict):
            return data
        address = data.get("ray_address")
        if isinstance(address, str) and not address.strip():
            return {**data, "ray_address": None}  # a blank address is no address
        if address is not None and "backend" not in data:
            return {**data, "backend": "ray"}
        return data


#: GroupNorm's groups in ConvNet4 (its default; dataset.norm = "group").
GROUP_NORM_GROUPS = 32


class DatasetConfig(_Section):
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


class PublicConfig(_Section):
    """Non-private pre-training on declared public data: a warm start for private training.

    Public pre-training is where DP few-shot learning does best (Tobaben et al. 2023), provided the
    public data is disjoint from the participants'. The public data here is Omniglot's background
    alphabets, which only ``dataset.split = "evaluation"`` leaves out of the participants' data;
    every output of such a run says so (summary, records), and its results are separate rows.
    """

    warm_start: bool = Field(
        False,
        description="pre-train the meta-model (non-private MAML) on the public classes before "
        "round 1; needs dataset.name = 'omniglot' and dataset.split = 'evaluation'",
    )
    # 2000: the warm start alone scored 88.1% on the 5-way evaluation-split test tasks after 2000
    # steps, 78.8% after 500 (docs/results.md); about 30 minutes on one CPU core, cached after.
    steps: int = Field(2000, ge=1, le=1_000_000, description="pre-training meta-steps")
    tasks_per_step: int = Field(16, ge=1, le=10_000, description="public tasks per meta-step")
    meta_lr: float = Field(1e-3, gt=0, le=1, description="pre-training Adam learning rate")


class TrainingConfig(_Section):
    """MAML inner loop and the server's meta-optimizer (server/fedmeta/server/optimizer.py)."""

    inner_steps: int = Field(1, ge=0, le=1000)
    inner_lr: float = Field(0.01, gt=0, le=10)
    first_order: bool = False
    # 0.03: of 0.01, 0.02 and 0.03 the best private and non-private sinusoid MSE (docs/results.md).
    meta_lr: float = Field(0.03, gt=0, le=10)
    optimizer: Literal["adam", "adam_bc", "sgd", "adam_floor"] = Field(
        "adam",
        description="adam (DP-MAML's), adam_bc (DP-AdamBC: Adam corrected for the DP noise "
        "variance), sgd with momentum, or adam_floor (Adam, eps = adam_noise_floor x noise std)",
    )
    adam_noise_floor: float = Field(
        1.0, ge=0, le=1000, description="adam_floor: eps as a multiple of the noise std"
    )
    momentum: float = Field(0.9, ge=0, lt=1, description="sgd momentum, [0, 1)")
    adam_bc_floor: float | None = Field(
        None,
        gt=0,
        le=1,
        description="adam_bc: floor of the corrected second moment; None = the noise variance",
    )
    lr_schedule: Literal["constant", "cosine"] = "constant"
    lr_min_factor: float = Field(
        0.1, ge=0, le=1, description="cosine: the final rate as a fraction of meta_lr"
    )
    warmup_rounds: int = Field(0, ge=0, le=1_000_000, description="linear warm-up rounds")
    eval_every: int = Field(25, ge=1, le=1_000_000, description="validate every k rounds")
    # 10: Finn et al. (2017)'s sinusoid protocol (train 1 step, test 10), the default job's measured
    # setting; a mismatch, which summary.json's `adaptation` states. None = inner_steps (matched).
    eval_inner_steps: int | None = Field(
        10, ge=0, le=1000, description="test-time adaptation steps; None = inner_steps"
    )
    eval_inner_lr: float | None = Field(
        None, gt=0, le=10, description="test-time inner rate; None = inner_lr"
    )
    inner_grad_clip: float | None = Field(
        None, gt=0, description="L2 bound on each inner-loop gradient (train and test); None = none"
    )
    zero_head: bool = Field(
        False, description="N-way models: start the classifier head at zero (Kao et al. 2022)"
    )
    meta_sgd: bool = Field(
        False,
        description="learn one inner learning rate per meta-parameter with the meta-model "
        "(Meta-SGD, Li et al. 2017), each starting at inner_lr; doubles the meta-parameters",
    )
    inner_step_check: bool = Field(
        True, description="keep an inner step only if the support loss does not rise (train/test)"
    )
    trained_parameters: Literal["all", "head", "norm_and_head"] = Field(
        "all",
        description="meta-parameters private training updates: all, the output layer alone, or "
        "the per-layer normalisation scale and shift with it; the rest keep their initial (or "
        "public warm-start) values, and the inner loop adapts every parameter",
    )
    # "last" by default: every recorded result before it tested the last model.
    # server/fedmeta/server/selection.py
    # says why the validated choice costs no privacy.
    model_selection: Literal["last", "best_validation"] = Field(
        "last",
        description="the model the run tests and releases: the last, or the best on the server's "
        "validation tasks among the starting model and the validated rounds",
    )
    checkpoint_every: int = Field(25, ge=1, le=1_000_000, description="checkpoint every k rounds")
    chunk_size: int | None = Field(None, ge=1, le=100_000)

    @model_validator(mode="after")
    def _learned_rates_are_usable(self) -> TrainingConfig:
        if not self.meta_sgd:
            return self
        # A test-time rate would replace the rates the run learned, so the model would be tested
        # with an inner loop it was never trained for.
        if self.eval_inner_lr is not None:
            raise ValueError(
                "training.eval_inner_lr must be unset with training.meta_sgd = true: the inner "
                "rates are learned and used at test too (remove eval_inner_lr)"
            )
        # No rate is in the head or normalisation subsets: a subset run would be plain MAML.
        if self.trained_parameters != "all":
            raise ValueError(
                "training.meta_sgd = true needs training.trained_parameters = 'all': the learned "
                f"rates are not in the '{self.trained_parameters}' subset, so they would never "
                "move (set trained_parameters = 'all' or meta_sgd = false)"
            )
        return self


class MetricsConfig(_Section):
    """Prometheus metrics of a live run (server/fedmeta/server/monitoring/live.py)."""

    port: int | None = Field(None, ge=0, le=65535, description="None = metrics off")
    bind: str = "127.0.0.1"
    private_diagnostics: bool = Field(
        False,
        description="export clip fraction and norm quantiles (not covered by the DP guarantee)",
    )


class OutputConfig(_Section):
    """Where and how results are written."""

    dir: str = "runs/fedmeta"
    progress: bool = True
    plots: bool = True


class Config(_Section):
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
