"""Benchmark the read-only statistics pass, the fused optimizers and a whole step against floors and PyTorch.

All in one run, timers interleaved round by round (``bench_unscale``'s method:
CUDA events, an L2 scrub before each timed run, medians):

- the statistics pass (``SyncFreeGradScaler.check`` with clipping, and its
  ``update``) against its floors: the bytes it reads at the copy bandwidth of a
  2 GiB device-to-device copy, and at the bandwidth of a streaming read; with
  the numerics report; and the scaler's whole step (``scale_loss``, ``check``,
  ``update``: GPU time, the host's hidden) beyond the read floor, run eagerly
  and replayed as a CUDA graph; and one streaming read of as many bytes, in one
  buffer (a single launch's ramp and tail included);
- fused AdamW and SGD with momentum on float16 parameters with float32 master
  weights, against their floors (AdamW moves 28 bytes per parameter, SGD 20);
- a whole step on GPT-2-XL float32 shapes: ours (``scale_loss``, ``check``,
  ``AdamW.step``, ``update``) against PyTorch's best (``GradScaler`` with
  ``unscale_``, ``clip_grad_norm_(foreach=True)``, ``AdamW(fused=True)``), with
  and without clipping, on the same data.

Usage: PYTHONPATH=. python tools/bench_optim.py [--repeats N] [--json PATH] [--skip-torch]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cupy
import numpy as np
from bench_unscale import (
    copy_timer,
    cupy_event_timer,
    environment,
    gpt2_shapes,
    hide_host_latency,
    interleaved_medians,
)

from cupy_amp import GradientSet, SyncFreeGradScaler
from cupy_amp.gradients import parse_gradients
from cupy_amp.optim import SGD, AdamW

COPY_BYTES = 2 * 4 * 2**29  # what copy_timer moves: 2 GiB read, 2 GiB written
READ_BYTES = 4 * 2**29  # what read_timer reads: 2 GiB


def llama_7b_shapes() -> list[tuple[int, ...]]:
    """LLaMA-7B's parameter shapes: 32 layers of attention (4 x 4096^2), MLP (3 x 4096 x 11008) and norms."""
    layer = [(4096, 4096)] * 4 + [(11008, 4096), (11008, 4096), (4096, 11008), (4096,), (4096,)]
    return [(32000, 4096), *layer * 32, (4096,), (32000, 4096)]


STATS_WORKLOADS = {
    "gpt2-small-fp16": (gpt2_shapes(12, 768), "float16"),
    "gpt2-small-fp32": (gpt2_shapes(12, 768), "float32"),
    "gpt2-xl-fp16": (gpt2_shapes(48, 1600), "float16"),
    "gpt2-xl-fp32": (gpt2_shapes(48, 1600), "float32"),
    "5000x8192-fp16": ([(8192,)] * 5000, "float16"),
    "5000x8192-fp32": ([(8192,)] * 5000, "float32"),
    "llama-7b-fp16": (llama_7b_shapes(), "float16"),
}
_READ_SOURCE = r"""
extern "C" __global__ void read_floor(const uint4* data, long long vectors, unsigned int* sink) {
    unsigned int acc = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < vectors; i += stride) {
        const uint4 v = __ldcs(data + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) sink[0] = acc;  // never true for this data: keeps the loads, writes nothing
}
"""


