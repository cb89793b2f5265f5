"""The fused optimizers' work on the GPU: their device tables, and the launches of one step.

A step is a one-thread begin kernel (it reads the statistics record of the
scaler's ``check()`` and opens the step on the optimizer's record), then one
launch per parameter dtype over a table of ParamChunk records
(``kernels/optimizers.cu``). Imported by :mod:`cupy_amp.optim.optimizers`
only for CuPy parameters.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import cupy
import numpy as np

from cupy_amp.kernel_interface import PARAM_CHUNK, PARAM_DTYPE_NAMES
from cupy_amp.kernel_launch import MAX_GRID, _on_device, launcher, order_after, refuse_capture
from cupy_amp.statistics import GradientStats

__all__ = [
    "PARAM_CHUNK_ELEMENTS",
    "ParamTable",
    "capturing",
    "load_optimizer",
    "optimizer_step",
    "param_tables",
    "refuse_capture",
]

_OTHER_STREAM = (
    "The optimizer step is captured on another stream than the check() that wrote its statistics, or than the "
    "optimizer's previous step: capture the whole step on one stream, and synchronize before capturing."
)

PARAM_CHUNK_ELEMENTS = 16384  # one block's share of a parameter


class ParamTable(NamedTuple):
    """One dtype group's ParamChunk records, in device memory: one launch."""

    entry: str
    memory: cupy.ndarray
    chunk_count: int


def param_tables(rule: str, groups: dict[str, list[tuple[int, ...]]], counts: dict[str, list[int]]) -> list[ParamTable]:
    """Build the device tables of an optimizer step (waits for the copy: tables are built once per layout).

    Args:
        rule: "adamw" or "sgd".
        groups: dtype name -> one (grad, param, master, first_moment, second_moment) address tuple per
            parameter (0 for a buffer it does not have).
        counts: dtype name -> the parameters' element counts.
    """
    refuse_capture("the optimizer's device tables for these gradients are not built yet")
    tables = []
    stream = cupy.cuda.get_current_stream()
    for type_name, addresses in groups.items():
        sizes = np.asarray(counts[type_name], dtype=np.int64)
        itemsize = 4 if type_name == "float32" else 2
        per = -(-sizes // PARAM_CHUNK_ELEMENTS)
        tensor = np.repeat(np.arange(len(sizes)), per)
        first = (
            np.arange(int(per.sum()), dtype=np.int64) - np.repeat(np.cumsum(per) - per, per)
        ) * PARAM_CHUNK_ELEMENTS
        bases = np.asarray(addresses, dtype=np.int64).reshape(len(sizes), 5)[tensor]
        records = np.zeros(len(first), dtype=PARAM_CHUNK)
        for column, (name, size) in enumerate(
            (("grad", itemsize), ("param", itemsize), ("master", 4), ("first_moment", 4), ("second_moment", 4))
        ):
            records[name] = np.where(bases[:, column] != 0, bases[:, column] + first * size, 0)
        records["count"] = np.minimum(sizes[tensor] - first, PARAM_CHUNK_ELEMENTS)
        records = records[records["count"] > 0]
        memory = cupy.empty(max(records.nbytes, 1), dtype=np.uint8)
        if records.size:
            memory[: records.nbytes].set(records.view(np.uint8), stream=stream)
            tables.append(ParamTable(f"cupy_amp_{rule}_{type_name}", memory, int(records.size)))
    stream.synchronize()
    return tables


def load_optimizer(rule: str, device: int) -> None:
    """Load the optimizer's kernels now (a CUDA graph capture cannot load modules)."""
    with _on_device(device):
        launcher("optimizers.cu", f"cupy_amp_{rule}_begin", threads=1)
        for name in PARAM_DTYPE_NAMES:
            launcher("optimizers.cu", f"cupy_amp_{rule}_{name}")


def optimizer_step(
    rule: str, device: int, tables: list[ParamTable], hyper: int, stats: GradientStats | None, last: Any
) -> Any:
    """Queue an optimizer step on the current stream: begin (reads ``stats``' record, if any), then every group.

    The stream first waits (an event) for a record last written on another
    stream, and for the optimizer's own previous step (on ``last``) if that
    went elsewhere; the record's next writer then waits for this stream.
    Returns the stream.

    Raises:
        ScalerProtocolError: That other stream's work cannot be waited for inside a CUDA graph capture.
    """
    with _on_device(device):
        current = cupy.cuda.get_current_stream()
        order_after(stats.stream if stats is not None else None, current, _OTHER_STREAM)
        order_after(last, current, _OTHER_STREAM)
        stream = current.ptr
        begin = launcher("optimizers.cu", f"cupy_amp_{rule}_begin", threads=1)
        begin(1, stream, hyper=hyper, stats=0 if stats is None else stats.source)
        for table in tables:
            grid = min(table.chunk_count, MAX_GRID)
            launcher("optimizers.cu", table.entry)(
                grid, stream, chunks=table.memory.data.ptr, chunk_count=table.chunk_count, hyper=hyper
            )
        if stats is not None and stats.read_on is not None:
            stats.read_on(current)
    return current


def capturing(device: int) -> bool:
    """Return whether the device's current stream is capturing a CUDA graph."""
    with _on_device(device):
        return bool(cupy.cuda.get_current_stream().is_capturing())
