"""Benchmark the fused unscale-and-check against the copy-bandwidth floor and PyTorch.

For each workload, in one run: the device-to-device copy bandwidth; cupy-amp's
kernel time (CUDA events, median) and the wall time of a full
``unscale_and_check`` call (host work and the flag read-back included); the
same two for PyTorch's fused ``torch._amp_foreach_non_finite_check_and_unscale_``
and for a naive per-tensor CuPy loop, when importable; and the wall time of a
whole step (scale_loss + unscale_and_check + update) on GPT-2-small.

Usage: PYTHONPATH=. python tools/bench_unscale.py [--quick] [--json PATH] [--skip-naive] [--skip-torch]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import cupy  # noqa: E402

from cupy_amp import GradientSet, GradScaler  # noqa: E402
from cupy_amp import cuda_kernels  # noqa: E402
from cupy_amp.cupy_backend import cupy_backend  # noqa: E402

INV_SCALES = (np.float32(2.0**-16), np.float32(2.0**16))


def gpt2_shapes(layers: int, width: int, vocab: int = 50257, context: int = 1024) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT-2 model (tied embeddings), in the usual order."""
    shapes: list[tuple[int, ...]] = [(vocab, width), (context, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (width, 3 * width), (3 * width,), (width, width), (width,)]
        shapes += [(width,), (width,), (width, 4 * width), (4 * width,), (4 * width, width), (width,)]
    return shapes + [(width,), (width,)]


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
    ours_wall_us: float
    ours_fraction: float
    ours_host_overhead_us: float
    ours_set_wall_us: float | None = None
    ours_set_host_overhead_us: float | None = None
    torch_kernel_us: float | None = None
    torch_wall_us: float | None = None
    torch_fraction: float | None = None
    speedup_vs_torch: float | None = None
    naive_wall_us: float | None = None
    speedup_vs_naive: float | None = None
    step_wall_us: float | None = None
    notes: list[str] = field(default_factory=list)


def event_median_us(run: Callable[[int], object], repeats: int, warmup: int = 3) -> float:
    """Median GPU time of ``run(i)`` between two CUDA events on the current stream."""
    for i in range(warmup):
        run(i)
    times = []
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for i in range(repeats):
        start.record()
        run(i)
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) * 1000.0)
    return statistics.median(times)


def wall_median_us(run: Callable[[int], object], repeats: int, warmup: int = 3) -> float:
    """Median wall time of ``run(i)``, which must itself wait for its result."""
    for i in range(warmup):
        run(i)
    cupy.cuda.Device().synchronize()
    times = []
    for i in range(repeats):
        begin = time.perf_counter()
        run(i)
        times.append((time.perf_counter() - begin) * 1e6)
    return statistics.median(times)


def copy_bandwidth_tbps(repeats: int) -> float:
    """Device-to-device copy rate, bytes read plus bytes written, of a 2 GiB buffer."""
    src = cupy.random.standard_normal(2**29, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    us = event_median_us(lambda _: cupy.copyto(dst, src), repeats)
    return 2 * src.nbytes / (us * 1e-6) / 1e12


def make_gradients(shapes: list[tuple[int, ...]], dtype: str, seed: int) -> list[cupy.ndarray]:
    rng = cupy.random.default_rng(seed)
    return [rng.standard_normal(shape, dtype=cupy.float32).astype(dtype) for shape in shapes]


def check_detection(scaler: GradScaler, grads: list[cupy.ndarray]) -> None:
    """Plant an inf in the last element of the last gradient; the check must find it."""
    last = grads[-1].reshape(-1)
    saved = last[-1:].copy()
    last[-1] = cupy.inf
    ok = scaler.unscale_and_check(grads)
    scaler.update()
    if ok or scaler.nonfinite_gradients() != [len(grads) - 1]:
        raise SystemExit("benchmark check failed: the planted inf was not detected")
    last[-1:] = saved


def bench_ours(grads: list[cupy.ndarray], repeats: int) -> tuple[float, float, float]:
    backend = cupy_backend()
    assert backend is not None
    plan = backend.prepare(grads)
    flag = cupy.zeros(1, dtype=cupy.int32)

    def launch(i: int) -> None:
        for group in plan.groups:
            cuda_kernels.launch_unscale_check(group.table, INV_SCALES[i % 2], i + 1, flag)

    kernel_us = event_median_us(launch, repeats)
    scalers = [GradScaler(init_scale=2.0**16, max_scale=None), GradScaler(init_scale=2.0**-16, min_scale=None)]

    def full_call(i: int) -> None:
        scaler = scalers[i % 2]
        scaler.unscale_and_check(grads)
        scaler.update()

    wall_us = wall_median_us(full_call, repeats)
    grad_set = GradientSet(grads)

    def set_call(i: int) -> None:
        scaler = scalers[i % 2]
        scaler.unscale_and_check(grad_set)
        scaler.update()

    set_wall_us = wall_median_us(set_call, repeats)
    return kernel_us, wall_us, set_wall_us


def bench_step(grads: list[cupy.ndarray], repeats: int) -> float:
    scalers = [GradScaler(init_scale=2.0**16, max_scale=None), GradScaler(init_scale=2.0**-16, min_scale=None)]
    loss = cupy.ones((), dtype=cupy.float32)

    def step(i: int) -> None:
        scaler = scalers[i % 2]
        scaler.scale_loss(loss)
        scaler.unscale_and_check(grads)
        scaler.update()

    return wall_median_us(step, repeats)


def bench_torch(grads: list[cupy.ndarray], repeats: int) -> tuple[float, float] | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    cupy.cuda.Device().synchronize()
    tensors = [torch.as_tensor(g, device="cuda") for g in grads]  # zero-copy views of the same memory
    found = torch.zeros(1, device="cuda")
    invs = [torch.full((1,), float(s), device="cuda") for s in INV_SCALES]

    def kernel(i: int) -> None:
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, invs[i % 2])

    def full_call(i: int) -> None:
        found.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, invs[i % 2])
        found.item()

    for i in range(3):
        kernel(i)
    torch.cuda.synchronize()
    times = []
    for i in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        kernel(i)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000.0)
    torch.cuda.synchronize()
    wall = []
    for i in range(repeats):
        begin = time.perf_counter()
        full_call(i)
        wall.append((time.perf_counter() - begin) * 1e6)
    return statistics.median(times), statistics.median(wall)


