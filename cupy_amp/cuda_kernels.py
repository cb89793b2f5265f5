"""Compile the CUDA kernels with CuPy and launch them.

Modules are compiled on first use per device (never at import) with
``cupy.RawModule`` from the sources of :mod:`cupy_amp.kernel_sources`; plain
``extern "C"`` entry points keep CuPy's on-disk compile cache in use.
Launches go on the current stream of the current device.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cupy
import numpy as np

from cupy_amp.kernel_launch import KernelLaunch
from cupy_amp.kernel_sources import NVRTC_OPTIONS, read_kernel_source

__all__ = [
    "CHUNK_BYTES",
    "THREADS_PER_BLOCK",
    "DeviceTable",
    "build_device_table",
    "compile_options",
    "dense_base",
    "kernel_dtype_name",
    "launch_scale_loss",
    "launch_unscale_check",
]

# Launch shape (tuned on an H200: see BENCHMARKS.md). The kernels receive the
# thread count and register budget through -D options, so both sides agree.
CHUNK_BYTES = 32768
THREADS_PER_BLOCK = 512
MIN_BLOCKS_PER_SM = 2
UNROLL = 4
STREAMING_HINTS = True
# Order the chunk table longest chunk first, so short chunks (small tensors, tails) fill the last wave.
LONGEST_FIRST = True
# 0: one block per chunk; N: a persistent grid of N blocks per multiprocessor looping over chunks.
GRID_BLOCKS_PER_SM = 0
_CHUNK_WORDS = 4
_MAX_GRID = 2**31 - 1
_DTYPE_NAMES = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32", np.dtype(np.float64): "float64"}

_lock = threading.Lock()
_modules: dict[tuple[int, str], Any] = {}
_functions: dict[tuple[int, str], Any] = {}
_scale_launches: dict[tuple[int, str], KernelLaunch] = {}

# Parameter types of the entry points (pointers as uint64), as declared in kernels/*.cu.
_UNSCALE_PARAMETERS = (np.uint64, np.uint64, np.uint64, np.int64, np.float32, np.int32, np.uint64, np.uint64)
_SCALE_PARAMETERS = (np.uint64, np.int64, np.int32, np.uint64, np.int64, np.float32)


def kernel_dtype_name(dtype: np.dtype[Any]) -> str | None:
    """Return the suffix of the entry points for ``dtype``, or None if no kernel handles it."""
    # Arrays carry np.dtype objects, found directly; anything else (a type, a string) is converted.
    name = _DTYPE_NAMES.get(dtype)
    return name if name is not None else _DTYPE_NAMES.get(np.dtype(dtype))


def compile_options() -> tuple[str, ...]:
    """Return the options cupy-amp passes to ``cupy.RawModule`` (CuPy adds its own)."""
    return (
        *NVRTC_OPTIONS,
        f"-DCUPY_AMP_THREADS={THREADS_PER_BLOCK}",
        f"-DCUPY_AMP_MIN_BLOCKS={MIN_BLOCKS_PER_SM}",
        f"-DCUPY_AMP_UNROLL={UNROLL}",
        f"-DCUPY_AMP_STREAMING={int(STREAMING_HINTS)}",
    )


def _function(file_name: str, entry: str) -> Any:
    device_id = cupy.cuda.runtime.getDevice()
    function = _functions.get((device_id, entry))
    if function is None:
        with _lock:
            module = _modules.get((device_id, file_name))
            if module is None:
                module = cupy.RawModule(code=read_kernel_source(file_name), options=compile_options())
                _modules[(device_id, file_name)] = module
            function = _functions[(device_id, entry)] = module.get_function(entry)
    return function


def dense_base(array: cupy.ndarray) -> int | None:
    """Return the lowest address of ``array`` if its elements fill one gap-free block, else None.

    Dense arrays (C- or F-ordered, transposed, reversed) are walked as flat
    memory, which is valid because unscaling treats every element alike.
    """
    if array.ndim == 0:
        return int(array.data.ptr)
    flags = array.flags
    if flags.c_contiguous or flags.f_contiguous:
        return int(array.data.ptr)
    itemsize = array.itemsize
    dims = sorted((abs(stride), extent) for extent, stride in zip(array.shape, array.strides) if extent > 1)
    expected = itemsize
    for stride, extent in dims:
        if stride != expected:
            return None
        expected *= extent
    offset = sum((extent - 1) * stride for extent, stride in zip(array.shape, array.strides) if stride < 0)
    return int(array.data.ptr) + int(offset)


def chunk_elements(itemsize: int) -> int:
    """Return how many elements of this size make one chunk (one block's unit of work)."""
    return CHUNK_BYTES // itemsize


@dataclass
class DeviceTable:
    """Device-resident description of the tensors of one (device, dtype) launch.

    One 32-byte record per chunk (see kernels/cupy_amp_common.cuh), longest
    chunks first, then the
    per-tensor layout offsets and the extents/strides of strided tensors, all
    in one int64 buffer. The tables are a pure function of the arrays'
    addresses, shapes, strides and dtype, so a cached table stays right for
    any arrays with that key, even new ones allocated where freed ones were; it
    therefore keeps no reference to the arrays (which would pin old gradients
    in memory when a training loop allocates fresh gradient arrays every step).
    """

    dtype_name: str
    chunk_count: int
    grid: int
    chunks: Any
    layout_offsets: Any
    layout: Any
    tensor_found: Any
    launch: KernelLaunch | None = None  # the table's own parameter block; None when it has no chunks


def build_device_table(arrays: Sequence[cupy.ndarray], dtype_name: str) -> DeviceTable:
    """Describe ``arrays`` (same device and dtype) in device tables, with one host-to-device copy."""
    count = len(arrays)
    bases = np.empty(count, dtype=np.int64)
    sizes = np.empty(count, dtype=np.int64)
    ndims = np.zeros(count, dtype=np.int64)
    layout_offsets = np.zeros(count, dtype=np.int64)
    layout: list[int] = []
    for index, array in enumerate(arrays):
        sizes[index] = array.size
        base = dense_base(array)
        if base is None:
            bases[index], ndims[index], layout_offsets[index] = int(array.data.ptr), array.ndim, len(layout)
            layout += list(array.shape)
            layout += [stride // array.itemsize for stride in array.strides]
        else:
            bases[index] = base
    itemsize = arrays[0].itemsize if count else 1
    per_chunk = chunk_elements(itemsize)
    counts = -(-sizes // per_chunk)
    chunk_count = int(counts.sum())
    tensor = np.repeat(np.arange(count, dtype=np.int64), counts)
    first = (np.arange(chunk_count, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)) * per_chunk
    last = np.minimum(first + per_chunk, sizes[tensor])
    dense = ndims[tensor] == 0
    records = np.empty((chunk_count, _CHUNK_WORDS), dtype=np.int64)
    records[:, 0] = np.where(dense, bases[tensor] + first * itemsize, bases[tensor])
    records[:, 1] = np.where(dense, 0, first)
    records[:, 2] = np.where(dense, last - first, last)
    records[:, 3] = tensor | (ndims[tensor] << 32)
    if LONGEST_FIRST:
        records = records[np.argsort(first - last, kind="stable")]

    host = np.concatenate([records.ravel(), layout_offsets, np.asarray(layout or [0], dtype=np.int64)])
    device = cupy.empty(host.size, dtype=np.int64)
    device.set(host, stream=cupy.cuda.get_current_stream())
    n_records = records.size
    table = DeviceTable(
        dtype_name=dtype_name,
        chunk_count=chunk_count,
        grid=_grid(chunk_count),
        chunks=device[:n_records],
        layout_offsets=device[n_records : n_records + count],
        layout=device[n_records + count :],
        tensor_found=cupy.zeros(count, dtype=np.int32),
    )
    if chunk_count:
        # Everything but the factor, the epoch and the flag's address is fixed for the table's life.
        table.launch = KernelLaunch(
            _function("unscale_check.cu", f"cupy_amp_unscale_check_{dtype_name}"),
            _UNSCALE_PARAMETERS,
            fixed={
                0: table.chunks.data.ptr,
                1: table.layout_offsets.data.ptr,
                2: table.layout.data.ptr,
                3: chunk_count,
                7: table.tensor_found.data.ptr,
            },
        )
    return table


@functools.cache
def _multiprocessors(device_id: int) -> int:
    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


def _grid(chunks: int) -> int:
    if GRID_BLOCKS_PER_SM:
        return max(1, min(chunks, GRID_BLOCKS_PER_SM * _multiprocessors(cupy.cuda.Device().id)))
    return min(chunks, _MAX_GRID)


def launch_unscale_check(table: DeviceTable, inv_scale: np.float32, epoch: int, found: Any) -> None:
    """Launch the fused unscale-and-check over ``table`` on the current stream.

    Sets ``found[0]`` and ``table.tensor_found[i]`` to ``epoch`` where inf/nan
    was seen. ``found`` is a CuPy int32 array or the device address of an int32.
    Asynchronous: never synchronizes the device.
    """
    if table.launch is None:
        return
    address = found if isinstance(found, (int, np.integer)) else found.data.ptr
    table.launch(table.grid, THREADS_PER_BLOCK, inv_scale, epoch, address)


def launch_scale_loss(loss: cupy.ndarray, dtype_name: str, scale: np.float32) -> None:
    """Multiply ``loss`` in place by ``scale`` on the current stream (never synchronizes the device)."""
    if loss.size == 0:
        return
    base = dense_base(loss)
    if base is not None:
        ndim, layout = 0, None
    else:
        base, ndim = int(loss.data.ptr), loss.ndim
        host_layout = np.array(list(loss.shape) + [s // loss.itemsize for s in loss.strides], dtype=np.int64)
        layout = cupy.empty(host_layout.size, dtype=np.int64)
        layout.set(host_layout, stream=cupy.cuda.get_current_stream())
    per_chunk = chunk_elements(loss.itemsize)
    _scale_launch(dtype_name)(
        min(-(-loss.size // per_chunk), _MAX_GRID),
        THREADS_PER_BLOCK,
        base,
        loss.size,
        ndim,
        layout.data.ptr if layout is not None else 0,
        per_chunk,
        scale,
    )


def _scale_launch(dtype_name: str) -> KernelLaunch:
    key = (cupy.cuda.runtime.getDevice(), dtype_name)
    launch = _scale_launches.get(key)
    if launch is None:
        function = _function("scale_loss.cu", f"cupy_amp_scale_loss_{dtype_name}")
        launch = _scale_launches.setdefault(key, KernelLaunch(function, _SCALE_PARAMETERS))
    return launch
