"""The fused re-check (server/recheck.py) against the workload's clip, and the wire arrays."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from flwr.app import Array
from hypothesis import given, settings
from hypothesis import strategies as st

from fedmeta import protocol as P
from fedmeta.metalearning import clip_by_global_norm
from fedmeta.server import recheck
from fedmeta.server.recheck import clip_margin, fused_row_sum

pytestmark = pytest.mark.unit


def _rows(n: int, dim: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((n, dim)) * rng.choice([0.01, 1.0, 50.0], (n, 1))
    return rows.astype(np.float32)


def _odd_rows() -> np.ndarray:
    rows = _rows(21, 257, 7)
    rows[4, 9] = np.nan
    rows[13, 0] = np.inf
    rows[17] = 0.0
    return rows


@pytest.mark.parametrize("clip", [0.5, 3.0, math.inf])
def test_fused_check_counts_and_bounds_like_the_workloads_clip(clip: float) -> None:
    """Pre-clip norms bit for bit, the same non-finite count, the sum to within the margin."""
    rows = _odd_rows()
    total, norms, post, nonfinite = fused_row_sum(rows, clip)
    ref_clipped, ref_norms = clip_by_global_norm(
        torch.from_numpy(rows.astype(np.float64)), clip, nonfinite="zero"
    )
    assert nonfinite == 2
    assert torch.equal(norms, ref_norms)
    # A clipped row differs by at most the margin m or the workload clip's own guard (it shortens
    # by 1e-6 a row that rounding put over C), relative to C, plus float64 rounding.
    scale = 1.0 if math.isinf(clip) else clip
    tol = (clip_margin(257) + 1e-6) * scale * rows.shape[0]
    assert torch.allclose(total, ref_clipped.sum(0), rtol=0, atol=tol)
    ref_post = torch.linalg.vector_norm(ref_clipped, dim=1)
    assert torch.allclose(post, ref_post, rtol=2e-6, atol=0)
    if math.isfinite(clip):
        assert float(post.max()) <= clip


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 6),
    dim=st.integers(1, 300),
    log_scale=st.floats(-30, 30),
    clip=st.floats(1e-6, 1e6),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_fused_contribution_stays_within_the_bound(
    n: int, dim: int, log_scale: float, clip: float, seed: int
) -> None:
    """Property: the summed rows, measured exactly (float64 of float32 rows), are each <= C."""
    rng = np.random.default_rng(seed)
    rows = (rng.standard_normal((n, dim)) * 2.0**log_scale).astype(np.float32)
    for i in range(n):  # one row at a time: the sum of one row is that row's contribution
        total, _, post, _ = fused_row_sum(rows[i : i + 1], clip)
        exact = math.sqrt(math.fsum(float(x) ** 2 for x in total.tolist()))
        assert exact <= clip and float(post[0]) <= clip


@pytest.mark.parametrize("clip", [0.5, math.inf])
def test_the_accelerators_whole_reply_path_agrees_with_the_row_by_row_path(clip: float) -> None:
    """``_whole`` (a GPU's path) run on the CPU: the same norms, count and post norms, the sum
    to float64 rounding (its additions are in another order)."""
    rows = _odd_rows()
    by_row = fused_row_sum(rows, clip)
    whole = recheck._whole(torch.from_numpy(rows), clip)
    assert torch.equal(by_row[1], whole[1]) and by_row[3] == whole[3]
    assert torch.allclose(by_row[2], whole[2], rtol=1e-15, atol=0)
    assert torch.allclose(by_row[0], whole[0], rtol=0, atol=1e-12)


def test_float64_rows_whose_norm_overflows_are_not_counted_as_nonfinite() -> None:
    rows = np.array([[1e300, 1e300], [0.3, 0.4], [np.nan, 1.0]])
    total, norms, post, nonfinite = fused_row_sum(rows, 1.0)
    _, ref_norms = clip_by_global_norm(torch.from_numpy(rows), 1.0, nonfinite="zero")
    assert nonfinite == 1 and torch.equal(norms, ref_norms)
    assert total.tolist() == pytest.approx([0.3, 0.4]) and float(post.max()) <= 1.0


@pytest.mark.parametrize(
    "values",
    [np.zeros((0, 7), np.float32), np.arange(12, dtype=np.float32).reshape(3, 4),
     np.float32([1.5]), np.ones((3, 8), np.float32)[:, ::2]],
)  # fmt: skip
def test_wire_arrays_are_np_saves_bytes_and_read_back_without_a_copy(values: np.ndarray) -> None:
    ours = P.npy_array(values)
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(values), allow_pickle=False)
    flowers = Array(np.ascontiguousarray(values))
    assert ours.data == buffer.getvalue() == flowers.data
    assert (ours.dtype, ours.shape, ours.stype) == (flowers.dtype, flowers.shape, flowers.stype)
    back = P.npy_values(flowers)
    assert np.array_equal(back, values) and back.shape == values.shape
    assert back.base is not None and not back.flags.writeable  # a view of the message's bytes


def test_a_truncated_wire_array_is_a_protocol_error() -> None:
    reply = P.GradientReply("r", 0, "p", (1,), np.ones((1, 4), np.float32), None, None)
    content = P.encode_gradient_reply(reply)
    array = content.array_records[P.GRADS_RECORD]["grads"]
    array.data = array.data[:-4]
    with pytest.raises(P.ProtocolError) as error:
        P.decode_gradient_reply(content)
    assert error.value.reason == P.REASON_BAD_DTYPE


def test_shared_replies_are_views_in_process_and_refused_elsewhere() -> None:
    """The in-process lane: no copy where the grid is in-process, malformed over any other."""
    rows = np.arange(10, dtype=np.float32).reshape(2, 5)
    reply = P.GradientReply("r", 0, "p", (1, 2), rows, None, None)
    content = P.encode_gradient_reply(reply, shared=True)
    back = P.decode_gradient_reply(content, shared=True)
    assert back.grads is not None and np.shares_memory(back.grads, rows)
    assert not back.grads.flags.writeable
    with pytest.raises(P.ProtocolError) as error:
        P.decode_gradient_reply(content)
    assert error.value.reason == P.REASON_BAD_DTYPE


def test_the_transport_accepts_shared_replies_only_from_an_in_process_grid() -> None:
    from fedmeta.server.transport import GridTransport
    from fedmeta.simulation.local_grid import InProcessGrid

    class NetworkGrid(InProcessGrid):
        shares_memory = False

    assert GridTransport(InProcessGrid(1), register_timeout_s=1, round_timeout_s=1).shared
    assert not GridTransport(NetworkGrid(1), register_timeout_s=1, round_timeout_s=1).shared


def test_device_rows_cross_the_in_process_grid_as_the_tensor_itself() -> None:
    """The device lane (wire_arrays.DEVICE_STYPE): the reply holds the participant's tensor, which
    the server reads as it is; from any other grid it is malformed, and the wire gets its bytes."""
    rows = torch.from_numpy(_odd_rows())
    reply = P.GradientReply("r", 0, "p", tuple(range(len(rows))), rows, None, None)
    back = P.decode_gradient_reply(P.encode_gradient_reply(reply, shared=True), shared=True)
    assert isinstance(back.grads, torch.Tensor)
    assert back.grads.data_ptr() == rows.data_ptr()  # the same memory: no copy, no host trip
    with pytest.raises(P.ProtocolError) as error:
        P.decode_gradient_reply(P.encode_gradient_reply(reply, shared=True))
    assert error.value.reason == P.REASON_BAD_DTYPE
    wire = P.decode_gradient_reply(P.encode_gradient_reply(reply))
    assert isinstance(wire.grads, np.ndarray)
    assert np.array_equal(wire.grads, rows.numpy(), equal_nan=True)


def test_a_device_array_whose_tensor_disagrees_with_it_is_malformed() -> None:
    rows = torch.zeros(3, 4)
    content = P.encode_gradient_reply(P.GradientReply("r", 0, "p", (0, 1, 2), rows, None, None),
                                      shared=True)  # fmt: skip
    array = content.array_records[P.GRADS_RECORD]["grads"]
    array.shape = (3, 5)  # what the message says no longer describes what it holds
    with pytest.raises(P.ProtocolError) as error:
        P.decode_gradient_reply(content, shared=True)
    assert error.value.reason == P.REASON_BAD_DTYPE
    with pytest.raises(ValueError, match="float32"):
        P.device_array(rows.double())


@pytest.mark.parametrize("clip", [0.5, math.inf])
def test_device_rows_are_validated_as_their_host_copy_is(clip: float) -> None:
    """The server's check of a reply whose rows are a tensor: the same acceptance, counts and
    post-clip norms as the host array's, its sum on the host; on the CPU bit for bit."""
    from fedmeta.server.validation import Accepted, Expectation, validate_reply

    rows = _odd_rows()
    exp = Expectation("r", 0, "p", tuple(range(len(rows))), rows.shape[1],
                      clip if math.isfinite(clip) else None, "per_task", 1e-6)  # fmt: skip
    results = []
    for grads in (rows, torch.from_numpy(rows)):
        reply = P.GradientReply("r", 0, "p", exp.task_ids, grads, None, None)
        content = P.encode_gradient_reply(reply, shared=True)
        results.append(validate_reply(P.decode_gradient_reply(content, shared=True), exp))
    host, device = results
    assert isinstance(host, Accepted) and isinstance(device, Accepted)
    assert device.grad_sum.device.type == "cpu"
    assert torch.equal(device.grad_sum, host.grad_sum)
    assert device.post_clip_norms == host.post_clip_norms
    assert (device.nonfinite, device.norm_violations) == (host.nonfinite, host.norm_violations)
