"""The configuration's sections on how the model learns: public pre-training and MAML training.

``public`` (:class:`PublicConfig`: the non-private warm start on declared public data) and
``training`` (:class:`TrainingConfig`: the inner loop, the server's meta-optimizer, evaluation,
model selection and checkpoints).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fedmeta.config_section import Section


class PublicConfig(Section):
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


class TrainingConfig(Section):
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
    # fp32: what every recorded result ran. bf16/tf32: issue 51's speed levers, each to be
    # measured for accuracy against fp32 (docs/benchmarks.md, "DP-MAML's recipe at speed").
    precision: Literal["fp32", "tf32", "bf16"] = Field(
        "fp32",
        description="arithmetic of the participants' inner loop and query pass: fp32, tf32 (CUDA "
        "matrix products; fp32 elsewhere) or bf16 (autocast); each task's gradient is cast to "
        "float32 before its norm and clip",
    )

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
