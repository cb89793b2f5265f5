"""CuPy's NCCL communicators as a :class:`~cupy_amp.distributed.Communicator`: the vote's transport on GPUs.

CuPy is imported when a pair is first summed, not with this module:
:func:`cupy_amp.distributed.communicator_for` recognizes a communicator
by its methods, on machines without CuPy too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["NcclAllReduce"]


class NcclAllReduce:
    """A :class:`Communicator` over a CuPy NCCL communicator.

    Accepts ``cupyx.distributed.NCCLBackend`` (``cupyx.distributed.init_process_group``) or a raw
    ``cupy.cuda.nccl.NcclCommunicator``. A device pair is summed on the stream given (the state's).
    """

    def __init__(self, comm: Any) -> None:
        self._comm = comm
        self._raw = not hasattr(comm, "all_reduce")  # NcclCommunicator spells it allReduce
        self._device: int | None = None  # the device of the pairs summed so far: the communicator's

    def reduce_sum(self, values: Any, stream: Any) -> None:
        if isinstance(values, np.ndarray):  # a host pair: through the device, and waited for
            import cupy

            # On the communicator's device, even from another thread (the poisoned vote's).
            with cupy.cuda.Device(self._device if self._device is not None else cupy.cuda.runtime.getDevice()):
                on_device = cupy.asarray(values)
                current = cupy.cuda.get_current_stream()
                self.reduce_sum(on_device, current)
                values[...] = on_device.get(stream=current)
            return
        self._device = int(values.device.id)
        if self._raw:
            from cupy.cuda import nccl

            ptr = values.data.ptr
            self._comm.allReduce(ptr, ptr, 2, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, stream.ptr)
        else:
            self._comm.all_reduce(values, values, op="sum", stream=stream)
