"""Host time of the scaler's calls on the GPU, per call, with the GPU kept busy so that nothing waits.

A long kernel is queued first; then N sync-free steps (``scale_loss``,
``check(max_norm)``, ``update``) on a ``GradientSet`` are queued behind it and
each call is timed on the host with ``time.perf_counter``: none of them can
wait for the device, so what is measured is the Python and the launches
(PyTorch's ``GradScaler`` beside them, where PyTorch with CUDA is installed). No
profiler runs (CUPTI's callbacks triple host times). ``GradScaler``'s
``unscale_and_check`` reads the verdict back, so it cannot hide behind a busy
GPU: it is timed on an idle GPU, as its wall time minus its kernel's time.
``--profile`` prints cProfile's view of the sync-free step instead (slower, but
it shows where the time goes).

Usage: PYTHONPATH=. python tools/bench_host_gpu.py [--steps 100] [--repeats 5] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

import cupy
import numpy as np
from bench_unscale import gpt2_shapes

from cupy_amp import GradientSet, GradScaler, SyncFreeGradScaler

WORKLOADS = {
    "gpt2-small-fp16": (gpt2_shapes(12, 768), "float16"),
    "5000x8192-fp16": ([(8192,)] * 5000, "float16"),
}
_SPIN = cupy.RawKernel(
    'extern "C" __global__ void spin(long long cycles) { long long t = clock64(); while (clock64() - t < cycles) {} }',
    "spin",
)


def gradients(shapes: list[tuple[int, ...]], dtype: str) -> list[cupy.ndarray]:
    return [cupy.full(shape, 0.5, dtype=dtype) for shape in shapes]


def busy(seconds: float) -> None:
    """Queue a kernel that keeps the GPU busy for about ``seconds``."""
    rate = cupy.cuda.Device().attributes["ClockRate"] * 1000  # kHz -> cycles per second
    _SPIN((1,), (1,), (np.int64(seconds * rate),))


def host_times(
    calls: dict[str, Callable[[], object]], steps: int, repeats: int, before_round: Callable[[], object]
) -> dict[str, float]:
    """Median host time (us) of each of ``calls``, run in order ``steps`` times per round after ``before_round``.

    Each call is run once first (kernels loaded, buffers sized); the medians' sum is given as "step".
    """
    for call in calls.values():
        call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        before_round()
        for _ in range(steps):
            for name, call in calls.items():
                begin = time.perf_counter()
                call()
                samples[name].append((time.perf_counter() - begin) * 1e6)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    medians["step"] = sum(medians.values())
    return medians


def behind_busy_gpu() -> None:
    cupy.cuda.Device().synchronize()
    busy(0.2)


def sync_free_calls(shapes: list[tuple[int, ...]], dtype: str, steps: int, repeats: int) -> dict[str, float]:
    """Median host time (us) of each call of a sync-free step, queued behind a busy GPU."""
    scaler = SyncFreeGradScaler(init_scale=1.0, growth_interval=10**9)
    prepared = scaler.prepare(gradients(shapes, dtype))
    loss = cupy.ones((), dtype=cupy.float32)
    calls: dict[str, Callable[[], object]] = {
        "scale_loss": lambda: scaler.scale_loss(loss),
        "check": lambda: scaler.check(prepared, max_norm=1.0),
        "update": scaler.update,
    }
    medians = host_times(calls, steps, repeats, behind_busy_gpu)
    cupy.cuda.Device().synchronize()
    if scaler.stats().skipped_steps:
        raise SystemExit("benchmark check failed: clean gradients were skipped")
    return medians


def torch_calls(
    shapes: list[tuple[int, ...]],
    steps: int,
    repeats: int,
    before_round: Callable[[], object],
    device: str = "cuda",
) -> dict[str, float] | None:
    """Median host time (us) of PyTorch's nearest step, each round after ``before_round``; None without PyTorch.

    ``torch.amp.GradScaler``'s ``scale``, ``unscale_`` (its fused check and unscale, which does not wait) and
    ``update``, on float32 gradients (``unscale_`` refuses float16 ones) of the same shapes. Its ``step``
    waits for the verdict unless the optimizer is fused, so it is left out, as our optimizer step is.
    """
    try:
        import torch
    except ImportError:
        return None
    if device == "cuda" and not torch.cuda.is_available():
        return None
    params = [torch.nn.Parameter(torch.zeros(shape, device=device)) for shape in shapes]
    for param in params:
        param.grad = torch.full_like(param, 0.5)
    optimizer = torch.optim.SGD(params, lr=0.0)
    scaler = torch.amp.GradScaler(device, init_scale=1.0, growth_interval=10**9)
    loss = torch.ones((), device=device)
    calls: dict[str, Callable[[], object]] = {
        "scale": lambda: scaler.scale(loss),
        "unscale_": lambda: scaler.unscale_(optimizer),
        "update": scaler.update,
    }
    medians = host_times(calls, steps, repeats, before_round)
    if device == "cuda":
        torch.cuda.synchronize()
    if scaler.get_scale() != 1.0:
        raise SystemExit("benchmark check failed: PyTorch's scaler saw an overflow in clean gradients")
    return medians


def grad_scaler_call(shapes: list[tuple[int, ...]], dtype: str, repeats: int) -> tuple[float, float]:
    """Median host time (us) of GradScaler.unscale_and_check on a GradientSet, on an idle GPU, two ways.

    The call waits for its verdict, so its wall time holds the host's part, the kernel and the read-back.
    Returned: (1) the median wall time less the kernel's median time (measured apart, between events);
    (2) the median wall time less that of the bare minimum on the same data: the same unscale launch and
    the same one-copy read of the verdict, without the scaler around them. (1) also counts what an idle
    GPU adds to a long kernel's time (clocks ramping up after the synchronize), which (2) cancels.
    """
    grads = gradients(shapes, dtype)
    prepared = GradientSet(grads)
    scalers = [GradScaler(init_scale=2.0, max_scale=None), GradScaler(init_scale=0.5, min_scale=None)]
    loss = cupy.ones((), dtype=cupy.float32)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    walls, bares, kernels = [], [], []
    for i in range(repeats * 10):
        scaler = scalers[i % 2]  # 2 then 1/2: the data stay in range
        scaler.scale_loss(loss)
        cupy.cuda.Device().synchronize()
        begin = time.perf_counter()
        scaler.unscale_and_check(prepared)
        walls.append((time.perf_counter() - begin) * 1e6)
        scaler.update()
        state = next(iter(scaler._scaling.states.values()))
        call = SimpleNamespace(plan=prepared._call.plan)  # the kernel alone, as the call launches it
        cupy.cuda.Device().synchronize()
        begin = time.perf_counter()
        state.unscale(call)
        state.read()
        bares.append((time.perf_counter() - begin) * 1e6)
        busy(0.001)  # the host's queuing hides behind it: the events time the kernel
        start.record()
        state.unscale(call)
        stop.record()
        stop.synchronize()
        kernels.append(cupy.cuda.get_elapsed_time(start, stop) * 1000.0)
    wall = statistics.median(walls)
    return wall - statistics.median(kernels), wall - statistics.median(bares)


def profile(shapes: list[tuple[int, ...]], dtype: str, steps: int) -> None:
    scaler = SyncFreeGradScaler(init_scale=1.0, growth_interval=10**9)
    prepared = scaler.prepare(gradients(shapes, dtype))
    loss = cupy.ones((), dtype=cupy.float32)

    def run() -> None:
        for _ in range(steps):
            scaler.scale_loss(loss)
            scaler.check(prepared, max_norm=1.0)
            scaler.update()

    run()
    cupy.cuda.Device().synchronize()
    busy(2.0)
    profiler = cProfile.Profile()
    profiler.runcall(run)
    cupy.cuda.Device().synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="steps queued behind one busy kernel (default 100)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--profile", action="store_true", help="print cProfile's view of the sync-free step")
    args = parser.parse_args(argv)
    if args.profile:
        profile(*WORKLOADS["gpt2-small-fp16"], args.steps)
        return 0
    for name, (shapes, dtype) in WORKLOADS.items():
        calls = sync_free_calls(shapes, dtype, args.steps, args.repeats)
        shown = "  ".join(f"{call} {us:5.1f}" for call, us in calls.items())
        print(f"{name:16s} sync-free (us): {shown}")
        theirs = torch_calls(shapes, args.steps, args.repeats, behind_busy_gpu)
        if theirs is not None:
            shown = "  ".join(f"{call} {us:5.1f}" for call, us in theirs.items())
            print(f"{name:16s} PyTorch GradScaler, float32 (us): {shown}")
        beyond_kernel, beyond_bare = grad_scaler_call(shapes, dtype, args.repeats)
        print(f"{name:16s} GradScaler.unscale_and_check(GradientSet): {beyond_kernel:.1f} us beyond its kernel, "
              f"{beyond_bare:.1f} us beyond a bare launch and verdict read")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
