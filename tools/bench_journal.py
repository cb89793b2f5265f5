"""Benchmark what the step journal costs: a sync-free step's check() and update() on GPT-2-small gradients.

One process times one tree of cupy-amp (the current one, or an older one on PYTHONPATH), so the cost of the
journal is measured by running this script alternately over the tree before the journal and the tree with
it, in one device call (``--label`` names each run). Within one process, with a journal, it also times
``journal=0`` against ``journal=1024``, interleaved round by round. Each round times ``--steps`` steps
(``check(gradients, max_norm=1.0)`` then ``update()`` on a ``SyncFreeGradScaler``, nothing synchronized)
with CUDA events; the median per step over the rounds is reported, with ``check()`` alone timed likewise.
It also records the bits of every step's norm and scale, to show the journal changes none of them.

Usage: PYTHONPATH=<tree> python tools/bench_journal.py --label NAME [--dtype float16] [--rounds N]
       [--steps N] [--json PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cupy
import numpy as np

import cupy_amp
from cupy_amp import GradientSet, SyncFreeGradScaler


def gpt2_small_shapes(
    layers: int = 12, width: int = 768, vocab: int = 50257, context: int = 1024
) -> list[tuple[int, ...]]:
    """GPT-2-small's parameter shapes (tied embeddings)."""
    shapes: list[tuple[int, ...]] = [(vocab, width), (context, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (width, 3 * width), (3 * width,), (width, width), (width,)]
        shapes += [(width,), (width,), (width, 4 * width), (4 * width,), (4 * width, width), (width,)]
    return [*shapes, (width,), (width,)]


def scaler_for(capacity: int | None) -> SyncFreeGradScaler:
    """A scaler with a journal of ``capacity`` steps; None: the tree's default (a tree before the journal)."""
    config: dict[str, Any] = {"init_scale": 2.0**16, "growth_interval": 7}
    return SyncFreeGradScaler(**config) if capacity is None else SyncFreeGradScaler(**config, journal=capacity)


def step_timer(scaler: SyncFreeGradScaler, grads: GradientSet, steps: int) -> Callable[[], float]:
    """Return a timer of ``steps`` whole steps (scale_loss, check, update), in microseconds per step (CUDA events)."""
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    loss = cupy.ones((), cupy.float32)

    def run() -> None:
        for _ in range(steps):
            scaler.scale_loss(loss)
            scaler.check(grads, max_norm=1.0)
            scaler.update()

    def timed() -> float:
        cupy.cuda.Device().synchronize()
        start.record()
        run()
        stop.record()
        stop.synchronize()
        return float(cupy.cuda.get_elapsed_time(start, stop)) * 1000.0 / steps

    return timed


def check_timer(scaler: SyncFreeGradScaler, grads: GradientSet, steps: int) -> Callable[[], float]:
    """Return a timer of check() alone, in microseconds per call: events around each check, summed per round."""
    loss = cupy.ones((), cupy.float32)
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(steps)]

    def timed() -> float:
        cupy.cuda.Device().synchronize()
        for start, stop in events:
            scaler.scale_loss(loss)
            start.record()
            scaler.check(grads, max_norm=1.0)
            stop.record()
            scaler.update()
        events[-1][1].synchronize()
        return sum(float(cupy.cuda.get_elapsed_time(a, b)) for a, b in events) * 1000.0 / steps

    return timed


def trajectory(capacity: int | None, shapes: list[tuple[int, ...]], dtype: str, steps: int = 60) -> str:
    """Return a digest of every step's norm and scale bits over ``steps`` steps with overflows planted."""
    rng = cupy.random.default_rng(11)
    grads = [rng.standard_normal(shape, dtype=cupy.float32).astype(dtype) for shape in shapes]
    scaler = scaler_for(capacity)
    digest = hashlib.sha256()
    for step in range(steps):
        saved = grads[3].reshape(-1)[:1].copy()
        if step % 9 == 4:
            grads[3].reshape(-1)[0] = cupy.inf
        scaler.scale_loss(cupy.ones((), cupy.float32))
        stats = scaler.check(grads, max_norm=1.0)
        digest.update(cupy.asnumpy(stats.norm).tobytes() + cupy.asnumpy(stats.factor).tobytes())
        scaler.update()
        grads[3].reshape(-1)[:1] = saved
        digest.update(np.float32(scaler.scale_factor()).tobytes())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="a name for this run (e.g. before, after)")
    parser.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=50, help="steps per timed round")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    shapes = gpt2_small_shapes()
    rng = cupy.random.default_rng(7)
    grads = GradientSet([rng.standard_normal(shape, dtype=cupy.float32).astype(args.dtype) for shape in shapes])
    journaled = "journal" in SyncFreeGradScaler.__init__.__code__.co_varnames
    variants: dict[str, int | None] = {"journal=0": 0, "journal=1024": 1024} if journaled else {"no journal": None}
    timers: dict[str, Callable[[], float]] = {}
    for name, capacity in variants.items():
        scaler = scaler_for(capacity)
        scaler.prepare(grads)
        timers[f"{name} step"] = step_timer(scaler, grads, args.steps)
        timers[f"{name} check"] = check_timer(scaler_for(capacity), grads, args.steps)
    for timer in timers.values():  # warm up: compile, tables, buffers
        timer()
    samples: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(args.rounds):
        for name, timer in timers.items():
            samples[name].append(timer())
    result = {
        "label": args.label,
        "cupy_amp": getattr(cupy_amp, "__version__", "?"),
        "gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        "cupy": cupy.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "dtype": args.dtype,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "median_us": {name: statistics.median(values) for name, values in samples.items()},
        "trajectory_sha256": {name: trajectory(capacity, shapes, args.dtype) for name, capacity in variants.items()},
    }
    for name, value in result["median_us"].items():
        print(f"{args.label:8} {name:20} {value:9.2f} us")
    for name, digest in result["trajectory_sha256"].items():
        print(f"{args.label:8} {name:20} trajectory {digest[:16]}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
