"""Host time of one kernel launch: cupy-amp's driver launch from a reused argument block, against CuPy's call.

Both launch the same compiled unscale kernel with the same struct argument
(``kernel_interface.UNSCALE_ARGS``) over a one-chunk table; the kernel is tiny,
so N launches queued back to back take N times the host cost of a launch.
This is the measurement that decides whether the driver launch is worth its
code (issue 12): CuPy's ``RawKernel.__call__`` accepts the struct as a
one-element NumPy structured array.

Usage: PYTHONPATH=. python tools/bench_launch.py [--launches 2000] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import cupy
import numpy as np

from cupy_amp import SyncFreeGradScaler, kernel_interface
from cupy_amp.gpu import backend as cupy_backend
from cupy_amp.gpu import launch as kernel_launch


def per_launch_us(launch: Any, launches: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        cupy.cuda.Device().synchronize()
        begin = time.perf_counter()
        for _ in range(launches):
            launch()
        elapsed = time.perf_counter() - begin
        cupy.cuda.Device().synchronize()
        samples.append(elapsed / launches * 1e6)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--launches", type=int, default=2000, help="launches queued per sample")
    parser.add_argument("--repeats", type=int, default=15, help="samples (the median is shown)")
    args = parser.parse_args(argv)
    grads = [cupy.ones(16, dtype=cupy.float32)]
    scaler = SyncFreeGradScaler(init_scale=1.0)
    scaler.prepare(grads)  # places the scaler's State on the device: every launch reads its scale and flags
    state = scaler._state.address
    (group,) = cupy_backend.prepare(grads)
    table = group.table
    stream = cupy.cuda.get_current_stream()

    flags = scaler._state._flags(group)  # the scaler's own culprit flags for this table

    def driver() -> None:
        table.launch(1, stream.ptr, state=state, tensor_found=flags)

    kernel = kernel_launch._module("unscale_check.cu").get_function("cupy_amp_unscale_check_float32")
    record = np.zeros(1, kernel_interface.UNSCALE_ARGS)
    record["chunks"] = table.memory.data.ptr
    record["layouts"] = table.memory.data.ptr + kernel_interface.CHUNK.itemsize * table.chunk_count
    record["chunk_count"] = table.chunk_count
    record["tensor_found"] = flags

    def cupy_call() -> None:
        record["state"] = state
        kernel((1,), (kernel_interface.THREADS,), (record,))

    for name, launch in (("driver launch, reused block", driver), ("CuPy RawKernel call", cupy_call)):
        launch()
        print(f"{name:30} {per_launch_us(launch, args.launches, args.repeats):6.2f} us per launch")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