def bench_naive(grads: list[cupy.ndarray], repeats: int) -> float:
    def loop(i: int) -> None:
        inv = float(INV_SCALES[i % 2])
        bad = cupy.zeros((), dtype=cupy.bool_)
        for g in grads:
            bad |= ~cupy.isfinite(g).all()
            g *= inv
        bool(bad)

    return wall_median_us(loop, max(3, repeats // 4), warmup=1)


def run(args: argparse.Namespace) -> tuple[dict[str, object], list[Row]]:
    repeats = 5 if args.quick else args.repeats
    device = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(device.id)
    environment: dict[str, object] = {
        "gpu": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
        "driver": cupy.cuda.runtime.driverGetVersion(),
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "cupy": cupy.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "repeats": repeats,
    }
    try:
        import torch

        environment["torch"] = torch.__version__
    except ImportError:
        environment["torch"] = None
    copy_tbps = copy_bandwidth_tbps(repeats)
    rows = []
    names = args.workload or list(WORKLOADS)
    for name in names:
        shapes, dtype = WORKLOADS[name]
        grads = make_gradients(shapes, dtype, seed=len(rows))
        elements = sum(int(g.size) for g in grads)
        bytes_moved = 2 * sum(int(g.nbytes) for g in grads)
        floor_us = bytes_moved / (copy_tbps * 1e12) * 1e6
        check_detection(GradScaler(init_scale=1.0, min_scale=None), grads)
        kernel_us, wall_us, set_wall_us = bench_ours(grads, repeats)
        row = Row(
            workload=name,
            tensors=len(grads),
            elements=elements,
            bytes_moved=bytes_moved,
            copy_tbps=round(copy_tbps, 3),
            floor_us=round(floor_us, 1),
            ours_kernel_us=round(kernel_us, 1),
            ours_wall_us=round(wall_us, 1),
            ours_fraction=round(floor_us / kernel_us, 3),
            ours_host_overhead_us=round(wall_us - kernel_us, 1),
            ours_set_wall_us=round(set_wall_us, 1),
            ours_set_host_overhead_us=round(set_wall_us - kernel_us, 1),
        )
        if not args.skip_torch:
            torch_times = bench_torch(grads, repeats)
            if torch_times is not None:
                row.torch_kernel_us, row.torch_wall_us = (round(t, 1) for t in torch_times)
                row.torch_fraction = round(floor_us / torch_times[0], 3)
                row.speedup_vs_torch = round(torch_times[0] / kernel_us, 2)
        if not args.skip_naive:
            naive_us = bench_naive(grads, repeats)
            row.naive_wall_us = round(naive_us, 1)
            row.speedup_vs_naive = round(naive_us / wall_us, 1)
        if name == "gpt2-small-fp32":
            row.step_wall_us = round(bench_step(grads, repeats), 1)
        rows.append(row)
        del grads
        cupy.get_default_memory_pool().free_all_blocks()
    return environment, rows


def print_table(environment: dict[str, object], rows: list[Row]) -> None:
    print(" ".join(f"{k}={v}" for k, v in environment.items()))
    header = (
        f"{'workload':17} {'tensors':>7} {'MB moved':>9} {'floor us':>9} {'ours us':>8} {'frac':>5} "
        f"{'wall us':>8} {'host us':>8} {'set host':>8} {'torch us':>9} {'frac':>5} {'x torch':>7} {'naive us':>9} {'step us':>8}"
    )
    print(header)
    for r in rows:

        def fmt(value: float | None, width: int, spec: str = ".1f") -> str:
            return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"

        print(
            f"{r.workload:17} {r.tensors:>7} {r.bytes_moved / 1e6:>9.1f} {r.floor_us:>9.1f} {r.ours_kernel_us:>8.1f} "
            f"{r.ours_fraction:>5.2f} {r.ours_wall_us:>8.1f} {r.ours_host_overhead_us:>8.1f} "
            f"{fmt(r.ours_set_host_overhead_us, 8)} "
            f"{fmt(r.torch_kernel_us, 9)} {fmt(r.torch_fraction, 5, '.2f')} {fmt(r.speedup_vs_torch, 7, '.2f')} "
            f"{fmt(r.naive_wall_us, 9)} {fmt(r.step_wall_us, 8)}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 repeats per measurement (under a minute)")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per measurement (default 30)")
    parser.add_argument("--json", type=Path, help="also write the results as JSON to this path")
    parser.add_argument("--workload", action="append", choices=list(WORKLOADS), help="run only these")
    parser.add_argument("--skip-torch", action="store_true", help="do not time PyTorch's fused kernel")
    parser.add_argument("--skip-naive", action="store_true", help="do not time the naive per-tensor CuPy loop")
    args = parser.parse_args(argv)
    environment, rows = run(args)
    print_table(environment, rows)
    if args.json:
        args.json.write_text(json.dumps({"environment": environment, "rows": [asdict(r) for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
