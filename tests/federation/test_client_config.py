"""What a participant is sent: its ClientConfig (fedmeta.client_config), not the whole tree."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from fedmeta import protocol as P
from fedmeta.client.app import app as client_app
from fedmeta.client.flower_internals import ensure_task_identity
from fedmeta.client_config import ClientConfig, client_config
from fedmeta.config import Config, dotted_keys
from fedmeta.server.app import execute
from fedmeta.simulation.local_grid import InProcessGrid
from fedmeta.workload import build_model, build_workload, initial_params

from .fakes import fake_ledger, opener
from .test_round import small

#: Keys no participant may be sent: budgets, the ledger, sampling, noise, node keys, addresses.
SERVER_ONLY = ("privacy.epsilon_budget", "privacy.delta", "privacy.ledger_path",
               "privacy.noise_multiplier", "privacy.insecure_test_seed", "sampling.task_rate",
               "federation.node_keys", "federation.ray_address", "metrics.bind", "output.dir",
               "rounds")  # fmt: skip


def _field(model: type[BaseModel], dotted: str) -> FieldInfo:
    """The field declared at a dotted key of ``model``."""
    *sections, leaf = dotted.split(".")
    for name in sections:
        annotation = model.model_fields[name].annotation
        assert isinstance(annotation, type) and issubclass(annotation, BaseModel)
        model = annotation
    return model.model_fields[leaf]


def _keys(payload: dict[str, Any], prefix: str = "") -> set[str]:
    """The dotted keys of a JSON object's leaves."""
    out: set[str] = set()
    for key, value in payload.items():
        out |= _keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key}
    return out


@pytest.mark.unit
def test_every_key_a_participant_is_sent_is_the_servers_own_field() -> None:
    """Same dotted name, type, default and bounds: the two schemas cannot drift apart.

    ``sample`` is not configuration but a sample-level run's resolved part (its calibrated inner
    noise, server/fedmeta/server/sample_plan.py): None unless the plan is sample level.
    """
    sent = [k for k in dotted_keys(ClientConfig) if k != "sample"]
    assert set(sent) <= set(dotted_keys(Config))
    for key in sent:
        mine, servers = _field(ClientConfig, key), _field(Config, key)
        assert (mine.annotation, mine.default, mine.metadata) == (
            servers.annotation, servers.default, servers.metadata), key  # fmt: skip
    assert not set(SERVER_ONLY) & set(sent)
    assert set(SERVER_ONLY) <= set(dotted_keys(Config))  # the negative names real keys


@pytest.mark.unit
def test_client_config_keeps_the_servers_values() -> None:
    cfg = small("seed=7", "dataset.ways=3", "training.inner_steps=2",
                "federation.participants=5", "federation.reply_format=sum_and_norms",
                "sampling.participants_per_round=2")  # fmt: skip
    part = client_config(cfg)
    assert part.sample is None  # a task-level run's participants get no sample-level part
    for key in (k for k in dotted_keys(ClientConfig) if k != "sample"):
        mine, servers = part, cfg
        for name in key.split("."):
            mine, servers = getattr(mine, name), getattr(servers, name)
        assert mine == servers, key
    assert P.decode_client_config(part.model_dump_json()) == part


@pytest.mark.integration
def test_a_participant_builds_the_servers_workload_from_what_it_is_sent() -> None:
    cfg = small()
    server, participant = build_workload(cfg), build_workload(client_config(cfg))
    assert server.dataset == participant.dataset and server.seed == participant.seed
    assert server.task_set.participant("2").num_tasks == participant.task_set.participant(
        "2").num_tasks  # fmt: skip
    assert np.array_equal(server.initial_params().numpy(), participant.initial_params().numpy())


