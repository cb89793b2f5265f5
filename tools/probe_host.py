"""Where the host time of a step goes (developer tool, GPU only).

Times the Python-side pieces of a step on tiny gradients (so kernel time is
negligible and wall time is host work plus launch and read-back), then
profiles a few thousand whole steps with cProfile.

Usage: PYTHONPATH=. python tools/probe_host.py
"""

from __future__ import annotations

import cProfile
import functools
import io
import pstats
import sys
import time
import unittest.mock
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import cupy  # noqa: E402
from cupy_amp.update_rule import next_state  # noqa: E402

from cupy_amp import GradientSet, GradScaler, cuda_kernels, entry_addresses  # noqa: E402
from cupy_amp.cupy_backend import cupy_backend  # noqa: E402


def per_call_us(run: Callable[[], object], calls: int = 3000, sync: bool = True) -> float:
    best = float("inf")
    for _ in range(5):
        cupy.cuda.Device().synchronize()
        begin = time.perf_counter()
        for _ in range(calls):
            run()
        if sync:
            cupy.cuda.Device().synchronize()
        best = min(best, (time.perf_counter() - begin) / calls * 1e6)
    return best


def probe(count: int, backend: Any, loss: cupy.ndarray) -> None:
    results: dict[int, dict[str, float]] = {}
    grads = [cupy.ones(256, dtype=cupy.float32) for _ in range(count)]
    grad_set = GradientSet(grads)
    scaler = GradScaler(init_scale=1.0, growth_interval=10**9)
    scaler.unscale_and_check(grads)
    scaler.update()
    scaler.unscale_and_check(grad_set)
    scaler.update()
    plan = backend.prepare(grads)
    table = plan.groups[0].table
    stream = cupy.cuda.get_current_stream()
    slot = backend._flag_slot(cupy.cuda.runtime.getDevice(), stream)
    inv = np.float32(1.0)

    def bare() -> None:
        cuda_kernels.launch_unscale_check(table, inv, 7, slot.device)
        slot.read(stream)

    def step(argument: object, with_loss: bool) -> Callable[[], None]:
        def run() -> None:
            if with_loss:
                scaler.scale_loss(loss)
            scaler.unscale_and_check(argument)
            scaler.update()

        return run

    # The same lookup forced onto each list-comparison path.
    forced = {}
    for label, by_address in (("entry scan", False), ("address vector", True)):
        # The comparison path is chosen when a list is first seen.
        with unittest.mock.patch.object(entry_addresses, "available", lambda by_address=by_address: by_address):
            probe_scaler = GradScaler(init_scale=1.0, growth_interval=10**9)
            probe_scaler.unscale_and_check(grads)
            probe_scaler.update()
        forced[f"lookup list, {label}"] = per_call_us(
            functools.partial(probe_scaler._prepared.lookup, grads), sync=False
        )
    results[count] = {
        **forced,
        "bare launch+read": per_call_us(bare),
        "launch only (no sync)": per_call_us(lambda: cuda_kernels.launch_unscale_check(table, inv, 7, slot.device)),
        "lookup list": per_call_us(lambda: scaler._prepared.lookup(grads), sync=False),
        "lookup set": per_call_us(lambda: scaler._prepared.lookup(grad_set), sync=False),
        "run_plan": per_call_us(lambda: backend.run_plan(plan, inv).found_overflow()),
        "unscale+update list": per_call_us(step(grads, False)),
        "unscale+update set": per_call_us(step(grad_set, False)),
        "step list": per_call_us(step(grads, True)),
        "step set": per_call_us(step(grad_set, True)),
    }
    if count == 148:
        results[count]["scale_loss (no sync)"] = per_call_us(lambda: scaler.scale_loss(loss), sync=False)
        results[count]["launch_scale_loss (no sync)"] = per_call_us(
            lambda: cuda_kernels.launch_scale_loss(loss, "float32", np.float32(2.0)), sync=False
        )
        results[count]["next_state"] = per_call_us(
            lambda: next_state(scaler.config, scaler._state, False, False), sync=False
        )
        results[count]["getDevice"] = per_call_us(cupy.cuda.runtime.getDevice, sync=False)
        results[count]["stream.synchronize idle"] = per_call_us(stream.synchronize, sync=False)
    for name, us in results[count].items():
        print(f"{count:5} tensors  {name:30} {us:8.2f} us", flush=True)
    for label, argument in (("list", grads), ("set", grad_set)):
        profile = cProfile.Profile()
        run = step(argument, True)
        profile.enable()
        for _ in range(3000):
            run()
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
        print(f"--- cProfile, {count} tensors, {label}, 3000 steps ---")
        print("\n".join(text.getvalue().splitlines()[6:30]))


def main() -> int:
    backend = cupy_backend()
    if backend is None:
        raise SystemExit("CuPy is not importable")
    loss = cupy.ones((), dtype=cupy.float32)
    for count in (148, 5000):
        probe(count, backend, loss)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
