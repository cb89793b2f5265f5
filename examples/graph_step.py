"""Train the demo's model with whole steps captured in a CUDA graph, and see what that buys.

    python examples/graph_step.py [--steps N]

The step (forward, backward, scale_loss, unscale_and_check, Adam gated on the
device by the scaler's verdict, update) is cupy_amp.demo.device_step's; this
file shows the capture itself: prepare, one eager step, capture, replay.
Needs a GPU.
"""

import argparse
import sys
import time

parser = argparse.ArgumentParser(description="Train the cupy-amp demo's MLP with CUDA graph replays.")
parser.add_argument("--steps", type=int, default=600, help="optimizer steps (default: 600)")
steps = parser.parse_args().steps
try:
    import cupy

    cupy.arange(2).sum()  # a GPU and a working CUDA install, not just the package
    from cupy_amp.demo.device_step import DeviceTrainer
except Exception as exc:
    sys.exit(f"this example needs a GPU ({type(exc).__name__}: {str(exc).splitlines()[0]})")

from cupy_amp import SyncFreeGradScaler  # noqa: E402  (after the GPU check, for a one-line error)
from cupy_amp.demo.model import load_dataset  # noqa: E402
from cupy_amp.demo.settings import Settings  # noqa: E402
from cupy_amp.demo.training import Device, new_state  # noqa: E402

settings = Settings()
dataset = load_dataset(settings.data, settings.seed)
state = new_state(Device(cupy, "gpu", "GPU"), settings, dataset)
# The demo's scaler settings: its gradients are tiny (loss weight 2**-13), its scale settles near 2**33.
scaler = SyncFreeGradScaler(init_scale=2.0**36, growth_interval=50, min_scale=1.0, max_scale=2.0**48)
# DeviceTrainer allocates every buffer once and calls scaler.prepare(gradients): the tables and the
# scaler's state exist before the capture, which can allocate nothing.
trainer = DeviceTrainer(settings, dataset, state, scaler, graph=False, chunk=steps)
stream = trainer.stream
with stream:
    trainer.step()  # step 1, eager: loads every kernel (a capture cannot)
    stream.begin_capture()
    try:
        trainer.step()  # recorded, not run
    finally:
        graph = stream.end_capture()
    stream.synchronize()
    start = time.perf_counter()
    for _ in range(steps - 1):
        graph.launch(stream)  # steps 2..N: one call each, no waiting
    queued = time.perf_counter() - start
    outcomes = trainer.read_back(0, steps)  # the one wait of the run
    seconds = time.perf_counter() - start
    state.step = steps
loss, accuracy = trainer.evaluate()
stats = scaler.stats()
per_replay = 1e6 * queued / (steps - 1)
print(f"{steps} steps: {steps / seconds:.0f} steps/s; the host queued each replay in {per_replay:.1f} us")
print(f"loss {outcomes[0].loss:.3f} -> {outcomes[-1].loss:.3f}; held-out accuracy {100 * accuracy:.1f}%")
print(f"scale {stats.scale:g}; {stats.skipped_steps} of {stats.steps} steps skipped, {stats.backoffs} backoffs")
