"""Data-parallel FP16 training on the GPUs of this machine, one process per GPU, one shared verdict.

Each rank trains the same small MLP regression on its own data shard;
gradients are all-reduced with NCCL; each rank's GradScaler gets the
communicator (``comm=``), so an overflow on any rank makes every rank skip
the step and back off together. Now and then one rank gets an inf planted in
its gradients (as a rank-local overflow would be), to show that the others
follow. Each rank prints its overflows and its scale; the launcher then
checks that all ranks ended with identical scale trajectories and weights.

Usage: PYTHONPATH=. python tools/ddp_example.py [--gpus N] [--steps 300] (or with cupy-amp installed)
Needs CuPy with NCCL and N >= 2 GPUs. The launcher starts one
``python tools/ddp_example.py --rank R ...`` process per GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def train(rank: int, world: int, port: int, steps: int, out: Path) -> None:
    """One rank: train, print this rank's story, write its trajectory and weights to ``out``."""
    import cupy
    from cupyx.distributed import init_process_group

    from cupy_amp import GradScaler

    cupy.cuda.Device(rank).use()
    comm = init_process_group(world, rank, host="127.0.0.1", port=port)
    init = np.random.default_rng(0)  # identical initial weights on every rank
    w1 = cupy.asarray(init.standard_normal((64, 128)).astype(np.float32) * 0.1)
    w2 = cupy.asarray(init.standard_normal((128, 1)).astype(np.float32) * 0.1)
    data = np.random.default_rng(1 + rank)  # each rank its own shard
    injections = np.random.default_rng(99)  # the same injection schedule everywhere
    # One communicator for the gradients and the scaler keeps the example short, and is sound while no call
    # fails. A training run should give the scaler one of its own (README, Multi-GPU): a rank that cannot
    # know the step's outcome sends a poisoned vote, which must meet the scaler's all-reduce, not yours.
    scaler = GradScaler(init_scale=2.0**16, growth_interval=25, comm=comm)
    trajectory = []
    for step in range(steps):
        x = cupy.asarray(data.standard_normal((256, 64)).astype(np.float16))
        y = cupy.sin(x[:, :1].astype(cupy.float32) * 3).astype(cupy.float16)
        # Forward and backward in fp16, the loss gradient seeded with the scale.
        h = cupy.maximum(x @ w1.astype(cupy.float16), 0)
        out_ = h @ w2.astype(cupy.float16)
        scaler.scale_loss(cupy.ones((), cupy.float32))  # the loss's seed, d(loss)/d(loss) = 1, times the scale
        seed = (out_ - y) * np.float16(2 * scaler.scale_factor() / out_.size)
        g2 = h.T @ seed
        g1 = x.T @ ((seed @ w2.astype(cupy.float16).T) * (h > 0))
        for grad in (g1, g2):
            comm.all_reduce(grad, grad, op="sum")
            grad /= np.float16(world)
        if int(injections.integers(0, 20)) == 0 and rank == int(injections.integers(0, world)):
            g1[0, 0] = cupy.inf  # a rank-local overflow
        if scaler.unscale_and_check({"w1": g1, "w2": g2}):
            w1 -= 0.05 * g1.astype(cupy.float32)
            w2 -= 0.05 * g2.astype(cupy.float32)
        scaler.update()
        stats = scaler.stats()
        trajectory.append(stats.scale)
        if stats.last_overflow != "none" or step % 50 == 0:
            print(
                f"rank {rank} step {step:4d} scale {stats.scale:>9g} skipped {stats.skipped_steps:3d} "
                f"overflow {stats.last_overflow:6} culprits {scaler.nonfinite_gradients()}",
                flush=True,
            )
    weights = (cupy.asnumpy(w1).tobytes() + cupy.asnumpy(w2).tobytes()).hex()
    (out / f"rank{rank}.json").write_text(json.dumps({"trajectory": trajectory, "weights": weights}))


def launch(world: int, steps: int) -> int:
    """Start one process per GPU, wait for all, compare what they report."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--rank",
                    str(r),
                    "--world",
                    str(world),
                    "--port",
                    str(port),
                    "--steps",
                    str(steps),
                    "--out",
                    tmp,
                ],
                env=env,
            )
            for r in range(world)
        ]
        codes = [proc.wait(timeout=900) for proc in procs]
        if any(codes):
            print(f"ddp_example: ranks exited with {codes}", file=sys.stderr)
            return 1
        results = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]
    for rank, result in enumerate(results):
        trajectory = result["trajectory"]
        changes = [(i, s) for i, s in enumerate(trajectory) if i == 0 or s != trajectory[i - 1]]
        print(f"rank {rank}: final scale {trajectory[-1]:g}; scale changes (step, scale) {changes[:10]}")
    agree = all(r["trajectory"] == results[0]["trajectory"] and r["weights"] == results[0]["weights"] for r in results)
    print(f"all {world} ranks agree on every scale and on the final weights: {agree}")
    return 0 if agree else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=0, help="processes/GPUs to use (default: all)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        train(args.rank, args.world, args.port, args.steps, args.out)
        return 0
    import cupy

    world = args.gpus or cupy.cuda.runtime.getDeviceCount()
    if world < 2:
        print(f"ddp_example: needs at least 2 GPUs, found {world}", file=sys.stderr)
        return 2
    return launch(world, args.steps)


if __name__ == "__main__":
    raise SystemExit(main())
