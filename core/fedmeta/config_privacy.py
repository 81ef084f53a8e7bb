"""The configuration's privacy section: budget, noise, clipping, the ledger, its subsections.

``privacy`` (:class:`PrivacyConfig`) with ``privacy.adaptive_clipping``
(:class:`AdaptiveClippingConfig`) and ``privacy.subspace`` (:class:`SubspaceConfig`). Checks that
need other sections (the normaliser against the dataset, the subspace against public data and the
optimizer) are the tree's, in ``fedmeta.config``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fedmeta.config_sample import SampleLevelConfig
from fedmeta.config_section import Section


class AdaptiveClippingConfig(Section):
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


class SubspaceConfig(Section):
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


class PrivacyConfig(Section):
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
    level: Literal["task", "sample"] = Field(
        "task",
        description="what the guarantee protects: one task of a participant (task), or one "
        "example (sample: DP-MAML's Algorithm 2, privacy.sample; docs/privacy.md)",
    )
    sample: SampleLevelConfig = SampleLevelConfig()

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
