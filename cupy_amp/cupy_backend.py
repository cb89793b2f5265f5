"""The CuPy backend: fused CUDA kernels with the NumPy backend's exact bits.

Gradients are grouped by (device, dtype); each group is one launch of the
multi-tensor kernel over device tables that are cached for the common case
where the same arrays come back every step. The only synchronization is the
read-back of one overflow flag per device (and, only when that flag is set,
of the per-gradient flags).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cupy_amp.array_backend import byte_extent, register_array_type
from cupy_amp.errors import GradientTypeError, GradientValueError

try:
    import cupy
except ImportError:  # the NumPy path works without CuPy
    cupy = None

__all__ = ["CupyBackend", "CupyOverflowCheck", "CupyUnscalePlan", "cupy_backend"]

_TABLE_CACHE_SIZE = 16


@dataclass(frozen=True)
class CupyOverflowCheck:
    """Overflow result of one call, already read back from the device(s)."""

    overflow: bool
    local: bool
    positions: tuple[int, ...]

    def found_overflow(self) -> bool:
        """Return the verdict (already read back: never synchronizes)."""
        return self.overflow

    def local_overflow(self) -> bool:
        """Return True if this process's gradients held inf/nan."""
        return self.local

    def nonfinite_positions(self) -> list[int]:
        """Return the positions of the gradients that held inf/nan."""
        return list(self.positions)


_CLEAN = CupyOverflowCheck(False, False, ())


class _LaunchedCheck:
    """The result of launched kernels, read back from the device on the first question.

    The caller can do work that does not depend on the verdict while the
    kernels run, and only then wait for them.
    """

    __slots__ = ("_read", "_result")

    def __init__(self, read: Any) -> None:
        self._read = read
        self._result: CupyOverflowCheck | None = None

    def _resolved(self) -> CupyOverflowCheck:
        if self._result is None:
            self._result = self._read()
            self._read = None  # the closure holds the plan's tables: drop it once read
        return self._result

    def found_overflow(self) -> bool:
        """Return the verdict (waits for the kernels the first time)."""
        return self._resolved().overflow

    def local_overflow(self) -> bool:
        """Return True if this process's gradients held inf/nan."""
        return self._resolved().local

    def nonfinite_positions(self) -> list[int]:
        """Return the positions of the gradients that held inf/nan."""
        return list(self._resolved().positions)


@dataclass(frozen=True)
class _Group:
    """The gradients of one (device, dtype): one kernel launch."""

    device_id: int
    positions: tuple[int, ...]
    table: Any


class CupyUnscalePlan:
    """Launch groups and device tables for one list of CuPy gradients.

    Holds no reference to the arrays. Reuse is valid while the same array
    objects come back: their addresses cannot change, and for the few
    non-dense arrays the shape and strides are re-checked.
    """

    def __init__(
        self, backend: CupyBackend, groups: tuple[_Group, ...], strided: tuple[tuple[int, Any, Any], ...]
    ) -> None:
        self._backend = backend
        self.groups = groups
        self._strided = strided

    def still_valid(self, arrays: Sequence[Any]) -> bool:
        if not self._strided:  # the usual case: dense arrays cannot change layout in place
            return True
        return all(
            arrays[position].shape == shape and arrays[position].strides == strides
            for position, shape, strides in self._strided
        )

    def run(self, arrays: Sequence[Any], inv_scale: np.float32, vote: Any = None) -> CupyOverflowCheck | _LaunchedCheck:
        if vote is not None:
            return self._backend.run_plan_voting(self, inv_scale, vote)
        return self._backend.run_plan(self, inv_scale)


class _FlagSlot:
    """The overflow flag of one (device, stream): one int32 in pinned, mapped host memory.

    The kernel writes the flag straight into host memory (with unified
    addressing a mapped pinned pointer is valid on the device), so reading it
    costs a stream synchronization and no copy.
    """

    def __init__(self) -> None:
        flags = cupy.cuda.runtime.hostAllocMapped | cupy.cuda.runtime.hostAllocPortable
        self._memory = cupy.cuda.PinnedMemory(4, flags)
        self.host = np.frombuffer(cupy.cuda.PinnedMemoryPointer(self._memory, 0), dtype=np.int32, count=1)
        self.host[0] = 0
        self.device = np.uint64(self._memory.ptr)

    def read(self, stream: Any) -> int:
        """Wait for ``stream`` (the one synchronization) and return the flag's value."""
        stream.synchronize()
        return int(self.host[0])


