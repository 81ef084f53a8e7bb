"""Which of a round's failure facts a private run may release: those that follow availability alone.

A failure is released only when it cannot depend on the sampled tasks or their data. The
accountant treats stage 1 (who is sampled) as revealed and availability (whether a participant's
node is connected) as public (docs/privacy.md, "What a run releases"); anything else about a reply
can follow stage 2 or a task's values:

* ``node_unavailable``: Flower answered for the participant because its node is not connected.
  That is availability, released; the remaining trust assumption (a task that crashes its
  participant's process makes the node disconnect) is stated in docs/privacy.md.
* ``timeout``: a participant that drew many tasks, or one slow task, answers late. Its cause can
  be the stage-2 count, so in a private run it is a private diagnostic, and it never suspends.
* ``error_reply``, protocol errors, validation rejections and stray replies: what a participant's
  code did with its request, which may depend on the request's tasks. Private diagnostics.

A non-private run releases everything (it has nothing to protect).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

#: Flower's own answer for a node that is not connected (server/fedmeta/server/transport.py reports
# it).
FAILURE_NODE_UNAVAILABLE = "node_unavailable"
#: Failure reasons that depend on availability alone: released, and the only ones that suspend.
AVAILABILITY_FAILURES = frozenset({FAILURE_NODE_UNAVAILABLE})


@dataclass(frozen=True)
class FailureRelease:
    """One round's failures split into what is released and what stays a private diagnostic."""

    released: Mapping[str, int]
    withheld: Mapping[str, int]

    @property
    def released_count(self) -> int:
        """Participants whose failure is released (availability failures in a private run)."""
        return sum(self.released.values())


def split_failures(failures: Mapping[str, int], *, private: bool) -> FailureRelease:
    """Failures by reason (one per failed participant), split by what a run may release."""
    if not private:
        return FailureRelease(dict(failures), {})
    released = {k: v for k, v in failures.items() if k in AVAILABILITY_FAILURES}
    withheld = {k: v for k, v in failures.items() if k not in AVAILABILITY_FAILURES}
    return FailureRelease(released, withheld)


def suspending_failures(private: bool, default: frozenset[str]) -> frozenset[str]:
    """The delivery failures that count towards suspension.

    Suspension changes who later rounds may sample, and with that the events the accountant
    composes: in a private run only availability may drive it. A non-private run keeps ``default``.
    """
    return AVAILABILITY_FAILURES if private else default
