"""How a message's arrays are held: ``np.save``'s bytes on the wire, shared memory in a process.

Three encodings of Flower's ``Array`` (server and participants read them through
:mod:`fedmeta.protocol`):

* ``numpy.ndarray``: the bytes ``np.save`` writes, the deployed wire format, made with one copy
  and read back as a view (:func:`npy_array`, :func:`npy_values`);
* :data:`SHARED_STYPE`: the participant's own host buffer, within one process;
* :data:`DEVICE_STYPE`: a tensor on the participant's accelerator, within one process.

The last two exist only in the in-process grid of ``fedmeta simulate``; a server accepts them only
from a grid that says it shares memory, and refuses them as malformed from any other.
"""

from __future__ import annotations

import io
import math
from typing import Final

import numpy as np
import torch
from flwr.app import Array
from numpy.lib import format as npy

# Flower's ``Array`` of a numpy array holds the bytes ``np.save`` writes (its ``stype`` "numpy.
# ndarray"). ``Array.from_numpy_ndarray`` writes them through a BytesIO and copies its buffer out,
# and ``Array.numpy()`` reads them back with ``np.load``, a third copy: on DP-MAML's round (1,600
# rows of 112,261 float32 values, 718 MB) those copies were a quarter of a GPU round
# (docs/benchmarks.md). The two functions below make and read the same bytes with numpy's own
# format module: the header from ``numpy.lib.format``, the values joined to it in one copy, and
# read back as a view of the message's bytes. The wire format is unchanged (a test compares the
# bytes with ``np.save``'s), so a deployed peer of either kind reads them.


def npy_array(values: np.ndarray) -> Array:
    """Flower's ``Array`` of ``values``: ``np.save``'s bytes, made with one copy of the values."""
    values = np.ascontiguousarray(values)
    head = io.BytesIO()
    npy.write_array_header_1_0(head, npy.header_data_from_array_1_0(values))
    data = b"".join((head.getvalue(), values.reshape(-1).view(np.uint8).data))
    return Array(dtype=str(values.dtype), shape=tuple(int(n) for n in values.shape),
                 stype="numpy.ndarray", data=data)  # fmt: skip


#: The ``stype`` of an array whose ``data`` is the participant's own float32 buffer, shared within
#: one process (the in-process grid): no bytes are made or parsed. Only a server whose grid is
#: in-process accepts it (``decode_gradient_reply(..., shared=True)``); over a network it is
#: refused as malformed, so the deployed wire format is the ``numpy.ndarray`` one alone.
SHARED_STYPE: Final = "fedmeta.shared"


def shared_array(values: np.ndarray) -> Array:
    """An ``Array`` whose data is ``values``' own memory (no copy), for the in-process grid only."""
    values = np.ascontiguousarray(values)
    array = Array(dtype=str(values.dtype), shape=tuple(int(n) for n in values.shape),
                  stype=SHARED_STYPE, data=b"")  # fmt: skip
    array.data = values.reshape(-1).view(np.uint8).data  # type: ignore[assignment]
    return array


def shared_values(array: Array) -> np.ndarray:
    """The values of a :func:`shared_array`, read-only, checked against its dtype and shape."""
    dtype = np.dtype(array.dtype)
    count = math.prod(array.shape)
    if len(array.data) != count * dtype.itemsize:
        raise ValueError(f"{len(array.data)} bytes for {count} values of {dtype}")
    values = np.frombuffer(array.data, dtype=dtype, count=count).reshape(array.shape)
    values.flags.writeable = False
    return values


#: The ``stype`` of an array whose values are a float32 tensor on an accelerator, held by the
#: ``Array`` object itself (no bytes): the in-process grid's batched round keeps the rows on the
#: GPU that computed them, so the server re-checks and sums them there and only the sum (one
#: vector) crosses to the host (server/recheck.py). Like :data:`SHARED_STYPE` it exists within one
#: process only and is refused from any other grid.
DEVICE_STYPE: Final = "fedmeta.device"
_DEVICE_ROWS = "_fedmeta_device_rows"  # the attribute of the Array that holds the tensor


def device_array(values: torch.Tensor) -> Array:
    """An ``Array`` holding the float32 tensor ``values`` itself, for the in-process grid only."""
    if values.dtype != torch.float32:
        raise ValueError(f"device rows must be float32; got {values.dtype}")
    array = Array(dtype="float32", shape=tuple(int(n) for n in values.shape),
                  stype=DEVICE_STYPE, data=b"")  # fmt: skip
    setattr(array, _DEVICE_ROWS, values.detach())
    return array


def device_values(array: Array) -> torch.Tensor:
    """The tensor of a :func:`device_array`, checked against its dtype and shape."""
    values = getattr(array, _DEVICE_ROWS, None)
    if not isinstance(values, torch.Tensor):
        raise ValueError("no tensor behind an in-process device array")
    if values.dtype != torch.float32 or tuple(values.shape) != tuple(array.shape):
        raise ValueError(f"a {values.dtype} tensor of shape {tuple(values.shape)} behind a "
                         f"float32 array of shape {tuple(array.shape)}")  # fmt: skip
    return values


def npy_values(array: Array) -> np.ndarray:
    """The values of a numpy ``Array``: a read-only view of its bytes where their layout allows.

    A header numpy would refuse raises; an object dtype or Fortran order (which fedmeta never
    sends) is left to ``np.load`` (no pickles: ``Array.numpy`` refuses them).
    """
    if array.stype != "numpy.ndarray":
        raise ValueError(f"stype {array.stype!r}, expected 'numpy.ndarray'")
    data = array.data
    stream = io.BytesIO(data)
    version = npy.read_magic(stream)
    if version == (1, 0):
        shape, fortran, dtype = npy.read_array_header_1_0(stream)
    elif version == (2, 0):
        shape, fortran, dtype = npy.read_array_header_2_0(stream)
    else:
        return np.asarray(array.numpy())
    if fortran or dtype.hasobject:
        return np.asarray(array.numpy())
    count = math.prod(shape)
    if len(data) - stream.tell() != count * dtype.itemsize:
        raise ValueError(f"{len(data) - stream.tell()} bytes for {count} values of {dtype}")
    return np.frombuffer(data, dtype=dtype, count=count, offset=stream.tell()).reshape(shape)
