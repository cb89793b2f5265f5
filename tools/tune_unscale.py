"""Compare launch-shape variants of the fused unscale kernel side by side (developer tool, GPU only).

Each variant is compiled into its own module (with its -D options) and gets
its own device tables (chunk size, chunk order); every round times every
variant once on the same data, so clock drift hits them alike. Prints, per
workload, each variant's median kernel time and fraction of the copy floor.

Usage: PYTHONPATH=. python tools/tune_unscale.py [--repeats 20] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import cupy  # noqa: E402

from cupy_amp import cuda_kernels  # noqa: E402
from cupy_amp.kernel_sources import NVRTC_OPTIONS, read_kernel_source  # noqa: E402
from tools.bench_unscale import (  # noqa: E402
    COPY_ELEMENTS,
    INV_SCALES,
    WORKLOADS,
    copy_timer,
    cupy_event_timer,
    interleaved_medians,
    make_gradients,
)


@dataclass(frozen=True)
class Variant:
    threads: int
    min_blocks: int
    unroll: int
    chunk_bytes: int
    longest_first: bool = True
    streaming: bool = False

    @property
    def label(self) -> str:
        order = "lpt" if self.longest_first else "ord"
        hint = "+cs" if self.streaming else ""
        return f"{self.threads}/{self.min_blocks}/u{self.unroll}/{self.chunk_bytes // 1024}K/{order}{hint}"


VARIANTS = [
    Variant(512, 2, 4, 65536),
    Variant(512, 2, 4, 65536, longest_first=False),
    Variant(512, 2, 4, 65536, streaming=True),
    Variant(512, 2, 4, 65536, longest_first=False, streaming=True),
    Variant(512, 2, 4, 32768),
    Variant(512, 2, 4, 32768, longest_first=False),
    Variant(512, 2, 4, 32768, streaming=True),
    Variant(1024, 1, 4, 131072),
    Variant(256, 4, 4, 32768),
    # Smaller chunks, to shorten the drain of the last wave on short (float16) kernels.
    Variant(256, 4, 4, 16384, streaming=True),
    Variant(512, 2, 2, 16384, streaming=True),
    Variant(256, 4, 4, 32768, streaming=True),
]


def build(variant: Variant, grads: list[cupy.ndarray]) -> tuple[object, cuda_kernels.DeviceTable]:
    options = (
        *NVRTC_OPTIONS,
        f"-DCUPY_AMP_THREADS={variant.threads}",
        f"-DCUPY_AMP_MIN_BLOCKS={variant.min_blocks}",
        f"-DCUPY_AMP_UNROLL={variant.unroll}",
        f"-DCUPY_AMP_STREAMING={int(variant.streaming)}",
    )
    module = cupy.RawModule(code=read_kernel_source("unscale_check.cu"), options=options)
    saved = cuda_kernels.CHUNK_BYTES, cuda_kernels.LONGEST_FIRST
    cuda_kernels.CHUNK_BYTES, cuda_kernels.LONGEST_FIRST = variant.chunk_bytes, variant.longest_first
    try:
        table = cuda_kernels.build_device_table(grads, cuda_kernels.kernel_dtype_name(grads[0].dtype))
    finally:
        cuda_kernels.CHUNK_BYTES, cuda_kernels.LONGEST_FIRST = saved
    return module.get_function(f"cupy_amp_unscale_check_{table.dtype_name}"), table


def launcher(variant: Variant, grads: list[cupy.ndarray], flag: cupy.ndarray) -> Callable[[int], None]:
    """Return a function launching ``variant`` over ``grads`` once (alternating unscale factors)."""
    kernel, table = build(variant, grads)
    args = [table.chunks, table.layout_offsets, table.layout, np.int64(table.chunk_count), None, None, flag]

    def launch(i: int) -> None:
        args[4], args[5] = INV_SCALES[i % 2], np.int32(i + 1)
        kernel((table.chunk_count,), (variant.threads,), (*args, table.tensor_found))  # type: ignore[operator]

    return launch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS), help="repeatable; default: all")
    args = parser.parse_args()
    flag = cupy.zeros(1, dtype=cupy.int32)
    results = {}
    print("variant: threads/min blocks per SM/unroll/chunk/chunk order(+streaming hints); cells: us, fraction of floor")
    for seed, (name, (shapes, dtype)) in enumerate(WORKLOADS.items()):
        if args.workload and name not in args.workload:
            continue
        grads = make_gradients(shapes, dtype, seed)
        timers = {"copy": copy_timer()}
        for variant in VARIANTS:
            timers[variant.label] = cupy_event_timer(launcher(variant, grads, flag))
        medians = interleaved_medians(timers, args.repeats)
        copy_tbps = 2 * COPY_ELEMENTS * 4 / (medians["copy"] * 1e-6) / 1e12
        floor_us = 2 * sum(int(g.nbytes) for g in grads) / (copy_tbps * 1e12) * 1e6
        results[name] = {"copy_tbps": copy_tbps, "floor_us": floor_us, "variants": {}}
        print(f"{name}: copy {copy_tbps:.3f} TB/s, floor {floor_us:.1f} us")
        for variant in VARIANTS:
            us = medians[variant.label]
            results[name]["variants"][variant.label] = {**asdict(variant), "us": us, "fraction": floor_us / us}
            print(f"    {variant.label:28} {us:9.1f} us  {floor_us / us:6.3f}", flush=True)
        del grads, timers
        cupy.get_default_memory_pool().free_all_blocks()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
