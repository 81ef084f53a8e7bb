"""Who may be sampled in a round: registered, bound to its key, online, and not suspended.

The policy (docs/deploy.md, "Membership"):

* **Start.** The run starts once ``federation.min_participants`` participants have registered,
  waiting at most ``federation.register_timeout_s``.
* **Join late, leave, come back.** Before every round, nodes that appeared since are asked to
  register, and nodes that are no longer connected leave the population. A node that comes back
  registers again.
* **Bound identities.** With ``federation.node_keys`` (participant id -> public-key fingerprint) a
  node is accepted only with a bound key and only as the participant bound to that key; anything
  else is refused and counted (``unbound_node``, ``wrong_key``), once: a node refused for a reason
  that cannot change during the run (also ``too_few_tasks``) is not asked again until it
  reconnects, so it costs no registration exchange before every round. Without bindings, nodes
  name themselves (simulation) and the first to claim an id keeps it (``duplicate_participant``;
  such a node is asked again, as the id may become free).
* **Suspension.** A participant whose last ``federation.max_consecutive_failures`` requests timed
  out or found its node unavailable is not sampled again until its node reconnects. In a private
  run only an unavailable node counts: a timeout can follow the stage-2 count, and suspension
  changes later samples (server/fedmeta/server/releases.py).
* **Accounting.** Each round samples from the population eligible at its start; the round's
  privacy event is built for that population, so a change is composed as groups of identical
  rounds. Availability is not private data (the accountant treats stage 1 as revealed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from fedmeta.config import Config
from fedmeta.protocol import RegisterRequest
from fedmeta.server.releases import FAILURE_NODE_UNAVAILABLE
from fedmeta.server.transport import FAILURE_TIMEOUT, GridTransport, Registered

log = logging.getLogger("fedmeta.server")

REFUSED_UNBOUND = "unbound_node"
REFUSED_WRONG_KEY = "wrong_key"
REFUSED_DUPLICATE = "duplicate_participant"
REFUSED_TOO_FEW_TASKS = "too_few_tasks"
#: Delivery failures that count towards suspension (an error reply is the participant's own).
SUSPENDING_FAILURES = frozenset({FAILURE_TIMEOUT, FAILURE_NODE_UNAVAILABLE})
#: Refusals that hold for the whole run: the node is not asked again until it reconnects.
FINAL_REFUSALS = frozenset({REFUSED_UNBOUND, REFUSED_WRONG_KEY, REFUSED_TOO_FEW_TASKS})


@dataclass(frozen=True)
class MembershipRules:
    """What membership needs of the configuration (``federation.*`` and the task minimum)."""

    want: int  # participants to wait for: ``federation.min_participants``, else n1
    register_timeout_s: float
    node_keys: Mapping[str, str]  # participant id -> key fingerprint; empty: nodes name themselves
    max_consecutive_failures: int
    min_tasks: int | None  # the fewest tasks a participant may hold (fixed stage 2), else None

    @classmethod
    def of(cls, cfg: Config) -> MembershipRules:
        """The rules ``cfg`` sets."""
        fed = cfg.federation
        fixed = cfg.sampling.stage2 == "fixed"
        return cls(fed.min_participants or cfg.n1, fed.register_timeout_s, dict(fed.node_keys),
                   fed.max_consecutive_failures, cfg.min_tasks if fixed else None)  # fmt: skip


@dataclass
class Membership:
    """The registered participants of a run and which of them a round may sample."""

    rules: MembershipRules
    transport: GridTransport
    request: RegisterRequest
    members: dict[str, Registered] = field(default_factory=dict)
    suspended: set[str] = field(default_factory=set)
    refused: dict[str, int] = field(default_factory=dict)
    #: Every data fingerprint admitted in this session, also of those who left since (the test
    #: evaluation's seen items, server/fedmeta/server/seen_release.py).
    declared: set[str] = field(default_factory=set)
    _failures: dict[str, int] = field(default_factory=dict)
    _refused_nodes: dict[int, str] = field(default_factory=dict)  # node id -> final refusal

    def start(self) -> None:
        """Register until ``min_participants`` are in or the registration timeout passes."""
        deadline = time.monotonic() + self.rules.register_timeout_s
        while True:
            self.refresh()
            if len(self.members) >= self.rules.want or time.monotonic() >= deadline:
                return
            time.sleep(0.2)

    def refresh(self) -> None:
        """Register nodes that appeared; drop those that left (they register again on return)."""
        online = set(self.transport.connected())
        for pid in [p for p, m in self.members.items() if m.node_id not in online]:
            log.info("participant %s left (node no longer connected)", pid)
            self._forget(pid)
        for node in [n for n in self._refused_nodes if n not in online]:
            del self._refused_nodes[node]  # asked again if it comes back
        known = {m.node_id for m in self.members.values()} | set(self._refused_nodes)
        new = sorted(online - known)
        if new:
            self._admit(self.transport.query(self.request, new))

    def _forget(self, pid: str) -> None:
        self.members.pop(pid, None)
        self.suspended.discard(pid)  # a node that comes back starts afresh
        self._failures.pop(pid, None)

    def _admit(self, registrations: Iterable[Registered]) -> None:
        bound = {key: pid for pid, key in self.rules.node_keys.items()}
        for reg in registrations:
            reason = self._refusal(reg, bound)
            if reason is not None:
                self.refused[reason] = self.refused.get(reason, 0) + 1
                if reason in FINAL_REFUSALS:
                    self._refused_nodes[reg.node_id] = reason
                log.warning("refused node %s claiming participant %r: %s",
                            reg.node_id, reg.participant_id, reason)  # fmt: skip
                continue
            self.members[reg.participant_id] = reg
            self.declared.add(reg.data_fingerprint)

    def _refusal(self, reg: Registered, bound: Mapping[str, str]) -> str | None:
        if bound:
            owner = bound.get(reg.node_key)
            if owner is None:
                return REFUSED_UNBOUND
            if owner != reg.participant_id:
                return REFUSED_WRONG_KEY
        if reg.participant_id in self.members:
            return REFUSED_DUPLICATE
        if self.rules.min_tasks is not None and reg.task_count < self.rules.min_tasks:
            return REFUSED_TOO_FEW_TASKS
        return None

    def eligible(self) -> dict[str, int]:
        """Participant id -> task count of those a round may sample (in a stable order)."""
        pids = [p for p in self.members if p not in self.suspended]
        order = sorted(pids, key=lambda s: (0, int(s), s) if s.isdigit() else (1, 0, s))
        return {p: self.members[p].task_count for p in order}

    def nodes(self) -> dict[str, int]:
        """Participant id -> Flower node id, for the transport."""
        return {pid: m.node_id for pid, m in self.members.items()}

    def record(
        self, sampled: Iterable[str], failures: Mapping[str, str], suspending: frozenset[str]
    ) -> None:
        """Count each sampled participant's consecutive delivery failures; suspend at the limit.

        ``suspending``: the failures that count, as the run's plan allows (a private run's are
        ``releases.suspending_failures(True, ...)``: availability only).
        """
        limit = self.rules.max_consecutive_failures
        for pid in sampled:
            if failures.get(pid) not in suspending:
                self._failures[pid] = 0
                continue
            self._failures[pid] = self._failures.get(pid, 0) + 1
            if self._failures[pid] >= limit and pid not in self.suspended:
                log.warning("participant %s suspended after %d consecutive failures", pid, limit)
                self.suspended.add(pid)
