"""Multi-tensor tables in device memory: one builder for the scalers' gradient tables and the optimizers'
parameter tables, with one cache.

A table describes many tensors to one kernel launch, one record per
chunk of a tensor (a block's work in the unscale kernel, a warp's in the
statistics pass): :data:`cupy_amp.kernel_interface.CHUNK` for the unscale and
statistics kernels (dense tensors walked as flat memory, strided ones through a
layout copied beside the records), and
:data:`~cupy_amp.kernel_interface.PARAM_CHUNK` for the fused optimizers. Both
are cut by :func:`chunks`, copied by :func:`upload`, and kept in one small LRU
cache keyed by everything the records are a function of (addresses, shapes,
strides, dtype), so the same memory coming back step after step, or new
memory allocated where freed memory was, finds its table built.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import cupy
import numpy as np

from cupy_amp.dtypes import dtype_name
from cupy_amp.gpu.launch import _function, _Launcher, _on_device, refuse_capture
from cupy_amp.kernel_interface import (
    CHUNK,
    CHUNK_BYTES,
    PARAM_CHUNK,
    STATS_ARGS,
    UNSCALE_ARGS,
    UNSCALE_DTYPE_NAMES,
)

__all__ = [
    "PARAM_CHUNK_ELEMENTS",
    "GradientGroup",
    "GradientTable",
    "ParamTable",
    "chunks",
    "dense_base",
    "gradient_tables",
    "layout_words",
    "param_tables",
    "upload",
]

PARAM_CHUNK_ELEMENTS = 16384  # one optimizer block's share of a parameter
_KEPT = 16  # tables kept in the cache (one per optimizer and per gradient list, say)

_T = TypeVar("_T")
_cache: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
_cache_lock = threading.Lock()


def _cached(key: tuple[Any, ...], build: Callable[[], _T]) -> _T:
    """Return the table cached under ``key``, building and caching it if there is none (LRU)."""
    with _cache_lock:
        table = _cache.get(key)
        if table is not None:
            _cache.move_to_end(key)
            return table  # type: ignore[no-any-return]
    table = build()
    with _cache_lock:
        _cache[key] = table
        while len(_cache) > _KEPT:
            _cache.popitem(last=False)
    return table


def chunks(sizes: np.ndarray, per_chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut tensors of ``sizes`` elements into chunks of at most ``per_chunk``; empty tensors get none.

    Returns, per chunk in tensor order: the tensor's index, the chunk's first
    element in it, and the chunk's element count.
    """
    counts = -(-sizes // per_chunk)
    total = int(counts.sum())
    tensor = np.repeat(np.arange(len(sizes), dtype=np.int64), counts)
    first = (np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)) * per_chunk
    return tensor, first, np.minimum(first + per_chunk, sizes[tensor]) - first


def upload(host: np.ndarray) -> cupy.ndarray:
    """Copy ``host``'s bytes into new device memory on the current device, complete when this returns.

    A table may be launched from another stream or thread (a ``GradientSet``, the
    shared cache), so it is finished on the device before it is handed out; tables
    are built once per layout, so this wait is rare.

    Raises:
        ScalerProtocolError: The current stream is capturing a CUDA graph (which cannot copy from the host).
    """
    refuse_capture("these arrays' device tables are not built yet")
    raw = host.view(np.uint8).reshape(-1)
    stream = cupy.cuda.get_current_stream()
    memory = cupy.empty(max(raw.size, 1), dtype=np.uint8)
    if raw.size:
        memory[: raw.size].set(raw, stream=stream)
    stream.synchronize()
    return memory


def dense_base(array: cupy.ndarray) -> int | None:
    """Return the lowest address of ``array`` if its elements fill one gap-free block, else None.

    Dense arrays (C- or F-ordered, transposed, reversed) are walked as flat
    memory, which is valid because unscaling treats every element alike.
    """
    flags = array.flags
    if array.ndim == 0 or flags.c_contiguous or flags.f_contiguous:
        return int(array.data.ptr)
    dims = sorted((abs(stride), extent) for extent, stride in zip(array.shape, array.strides) if extent > 1)
    expected = array.itemsize
    for stride, extent in dims:
        if stride != expected:
            return None
        expected *= extent
    offset = sum((extent - 1) * stride for extent, stride in zip(array.shape, array.strides) if stride < 0)
    return int(array.data.ptr) + int(offset)


