"""Benchmark the fused unscale-and-check against the copy-bandwidth floor and PyTorch.

For each workload, measured in one run with every timer interleaved round by
round (so clock drift hits all of them alike): a 2 GiB device-to-device copy
(the bandwidth floor); cupy-amp's kernel (CUDA events) and the wall time of a
full ``unscale_and_check`` + ``update`` with a plain list and with a
``GradientSet`` (host work and the flag read-back included); PyTorch's fused
``torch._amp_foreach_non_finite_check_and_unscale_`` (events, and wall time
with its ``found_inf.item()``) when torch with CUDA is importable; a naive
per-tensor CuPy loop; and, on GPT-2-small, the wall time of a whole step
(``scale_loss`` + ``unscale_and_check`` + ``update``). Medians are reported.

Usage: PYTHONPATH=. python tools/bench_unscale.py [--quick] [--repeats N] [--json PATH]
       [--workload NAME ...] [--skip-torch] [--skip-naive]
(or with cupy-amp installed, without PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cupy
import numpy as np

from cupy_amp import GradientSet, GradScaler, kernel_interface
from cupy_amp.gpu import backend as cupy_backend
from cupy_amp.gpu.device_state import DeviceState
from cupy_amp.rule import ScalerConfig, ScalerState

INV_SCALES = (np.float32(2.0**-16), np.float32(2.0**16))
COPY_ELEMENTS = 2**29  # float32: a 2 GiB source and a 2 GiB destination


def gpt2_shapes(layers: int, width: int, vocab: int = 50257, context: int = 1024) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT-2 model (tied embeddings), in the usual order."""
    shapes: list[tuple[int, ...]] = [(vocab, width), (context, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (width, 3 * width), (3 * width,), (width, width), (width,)]
        shapes += [(width,), (width,), (width, 4 * width), (4 * width,), (4 * width, width), (width,)]
    return [*shapes, (width,), (width,)]


WORKLOADS: dict[str, tuple[list[tuple[int, ...]], str]] = {
    "1GiB-fp32": ([(2**28,)], "float32"),
    "gpt2-small-fp32": (gpt2_shapes(12, 768), "float32"),
    "gpt2-small-fp16": (gpt2_shapes(12, 768), "float16"),
    "5000x8192-fp32": ([(8192,)] * 5000, "float32"),
    "gpt2-xl-fp32": (gpt2_shapes(48, 1600), "float32"),
}


@dataclass
class Row:
    workload: str
    tensors: int
    elements: int
    bytes_moved: int
    copy_tbps: float
    floor_us: float
    ours_kernel_us: float
    ours_fraction: float
    ours_wall_us: float
    ours_host_overhead_us: float
    ours_set_wall_us: float
    ours_set_host_overhead_us: float
    bare_launch_and_readback_overhead_us: float
    torch_kernel_us: float | None = None
    torch_fraction: float | None = None
    torch_wall_us: float | None = None
    speedup_vs_torch: float | None = None
    naive_wall_us: float | None = None
    speedup_vs_naive: float | None = None
    step_wall_us: float | None = None
    step_over_kernel: float | None = None
    step_set_wall_us: float | None = None
    step_set_over_kernel: float | None = None


# Every timer first runs its operation once untimed, then times it: the timed run starts
# from the cache state its own operation leaves (as in a loop of training steps) rather
# than from whatever the previous timer left; in particular, L2 lines dirtied by the
# previous timer are not written back on the timed run's account. Runs go in pairs
# (i, i+1), so the alternating unscale factors cancel and the data stays in range.


_SPIN = cupy.RawKernel(
    'extern "C" __global__ void bench_spin(long long cycles) '
    "{ long long start = clock64(); while (clock64() - start < cycles) {} }",
    "bench_spin",
)


def hide_host_latency(rounds: int = 1) -> None:
    """Keep the GPU busy (about 100 us per round) while the host queues the timed work, so no event times host latency.

    Without it, the Python between recording the start event and queueing the
    kernel (microseconds: a lock, a stream lookup, the argument block) counts
    as kernel time. Every event timer calls it just before its start event.
    """
    for _ in range(rounds):
        _SPIN((1,), (1,), (np.int64(200_000),))


def cupy_event_timer(run: Callable[[int], object], cover: int = 1) -> Callable[[int], float]:
    """Return a timer giving the GPU time of ``run(i)`` in microseconds (CuPy events).

    ``cover``: rounds of :func:`hide_host_latency` (about 100 us each) queued before the start event.
    """
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()

    def timed(i: int) -> float:
        run(2 * i)
        hide_host_latency(cover)
        start.record()
        run(2 * i + 1)
        stop.record()
        stop.synchronize()
        return float(cupy.cuda.get_elapsed_time(start, stop)) * 1000.0

    return timed


def wall_timer(run: Callable[[int], object], setup: Callable[[int], object] | None = None) -> Callable[[int], float]:
    """Return a timer giving the wall time of ``run(i)``, which must wait for its own result.

    ``setup(i)``, if given, runs before each ``run(i)``, untimed (the timed one's finished before the clock starts).
    """

    def timed(i: int) -> float:
        if setup is not None:
            setup(2 * i)
        run(2 * i)
        if setup is not None:
            setup(2 * i + 1)
        cupy.cuda.Device().synchronize()
        begin = time.perf_counter()
        run(2 * i + 1)
        return (time.perf_counter() - begin) * 1e6

    return timed


_scrub_buffer: list[cupy.ndarray] = []


def scrub_l2() -> None:
    """Read 256 MiB (several times any L2) untimed, so the next timer starts from an L2 of clean lines.

    Otherwise a timer may pay for writing back the dirty lines the previous timer
    left, which its own untimed run does not always flush: lines loaded with
    evict-first hints go before the previous timer's ordinary ones.
    """
    if not _scrub_buffer:
        _scrub_buffer.append(cupy.ones(2**26, dtype=cupy.float32))
    _scrub_buffer[0].sum()
    cupy.cuda.Device().synchronize()


def interleaved_medians(timers: dict[str, Callable[[int], float]], repeats: int, warmup: int = 3) -> dict[str, float]:
    """Run every timer once per round, ``repeats`` rounds, and return each one's median.

    Each timer call starts after an L2 scrub (see :func:`scrub_l2`).
    """
    for i in range(warmup):
        for timer in timers.values():
            scrub_l2()
            timer(i)
    samples: dict[str, list[float]] = {name: [] for name in timers}
    for i in range(repeats):
        for name, timer in timers.items():
            scrub_l2()
            samples[name].append(timer(i))
    return {name: statistics.median(values) for name, values in samples.items()}


def copy_timer() -> Callable[[int], float]:
    """Return a timer of the 2 GiB device-to-device copy that defines the bandwidth floor."""
    src = cupy.random.standard_normal(COPY_ELEMENTS, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    return cupy_event_timer(lambda _: cupy.copyto(dst, src))


def make_gradients(shapes: list[tuple[int, ...]], dtype: str, seed: int) -> list[cupy.ndarray]:
    rng = cupy.random.default_rng(seed)
    return [rng.standard_normal(shape, dtype=cupy.float32).astype(dtype) for shape in shapes]


def check_detection(grads: list[cupy.ndarray]) -> None:
    """Plant an inf in the last element of the last gradient; the check must find it."""
    scaler = GradScaler(init_scale=1.0, min_scale=None)
    last = grads[-1].reshape(-1)
    saved = last[-1:].copy()
    last[-1] = cupy.inf
    scaler.scale_loss(cupy.ones((), dtype=cupy.float32))
    ok = scaler.unscale_and_check(grads)
    if ok or scaler.nonfinite_gradients() != [len(grads) - 1]:
        raise SystemExit("benchmark check failed: the planted inf was not detected")
    last[-1:] = saved


def alternating_scalers() -> list[GradScaler]:
    # Unscaling by 2**-16 then 2**16 keeps the data in range however many calls run.
    return [GradScaler(init_scale=2.0**16, max_scale=None), GradScaler(init_scale=2.0**-16, min_scale=None)]


def our_timers(grads: list[cupy.ndarray], step: bool) -> dict[str, Callable[[int], float]]:
    plan = cupy_backend.prepare(grads)
    scalers = alternating_scalers()
    grad_set = GradientSet(grads)
    loss = cupy.ones((), dtype=cupy.float32)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()

    # The kernel reads the factor and epoch from a scaler state in device memory (both scalers' launch).
    config = ScalerConfig(min_scale=None, max_scale=None)
    states = [
        DeviceState(cupy.cuda.Device().id, config, ScalerState(scale, 0, 1), False, False, 0)
        for scale in (2.0**16, 2.0**-16)
    ]
    call_of_plan = SimpleNamespace(plan=plan)

    def kernel(i: int) -> float:
        states[0].unscale(call_of_plan)
        hide_host_latency()
        start.record()
        states[1].unscale(call_of_plan)
        stop.record()
        stop.synchronize()
        return float(cupy.cuda.get_elapsed_time(start, stop)) * 1000.0

    def open_step(i: int) -> None:
        scalers[i % 2].scale_loss(loss)

    def call(argument: Any, with_loss: bool) -> Callable[[int], None]:
        def run(i: int) -> None:
            scaler = scalers[i % 2]
            if with_loss:
                scaler.scale_loss(loss)
            scaler.unscale_and_check(argument)
            scaler.update()

        return run

    def bare(i: int) -> None:
        # The backend alone: the same launch and verdict read-back, without the scaler's validation and bookkeeping.
        states[i % 2].unscale(call_of_plan)
        states[i % 2].read()

    timers = {
        "ours_kernel": kernel,
        "bare_wall": wall_timer(bare),
        "ours_wall": wall_timer(call(grads, False), open_step),  # the step opened by an untimed scale_loss
        "ours_set_wall": wall_timer(call(grad_set, False), open_step),
    }
    if step:
        timers["step_wall"] = wall_timer(call(grads, True))
        timers["step_set_wall"] = wall_timer(call(grad_set, True))
    return timers


def torch_timers(grads: list[cupy.ndarray]) -> dict[str, Callable[[int], float]]:
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    cupy.cuda.Device().synchronize()
    tensors = [torch.as_tensor(g, device="cuda") for g in grads]  # zero-copy views of the same memory
    found = torch.zeros(1, device="cuda")
    invs = [torch.full((1,), float(s), device="cuda") for s in INV_SCALES]
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def kernel(i: int) -> float:
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, invs[0])
        hide_host_latency()
        start.record()
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, invs[1])
        stop.record()
        stop.synchronize()
        return float(start.elapsed_time(stop)) * 1000.0

    def full_call(i: int) -> None:
        found.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, invs[i % 2])
        found.item()

    def full_call_timed(i: int) -> float:
        torch.cuda.synchronize()
        return wall_timer(full_call)(i)

    return {"torch_kernel": kernel, "torch_wall": full_call_timed}


