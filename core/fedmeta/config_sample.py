"""``privacy.sample``: sample-level DP-MAML's constants, and what a sample-level run refuses.

``privacy.level = "sample"`` runs the seed paper's Algorithm 2 (docs/privacy.md, "Sample level
(issue 53): the bound"): each round the sampled participants draw each of their examples with
probability ``example_rate``, build ``max_appearances`` passes of N-way tasks from them (an example
fills at most one slot a pass: ``m = max_appearances``), adapt with ``training.inner_steps`` noisy
DP-SGD steps (per-example clip ``inner_clip``, noise ``inner_noise_multiplier``) and send each
query example's gradient at the adapted parameters clipped to ``privacy.clip``; the server adds
``N(0, (privacy.noise_multiplier x privacy.clip)^2 I)`` to their sum. So at sample level
``privacy.clip`` is the per-example outer clip ``C_out`` and ``privacy.noise_multiplier`` the outer
``z_out`` (the names ``fedmeta privacy ... --level sample`` prints beside them).

:func:`check_sample_level` is the tree's cross-check: every combination the mechanism or its bound
does not cover is refused in one line naming the field and the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from fedmeta.config_section import Section

if TYPE_CHECKING:
    from fedmeta.config import Config


class SampleLevelConfig(Section):
    """The sample-level constants (read only when ``privacy.level = "sample"``)."""

    example_rate: float = Field(
        0.5, gt=0, le=1, description="q: each example of a sampled participant is used with this "
        "probability a round (Poisson), (0, 1]",
    )  # fmt: skip
    max_appearances: int = Field(
        1, ge=1, le=1000, description="m: passes a round; an example fills at most one slot a "
        "pass (a task's support or query set), so at most m slots a round",
    )  # fmt: skip
    tasks_per_pass: int = Field(
        1, ge=1, le=100_000, description="N-way tasks built per pass from a participant's classes "
        "(fewer when it has fewer than ways x tasks_per_pass classes)",
    )  # fmt: skip
    inner_clip: float = Field(
        1.0, gt=0, le=1e6, description="C_in: per-example L2 clip of each inner DP-SGD step"
    )
    inner_noise_multiplier: float | None = Field(
        None, ge=1e-4, le=1000, description="z_in: inner noise relative to inner_clip; None = "
        "calibrated with privacy.noise_multiplier (both unset) to the budget",
    )  # fmt: skip


def _refusals(cfg: Config) -> list[tuple[bool, str]]:
    """``(refused, line)`` for each combination sample level does not run."""
    p, ds, t = cfg.privacy, cfg.dataset, cfg.training
    return [
        (not p.enabled, "privacy.level = 'sample' needs privacy.enabled = true (a non-private "
         "run has no level): set privacy.enabled = true or privacy.level = 'task'"),
        (ds.name == "sinusoid", "dataset.name = 'sinusoid' has no examples to sample at sample "
         "level (each task draws fresh points of its own function, so no example is shared "
         "between tasks and the slot rule has no classes to deal; docs/privacy.md): use "
         "dataset.name = 'omniglot' or 'image_folder', or privacy.level = 'task'"),
        (ds.rotations, "dataset.rotations = true makes four rows of each drawing, which the "
         "per-example bound would count as four examples: set dataset.rotations = false at "
         "privacy.level = 'sample'"),
        (ds.norm == "batch", "dataset.norm = 'batch' normalises each example by itself when its "
         "gradient is computed alone (sample level): set dataset.norm = 'group'"),
        (not t.first_order, "training.first_order = false (second order) makes one support "
         "example move every query gradient of its task, which sample level does not calibrate: "
         "set training.first_order = true"),
        (t.inner_steps < 1, "training.inner_steps must be >= 1 at privacy.level = 'sample' (the "
         "bound counts noisy inner steps); got 0"),
        (t.meta_sgd, "training.meta_sgd = true (learned inner rates) is not analysed at sample "
         "level: set training.meta_sgd = false"),
        (t.inner_grad_clip is not None, "training.inner_grad_clip is the task level's inner "
         "clip; at sample level the inner clip is privacy.sample.inner_clip: unset "
         "training.inner_grad_clip"),
        (t.trained_parameters != "all", "training.trained_parameters must be 'all' at "
         "privacy.level = 'sample' (the per-example gradients cover every parameter)"),
        (t.precision != "fp32", "training.precision must be 'fp32' at privacy.level = 'sample'"),
        (p.adaptive_clipping.enabled, "privacy.adaptive_clipping is task level only (its bits "
         "are per task): set privacy.adaptive_clipping.enabled = false"),
        (p.subspace.dimension is not None, "privacy.subspace is task level only: unset "
         "privacy.subspace.dimension"),
        (p.neighbouring != "add_remove", "privacy.neighbouring must be 'add_remove' at "
         "privacy.level = 'sample' (add or remove one example)"),
        (cfg.sampling.stage2 != "poisson", "sampling.stage2 = 'fixed' samples tasks; at "
         "privacy.level = 'sample' examples are sampled (privacy.sample.example_rate): set "
         "sampling.stage2 = 'poisson'"),
        (cfg.federation.reply_format != "per_task", "federation.reply_format must be 'per_task' "
         "at privacy.level = 'sample' (the server re-checks each query example's row)"),
        ((p.noise_multiplier is None) != (p.sample.inner_noise_multiplier is None),
         "privacy.noise_multiplier (z_out) and privacy.sample.inner_noise_multiplier (z_in) must "
         "be both set or both unset (calibrated together): set the other or unset both"),
    ]  # fmt: skip


def check_sample_level(cfg: Config) -> None:
    """Refuse (ValueError, one line) what ``privacy.level = "sample"`` does not cover."""
    if cfg.privacy.level != "sample":
        return
    for refused, line in _refusals(cfg):
        if refused:
            raise ValueError(line)
