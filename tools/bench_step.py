"""The demo's training step in three modes on one GPU: synchronous, sync-free eager, CUDA graph replays.

For each mode: steps per second over a run of the demo's default model and
batch (kernels compiled and cached by a warm-up run first), and, from a
profiler trace (CUPTI through ``torch.profiler``, where PyTorch with CUDA is
installed), the synchronizing CUDA API calls and device-to-host copies per
steady-state step. The synchronous mode is the control: its one wait per step
must show up, or the count proves nothing. For the device modes, also the
steps queued back to back with nothing read back (each still draws its batch
on the device), as the PyTorch reference runs them ("alone"); for graphs, the host time to queue one
replay. Every timing runs before the first profiler trace (CUPTI, once attached, slows
every CUDA call of the process). With PyTorch, the nearest PyTorch equivalent as a reference:
the same MLP with autocast fp16, ``torch.amp.GradScaler`` and ``Adam(fused=True)``,
eager and captured in a CUDA graph.

Usage: PYTHONPATH=. python tools/bench_step.py [--steps 600] [--profile-steps 20] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import cupy
import numpy as np

from cupy_amp import GradScaler, SyncFreeGradScaler
from cupy_amp.demo.device_step import DeviceTrainer
from cupy_amp.demo.model import load_dataset
from cupy_amp.demo.settings import SCALER_DEFAULTS, Settings
from cupy_amp.demo.training import Device, Trainer, new_state

SPIN = cupy.RawKernel(
    'extern "C" __global__ void bench_spin(long long cycles) '
    "{ long long start = clock64(); while (clock64() - start < cycles) {} }",
    "bench_spin",
)
# What counts as the host waiting for the device: the synchronizing API calls, runtime and driver.
SYNC_CALLS = ("Synchronize", "cudaMemcpy(", "cudaMemcpy ", "cuMemcpyDtoH", "cuMemcpyHtoD")
SCALER = {**asdict(SCALER_DEFAULTS), "growth_interval": 50}  # the demo's scaler settings


def make_trainer(mode: str, chunk: int = 50) -> tuple[Any, Any]:
    """A fresh run of the demo's default task in ``mode``: (trainer, a function running N more steps)."""
    settings = Settings()
    dataset = load_dataset(settings.data, settings.seed)
    state = new_state(Device(cupy, "gpu", "GPU"), settings, dataset)
    if mode == "sync":
        trainer = Trainer("amp", settings, dataset, Device(cupy, "gpu", "GPU"), state, GradScaler(**SCALER))

        def run(count: int) -> None:
            for _ in range(count):
                trainer.step()

        return trainer, run
    scaler = SyncFreeGradScaler(**SCALER)
    device_trainer = DeviceTrainer(settings, dataset, state, scaler, graph=mode == "graph", chunk=chunk)

    def run_device(count: int) -> None:
        device_trainer.run(state.step + count, lambda outcome: None, lambda step: None, 10**9)

    return device_trainer, run_device


