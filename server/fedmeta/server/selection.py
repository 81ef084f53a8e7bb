"""Which meta-model a run releases: the last one, or the best on the server's validation tasks.

``training.model_selection = "best_validation"`` keeps, among the models the run validated (the
model it started from, round 0, and every ``eval_every``-th round), the one with the best
validation metric, and tests that one. Why this costs no privacy: every candidate is either the
starting model (public: a seed, or the declared public warm start) or a noisy model the run
releases anyway, and the validation tasks are drawn from classes no participant owns
(``Workload.held_out``); choosing among released models with data outside the participants' is
post-processing (Dwork and Roth 2014, Proposition 2.1). The test tasks are other classes again, so
the choice does not bias the reported test metric; a workload whose validation would fall back to
its test classes is refused (``Workload.validation_is_test``).

A noisy round can lower accuracy (docs/results.md: 20-way, 57.0% validation after 50 private
rounds, 49.5% after 300); with this rule such a run releases its best validated model, the warm
start itself when no private round beat it, and the summary says which round it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from fedmeta.checkpoint import KeptModel

Rule = Literal["last", "best_validation"]


@dataclass
class ModelSelection:
    """The best validated model so far (``best_validation``), or nothing to keep (``last``)."""

    rule: Rule
    higher_is_better: bool
    round: int | None = None  # 0: the starting model
    metric: float | None = None
    params: torch.Tensor | None = None
    start_metric: float | None = None  # round 0's, whether or not a later round beat it

    @property
    def keeps_best(self) -> bool:
        """Whether the run keeps its best validated model (else it releases the last)."""
        return self.rule == "best_validation"

    def offer(self, round_: int, metric: float | None, params: torch.Tensor) -> None:
        """Keep ``params`` if it validates strictly better than the kept one (ties: the earlier)."""
        if not self.keeps_best or metric is None or metric != metric:  # NaN never wins
            return
        if round_ == 0:
            self.start_metric = float(metric)
        if self.metric is not None:
            better = metric > self.metric if self.higher_is_better else metric < self.metric
            if not better:
                return
        self.round, self.metric = round_, float(metric)
        self.params = params.detach().clone()

    def released(self, last: torch.Tensor) -> torch.Tensor:
        """The model the run tests and releases as its result."""
        return self.params if self.keeps_best and self.params is not None else last

    def to_checkpoint(self) -> KeptModel | None:
        """The kept model and its round, for the checkpoint (None: nothing kept)."""
        if not self.keeps_best or self.params is None:
            return None
        return KeptModel(self.rule, self.round, self.metric, self.start_metric, self.params)

    def restore(self, saved: KeptModel | None) -> None:
        """Take the kept model back from a checkpoint (a resumed run goes on comparing)."""
        if saved is None or not self.keeps_best:
            return
        self.round, self.metric = saved.round, saved.validation_metric
        self.params = saved.params.detach().clone()
        self.start_metric = saved.start_validation_metric

    def summary(self, validation_tasks: int, last_round: int) -> dict[str, Any]:
        """``summary.json``'s ``model_selection``: what was tested, and why."""
        if not self.keeps_best:
            return {"rule": "last", "round": last_round}
        return {
            "rule": "best_validation",
            "round": self.round,
            "validation_metric": self.metric,
            "start_validation_metric": self.start_metric,
            "validation_tasks": validation_tasks,
            "note": "the tested model is the best on server-held validation classes among the "
            "starting model (round 0) and the validated rounds; no participant owns those classes",
        }
