"""Pick the array module: NumPy on the CPU, CuPy on a GPU (imported only here, only when asked)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from cupy_amp.demo.options import DemoError

__all__ = ["Device", "select_device", "small_matrix_threads"]


@dataclass(frozen=True)
class Device:
    """The array module a run computes with.

    Attributes:
        xp: ``numpy`` or ``cupy``.
        kind: "cpu" or "gpu".
        description: One line for the user, e.g. "GPU 0: NVIDIA H200 (CuPy 14.2.0)".
    """

    xp: Any
    kind: str
    description: str

    def to_host(self, array: Any) -> np.ndarray:
        """Copy an array of this device to a NumPy array (synchronizes the GPU)."""
        return np.asarray(self.xp.asnumpy(array)) if self.kind == "gpu" else np.asarray(array)


def select_device(choice: str) -> tuple[Device, str | None]:
    """Return the device for ``--device`` and, under 'auto' on the CPU, why the GPU was not used.

    Raises:
        DemoError: ``choice`` is "gpu" and CuPy cannot run a kernel here.
    """
    cpu = Device(np, "cpu", f"CPU (NumPy {np.__version__})")
    if choice == "cpu":
        return cpu, None
    gpu, problem = _probe_gpu()
    if gpu is not None:
        return gpu, None
    if choice == "gpu":
        raise DemoError(f"--device gpu: no usable GPU: {problem}. Use --device cpu (or auto) to run on the CPU.")
    return cpu, problem


def _probe_gpu() -> tuple[Device | None, str]:
    """Import CuPy and run one small kernel; return the device, or None and the reason it failed."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken install raising anything at import
        return None, f"CuPy is not installed ({_short(exc)})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "CuPy sees no CUDA device"
        total = int(cupy.arange(4, dtype=cupy.float32).sum())  # compiles and runs a kernel: driver and NVRTC work
        if total != 6:
            return None, f"a test kernel returned {total} instead of 6"
        properties = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    except Exception as exc:  # CUDARuntimeError, CompileException, missing NVRTC library ...
        return None, f"CuPy cannot use a GPU ({_short(exc)})"
    name = properties["name"].decode(errors="replace") if isinstance(properties["name"], bytes) else properties["name"]
    return Device(cupy, "gpu", f"GPU {cupy.cuda.Device().id}: {name} (CuPy {cupy.__version__})"), ""


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text if len(text) <= 160 else text[:157] + "..."


def small_matrix_threads(device: Device) -> contextlib.AbstractContextManager[Any]:
    """Limit NumPy's BLAS to one thread while training on the CPU, when threadpoolctl is installed.

    The demo's matrices are small (512 x 64); a multithreaded BLAS spends more
    time synchronizing its threads than multiplying, several times more on a
    busy two-core machine. Results depend on the thread count (the summation
    order does), so a run and its resumption should agree on having
    threadpoolctl. Without it, nothing changes.
    """
    if device.kind != "cpu":
        return contextlib.nullcontext()
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    limits: contextlib.AbstractContextManager[Any] = threadpool_limits(limits=1, user_api="blas")
    return limits
