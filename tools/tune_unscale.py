"""Time launch-shape variants of the fused unscale kernel (developer tool, GPU only).

Each variant sets cupy_amp.cuda_kernels' launch constants, recompiles, rebuilds
the device tables and times the bare kernel on every benchmark workload
(CUDA events, median). Prints one row per variant: fraction of the copy floor.

Usage: PYTHONPATH=. python tools/tune_unscale.py [--repeats 20] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import cupy  # noqa: E402

from cupy_amp import cuda_kernels  # noqa: E402
from cupy_amp.cupy_backend import cupy_backend  # noqa: E402
from tools.bench_unscale import INV_SCALES, WORKLOADS, copy_bandwidth_tbps, event_median_us, make_gradients  # noqa: E402

VARIANTS = [
    # threads, min blocks/SM, unroll, chunk bytes, persistent blocks/SM
    (512, 2, 4, 65536, 0),
    (512, 2, 4, 32768, 0),
    (512, 2, 8, 65536, 0),
    (512, 1, 4, 65536, 0),
    (256, 4, 2, 32768, 0),
    (128, 8, 4, 32768, 0),
    (1024, 1, 4, 131072, 0),
]


def kernel_time(grads: list[cupy.ndarray], repeats: int) -> float:
    backend = cupy_backend()
    plan = backend.prepare(grads)
    flag = cupy.zeros(1, dtype=cupy.int32)

    def launch(i: int) -> None:
        for group in plan.groups:
            cuda_kernels.launch_unscale_check(group.table, INV_SCALES[i % 2], i + 1, flag)

    return event_median_us(launch, repeats)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    copy_tbps = copy_bandwidth_tbps(args.repeats)
    workloads = {name: make_gradients(shapes, dtype, seed) for seed, (name, (shapes, dtype)) in enumerate(WORKLOADS.items())}
    floors = {name: 2 * sum(g.nbytes for g in grads) / (copy_tbps * 1e12) * 1e6 for name, grads in workloads.items()}
    print(f"copy {copy_tbps:.3f} TB/s; floors (us): " + ", ".join(f"{n}={f:.1f}" for n, f in floors.items()))
    print("threads minblk unroll chunkB persist | " + " | ".join(f"{n:>15}" for n in workloads))
    results = []
    for threads, min_blocks, unroll, chunk, persistent in VARIANTS:
        cuda_kernels.THREADS_PER_BLOCK, cuda_kernels.MIN_BLOCKS_PER_SM = threads, min_blocks
        cuda_kernels.UNROLL, cuda_kernels.CHUNK_BYTES, cuda_kernels.GRID_BLOCKS_PER_SM = unroll, chunk, persistent
        cuda_kernels._modules.clear()
        cupy_backend()._tables.clear()
        row = {"threads": threads, "min_blocks": min_blocks, "unroll": unroll, "chunk": chunk, "persistent": persistent}
        cells = []
        for name, grads in workloads.items():
            us = kernel_time(grads, args.repeats)
            row[name] = {"us": round(us, 1), "fraction": round(floors[name] / us, 3)}
            cells.append(f"{us:8.1f} {floors[name] / us:5.3f}")
        results.append(row)
        print(f"{threads:7} {min_blocks:6} {unroll:6} {chunk:6} {persistent:7} | " + " | ".join(cells), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"copy_tbps": copy_tbps, "floors_us": floors, "variants": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
