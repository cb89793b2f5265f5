"""Probe why float16 unscaling sits further below the copy floor than float32 (developer tool, GPU only).

Times, interleaved round by round on GPT-2-small shapes, the shipped kernel
under several data regimes and a few source variants of it (patched in memory,
never shipped), so that each suspected cost can be seen on its own:

- ``bench``      the benchmark's condition: unit-normal data unscaled alternately by
                 2**-16 (untimed) and 2**16 (timed), so the timed call reads float16 subnormals;
- ``normal``     data times 2**8, same factors: all but about 1% of the values stay float16 normals;
- ``identity``   factor 1.0 on both calls (no value changes range);
- ``no-math``    the finite path's multiply removed (loads, checks, stores only);
- ``int-widen``  float16 -> float32 widening done with integer ops and one exact multiply
                 by 2**112 instead of ``cvt.f32.f16``;
- ``64K``        64 KiB chunks instead of 32 KiB (half the chunks).

Usage: PYTHONPATH=. python tools/probe_fp16.py [--repeats 30] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import cupy  # noqa: E402

from cupy_amp import cuda_kernels  # noqa: E402
from cupy_amp.kernel_sources import read_kernel_source  # noqa: E402
from tools.bench_unscale import (  # noqa: E402
    COPY_ELEMENTS,
    copy_timer,
    cupy_event_timer,
    gpt2_shapes,
    interleaved_medians,
    make_gradients,
)

SHIPPED_MULTIPLY = "Type::multiply_finite(loaded[k].raw, factor);"
SHIPPED_WIDEN = """        float low = cupy_amp_mul_f32(cupy_amp_f16_to_f32((cupy_amp_u16)(w & 0xffffu)), factor);
        float high = cupy_amp_mul_f32(cupy_amp_f16_to_f32((cupy_amp_u16)(w >> 16)), factor);"""
INT_WIDEN = """        // exact: the float16 bits shifted into a float32 are the value times 2**-112
        float low = __uint_as_float(((w & 0x7fffu) << 13) | ((w & 0x8000u) << 16));
        float high = __uint_as_float(((w & 0x7fff0000u) >> 3) | (w & 0x80000000u));
        low = cupy_amp_mul_f32(cupy_amp_mul_f32(low, 0x1p112f), factor);
        high = cupy_amp_mul_f32(cupy_amp_mul_f32(high, 0x1p112f), factor);"""


def compiled(dtype_name: str, patch: tuple[str, str] | None = None) -> object:
    source = read_kernel_source("unscale_check.cu")
    if patch is not None:
        if patch[0] not in source:
            raise SystemExit(f"probe patch target not found: {patch[0][:40]!r}")
        source = source.replace(patch[0], patch[1])
    module = cupy.RawModule(code=source, options=cuda_kernels.compile_options())
    return module.get_function(f"cupy_amp_unscale_check_{dtype_name}")


def launcher(
    kernel: object, grads: list[cupy.ndarray], factors: tuple[float, float], chunk_bytes: int | None = None
) -> Callable[[int], None]:
    saved = cuda_kernels.CHUNK_BYTES
    if chunk_bytes is not None:
        cuda_kernels.CHUNK_BYTES = chunk_bytes
    try:
        table = cuda_kernels.build_device_table(grads, "float16" if grads[0].dtype == cupy.float16 else "float32")
    finally:
        cuda_kernels.CHUNK_BYTES = saved
    flag = cupy.zeros(1, dtype=cupy.int32)
    invs = (np.float32(factors[0]), np.float32(factors[1]))

    def launch(i: int, arrays: list[cupy.ndarray] = grads) -> None:
        # `arrays` keeps the gradients alive: the table holds no reference to them, and freed
        # memory would go to the next variant's arrays.
        args = (
            table.chunks,
            table.layout_offsets,
            table.layout,
            np.int64(table.chunk_count),
            invs[i % 2],
            np.int32(i + 1),
            flag,
            table.tensor_found,
        )
        kernel((table.chunk_count,), (cuda_kernels.THREADS_PER_BLOCK,), args)  # type: ignore[operator]

    return launch


def torch_launcher(grads: list[cupy.ndarray], factors: tuple[float, float]) -> Callable[[int], None] | None:
    try:
        import torch
    except ImportError:
        return None
    tensors = [torch.as_tensor(g, device="cuda") for g in grads]
    found = torch.zeros(1, device="cuda")
    invs = [torch.full((1,), f, device="cuda") for f in factors]

    def launch(i: int, arrays: list[cupy.ndarray] = grads) -> None:  # keeps the CuPy owners alive
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, invs[i % 2])

    return launch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    shapes = gpt2_shapes(12, 768)
    alternating = (2.0**-16, 2.0**16)
    shipped16, shipped32 = compiled("float16"), compiled("float32")
    no_math16 = compiled("float16", (SHIPPED_MULTIPLY, ";"))
    no_math32 = compiled("float32", (SHIPPED_MULTIPLY, ";"))
    int_widen16 = compiled("float16", (SHIPPED_WIDEN, INT_WIDEN))

    def data(dtype: str, seed: int, boost: float = 1.0) -> list[cupy.ndarray]:
        grads = make_gradients(shapes, dtype, seed)
        if boost != 1.0:
            for g in grads:
                g *= boost
        return grads

    runs: dict[str, Callable[[int], None] | None] = {
        "fp16 bench": launcher(shipped16, data("float16", 1), alternating),
        "fp16 normal": launcher(shipped16, data("float16", 2, 2.0**8), alternating),
        "fp16 identity": launcher(shipped16, data("float16", 3), (1.0, 1.0)),
        "fp16 no-math": launcher(no_math16, data("float16", 4), alternating),
        "fp16 int-widen bench": launcher(int_widen16, data("float16", 5), alternating),
        "fp16 int-widen normal": launcher(int_widen16, data("float16", 6, 2.0**8), alternating),
        "fp16 64K bench": launcher(shipped16, data("float16", 7), alternating, 65536),
        "fp16 64K normal": launcher(shipped16, data("float16", 8, 2.0**8), alternating, 65536),
        "fp32 bench": launcher(shipped32, data("float32", 9), alternating),
        "fp32 no-math": launcher(no_math32, data("float32", 10), alternating),
        "torch fp16 bench": torch_launcher(data("float16", 11), alternating),
        "torch fp16 normal": torch_launcher(data("float16", 12, 2.0**8), alternating),
    }
    timers = {"copy": copy_timer()}
    timers.update({name: cupy_event_timer(run) for name, run in runs.items() if run is not None})
    medians = interleaved_medians(timers, args.repeats)
    copy_tbps = 2 * COPY_ELEMENTS * 4 / (medians["copy"] * 1e-6) / 1e12
    elements = sum(int(np.prod(s)) for s in shapes)
    results = {"copy_tbps": copy_tbps, "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()}
    print(f"copy {copy_tbps:.3f} TB/s")
    for name in timers:
        if name == "copy":
            continue
        itemsize = 2 if "fp16" in name else 4
        floor_us = 2 * elements * itemsize / (copy_tbps * 1e12) * 1e6
        results[name] = {"us": medians[name], "fraction": floor_us / medians[name]}
        print(f"{name:24} {medians[name]:8.1f} us  {floor_us / medians[name]:6.3f} of floor", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