@pytest.mark.integration
def test_a_run_sends_every_participant_its_client_config_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registration and every gradient request carry exactly the ClientConfig's keys."""
    sent: dict[str, list[str]] = {"register": [], "gradients": []}
    encode_register, encode_gradients = P.encode_register_request, P.encode_gradient_request

    def register(request: P.RegisterRequest) -> RecordDict:
        sent["register"].append(request.config_json)
        return encode_register(request)

    def gradients(request: P.GradientRequest) -> RecordDict:
        sent["gradients"].append(request.config_json)
        return encode_gradients(request)

    monkeypatch.setattr(P, "encode_register_request", register)
    monkeypatch.setattr(P, "encode_gradient_request", gradients)
    cfg = small("rounds=2", "privacy.noise_multiplier=1.0", "training.eval_every=100")
    ledger = opener(fake_ledger(100.0, 0.1))
    result = execute(cfg, InProcessGrid(cfg.federation.participants), out_dir=tmp_path / "run",
                     observers=[], echo=False, open_ledger=ledger)  # fmt: skip
    assert result.summary["rounds_completed"] == 2
    assert sent["register"] and sent["gradients"]
    expected = client_config(cfg)
    for text in sent["register"] + sent["gradients"]:
        assert _keys(json.loads(text)) == set(dotted_keys(ClientConfig))
        assert ClientConfig.model_validate_json(text) == expected


def _train(config_json: str) -> Message:
    """The ClientApp's answer to a gradient request carrying ``config_json``."""
    ensure_task_identity()
    params = initial_params(Config(), build_model(Config())).numpy()
    request = P.GradientRequest("r", 0, (0,), 1.0, params, config_json)
    message = Message(P.encode_gradient_request(request), 1, P.MSG_TRAIN, group_id="0")
    context = Context(run_id=1, node_id=1, node_config={P.NODE_PARTITION_ID: 0},
                      state=RecordDict(), run_config={})  # fmt: skip
    return client_app(message, context)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda d: d.update(privacy={"ledger_path": "/srv/ledger.sqlite"}), "config.privacy"),
        (lambda d: d["federation"].update(node_keys={}), "config.federation.node_keys"),
        (lambda d: d["dataset"].update(ways=1), "config.dataset.ways"),
        (lambda d: d["training"].update(inner_lr=True), "config.training.inner_lr"),
    ],
    ids=["server-section", "server-key", "out-of-range", "wrong-type"],
)
def test_a_bad_config_is_refused_in_one_line_naming_the_field(edit: Any, named: str) -> None:
    payload = json.loads(client_config(Config()).model_dump_json())
    edit(payload)
    with pytest.raises(P.ProtocolError) as refused:
        _train(json.dumps(payload))
    assert refused.value.reason == P.REASON_BAD_CONFIG
    assert named in refused.value.detail and "\n" not in str(refused.value)


@pytest.mark.integration
def test_the_servers_whole_tree_is_refused_as_another_version() -> None:
    """What a participant was sent before ClientConfig: every extra key refused, on one line."""
    with pytest.raises(P.ProtocolError, match="same fedmeta version") as refused:
        _train(Config().model_dump_json())
    assert refused.value.reason == P.REASON_BAD_CONFIG and "\n" not in str(refused.value)


@pytest.mark.integration
def test_a_valid_config_is_answered() -> None:
    """Control for the refusals above: the same request with the config as sent is computed."""
    reply = P.decode_gradient_reply(_train(client_config(Config()).model_dump_json()).content)
    assert reply.task_ids == (0,)


@pytest.mark.integration
def test_a_participant_with_its_own_folder_computes_from_it_alone(tmp_path: Path) -> None:
    """A deployed node's ``data-path`` replaces the server's ``dataset.path``: one participant."""
    from PIL import Image

    from fedmeta.client.gradients import gradient_reply, registration

    own = tmp_path / "mine"
    rng = np.random.default_rng(0)
    for c in range(12):
        (own / f"class{c}").mkdir(parents=True)
        for i in range(3):
            pixels = rng.integers(0, 255, (10, 12, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(own / f"class{c}" / f"{i}.png")
    # The server's folder does not exist here: reading it instead would fail.
    cfg = small("dataset.name=image_folder", f"dataset.path={tmp_path / 'servers'}",
                "dataset.ways=2", "dataset.shots=1", "dataset.query=1", "dataset.filters=8",
                "dataset.image_size=8")  # fmt: skip
    sent = client_config(cfg).model_dump_json()
    reg = registration(P.RegisterRequest("r", sent), "4", str(own))
    assert reg.task_count > 0 and reg.data_fingerprint.startswith("items-v2:")
    params = initial_params(cfg, build_model(cfg)).numpy()
    reply = gradient_reply(P.GradientRequest("r", 0, (0, 1), 1.0, params, sent), "4", str(own))
    assert reply.grads is not None and reply.grads.shape == (2, params.size)
    assert np.isfinite(reply.grads).all() and np.abs(reply.grads).sum() > 0