def _median_rate(run: Callable[[], None], steps: int, repeats: int) -> float:
    """The median steps per second over ``repeats`` timed calls of ``run`` (``steps`` steps each)."""
    rates = []
    for _ in range(repeats):
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        run()
        cupy.cuda.Device().synchronize()
        rates.append(steps / (time.perf_counter() - start))
    return sorted(rates)[len(rates) // 2]


def steps_per_second(mode: str, steps: int, repeats: int = 3) -> float:
    """The median over ``repeats`` runs of ``steps`` steps, after 60 untimed ones."""
    _, run = make_trainer(mode)
    run(60)  # the first steps: compilation, table building, the graph's capture
    return _median_rate(lambda: run(steps), steps, repeats)


def steps_alone_per_second(mode: str, steps: int, repeats: int = 3) -> float:
    """As :func:`steps_per_second` for a device mode, with the steps queued back to back and nothing read back
    (each step still draws its batch, on the device), as the PyTorch reference's loop runs."""
    trainer, run = make_trainer(mode)
    run(60)

    def queue() -> None:
        for _ in range(steps):
            trainer.launch()

    with trainer.stream:
        return _median_rate(queue, steps, repeats)


def _waits(names: list[str]) -> list[str]:
    return [name for name in names if any(key in name for key in SYNC_CALLS)]


def profiled_calls(mode: str, steps: int) -> dict[str, Any] | str:
    """Synchronizing calls and device-to-host copies per step over ``steps`` steady-state steps.

    The calls a profiler window records with nothing in it (the profiler's own)
    are counted apart and subtracted.
    """
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "PyTorch has no CUDA here"
    trainer, run = make_trainer(mode)
    run(60)
    queue: Callable[[], None]
    if mode == "sync":

        def queue() -> None:
            for _ in range(steps):
                trainer.step()
    else:

        def queue() -> None:
            with trainer.stream:
                for _ in range(steps):
                    trainer.launch()  # no read-back: the steady state between two chunks

        steps = min(steps, trainer.chunk)
    cupy.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as empty:
        pass
    baseline = _waits([event.name for event in empty.events()])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        queue()
    cupy.cuda.Device().synchronize()
    names = [event.name for event in trace.events()]
    waits = _waits(names)
    launches = sum(name in ("cuLaunchKernel", "cudaLaunchKernel", "cuGraphLaunch", "cudaGraphLaunch") for name in names)
    return {
        "sync_calls_per_step": (len(waits) - len(baseline)) / steps,
        "sync_calls_seen": sorted(set(waits)),
        "sync_calls_in_an_empty_window": sorted(baseline),
        "device_to_host_copies_per_step": sum("DtoH" in name or "Device -> Pageable" in name for name in names) / steps,
        "launch_calls_per_step": launches / steps,  # shows that CUPTI saw the process's CUDA calls at all
    }


def graph_host_us(replays: int) -> dict[str, float]:
    """Host time to queue one replay: while the GPU runs the replays, and behind a 100 ms kernel."""
    trainer, run = make_trainer("graph", chunk=replays)
    run(60)
    result = {}
    for case in ("gpu_running", "behind_a_busy_gpu"):
        with trainer.stream:
            cupy.cuda.Device().synchronize()
            if case == "behind_a_busy_gpu":
                SPIN((1,), (1,), (np.int64(200_000_000),))
            start = time.perf_counter()
            for _ in range(replays):
                trainer.launch()
            queued = time.perf_counter() - start
            trainer.stream.synchronize()
        result[case] = round(1e6 * queued / replays, 2)
    return result


def torch_reference(steps: int) -> dict[str, Any] | str:
    """The same MLP in PyTorch (autocast fp16, GradScaler, fused Adam): steps per second, eager and as a graph."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "PyTorch has no CUDA here"
    results: dict[str, Any] = {"torch": torch.__version__}
    for mode in ("eager", "graph"):
        try:
            results[f"{mode}_steps_per_second"] = _torch_steps_per_second(torch, mode == "graph", steps)
        except Exception as exc:  # a PyTorch version that cannot capture this step: say so, keep the rest
            results[f"{mode}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return results


def _torch_steps_per_second(torch: Any, captured: bool, steps: int) -> float:
    settings = Settings()
    dataset = load_dataset(settings.data, settings.seed)
    device = torch.device("cuda")
    x_train = torch.as_tensor(dataset.x_train, device=device)
    y_train = torch.as_tensor(dataset.y_train, device=device)
    order = torch.stack([torch.randperm(len(y_train), device=device)[: settings.batch_size] for _ in range(64)])
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(dataset.features, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, dataset.classes),
    ).to(device)  # fmt: skip
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr, fused=True, capturable=captured)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16, growth_interval=50)
    index = torch.zeros(settings.batch_size, dtype=torch.long, device=device)

    def step() -> None:
        x, y = x_train[index], y_train[index]
        with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):
            loss = torch.nn.functional.cross_entropy(model(x), y) * settings.loss_weight
        optimizer.zero_grad(set_to_none=False)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as PyTorch's graph capture asks
        for k in range(5):
            index.copy_(order[k])
            step()
    torch.cuda.current_stream().wait_stream(side)
    run: Callable[[], None] = step
    if captured:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run = graph.replay
    torch.cuda.synchronize()
    start = time.perf_counter()
    for k in range(steps):
        index.copy_(order[k % len(order)])
        run()
    torch.cuda.synchronize()
    return steps / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="timed steps per mode (default: 600)")
    parser.add_argument("--profile-steps", type=int, default=20, help="steps in each profiler trace (default: 20)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    properties = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = properties["name"].decode() if isinstance(properties["name"], bytes) else properties["name"]
    report: dict[str, Any] = {
        "gpu": name,
        "cupy": cupy.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "steps": args.steps,
    }
    # Every timing first: once a profiler has attached CUPTI, every CUDA call in the process costs more.
    for mode in ("sync", "sync-free", "graph"):
        report[mode] = {"steps_per_second": steps_per_second(mode, args.steps)}
    for mode in ("sync-free", "graph"):
        report[mode]["steps_alone_per_second"] = steps_alone_per_second(mode, args.steps)
    report["graph"]["host_us_per_replay"] = graph_host_us(args.profile_steps * 10)
    report["torch_reference"] = torch_reference(args.steps)
    for mode in ("sync", "sync-free", "graph"):
        report[mode]["profile"] = profiled_calls(mode, args.profile_steps)
    sync = report["sync"]["steps_per_second"]
    print(f"{name}, CuPy {cupy.__version__}; the demo's step ({args.steps} steps per mode)")
    for mode in ("sync", "sync-free", "graph"):
        rate = report[mode]["steps_per_second"]
        alone = f"  alone {report[mode]['steps_alone_per_second']:.0f} steps/s" if mode != "sync" else ""
        print(f"  {mode:<10} {rate:>9.0f} steps/s  ({rate / sync:.2f}x){alone}  profile: {report[mode]['profile']}")
    print(f"  graph: host time per replay (us): {report['graph']['host_us_per_replay']}")
    print(f"  PyTorch reference: {report['torch_reference']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(report, file, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
