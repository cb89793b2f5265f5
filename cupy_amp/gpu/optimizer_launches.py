"""The fused optimizers' work on the GPU: the launches of one step (their tables: :mod:`cupy_amp.gpu.tables`).

A step is a one-thread begin kernel (it reads the statistics record of the
scaler's ``check()`` and opens the step on the optimizer's record), then one
launch per parameter dtype over a table of ParamChunk records
(``kernels/<rule>.cu``, over ``kernels/optimizer.cuh``). Imported by :mod:`cupy_amp.optim.base`
only for CuPy parameters.
"""

from __future__ import annotations

from typing import Any

import cupy
import numpy as np

from cupy_amp.gpu.launch import MAX_GRID, _on_device, launcher, order_after, refuse_capture
from cupy_amp.gpu.launch import capturing as _stream_capturing
from cupy_amp.gpu.tables import PARAM_CHUNK_ELEMENTS, ParamTable, param_tables
from cupy_amp.kernel_interface import PARAM_DTYPE_NAMES

__all__ = [
    "PARAM_CHUNK_ELEMENTS",
    "ParamTable",
    "capturing",
    "current_stream",
    "load_optimizer",
    "optimizer_step",
    "param_tables",
    "refuse_capture",
    "write_after",
]

_OTHER_STREAM = (
    "The optimizer step is captured on another stream than the check() that wrote its statistics, or than the "
    "optimizer's previous step: capture the whole step on one stream, and synchronize before capturing."
)


def load_optimizer(rule: str, device: int) -> None:
    """Load the optimizer's kernels now (a CUDA graph capture cannot load modules)."""
    with _on_device(device):
        launcher(f"{rule}.cu", f"cupy_amp_{rule}_begin", threads=1)
        for name in PARAM_DTYPE_NAMES:
            launcher(f"{rule}.cu", f"cupy_amp_{rule}_{name}")


def optimizer_step(rule: str, device: int, tables: list[ParamTable], hyper: int, stats: int, last: Any) -> Any:
    """Queue an optimizer step on the current stream: begin (reads the statistics record at ``stats``, if not 0),
    then every group. Returns the stream.

    The stream first waits (an event) for the optimizer's own previous step (on ``last``) if that went
    elsewhere; its order with the record's writes is the record's own (:class:`cupy_amp.record.StatsRecord`).

    Raises:
        ScalerProtocolError: That other stream's work cannot be waited for inside a CUDA graph capture.
    """
    with _on_device(device):
        current = cupy.cuda.get_current_stream()
        order_after(last, current, _OTHER_STREAM)
        stream = current.ptr
        begin = launcher(f"{rule}.cu", f"cupy_amp_{rule}_begin", threads=1)
        begin(1, stream, hyper=hyper, stats=stats)
        for table in tables:
            grid = min(table.chunk_count, MAX_GRID)
            launcher(f"{rule}.cu", table.entry)(
                grid, stream, chunks=table.memory.data.ptr, chunk_count=table.chunk_count, hyper=hyper
            )
    return current


def current_stream(device: int) -> Any:
    """Return the current stream of ``device``."""
    with _on_device(device):
        return cupy.cuda.get_current_stream()


def write_after(device: int, last: Any, target: Any, data: np.ndarray) -> Any:
    """Copy ``data``'s bytes into ``target`` on the current stream, after the work queued on ``last``.

    Returns the stream, the optimizer's new last one: its next step on another stream waits for the copy.
    """
    with _on_device(device):
        current = cupy.cuda.get_current_stream()
        order_after(last, current, _OTHER_STREAM)
        target.set(data.view(np.uint8), stream=current)
    return current


def capturing(device: int) -> bool:
    """Return whether the device's current stream is capturing a CUDA graph."""
    with _on_device(device):
        return _stream_capturing()
