"""DP-MAML's own accounting of its sample-level setting, AS PUBLISHED: NOT A GUARANTEE (issue 53).

DP-MAML (Section 5.4, equations 7-10; Section 6.4) accounts one moments-accountant mechanism per
meta-update: a lot of ``L`` tasks drawn from ``N`` tasks (``q = L / N``), noise multiplier ``z``,
composed over ``T`` updates, for task-level and sample-level runs alike. Its Section 6.4 reports
Omniglot 5-way K-shot at ``(1.18, 1e-5)`` with ``z = 1`` and ``L = 10``. As an example-level
statement this reading ignores (1) that one example fills many slots (appearances), (2) that the
inner loop's noisy steps release about the support set too (both loops compose), and (3) that the
example, not the task, is the sampled unit. It is reported beside the valid bound
(``accounting.sample_level_bound``) for comparison and must never enforce a budget.

Two numbers, both labelled:

* ``dpmaml_moments_epsilon``: the paper's formula. Abadi et al. (2016), Lemma 3, leading term
  ``alpha(lambda) <= q^2 lambda (lambda + 1) / ((1 - q) z^2)`` per update (their equation 7, the
  ``O(q^3 lambda^3 / z^3)`` term dropped as the paper drops it: this errs LOW), composed over ``T``
  updates (equation 8) and converted by the moments accountant's tail bound (Abadi et al.,
  ``delta = min_lambda exp(alpha(lambda) - lambda epsilon)``), over the integer moments the lemma
  allows, ``1 <= lambda <= z^2 ln(1 / (q z))`` (needs ``z >= 1``,
  ``q < 1/(16 z)``).
* ``dpmaml_per_update_epsilon``: the same per-update event computed exactly (pessimistic PLD,
  ``accounting.composition``): a Poisson-subsampled Gaussian at the task rate. A valid *task-level*
  bound only for Poisson lots of tasks that are each one owner's data; still not example level.
"""

from __future__ import annotations

import math

from fedmeta.accounting.composition import check_rounds, epsilon
from fedmeta.accounting.schemes import FlatPoissonScheme, GaussianRound, check_delta

#: The label every caller prints beside these numbers.
NOT_A_GUARANTEE = (
    "DP-MAML's reading, not an example-level guarantee: ignores appearances and the inner loop"
)


def _task_rate(tasks_per_lot: int, tasks: int) -> float:
    for name, value in (("tasks_per_lot", tasks_per_lot), ("tasks", tasks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
    if tasks_per_lot > tasks:
        raise ValueError(f"tasks_per_lot must be <= tasks ({tasks}); got {tasks_per_lot}")
    return tasks_per_lot / tasks


def _check_noise(noise_multiplier: float) -> float:
    ok = isinstance(noise_multiplier, int | float) and not isinstance(noise_multiplier, bool)
    if not (ok and math.isfinite(noise_multiplier) and noise_multiplier > 0.0):
        raise ValueError(f"noise_multiplier must be a finite number > 0; got {noise_multiplier!r}")
    return float(noise_multiplier)


def dpmaml_moments_epsilon(
    tasks_per_lot: int, tasks: int, noise_multiplier: float, rounds: int, delta: float
) -> float:
    """AS PUBLISHED, NOT A GUARANTEE: DP-MAML's moments-accountant epsilon (module docstring).

    Refuses the settings outside Lemma 3's hypotheses (``z >= 1``, ``q < 1 / (16 z)``), as the paper
    does (its Section 6.3.5).
    """
    q = _task_rate(tasks_per_lot, tasks)
    z = _check_noise(noise_multiplier)
    rounds = check_rounds("rounds", rounds, minimum=1)
    check_delta(delta)
    if z < 1.0 or q >= 1.0 / (16.0 * z):
        raise ValueError(
            "noise_multiplier must be >= 1 and tasks_per_lot / tasks < 1 / (16 noise_multiplier) "
            f"(Abadi et al. 2016, Lemma 3); got z={z!r}, q={q!r}"
        )
    largest = math.floor(z * z * math.log(1.0 / (q * z)))
    per_moment = q * q / ((1.0 - q) * z * z)
    return min(
        (rounds * per_moment * lam * (lam + 1) + math.log(1.0 / delta)) / lam
        for lam in range(1, max(1, largest) + 1)
    )


def dpmaml_per_update_epsilon(
    tasks_per_lot: int, tasks: int, noise_multiplier: float, rounds: int, delta: float
) -> float:
    """NOT AN EXAMPLE-LEVEL GUARANTEE: one Poisson-subsampled Gaussian per update at ``L / N``."""
    q = _task_rate(tasks_per_lot, tasks)
    event = GaussianRound(FlatPoissonScheme(q), _check_noise(noise_multiplier))
    return epsilon([(event, check_rounds("rounds", rounds, minimum=1))], delta)
