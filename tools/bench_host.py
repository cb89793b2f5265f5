"""Host time of the scaler's own bookkeeping, on the CPU: many ``unscale_and_check`` calls in one step.

A Chainer-style loop may call ``unscale_and_check`` once per parameter. Each call
must cost about the same however many calls the step already had (no work that
grows with the step). Prints the mean time per call for steps of N one-array
calls, with tiny NumPy arrays so that the scaler's own Python dominates.

Usage: PYTHONPATH=. python tools/bench_host.py [--calls 100 1000 4000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from cupy_amp import GradScaler


def per_call_us(calls: int, repeats: int) -> float:
    """Return the median over ``repeats`` steps of the mean time of one of ``calls`` calls in a step."""
    grads = [np.ones(4, dtype=np.float32) for _ in range(calls)]
    scaler = GradScaler(init_scale=1.0, min_scale=None, growth_interval=10**9)
    loss = np.ones((), dtype=np.float32)
    samples = []
    for _ in range(repeats):
        scaler.scale_loss(loss)  # opens the step, untimed
        begin = time.perf_counter()
        for grad in grads:
            scaler.unscale_and_check([grad])
        samples.append((time.perf_counter() - begin) / calls * 1e6)
        scaler.update()
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, nargs="+", default=[100, 1000, 4000], help="calls per step")
    parser.add_argument("--repeats", type=int, default=3, help="steps timed per size (the median is shown)")
    args = parser.parse_args(argv)
    for calls in args.calls:
        print(f"{calls:>6} calls in a step: {per_call_us(calls, args.repeats):8.1f} us per call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