def read_timer(nbytes: int = READ_BYTES) -> Callable[[int], float]:
    """Return a timer of a streaming read-only kernel over one buffer: over 2 GiB, the read floor.

    Over a workload's own byte count it is what one launch reading that many
    bytes takes, ramp and tail included: the fastest such a pass can be.
    """
    data = cupy.random.standard_normal(-(-nbytes // 16) * 4, dtype=cupy.float32)
    sink = cupy.zeros(1, dtype=cupy.uint32)
    kernel = cupy.RawKernel(_READ_SOURCE, "read_floor")
    blocks = 8 * cupy.cuda.Device().attributes["MultiProcessorCount"]
    vectors = np.int64(data.nbytes // 16)
    return cupy_event_timer(lambda _: kernel((blocks,), (512,), (data, vectors, sink)))


OPTIMIZER_WORKLOADS = {"gpt2-small": gpt2_shapes(12, 768), "gpt2-xl": gpt2_shapes(48, 1600)}
# Bytes per parameter: float16 gradient read; float32 master read and written, float16 parameter written;
# AdamW: two float32 moments read and written; SGD: one momentum buffer read and written.
OPTIMIZER_BYTES = {"adamw": 2 + 4 + 4 + 2 + 16, "sgd-momentum": 2 + 4 + 4 + 2 + 8}


# About 400 us of GPU work queued before each timed run: the host's part of a call (thousands of
# tensors take a Python loop or two) never shows as GPU time.
COVER = 4


def host_us(run: Callable[[int], object], repeats: int) -> float:
    """Return the median host time of ``run(i)`` (queued work not waited for)."""
    samples = []
    for i in range(repeats):
        cupy.cuda.Device().synchronize()
        begin = time.perf_counter()
        run(i)
        samples.append((time.perf_counter() - begin) * 1e6)
    cupy.cuda.Device().synchronize()
    return statistics.median(samples)


def arrays(shapes: list[tuple[int, ...]], dtype: str, seed: int) -> list[cupy.ndarray]:
    rng = cupy.random.default_rng(seed)
    return [rng.standard_normal(shape, dtype=cupy.float32).astype(dtype) for shape in shapes]


def stats_timer(grads: list[cupy.ndarray]) -> tuple[Callable[[int], float], Callable[[int], object]]:
    """Return (a timer of ``check()``'s GPU time, a run of ``check()`` + ``update()`` for host timing).

    The scaler's ``update()`` ends each step outside the timed region: it is the
    scaler's rule, not part of the statistics pass.
    """
    scaler = SyncFreeGradScaler(init_scale=1.0)
    prepared = scaler.prepare(grads)
    loss = cupy.ones((), dtype=cupy.float32)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()

    def run(i: int) -> None:
        scaler.scale_loss(loss)
        scaler.check(prepared, max_norm=1.0)
        scaler.update()

    def timed(i: int) -> float:
        run(2 * i)
        scaler.scale_loss(loss)  # opens the step, outside the timed region
        hide_host_latency(COVER)
        start.record()
        scaler.check(prepared, max_norm=1.0)
        stop.record()
        scaler.update()
        stop.synchronize()
        return float(cupy.cuda.get_elapsed_time(start, stop)) * 1000.0

    run(0)
    if scaler.stats().last_overflow != "none":
        raise SystemExit("benchmark check failed: clean gradients reported an overflow")
    return timed, run


def captured(run: Callable[[int], object]) -> Callable[[int], object]:
    """Return replays of ``run(0)`` captured once in a CUDA graph (after an eager call that loads its kernels).

    The graph's kernels follow one another with no host between them, so its
    time beyond the read floor is the kernels' own fixed cost, launch gaps aside.
    """
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:  # the scaler refuses a capture on another stream than its last work's
        run(0)
        stream.begin_capture()
        try:
            run(0)
        finally:
            graph = stream.end_capture()
    # A graph holds no Python references: the replays keep `run` (its scaler, state and tables) alive themselves.
    return lambda i, _owners=(run, stream): graph.launch(cupy.cuda.get_current_stream())


def stats_kernels_timer(grads: list[cupy.ndarray], report: bool = False) -> Callable[[int], float]:
    """Return a timer of the statistics kernels alone (the per-dtype launches and the finishing block).

    Reaches into the scaler's device state for its launches: what ``check()``
    adds around them is one one-thread kernel that opens the step.
    """
    scaler = SyncFreeGradScaler(init_scale=1.0)
    prepared = scaler.prepare(grads)
    scaler.scale_loss(cupy.ones((), dtype=cupy.float32))
    scaler.check(prepared)
    scaler.update()
    state = scaler._state
    call = parse_gradients(prepared)

    def run(i: int) -> None:
        state.stats.gather(call.plan, cupy.cuda.get_current_stream(), state.address, state._flags, 1.0, False, report)

    return cupy_event_timer(run, COVER)


def optimizer_timer(kind: str, shapes: list[tuple[int, ...]]) -> Callable[[int], float]:
    params = arrays(shapes, "float16", 1)
    grads = GradientSet(arrays(shapes, "float16", 2))
    optimizer = AdamW(params, lr=1e-6) if kind == "adamw" else SGD(params, lr=1e-6, momentum=0.9)
    gradient_list = list(grads)
    # The optimizer alone, over and over: statistics apply once per check(), so these steps take none (factor 1;
    # the begin kernel then reads no record, the update pass is the same).
    return cupy_event_timer(lambda i: optimizer.step(gradient_list, None), COVER)


def our_step_timer(shapes: list[tuple[int, ...]], clip: bool) -> Callable[[int], float]:
    params = arrays(shapes, "float32", 3)
    grads = arrays(shapes, "float32", 4)
    loss = cupy.ones((), cupy.float32)
    scaler = SyncFreeGradScaler(init_scale=1.0)
    prepared = scaler.prepare(grads)
    optimizer = AdamW(params, lr=1e-6)

    def step(i: int) -> None:
        scaler.scale_loss(loss)
        optimizer.step(grads, scaler.check(prepared, max_norm=1.0 if clip else None))
        scaler.update()

    return cupy_event_timer(step, COVER)


def torch_step_timer(shapes: list[tuple[int, ...]], clip: bool) -> Callable[[int], float] | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    generator = torch.Generator(device="cuda").manual_seed(5)
    params = [torch.randn(shape, device="cuda", generator=generator, requires_grad=True) for shape in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=generator)
    optimizer = torch.optim.AdamW(params, lr=1e-6, fused=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=1.0, growth_interval=10**9)
    loss = torch.ones((), device="cuda")
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def step() -> None:
        scaler.scale(loss)
        if clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        scaler.step(optimizer)
        scaler.update()

    def timed(i: int) -> float:
        step()
        hide_host_latency(COVER)  # as for ours
        start.record()
        step()
        stop.record()
        stop.synchronize()
        return float(start.elapsed_time(stop)) * 1000.0

    return timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed rounds (default 20)")
    parser.add_argument("--json", type=Path, help="also write the results as JSON to this path")
    parser.add_argument("--skip-torch", action="store_true", help="do not time PyTorch's step")
    parser.add_argument(
        "--part", action="append", choices=("stats", "optimizers", "steps"), help="run only these parts (repeatable)"
    )
    args = parser.parse_args(argv)
    info = environment(args.repeats)
    results: dict[str, Any] = {"environment": info, "stats": {}, "optimizers": {}, "steps": {}}

    parts = set(args.part or ("stats", "optimizers", "steps"))
    copy = copy_timer()
    read = read_timer() if "stats" in parts else None
    for name, (shapes, dtype) in STATS_WORKLOADS.items() if "stats" in parts else ():
        grads = arrays(shapes, dtype, 0)
        timer, run = stats_timer(grads)
        timers = {"copy": copy, "read": read, "stats": timer, "kernels": stats_kernels_timer(grads)}
        timers["step"] = cupy_event_timer(run, COVER)  # scale_loss + check + update, the host hidden
        timers["report"] = stats_kernels_timer(grads, report=True)
        timers["graph"] = cupy_event_timer(captured(stats_timer(grads)[1]), COVER)  # a scaler of its own
        timers["same_size_read"] = read_timer(sum(g.nbytes for g in grads))
        medians = interleaved_medians(timers, args.repeats)
        nbytes = sum(g.nbytes for g in grads)
        floor = nbytes / (COPY_BYTES / medians["copy"])  # at the copy bandwidth, bytes per microsecond
        read_floor = nbytes / (READ_BYTES / medians["read"])  # at the read bandwidth
        host = host_us(run, args.repeats)
        us, kernels, report, step = medians["stats"], medians["kernels"], medians["report"], medians["step"]
        graph, same_size = medians["graph"], medians["same_size_read"]
        results["stats"][name] = {
            "us": us, "floor_us": floor, "fraction": floor / us, "host_us": host, "kernels_us": kernels,
            "kernels_fraction": floor / kernels, "read_floor_us": read_floor, "read_fraction": read_floor / us,
            "kernels_read_fraction": read_floor / kernels, "report_kernels_us": report,
            "report_cost": report / kernels - 1.0, "step_us": step, "step_over_read_floor_us": step - read_floor,
            "graph_step_us": graph, "graph_step_over_read_floor_us": graph - read_floor,
            "same_size_read_us": same_size, "same_size_read_fraction": same_size / us,
        }  # fmt: skip
        del grads, timers
        cupy.get_default_memory_pool().free_all_blocks()
        print(
            f"stats {name:16s} {us:9.1f} us  copy floor {floor:9.1f} ({floor / us:.3f})  read floor {read_floor:9.1f} "
            f"({read_floor / us:.3f})  kernels alone {kernels:.1f} ({read_floor / kernels:.3f} of read)  "
            f"with report {report:.1f} ({100 * (report / kernels - 1):+.1f}%)  host {host:.1f} us  "
            f"step {step:.1f} (read floor {step - read_floor:+.1f} us)  "
            f"captured {graph:.1f} (read floor {graph - read_floor:+.1f} us)  "
            f"one read of as many bytes {same_size:.1f} us ({same_size / us:.3f} of check)"
        )

    for name, shapes in OPTIMIZER_WORKLOADS.items() if "optimizers" in parts else ():
        elements = sum(int(np.prod(shape)) for shape in shapes)
        for kind, per_parameter in OPTIMIZER_BYTES.items():
            medians = interleaved_medians({"copy": copy, "step": optimizer_timer(kind, shapes)}, args.repeats)
            floor = elements * per_parameter / (COPY_BYTES / medians["copy"])
            results["optimizers"][f"{kind}-{name}"] = {
                "us": medians["step"], "floor_us": floor, "fraction": floor / medians["step"],
            }  # fmt: skip
            cupy.get_default_memory_pool().free_all_blocks()
            us = medians["step"]
            print(f"{kind:12s} {name:10s} {us:9.1f} us  floor {floor:9.1f} us  fraction {floor / us:.3f}")

    shapes = gpt2_shapes(48, 1600)
    for clip in (True, False) if "steps" in parts else ():
        timers = {"ours": our_step_timer(shapes, clip)}
        theirs = None if args.skip_torch else torch_step_timer(shapes, clip)
        if theirs is not None:
            timers["torch"] = theirs
        medians = interleaved_medians(timers, args.repeats)
        label = "clip" if clip else "no-clip"
        row = {"ours_us": medians["ours"], "torch_us": medians.get("torch")}
        if "torch" in medians:
            row["speedup"] = medians["torch"] / medians["ours"]
        results["steps"][f"gpt2-xl-fp32-{label}"] = row
        torch_us, speedup = medians.get("torch", float("nan")), row.get("speedup", float("nan"))
        ours = medians["ours"]
        print(f"step gpt2-xl-fp32 {label:8s} ours {ours:9.1f} us  torch {torch_us:9.1f} us  speedup {speedup:.2f}")
        del timers
        gc.collect()
        cupy.get_default_memory_pool().free_all_blocks()
        try:
            import torch

            torch.cuda.empty_cache()
        except ImportError:
            pass
    print(json.dumps(info))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
