"""Launch a compiled kernel with one driver call, its arguments kept in a reusable host block.

CuPy's general kernel call inspects and converts every argument on every
launch, which costs several microseconds of Python per launch. The scaler
launches the same kernels with the same argument types every step, so each
launch site keeps a fixed parameter block instead: one 8-byte slot per
argument and the array of pointers to the slots that ``cuLaunchKernel``
takes. Arguments that never change (table addresses, counts) are written
once; a launch writes only the others. The driver copies the values during
the call, so the block can be refilled as soon as the call returns.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import cupy
import numpy as np

__all__ = ["KernelLaunch"]

_SLOT_BYTES = 8


class KernelLaunch:
    """One kernel's parameter block, some of it filled once, the rest per launch.

    Args:
        function: A function of a ``cupy.RawModule`` (or its compiled
            ``cupy.cuda.Function``), taken while its device is current.
        argument_types: The numpy type of each kernel parameter, in order
            (pointers as ``np.uint64``); every one must fit in 8 bytes.
        fixed: Values of the parameters that never change, by position.
    """

    def __init__(self, function: Any, argument_types: Sequence[Any], fixed: Mapping[int, Any] | None = None) -> None:
        fixed = fixed or {}
        # A RawKernel's compiled function for the current device; held so its module stays loaded.
        self._handle = getattr(function, "kernel", function)
        self._function = int(self._handle.ptr)
        self._block = np.zeros(len(argument_types), dtype=np.uint64)
        self._pointers = np.array(
            [self._block.ctypes.data + _SLOT_BYTES * i for i in range(len(argument_types))], dtype=np.uint64
        )
        self._pointers_address = self._pointers.ctypes.data
        slots = []
        for position, kind in enumerate(argument_types):
            kind = np.dtype(kind)
            if kind.itemsize > _SLOT_BYTES:
                raise ValueError(f"kernel parameter {position} of type {kind} does not fit in {_SLOT_BYTES} bytes")
            slot = self._block[position : position + 1].view(np.uint8)[: kind.itemsize].view(kind)
            if position in fixed:
                slot[0] = fixed[position]
            else:
                slots.append(slot)
        self._changing = tuple(slots)
        # Two threads launching through one block must not interleave their writes.
        self._lock = threading.Lock()

    def __call__(self, grid: int, block: int, *values: Any) -> None:
        """Launch on the current stream with ``values`` for the non-fixed parameters, in order.

        Asynchronous: never synchronizes the device.
        """
        if len(values) != len(self._changing):
            raise TypeError(f"this launch takes {len(self._changing)} changing arguments, got {len(values)}")
        with self._lock:
            for slot, value in zip(self._changing, values):
                slot[0] = value
            cupy.cuda.driver.launchKernel(
                self._function,
                grid,
                1,
                1,
                block,
                1,
                1,
                0,
                cupy.cuda.get_current_stream().ptr,
                self._pointers_address,
                0,
            )