def layout_words(array: cupy.ndarray) -> list[int]:
    """Return a strided array's layout as the kernels read it: ndim, the extents, the strides in elements."""
    return [array.ndim, *array.shape, *(stride // array.itemsize for stride in array.strides)]


# The scalers' tables: one per (device, dtype) group of a call, with its two launches.


class GradientTable(NamedTuple):
    """The device tables of one (device, dtype) group: one kernel launch."""

    chunk_count: int
    memory: cupy.ndarray  # the chunk records, then the layouts of strided tensors
    launch: _Launcher | None  # the unscale kernel; None when the group has no elements, or is bfloat16
    stats: _Launcher | None  # the statistics kernel; None when the group has no elements
    report_stats: _Launcher | None  # the same with the numerics report (into the scaler's record: never shared)
    dtype: np.dtype[Any]
    sizes: tuple[int, ...]  # each tensor's element count


class GradientGroup(NamedTuple):
    device: int
    positions: tuple[int, ...]  # of the group's arrays in the call
    table: GradientTable


def gradient_tables(arrays: Sequence[cupy.ndarray]) -> tuple[GradientGroup, ...]:
    """Group ``arrays`` by (device, dtype) and describe each group in device tables (cached; hold no arrays)."""
    positions: dict[tuple[int, Any], list[int]] = {}
    for position, array in enumerate(arrays):
        positions.setdefault((array.data.device_id, array.dtype), []).append(position)
    groups = []
    for (device, dtype), members in positions.items():
        key = (
            "gradients",
            device,
            dtype,
            tuple((p, arrays[p].data.ptr, arrays[p].shape, arrays[p].strides) for p in members),
        )

        def build(device: int = device, members: list[int] = members) -> GradientTable:
            with _on_device(device):
                dtype = str(dtype_name(arrays[members[0]].dtype))
                return _gradient_table([arrays[p] for p in members], dtype, members)

        groups.append(GradientGroup(device, tuple(members), _cached(key, build)))
    return tuple(groups)


def _gradient_table(arrays: list[cupy.ndarray], type_name: str, positions: list[int]) -> GradientTable:
    """Describe ``arrays`` (one device, one dtype; at ``positions`` in their call) in device tables, with one
    host-to-device copy."""
    count = len(arrays)
    bases = np.empty(count, dtype=np.int64)
    sizes = np.empty(count, dtype=np.int64)
    layout_of = np.full(count, -1, dtype=np.int64)
    layouts: list[int] = []
    for index, array in enumerate(arrays):
        sizes[index] = array.size
        base = dense_base(array)
        if base is None:
            bases[index], layout_of[index] = array.data.ptr, len(layouts)
            layouts += layout_words(array)
        else:
            bases[index] = base
    tensor, first, count_of = chunks(sizes, CHUNK_BYTES // arrays[0].itemsize)
    dense = layout_of[tensor] < 0
    records = np.empty(len(tensor), dtype=CHUNK)
    records["address"] = np.where(dense, bases[tensor] + first * arrays[0].itemsize, bases[tensor])
    records["first"] = np.where(dense, 0, first)
    records["last"] = np.where(dense, count_of, first + count_of)
    records["tensor"] = tensor
    records["layout"] = layout_of[tensor]
    words = np.asarray(layouts, dtype=np.int64)
    where = np.asarray(positions, dtype=np.int32)  # each tensor's position in the call, for the journal
    memory = upload(np.concatenate([records.view(np.uint8), words.view(np.uint8), where.view(np.uint8)]))
    launch = stats = report_stats = None
    if len(records):
        # Each state passes its own culprit flags (tensor_found) at launch: a table is shared by every scaler.
        tables = {
            "chunks": memory.data.ptr,
            "layouts": memory.data.ptr + records.nbytes,
            "chunk_count": len(records),
            "positions": memory.data.ptr + records.nbytes + words.nbytes,
        }
        if type_name in UNSCALE_DTYPE_NAMES:
            function = _function("unscale_check.cu", f"cupy_amp_unscale_check_{type_name}")
            launch = _Launcher(function, UNSCALE_ARGS, **tables)
        stats = _Launcher(_function("grad_stats.cu", f"cupy_amp_gradient_stats_{type_name}"), STATS_ARGS, **tables)
        function = _function("grad_stats.cu", f"cupy_amp_gradient_report_{type_name}")
        report_stats = _Launcher(function, STATS_ARGS, **tables)
    counts = tuple(int(size) for size in sizes)
    return GradientTable(len(records), memory, launch, stats, report_stats, arrays[0].dtype, counts)


# The optimizers' tables: one per parameter dtype, each a launch of the rule's kernel.


class ParamTable(NamedTuple):
    """One dtype group's ParamChunk records, in device memory: one launch."""

    entry: str
    memory: cupy.ndarray
    chunk_count: int


def param_tables(rule: str, groups: dict[str, list[tuple[int, ...]]], counts: dict[str, list[int]]) -> list[ParamTable]:
    """Return the device tables of an optimizer step (cached like the gradients' tables).

    Args:
        rule: "adamw" or "sgd".
        groups: dtype name -> one (grad, param, master, first_moment, second_moment) address tuple per
            parameter (0 for a buffer it does not have).
        counts: dtype name -> the parameters' element counts.
    """
    key = ("params", rule, tuple((name, tuple(addresses), tuple(counts[name])) for name, addresses in groups.items()))
    return _cached(key, lambda: _param_tables(rule, groups, counts))


def _param_tables(
    rule: str, groups: dict[str, list[tuple[int, ...]]], counts: dict[str, list[int]]
) -> list[ParamTable]:
    tables = []
    for type_name, addresses in groups.items():
        itemsize = 4 if type_name == "float32" else 2
        tensor, first, count_of = chunks(np.asarray(counts[type_name], dtype=np.int64), PARAM_CHUNK_ELEMENTS)
        bases = np.asarray(addresses, dtype=np.int64).reshape(-1, 5)[tensor]
        records = np.zeros(len(tensor), dtype=PARAM_CHUNK)
        for column, (name, size) in enumerate(
            (("grad", itemsize), ("param", itemsize), ("master", 4), ("first_moment", 4), ("second_moment", 4))
        ):
            records[name] = np.where(bases[:, column] != 0, bases[:, column] + first * size, 0)
        records["count"] = count_of
        if records.size:
            tables.append(ParamTable(f"cupy_amp_{rule}_{type_name}", upload(records), int(records.size)))
    return tables
