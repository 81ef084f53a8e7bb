"""The server's re-check of a reply's rows, fused: each row read from memory once.

:func:`fedmeta.server.validation.clipped_row_sum` re-clips rows with the workload's own
:func:`~fedmeta.metalearning.clip_by_global_norm` and then measures each clipped row again (its
post-clip norm, and the guard against ``norm * (C / norm)`` rounding over C): on a round of
DP-MAML's lot that is five passes over 1,600 rows of 112,261 float64 values, most of the server's
round (docs/benchmarks.md, "The cost of a round apart from the model"). This module does the same
check in two passes over each block of rows while the block is in cache, after one read of the
float32 rows from memory:

1. the pre-clip norm of every row, ``torch.linalg.vector_norm`` in float64 (the same function and
   precision as the workload's clip, so norm violations are counted on the same values);
2. ``total += rows^T s`` (one BLAS matrix-vector product), with ``s_i = 1`` for a row within the
   bound (it is added unchanged), ``s_i = (C / norm_i) (1 - m)`` for a row over it, and ``s_i = 0``
   for a non-finite row (whose entries are zeroed first: ``NaN * 0`` is NaN).

No clipped row is written out or measured again. Instead the bound holds by construction: the
computed norm of a float64 row of ``d`` values is within a factor ``1 +- d u`` of the exact one
(``u = 2^-53``; the textbook bound for a recursive sum of squares, which torch's blocked sums only
improve on, Higham 2002, section 4.2) and scaling a value by ``s_i`` errs by at most ``u``, so
with ``m = (d + 4) 2^-52`` (2.5e-11 for the conv net) every scaled row's exact norm is below C:
each accepted task contributes at most C, which is what the accountant assumes. The margin errs
on the safe side (a clipped row is shorter than C by ``m C``). The reported post-clip norm of a
row is ``norm_i s_i`` (a private diagnostic, never over C); the float64 sum differs from the
unfused check's only by the rounding of its additions and of ``m``.

The same code runs wherever the rows are: a reply decoded from the wire is a host array, a tensor
on a GPU is checked on that GPU (one block: the whole reply).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from torch import Tensor


def clip_margin(dim: int) -> float:
    """``m``: the relative shortening of a clipped row that keeps it within C (module docstring)."""
    return (dim + 4) * 2.0**-52


def as_rows(grads: np.ndarray | Tensor) -> Tensor:
    """The reply's rows as a tensor, without a copy where torch can share the memory.

    A reply decoded from the wire is a read-only view of the message's bytes; it is only read
    here, so torch's warning about non-writable arrays does not apply. A dtype torch lacks (long
    double) or a foreign byte order is converted to float64 first.
    """
    if isinstance(grads, Tensor):
        return grads
    rows = np.asarray(grads)
    if rows.dtype.itemsize > 8 or not rows.dtype.isnative:
        rows = rows.astype(np.float64)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return torch.from_numpy(rows)


def fused_row_sum(grads: np.ndarray | Tensor, clip: float) -> tuple[Tensor, Tensor, Tensor, int]:
    """(sum of the rows clipped to ``clip``, pre-clip norms, post-clip norms, non-finite rows).

    ``grads`` is ``[n, dim]`` floating point; everything returned is float64 on the rows' device.
    ``clip = inf`` sums the finite rows unclipped. On the CPU the rows are taken one at a time: a
    row of the conv net's 112,261 float64 values (0.9 MB) stays in a core's own cache between its
    two passes, and one row was faster than blocks of 2, 4 or 16 on the 2-core VM. Elsewhere the
    whole reply is one block.
    """
    data = as_rows(grads)
    if data.device.type == "cpu":
        return _row_by_row(data, clip)
    return _whole(data, clip)


def _row_by_row(data: Tensor, clip: float) -> tuple[Tensor, Tensor, Tensor, int]:
    """The CPU path: per row, one float64 copy (in cache), its norm, and ``total += s row``."""
    n, dim = data.shape
    total = torch.zeros(dim, dtype=torch.float64)
    row = torch.empty(dim, dtype=torch.float64)
    shrink = 1.0 - clip_margin(dim)
    norms, scales = [0.0] * n, [0.0] * n
    nonfinite = 0
    for i in range(n):
        row.copy_(data[i])  # the one read of this row from memory
        norm = float(torch.linalg.vector_norm(row))
        scale = 1.0 if norm <= clip else clip * shrink / norm
        if not math.isfinite(norm):
            finite = bool(torch.isfinite(row).all())
            nonfinite += 0 if finite else 1
            # A non-finite entry: zero. Finite entries whose float64 norm overflows: scale C / inf
            # = 0 under a finite bound, the row itself under C = inf (as clip_by_global_norm).
            norm, scale = math.inf, 1.0 if finite and math.isinf(clip) else 0.0
        if scale:
            total.add_(row, alpha=scale)
        norms[i], scales[i] = norm, scale
    pre = torch.tensor(norms, dtype=torch.float64)
    post = torch.tensor([x * s if s else 0.0 for x, s in zip(norms, scales, strict=True)],
                        dtype=torch.float64)  # fmt: skip
    return total, pre, post, nonfinite


def _whole(data: Tensor, clip: float) -> tuple[Tensor, Tensor, Tensor, int]:
    """On an accelerator: the reply as one float64 block, ``total = rows^T s``."""
    block = data.to(torch.float64)
    norm = torch.linalg.vector_norm(block, dim=1)
    scale = torch.where(norm <= clip, 1.0, clip * (1.0 - clip_margin(block.shape[1])) / norm)
    finite = torch.isfinite(norm)
    nonfinite = 0
    if not bool(finite.all()):
        nonfinite = _zero_nonfinite(block, finite, norm, scale)
    total = block.T.mv(scale) if block.shape[0] else block.new_zeros(block.shape[1])
    return total, norm, norm.nan_to_num(0.0, posinf=0.0) * scale, nonfinite


def _zero_nonfinite(block: Tensor, finite: Tensor, norm: Tensor, scale: Tensor) -> int:
    """Rows whose norm is not finite: reported as ``inf``, zeroed if an entry is NaN or infinite.

    As in ``clip_by_global_norm``: a row with a non-finite entry contributes zero and is counted;
    a float64 row of finite entries whose norm overflows is not counted, and contributes zero
    under a finite bound (its scale ``C / inf``) and itself under ``C = inf``.
    """
    count = 0
    for i in torch.nonzero(~finite).flatten().tolist():
        row = block[i]
        if not bool(torch.isfinite(row).all()):
            row.zero_()
            scale[i] = 0.0
            count += 1
        elif not bool(scale[i] == 1.0):
            scale[i] = 0.0
        norm[i] = math.inf
    return count
