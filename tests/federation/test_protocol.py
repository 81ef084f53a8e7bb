"""The wire protocol: every payload survives encode/decode; anything else is refused by reason."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedmeta import protocol as P
from fedmeta.client.app import app as client_app
from fedmeta.client.flower_internals import ensure_task_identity
from fedmeta.client_config import client_config
from fedmeta.config import Config

pytestmark = pytest.mark.unit


def test_every_payload_round_trips() -> None:
    reg = P.RegisterRequest("run1", '{"rounds": 3}')
    assert P.decode_register_request(P.encode_register_request(reg)) == reg
    registration = P.Registration("7", 200, "sinusoid:abc")
    assert P.decode_registration(P.encode_registration(registration)) == registration
    params = np.arange(5, dtype=np.float32)
    for clip in (1.5, None):
        req = P.GradientRequest("run1", 4, (0, 3), clip, params, "{}")
        out = P.decode_gradient_request(P.encode_gradient_request(req))
        assert (out.run_id, out.round_id, out.task_ids, out.clip, out.config_json) == (
            "run1", 4, (0, 3), clip, "{}"
        )  # fmt: skip
        assert np.array_equal(out.params, params)
    rows = np.ones((2, 5), dtype=np.float32)
    per_task = P.GradientReply("run1", 4, "7", (0, 3), rows, None, None, 0.25)
    back = P.decode_gradient_reply(P.encode_gradient_reply(per_task))
    assert back.reply_format == P.REPLY_PER_TASK and back.compute_seconds == 0.25
    assert back.grads is not None and np.array_equal(back.grads, rows)
    summed = P.GradientReply("run1", 4, "7", (0, 3), None, rows.sum(0), (1.0, 1.0), None)
    back = P.decode_gradient_reply(P.encode_gradient_reply(summed))
    assert back.reply_format == P.REPLY_SUM_AND_NORMS and back.task_norms == (1.0, 1.0)
    empty = P.GradientReply("run1", 4, "7", (), np.zeros((0, 5), np.float32), None, None)
    assert P.decode_gradient_reply(P.encode_gradient_reply(empty)).task_ids == ()


def _reply_content(**meta: object) -> RecordDict:
    base: dict[str, object] = {
        "version": P.PROTOCOL_VERSION, "run_id": "r", "round_id": 1, "participant_id": "p",
        "task_ids": [1],
    }  # fmt: skip
    base.update(meta)
    return RecordDict(
        {
            P.GRADS_RECORD: ArrayRecord({"grads": Array(np.zeros((1, 3), np.float32))}),
            P.REPLY_RECORD: ConfigRecord({k: v for k, v in base.items() if v is not None}),  # type: ignore[misc]
        }
    )


@pytest.mark.parametrize(
    ("meta", "reason"),
    [
        ({"version": P.PROTOCOL_VERSION - 1}, P.REASON_PROTOCOL_VERSION),
        ({"version": None}, P.REASON_PROTOCOL_VERSION),
        ({"run_id": None}, P.REASON_MISSING_RECORD),
        ({"round_id": "1"}, P.REASON_BAD_DTYPE),
        ({"round_id": True}, P.REASON_BAD_DTYPE),
        ({"task_ids": ["1"]}, P.REASON_BAD_DTYPE),
        ({"task_ids": [True]}, P.REASON_BAD_DTYPE),
    ],
)
def test_malformed_replies_are_refused_by_reason(meta: dict[str, object], reason: str) -> None:
    with pytest.raises(P.ProtocolError) as info:
        P.decode_gradient_reply(_reply_content(**meta))
    assert info.value.reason == reason


def test_arrays_must_be_float32_of_the_right_rank() -> None:
    content = _reply_content()
    content[P.GRADS_RECORD] = ArrayRecord({"grads": Array(np.zeros((1, 3), np.float64))})
    with pytest.raises(P.ProtocolError, match="float32") as info:
        P.decode_gradient_reply(content)
    assert info.value.reason == P.REASON_BAD_DTYPE
    with pytest.raises(P.ProtocolError) as info:
        P.decode_gradient_reply(RecordDict({}))
    assert info.value.reason == P.REASON_MISSING_RECORD


def test_the_client_refuses_a_request_of_another_protocol_version() -> None:
    """Checked on both sides: a participant never computes from a request it may misread."""
    ensure_task_identity()
    req = P.GradientRequest("r", 0, (0,), 1.0, np.zeros(3, np.float32),
                          client_config(Config()).model_dump_json())
    content = P.encode_gradient_request(req)
    content.config_records[P.REQUEST_RECORD]["version"] = P.PROTOCOL_VERSION + 1
    message = Message(content, 1, P.MSG_TRAIN, group_id="0")
    ctx = Context(run_id=1, node_id=1, node_config={P.NODE_PARTITION_ID: 0}, state=RecordDict(),
                  run_config={})  # fmt: skip
    with pytest.raises(P.ProtocolError, match="same fedmeta version"):
        client_app(message, ctx)
