"""cupy-amp's Chainer attachment against Chainer's own ``optimizer.loss_scaling()``, on a model of many parameters.

A deep float16 MLP (``--layers`` linear layers of ``--width``, fp32 masters by
``use_fp32_update()``, Adam) trains on random data with
``optimizer.update(lossfun, x, t)``, as a ``StandardUpdater`` calls it. For each
setting: the median time per ``update()`` over ``--repeats`` runs of ``--steps``
steps (after untimed warm-up steps: compilation, masters, Adam's state), and the
host reads of a verdict per step, counted where they happen: cupy-amp's state
reads (``HostState.read``, ``DeviceState.read``) and Chainer's ``isfinite``
reads in ``check_nan_in_grads`` (one per parameter, each a device-to-host copy
on a GPU). The settings: each scaler without clipping, with Chainer's
``GradientClipping`` hook, and (cupy-amp) with ``attach(..., max_norm=)``,
which clips with the norm its check reads in its one pass.

Usage: PYTHONPATH=. python tools/bench_chainer.py [--device cpu|gpu] [--layers 24] [--width 1024]
       [--batch 256] [--steps 20] [--repeats 3] [--json FILE]
Needs Chainer 7.8.1 (``cupy_amp.chainer.chainer_on_numpy2()`` is called first, for NumPy 2).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from cupy_amp.chainer import chainer_on_numpy2

chainer_on_numpy2()

import chainer  # noqa: E402

from cupy_amp import GradScaler  # noqa: E402
from cupy_amp.chainer import attach  # noqa: E402
from cupy_amp.twins.step_state import HostState  # noqa: E402

SETTINGS = ("cupy-amp", "cupy-amp + GradientClipping", "cupy-amp max_norm", "chainer", "chainer + GradientClipping")
MAX_NORM = 1.0


class DeepMLP(chainer.ChainList):
    """``layers`` linear layers of ``width`` with ReLU between them; the loss is computed in float32."""

    def __init__(self, layers: int, width: int, classes: int) -> None:
        super().__init__(*[chainer.links.Linear(width, width) for _ in range(layers - 1)])
        self.add_link(chainer.links.Linear(width, classes))

    def __call__(self, x: Any, t: Any) -> Any:
        for link in list(self)[:-1]:
            x = chainer.functions.relu(link(x))
        logits = chainer.functions.cast(list(self)[-1](x), "float32")
        return chainer.functions.softmax_cross_entropy(logits, t)


def build(setting: str, device: Any, layers: int, width: int) -> tuple[Any, Any]:
    with chainer.using_config("dtype", np.float16):
        model = DeepMLP(layers, width, classes=10)
    model.to_device(device)
    optimizer = chainer.optimizers.Adam(alpha=1e-4)
    optimizer.setup(model)
    optimizer.use_fp32_update()
    if setting.endswith("GradientClipping"):
        optimizer.add_hook(chainer.optimizer_hooks.GradientClipping(MAX_NORM))
    if setting.startswith("cupy-amp"):
        attach(optimizer, GradScaler(init_scale=2.0**10), max_norm=MAX_NORM if "max_norm" in setting else None)
    else:
        optimizer.loss_scaling()  # dynamic, as ours: it skips a step with inf/nan
    return model, optimizer


@contextlib.contextmanager
def counting_reads(setting: str, xp: Any) -> Iterator[list[int]]:
    """Count the host reads of a verdict: cupy-amp's state reads, or Chainer's isfinite calls (one per
    parameter in its check_nan_in_grads, each read back into a Python bool)."""
    counts = [0]
    patched: list[tuple[Any, str, Any]] = []
    if setting.startswith("cupy-amp"):
        patched.append((HostState, "read", HostState.read))
        if xp is not np:
            from cupy_amp.gpu.device_state import DeviceState

            patched.append((DeviceState, "read", DeviceState.read))
    else:
        patched.append((xp, "isfinite", xp.isfinite))
    for owner, name, real in patched:

        def counted(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            counts[0] += 1
            return _real(*args, **kwargs)

        setattr(owner, name, counted)
    try:
        yield counts
    finally:
        for owner, name, real in patched:
            setattr(owner, name, real)


def measure(setting: str, device: Any, args: argparse.Namespace) -> dict[str, Any]:
    xp = device.xp
    rng = np.random.default_rng(0)
    x = device.send(rng.standard_normal((args.batch, args.width)).astype(np.float16))
    t = device.send(rng.integers(0, 10, args.batch).astype(np.int32))
    model, optimizer = build(setting, device, args.layers, args.width)
    synchronize: Callable[[], None] = getattr(device, "synchronize", lambda: None)
    for _ in range(3):
        optimizer.update(model, x, t)
    with counting_reads(setting, xp) as reads:
        optimizer.update(model, x, t)
    times = []
    for _ in range(args.repeats):
        synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            optimizer.update(model, x, t)
        synchronize()
        times.append((time.perf_counter() - start) / args.steps)
    return {
        "setting": setting,
        "ms_per_update": 1e3 * sorted(times)[len(times) // 2],
        "verdict_reads_per_step": reads[0],
        "parameters": len(list(model.params())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, gpu, or a Chainer device (@cupy:1)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    device = chainer.get_device({"cpu": "@numpy", "gpu": "@cupy:0"}.get(args.device, args.device))
    device.use()
    rows = [measure(setting, device, args) for setting in SETTINGS]
    print(
        f"{device}, {args.layers} layers of {args.width}, batch {args.batch}, Chainer {chainer.__version__}, "
        f"NumPy {np.__version__}, Python {platform.python_version()}"
    )
    for row in rows:
        print(
            f"{row['setting']:<30} {row['ms_per_update']:9.3f} ms/update   {row['verdict_reads_per_step']:4d} "
            f"verdict reads/step  ({row['parameters']} parameters)"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump({"device": str(device), "args": vars(args), "rows": rows}, file, indent=2)


if __name__ == "__main__":
    main()