def naive_wall_us(grads: list[cupy.ndarray], repeats: int) -> float:
    """Wall time of a per-tensor CuPy loop: isfinite().all() then an in-place multiply."""

    def loop(i: int) -> None:
        inv = float(INV_SCALES[i % 2])
        bad = cupy.zeros((), dtype=cupy.bool_)
        for g in grads:
            bad |= ~cupy.isfinite(g).all()
            g *= inv
        bool(bad)

    with np.errstate(over="ignore"):
        return interleaved_medians({"naive": wall_timer(loop)}, max(3, repeats // 4), warmup=1)["naive"]


def measure(name: str, args: argparse.Namespace, repeats: int, seed: int) -> Row:
    shapes, dtype = WORKLOADS[name]
    grads = make_gradients(shapes, dtype, seed)
    check_detection(grads)
    timers = {"copy": copy_timer()}
    timers.update(our_timers(grads, step=name == "gpt2-small-fp32"))
    if not args.skip_torch:
        timers.update(torch_timers(grads))
    medians = interleaved_medians(timers, repeats)
    del timers

    copy_tbps = 2 * COPY_ELEMENTS * 4 / (medians["copy"] * 1e-6) / 1e12
    bytes_moved = 2 * sum(int(g.nbytes) for g in grads)
    floor_us = bytes_moved / (copy_tbps * 1e12) * 1e6
    kernel_us = medians["ours_kernel"]
    row = Row(
        workload=name,
        tensors=len(grads),
        elements=sum(int(g.size) for g in grads),
        bytes_moved=bytes_moved,
        copy_tbps=round(copy_tbps, 3),
        floor_us=round(floor_us, 1),
        ours_kernel_us=round(kernel_us, 1),
        ours_fraction=round(floor_us / kernel_us, 3),
        ours_wall_us=round(medians["ours_wall"], 1),
        ours_host_overhead_us=round(medians["ours_wall"] - kernel_us, 1),
        ours_set_wall_us=round(medians["ours_set_wall"], 1),
        ours_set_host_overhead_us=round(medians["ours_set_wall"] - kernel_us, 1),
        bare_launch_and_readback_overhead_us=round(medians["bare_wall"] - kernel_us, 1),
    )
    if "torch_kernel" in medians:
        row.torch_kernel_us = round(medians["torch_kernel"], 1)
        row.torch_fraction = round(floor_us / medians["torch_kernel"], 3)
        row.torch_wall_us = round(medians["torch_wall"], 1)
        row.speedup_vs_torch = round(medians["torch_kernel"] / kernel_us, 2)
    if "step_wall" in medians:
        row.step_wall_us = round(medians["step_wall"], 1)
        row.step_over_kernel = round(medians["step_wall"] / kernel_us, 3)
        row.step_set_wall_us = round(medians["step_set_wall"], 1)
        row.step_set_over_kernel = round(medians["step_set_wall"] / kernel_us, 3)
    if not args.skip_naive:
        row.naive_wall_us = round(naive_wall_us(grads, repeats), 1)
        row.speedup_vs_naive = round(row.naive_wall_us / medians["ours_wall"], 1)
    del grads
    cupy.get_default_memory_pool().free_all_blocks()
    return row


def environment(repeats: int) -> dict[str, object]:
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    info: dict[str, object] = {
        "gpu": name.decode() if isinstance(name, bytes) else name,
        "driver": cupy.cuda.runtime.driverGetVersion(),
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "cupy": cupy.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "repeats": repeats,
        "launch": {"threads": kernel_interface.THREADS, "chunk_bytes": kernel_interface.CHUNK_BYTES},
    }
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        info["torch"] = None
    return info


def print_table(info: dict[str, object], rows: list[Row]) -> None:
    print(" ".join(f"{k}={v}" for k, v in info.items()))

    def cell(value: float | None, width: int, spec: str = ".1f") -> str:
        return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"

    print(
        f"{'workload':16} {'tensors':>7} {'copy TB/s':>9} {'floor us':>8} {'ours us':>8} {'frac':>5} "
        f"{'host us':>7} {'set host':>8} {'bare':>5} {'torch us':>8} {'frac':>5} {'x torch':>7} {'naive us':>9} "
        f"{'step/k':>6} {'set step/k':>10}"
    )
    for r in rows:
        print(
            f"{r.workload:16} {r.tensors:>7} {r.copy_tbps:>9.3f} {r.floor_us:>8.1f} {r.ours_kernel_us:>8.1f} "
            f"{r.ours_fraction:>5.3f} {r.ours_host_overhead_us:>7.1f} {r.ours_set_host_overhead_us:>8.1f} "
            f"{r.bare_launch_and_readback_overhead_us:>5.1f} "
            f"{cell(r.torch_kernel_us, 8)} {cell(r.torch_fraction, 5, '.3f')} {cell(r.speedup_vs_torch, 7, '.2f')} "
            f"{cell(r.naive_wall_us, 9)} {cell(r.step_over_kernel, 6, '.3f')} "
            f"{cell(r.step_set_over_kernel, 10, '.3f')}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="7 rounds per workload, no naive loop (under a minute)")
    parser.add_argument("--repeats", type=int, default=30, help="timed rounds per workload (default 30)")
    parser.add_argument("--json", type=Path, help="also write the results as JSON to this path")
    parser.add_argument("--workload", action="append", choices=list(WORKLOADS), help="run only these (repeatable)")
    parser.add_argument("--skip-torch", action="store_true", help="do not time PyTorch's fused kernel")
    parser.add_argument("--skip-naive", action="store_true", help="do not time the naive per-tensor CuPy loop")
    args = parser.parse_args(argv)
    if args.quick:
        args.skip_naive = True
    repeats = 7 if args.quick else args.repeats
    info = environment(repeats)
    rows = [measure(name, args, repeats, seed) for seed, name in enumerate(args.workload or WORKLOADS)]
    print_table(info, rows)
    if args.json:
        args.json.write_text(json.dumps({"environment": info, "rows": [asdict(r) for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