class _VoteSlot:
    """Two device int32 flags (local, agreed) for a voting call, and pinned host memory to read them."""

    def __init__(self) -> None:
        self.device = cupy.zeros(2, dtype=np.int32)
        self._pinned = cupy.cuda.alloc_pinned_memory(8)
        self.host = np.frombuffer(self._pinned, dtype=np.int32, count=2)

    def read(self, stream: Any) -> tuple[int, int]:
        """Copy both flags to the host on ``stream`` and wait (the one synchronization)."""
        cupy.cuda.runtime.memcpyAsync(
            self.host.ctypes.data, self.device.data.ptr, 8, cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr
        )
        stream.synchronize()
        return int(self.host[0]), int(self.host[1])


class CupyBackend:
    """Array operations on ``cupy.ndarray`` (and zero-copy views of CUDA arrays)."""

    name = "cupy"

    def __init__(self) -> None:
        from cupy_amp import cuda_kernels

        self._kernels = cuda_kernels
        self._lock = threading.Lock()
        self._tables: OrderedDict[Hashable, Any] = OrderedDict()
        # Flag slots per thread as well as per (device, stream): two threads launching on one stream
        # must not write (and read) each other's flag between a launch and its read-back. Held in
        # thread-local storage, so a thread's pinned slots are freed when the thread ends.
        self._per_thread = threading.local()
        self._epochs = itertools.count(1)

    def coerce(self, obj: Any) -> Any | None:
        if isinstance(obj, cupy.ndarray):
            return obj
        try:
            if hasattr(obj, "__cuda_array_interface__"):
                return cupy.asarray(obj)
            if hasattr(obj, "__dlpack__"):
                return cupy.from_dlpack(obj)
        except Exception:  # not a CUDA array after all (a CPU DLPack tensor, one that needs grad...)
            return None
        return None

    def dtype_problem(self, array: Any) -> str | None:
        if self._kernels.kernel_dtype_name(array.dtype) is not None:
            return None
        return f"dtype {array.dtype} is not supported (expected float16, float32 or float64)"

    def write_problem(self, array: Any) -> str | None:
        if array.size == 0:
            return None
        for extent, stride in zip(array.shape, array.strides):
            if stride % array.itemsize:
                return f"its strides {array.strides} are not multiples of its itemsize {array.itemsize}"
            if stride == 0 and extent > 1:
                return "it repeats elements (a zero stride, as from broadcasting), so some would be scaled twice"
        return None

    def memory_extent(self, array: Any) -> tuple[Hashable, int, int]:
        start, stop = byte_extent(int(array.data.ptr), array.shape, array.strides, array.itemsize)
        return ("cuda", array.device.id), start, stop

    def shares_memory(self, first: Any, second: Any) -> bool:
        return bool(cupy.shares_memory(first, second))

    def _dtype_name(self, dtype: Any) -> str:
        name = self._kernels.kernel_dtype_name(dtype)
        if name is None:  # validation refuses such arrays before they get here
            raise GradientTypeError(f"dtype {dtype} has no kernel (expected float16, float32 or float64)")
        return name

    def scale_in_place(self, loss: Any, scale: np.float32) -> None:
        dtype_name = self._dtype_name(loss.dtype)
        with _on_device(loss.data.device_id):
            self._kernels.launch_scale_loss(loss, dtype_name, np.float32(scale))

    def prepare(self, arrays: Sequence[Any]) -> CupyUnscalePlan:
        positions_by_group: dict[tuple[int, str], list[int]] = {}
        for position, array in enumerate(arrays):
            key = (array.device.id, self._dtype_name(array.dtype))
            positions_by_group.setdefault(key, []).append(position)
        groups = []
        for (device_id, dtype_name), positions in positions_by_group.items():
            with cupy.cuda.Device(device_id):
                table = self._table(device_id, dtype_name, [arrays[p] for p in positions])
            groups.append(_Group(device_id, tuple(positions), table))
        strided = tuple(
            (position, array.shape, array.strides)
            for position, array in enumerate(arrays)
            if self._kernels.dense_base(array) is None
        )
        return CupyUnscalePlan(self, tuple(groups), strided)

    def run_plan(self, plan: CupyUnscalePlan, inv_scale: np.float32) -> _LaunchedCheck:
        """Launch every group of ``plan``; each device's flag is read once, when the result is first asked."""
        epoch = next(self._epochs) % (2**31 - 1) + 1
        factor = inv_scale
        streams: dict[int, tuple[Any, _FlagSlot]] = {}
        for group in plan.groups:
            with _on_device(group.device_id):
                if group.device_id not in streams:
                    stream = cupy.cuda.get_current_stream()
                    streams[group.device_id] = (stream, self._flag_slot(group.device_id, stream))
                self._kernels.launch_unscale_check(group.table, factor, epoch, streams[group.device_id][1].device)
        return _LaunchedCheck(functools.partial(self._read_flags, plan, streams, epoch))

    def _read_flags(
        self, plan: CupyUnscalePlan, streams: dict[int, tuple[Any, _FlagSlot]], epoch: int
    ) -> CupyOverflowCheck:
        """Wait for the launches of one call and collect its verdict (per-gradient flags only after an overflow)."""
        overflow = False
        culprits: list[int] = []
        for device_id, (stream, slot) in streams.items():
            if slot.read(stream) != epoch:
                continue
            overflow = True
            with _on_device(device_id):
                for group in plan.groups:
                    if group.device_id == device_id:
                        flags = group.table.tensor_found.get(stream=stream)
                        culprits += [group.positions[i] for i in np.flatnonzero(flags == epoch)]
        return CupyOverflowCheck(overflow, overflow, tuple(sorted(culprits))) if overflow else _CLEAN

    def run_plan_voting(self, plan: CupyUnscalePlan, inv_scale: np.float32, vote: Any) -> CupyOverflowCheck:
        """Like :meth:`run_plan`, with the local flag all-reduced (MAX) across ranks before the read-back."""
        devices = {group.device_id for group in plan.groups}
        if len(devices) != 1:
            raise GradientValueError(
                f"With a communicator, every gradient of a call must be on one device (the communicator's); "
                f"got devices {sorted(devices)}."
            )
        (device_id,) = devices
        epoch = next(self._epochs) % (2**31 - 1) + 1
        with _on_device(device_id):
            stream = cupy.cuda.get_current_stream()
            slot = self._vote_slot(device_id, stream)
            cupy.cuda.runtime.memsetAsync(slot.device.data.ptr, 0, 8, stream.ptr)
            for group in plan.groups:
                self._kernels.launch_unscale_check(group.table, np.float32(inv_scale), epoch, slot.device)
            vote.reduce_max(slot.device, stream)
            local_flag, agreed_flag = slot.read(stream)
            culprits: list[int] = []
            if local_flag:
                for group in plan.groups:
                    flags = group.table.tensor_found.get(stream=stream)
                    culprits += [group.positions[i] for i in np.flatnonzero(flags == epoch)]
        return CupyOverflowCheck(bool(agreed_flag), bool(local_flag), tuple(sorted(culprits)))

    def _vote_slot(self, device_id: int, stream: Any) -> _VoteSlot:
        slots: dict[tuple[int, int], _VoteSlot] = self._per_thread.__dict__.setdefault("votes", {})
        key = (device_id, stream.ptr)
        slot = slots.get(key)
        if slot is None:
            slot = slots[key] = _VoteSlot()
        return slot

    def _flag_slot(self, device_id: int, stream: Any) -> _FlagSlot:
        slots: dict[tuple[int, int], _FlagSlot] = self._per_thread.__dict__.setdefault("flags", {})
        key = (device_id, stream.ptr)
        slot = slots.get(key)
        if slot is None:
            slot = slots[key] = _FlagSlot()
        return slot

    def _table(self, device_id: int, dtype_name: str, arrays: list[Any]) -> Any:
        key = (device_id, dtype_name, tuple((a.data.ptr, a.shape, a.strides) for a in arrays))
        with self._lock:
            table = self._tables.get(key)
            if table is not None:
                self._tables.move_to_end(key)
                return table
        table = self._kernels.build_device_table(arrays, dtype_name)
        with self._lock:
            self._tables[key] = table
            while len(self._tables) > _TABLE_CACHE_SIZE:
                self._tables.popitem(last=False)
        return table


_ALREADY_CURRENT = contextlib.nullcontext()  # stateless, so one instance serves every block


def _on_device(device_id: int) -> Any:
    """Make ``device_id`` current for a block; free when it already is (the usual case)."""
    if cupy.cuda.runtime.getDevice() == device_id:
        return _ALREADY_CURRENT
    return cupy.cuda.Device(device_id)


@functools.cache
def cupy_backend() -> CupyBackend | None:
    """Return the shared CuPy backend, or None when CuPy is not installed."""
    if cupy is None:
        return None
    backend = CupyBackend()
    register_array_type(cupy.ndarray, backend)
    return backend
