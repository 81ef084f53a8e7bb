"""``TwoStageSampler``: executes exactly the sampling scheme that the accountant models.

The scheme object that builds the ``GaussianRound`` event is the one this sampler runs, so the two
cannot drift apart (conventions, item 5). Amplification by subsampling needs the sample to be random
and secret, so every random bit is *drawn* from a ``RandomSource`` (``accounting.randomness``): the
OS CSPRNG in a private run, a seeded keystream only in tests. The sampler has no generator state of
its own, so there is nothing secret to checkpoint; a reproducible (insecure) run re-creates
``InsecureSeededSource(seed, stream=round_index)`` for each round instead.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedmeta.accounting.randomness import (
    RandomSource,
    bernoulli_unchecked,
    check_source,
    sample_without_replacement_unchecked,
)
from fedmeta.accounting.schemes import TwoStageFixedScheme, TwoStagePoissonScheme


class TwoStageSampler:
    """Sample participants (stage 1, without replacement) then tasks inside each (stage 2).

    ``sample(task_counts)`` takes the *available* participants this round (id -> number of tasks,
    public metadata) and returns ``{participant id: sorted task ids}`` for the sampled ones. Stage 1
    draws ``participants_per_round`` of the available participants uniformly without replacement;
    fewer available than that is an error (the accounted rate would be wrong). Stage 2 includes each
    task independently with probability ``floor(task_rate * 2**64) / 2**64 <= task_rate`` (Poisson;
    see ``accounting.randomness.bernoulli``) or draws ``tasks_per_round`` uniformly without
    replacement (a participant with fewer tasks than that is an error: the accountant's worst case
    assumed more).

    Every stage-1 participant appears in the result; under Poisson stage 2 its task list may be
    empty. It is still part of the round (skipping it would change the mechanism).
    """

    def __init__(
        self, scheme: TwoStagePoissonScheme | TwoStageFixedScheme, source: RandomSource
    ) -> None:
        """Create a sampler drawing from ``source`` (``SystemRandomSource()`` in a private run)."""
        if not isinstance(scheme, TwoStagePoissonScheme | TwoStageFixedScheme):
            raise ValueError(f"scheme must be a two-stage scheme; got {type(scheme).__name__}")
        self.scheme = scheme
        self._source = check_source(source)

    @property
    def secure(self) -> bool:
        """Whether the samples are secret (the source is a CSPRNG, not a known seed)."""
        return bool(self._source.secure)

    def __repr__(self) -> str:
        return f"TwoStageSampler({self.scheme!r}, {self._source!r})"

    def sample(self, task_counts: Mapping[str, int]) -> dict[str, list[int]]:
        """Run one round of two-stage sampling over the available participants."""
        scheme = self.scheme
        n1 = scheme.participants_per_round
        # Sorted ids: the result depends only on the source and the set of ids, not on dict order.
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
        # The source was checked once, in __init__; the helpers' own checks would cost more than
        # the draws (a runtime Protocol check is slow).
        chosen = sample_without_replacement_unchecked(self._source, len(ids), n1)
        out: dict[str, list[int]] = {}
        for index in sorted(chosen):
            pid = ids[index]
            count = int(task_counts[pid])
            if isinstance(scheme, TwoStagePoissonScheme):
                tasks = [
                    int(t)
                    for t in np.flatnonzero(
                        bernoulli_unchecked(self._source, count, scheme.task_rate)
                    )
                ]
            else:
                tasks = sorted(
                    sample_without_replacement_unchecked(
                        self._source, count, scheme.tasks_per_round
                    )
                )
            out[pid] = tasks
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
