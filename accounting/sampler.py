"""``TwoStageSampler``: executes exactly the sampling scheme that the accountant models.

The scheme object that builds the ``GaussianRound`` event is the one this sampler runs, so the two
cannot drift apart (conventions, item 5). Sampling must be random and secret for amplification to
hold: the generator is seeded from ``secrets`` unless a test passes a seed explicitly.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

import numpy as np

from accounting.schemes import TwoStageFixedScheme, TwoStagePoissonScheme


class TwoStageSampler:
    """Sample participants (stage 1, without replacement) then tasks inside each (stage 2).

    ``sample(task_counts)`` takes the *available* participants this round (id -> number of tasks,
    public metadata) and returns ``{participant id: sorted task ids}`` for the sampled ones. Stage 1
    draws ``participants_per_round`` of the available participants uniformly without replacement;
    fewer available than that is an error (the accounted rate would be wrong). Stage 2 is Poisson
    with ``task_rate`` or ``tasks_per_round`` without replacement (a participant with fewer tasks
    than that, or fewer than the scheme's ``min_tasks``, is an error: the accountant's worst case
    assumed more).

    A sampled participant may receive an empty task list under Poisson stage 2: it is still part of
    the round (skipping it would change the mechanism).
    """

    def __init__(
        self,
        scheme: TwoStagePoissonScheme | TwoStageFixedScheme,
        rng: np.random.Generator | None = None,
        *,
        seed: int | None = None,
    ) -> None:
        """Create a sampler; ``seed`` is for tests only (a known seed makes sampling public)."""
        if not isinstance(scheme, TwoStagePoissonScheme | TwoStageFixedScheme):
            raise ValueError(f"scheme must be a two-stage scheme; got {type(scheme).__name__}")
        if rng is not None and seed is not None:
            raise ValueError("seed must be None when rng is given; got both")
        self.scheme = scheme
        if rng is None:
            # 128 bits from the OS CSPRNG: the sample is secret from anyone who reads the config.
            rng = np.random.Generator(
                np.random.PCG64(secrets.randbits(128) if seed is None else seed)
            )
        self._rng = rng

    def sample(self, task_counts: Mapping[str, int]) -> dict[str, list[int]]:
        """Run one round of two-stage sampling over the available participants."""
        scheme = self.scheme
        n1 = scheme.participants_per_round
        # Sorted ids: the result depends only on the RNG and the set of ids, not on dict order.
        ids = sorted(task_counts)
        if len(ids) < n1:
            raise ValueError(
                f"task_counts must list at least participants_per_round ({n1}) available "
                f"participants; got {len(ids)}"
            )
        for pid in ids:
            count = task_counts[pid]
            if isinstance(count, bool) or not isinstance(count, int | np.integer) or count < 0:
                raise ValueError(f"task_counts[{pid!r}] must be an integer >= 0; got {count!r}")
            # The accountant's min_tasks is checked by the caller against the real dataset
            # (``check_task_counts``); here only what sampling itself needs, so the same code path
            # also runs on a hypothetical neighbour (one task removed) in audits.
            if isinstance(scheme, TwoStageFixedScheme) and count < scheme.tasks_per_round:
                raise ValueError(
                    f"task_counts[{pid!r}] must be >= tasks_per_round ({scheme.tasks_per_round}); "
                    f"got {count}"
                )
        chosen = self._rng.choice(len(ids), size=n1, replace=False)
        out: dict[str, list[int]] = {}
        for index in sorted(int(i) for i in chosen):
            pid = ids[index]
            count = int(task_counts[pid])
            if isinstance(scheme, TwoStagePoissonScheme):
                mask = self._rng.random(count) < scheme.task_rate
                tasks = np.flatnonzero(mask)
            else:
                tasks = np.sort(self._rng.choice(count, size=scheme.tasks_per_round, replace=False))
            out[pid] = [int(t) for t in tasks]
        return out

    def check_task_counts(self, task_counts: Mapping[str, int]) -> None:
        """Raise unless every participant has at least the accounted ``min_tasks`` tasks.

        With a fixed-size stage 2 the accounted rate is ``tasks_per_round / min_tasks``; a smaller
        participant would have a larger rate than the one accounted for. The server calls this on
        the registered task counts before the first round and whenever they change.
        """
        if isinstance(self.scheme, TwoStageFixedScheme):
            for pid, count in task_counts.items():
                if count < self.scheme.min_tasks:
                    raise ValueError(
                        f"task_counts[{pid!r}] must be >= min_tasks ({self.scheme.min_tasks}) of "
                        f"the accounted scheme; got {count}"
                    )

    def state(self) -> dict[str, Any]:
        """Return the generator's state, for checkpoints (keep it as secret as the noise)."""
        return {"bit_generator": self._rng.bit_generator.state}

    @classmethod
    def from_state(
        cls, scheme: TwoStagePoissonScheme | TwoStageFixedScheme, state: Mapping[str, Any]
    ) -> TwoStageSampler:
        """Restore a sampler from ``state()`` so a resumed run continues the same stream."""
        bit_state = state["bit_generator"]
        name = bit_state.get("bit_generator")
        bit_type = getattr(np.random, str(name), None)
        if bit_type is None:
            raise ValueError(
                f"state['bit_generator'] must name a numpy bit generator; got {name!r}"
            )
        bit_generator = bit_type()
        bit_generator.state = bit_state
        return cls(scheme, np.random.Generator(bit_generator))
