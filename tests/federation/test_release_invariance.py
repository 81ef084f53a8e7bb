"""What a private run releases does not depend on stage 2 or on private data (issue 9, item 2).

Two neighbouring datasets D and D' (participant 0 holds tasks {0, 1} in D and {0} in D'), the
same randomness (the reproducible test mode), a private run over each: ``rounds.csv``,
``summary.json`` and the metrics page must be identical apart from the values computed from the
noisy model (loss, validation and test metrics: post-processing) and from wall clocks and random
ids. Participant 0 often draws no task at all, so a run that contacted only participants with
tasks, or published how many tasks it received, would differ between D and D'.
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Context, Message
from prometheus_client import generate_latest

from fedmeta import protocol as P
from fedmeta.client.app import app as client_app
from fedmeta.config_io import load_config
from fedmeta.server.app import execute
from fedmeta.server.monitoring.live import PrometheusRunObserver
from fedmeta.simulation.local_grid import InProcessGrid

pytestmark = pytest.mark.integration

# Computed from the noisy model, or (the clip bound under adaptive clipping, on by default) from
# the noisy count released with it: post-processing of the DP release, free to differ.
MODEL_DERIVED_COLUMNS = {"loss", "validation_metric", "clip"}
MODEL_DERIVED_SUMMARY = {
    "final_metric", "final_metric_ci95", "final_metric_ci95_halfwidth",
    "final_metric_pre_adaptation", "final_metric_median", "adaptation_diverged_tasks",
}  # fmt: skip
# A random id; an HMAC under each ledger's random secret salt (independent of the data); a wall
# clock; a temporary path.
RANDOM_OR_CLOCK = {"run_id", "federation_id", "wall_seconds", "ledger"}
MODEL_DERIVED_METRICS = ("fedmeta_train_loss", "fedmeta_validation_metric", "fedmeta_final_metric",
                         "fedmeta_clip_bound", "fedmeta_noise_std")  # z_grad * C_t  # fmt: skip
CLOCK_METRICS = ("_timestamp_seconds",)


def neighbour(tasks_of_participant_0: tuple[int, ...]) -> Any:
    """A ClientApp whose participant 0 holds only ``tasks_of_participant_0`` of its tasks."""

    def handler(msg: Message, ctx: Context) -> Any:
        if int(ctx.node_config[P.NODE_PARTITION_ID]) != 0:
            return client_app(msg, ctx)
        if msg.metadata.message_type == P.MSG_REGISTER:
            reg = P.decode_registration(client_app(msg, ctx).content)
            own = P.Registration(
                reg.participant_id, len(tasks_of_participant_0), reg.data_fingerprint
            )
            return Message(P.encode_registration(own), reply_to=msg)
        req = P.decode_gradient_request(msg.content)
        real = tuple(tasks_of_participant_0[i] for i in req.task_ids)  # its local numbering
        content = P.encode_gradient_request(replace(req, task_ids=real))
        inner = Message(content, msg.metadata.dst_node_id, P.MSG_TRAIN, group_id="x")
        inner.metadata.__dict__["_message_id"] = msg.metadata.message_id
        reply = P.decode_gradient_reply(client_app(inner, ctx).content, shared=True)  # in-process
        local = replace(reply, task_ids=req.task_ids)  # back to the server's numbering
        return Message(P.encode_gradient_reply(local), reply_to=msg)

    return handler


def private_run(
    out: Path, tasks_of_participant_0: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> str:
    monkeypatch.setenv("FEDMETA_STATE_DIR", str(out.parent / f"state-{out.name}"))
    cfg = load_config(None, [
        "federation.participants=3", "sampling.participants_per_round=3", "sampling.task_rate=0.5",
        "dataset.tasks_per_participant=4", "dataset.validation_tasks=8", "dataset.test_tasks=16",
        "dataset.probe_tasks=4", "training.eval_every=3", "privacy.report_every=2", "rounds=8",
        "privacy.noise_multiplier=2.0", "privacy.insecure_test_seed=11", "output.progress=false",
        "output.plots=false",
    ])  # fmt: skip
    observer = PrometheusRunObserver()
    grid = InProcessGrid(3, neighbour(tasks_of_participant_0))
    execute(cfg, grid, out_dir=out, observers=[observer], echo=False)
    return generate_latest(observer.registry).decode()


def _csv(path: Path) -> list[dict[str, str]]:
    rows = list(csv.DictReader(path.open()))
    return [{k: v for k, v in row.items() if k not in MODEL_DERIVED_COLUMNS} for row in rows]


def _summary(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    assert data["adaptive_clipping"] is not None  # the default path is the one checked here
    data["adaptive_clipping"].pop("last_clip")  # from the released noisy counts
    return {k: v for k, v in data.items() if k not in MODEL_DERIVED_SUMMARY | RANDOM_OR_CLOCK}


def _page(text: str) -> list[str]:
    keep = [
        line for line in text.splitlines()
        if not line.startswith(MODEL_DERIVED_METRICS) and CLOCK_METRICS[0] not in line.split("{")[0]
    ]  # fmt: skip
    keep = [re.sub(r'run="[0-9a-f]+"', 'run="R"', line) for line in keep]
    return [re.sub(r'federation="[^"]+"', 'federation="F"', line) for line in keep]


def test_neighbouring_datasets_release_the_same_files_and_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    page_d = private_run(tmp_path / "d", (0, 1), monkeypatch)
    page_d_prime = private_run(tmp_path / "dprime", (0,), monkeypatch)
    assert _csv(tmp_path / "d" / "rounds.csv") == _csv(tmp_path / "dprime" / "rounds.csv")
    assert _summary(tmp_path / "d" / "summary.json") == _summary(
        tmp_path / "dprime" / "summary.json"
    )
    assert _page(page_d) == _page(page_d_prime)
    # The runs did differ where they may: the model saw different tasks.
    d = json.loads((tmp_path / "d" / "summary.json").read_text())
    d_prime = json.loads((tmp_path / "dprime" / "summary.json").read_text())
    assert d["final_metric"] != d_prime["final_metric"]
    assert d["rounds_completed"] == 8 and d["epsilon_spent"] > 0
