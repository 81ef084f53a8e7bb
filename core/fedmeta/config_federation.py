"""The configuration's sections on who takes part: sampling and the federation's transport.

``sampling`` (:class:`SamplingConfig`: the two-stage sampling the accountant composes) and
``federation`` (:class:`FederationConfig`: participants, backend, timeouts, node keys).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from fedmeta.config_section import Section


class SamplingConfig(Section):
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


class FederationConfig(Section):
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
