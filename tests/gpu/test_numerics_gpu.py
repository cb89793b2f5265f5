"""The numerics report on the GPU: the same counts as the NumPy path and as the bits, the norm unchanged."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import MASKS, awkward, capture, on_the_bits, open_step

cupy = pytest.importorskip("cupy")

from cupy_amp import GradientSet, GradScaler, SyncFreeGradScaler  # noqa: E402
from cupy_amp.kernel_interface import CHUNK_BYTES  # noqa: E402

FACES = [GradScaler, SyncFreeGradScaler]


def strided(base: Any) -> Any:
    return base.reshape(30, 20)[::-2, 1::3]


def both_gradients(dtype: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The same gradients on the host and on the device: several chunks, tiny, empty, strided, a NaN."""
    rng = np.random.default_rng(6)
    big = 3 * CHUNK_BYTES // np.dtype(dtype).itemsize + 5  # several chunks, a ragged last one
    host = {name: awkward(rng, dtype, size) for name, size in (("big", big), ("small", 9), ("one", 1))}
    host["empty"] = np.zeros(0, dtype)
    host["big"][123] = np.array(np.nan).astype(dtype)
    device = {name: cupy.asarray(array) for name, array in host.items()}
    base = awkward(rng, dtype, 600)
    host["strided"], device["strided"] = strided(base), strided(cupy.asarray(base))
    return host, device


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("dtype", sorted(MASKS, key=str), ids=str)
def test_the_gpu_report_equals_numpys_and_the_bits(face: type, dtype: Any) -> None:
    host, device = both_gradients(dtype)
    assert all(cupy.asnumpy(device[name]).tobytes() == host[name].tobytes() for name in host)  # the same bits
    on_gpu, on_cpu = open_step(face(init_scale=4.0), cupy), open_step(face(init_scale=4.0))
    gpu_stats, cpu_stats = on_gpu.check(device, max_norm=1.0, report=True), on_cpu.check(host, report=True)
    assert not bool(gpu_stats.finite) and not bool(cpu_stats.finite)
    gpu, cpu = on_gpu.gradient_numerics(), on_cpu.gradient_numerics()
    assert gpu == cpu
    for row in gpu:
        assert (row.amax, row.zeros, row.subnormals) == on_the_bits(host[row.label]), row.label
    assert [row.label for row in gpu if row.nonfinite] == ["big"]


@pytest.mark.parametrize("dtype", sorted(MASKS, key=str), ids=str)
def test_a_finite_gradient_of_zeros_and_subnormals_is_counted_on_the_gpu(dtype: Any) -> None:
    """Every vector finite (the float-pipe counts), the largest magnitude a subnormal, both signs of zero.

    2,200 chunks of one tensor, a warp each (the many-chunks-per-warp case is the test below).
    """
    unsigned, magnitude_mask, _, min_normal = MASKS[np.dtype(dtype)]
    rng = np.random.default_rng(8)
    size = 2200 * CHUNK_BYTES // np.dtype(dtype).itemsize + 3
    bits = rng.integers(0, int(min_normal), size=size, dtype=np.uint64).astype(unsigned)
    bits[rng.random(size) < 0.3] = 0
    bits[rng.random(size) < 0.5] |= unsigned(magnitude_mask + 1)
    host = bits.view(np.dtype(dtype))
    scaler = open_step(SyncFreeGradScaler(init_scale=1.0), cupy)
    scaler.check([cupy.asarray(host)], report=True)
    (row,) = scaler.gradient_numerics()
    assert (row.amax, row.zeros, row.subnormals) == on_the_bits(host)
    smallest_normal = float(np.array(min_normal, dtype=unsigned).view(np.dtype(dtype)))
    assert row.subnormals > 0 and row.zeros > 0 and 0 < row.amax < smallest_normal


def many_chunks_per_warp(dtype: Any, nan: bool) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Tensors of 20 and 7 chunks, a small one between, and a strided one (negative strides) over 3 chunks.

    With ``nan``, values of every class (``awkward``) and a NaN; without, normal values whose norm is finite.
    """
    rng = np.random.default_rng(9)

    def values(rng: np.random.Generator, dtype: Any, size: int) -> np.ndarray:
        return awkward(rng, dtype, size) if nan else rng.standard_normal(size).astype(dtype)

    per_chunk = CHUNK_BYTES // np.dtype(dtype).itemsize
    host = {"a": values(rng, dtype, 20 * per_chunk + 17), "b": values(rng, dtype, 9)}
    host["c"] = values(rng, dtype, 7 * per_chunk)
    if nan:
        host["c"][6 * per_chunk + 5] = np.array(np.nan).astype(dtype)  # in the tensor's last chunk
    device = {name: cupy.asarray(array) for name, array in host.items()}
    base = values(rng, dtype, 6 * per_chunk)
    view = (slice(None, None, -1), slice(None, None, -2))
    host["strided"] = base.reshape(6, per_chunk)[view]
    device["strided"] = cupy.asarray(base).reshape(6, per_chunk)[view]
    return host, device


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=str)
def test_warps_that_walk_many_chunks_report_and_sum_as_numpy(
    face: type, dtype: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One block (16 warps) for about 35 chunks: each warp walks chunks of several tensors in turn.

    Its report is flushed each time the tensor changes, a NaN in a late chunk is still found, and the norm's
    bits repeat from step to step and stay within a float32 ulp of NumPy's (and of the full grid's).
    """
    from cupy_amp.gpu import stats as device_stats

    full_grid = open_step(face(init_scale=1.0), cupy)
    host, device = many_chunks_per_warp(dtype, nan=False)
    expected = float(full_grid.check(device, max_norm=1.0).norm)
    monkeypatch.setattr(device_stats, "_stats_grid", lambda: 1)
    on_gpu, on_cpu = face(init_scale=1.0), open_step(face(init_scale=1.0))
    reference = float(on_cpu.check(host, max_norm=1.0).norm)
    norms = []
    for _ in range(3):
        norms.append(cupy.asnumpy(open_step(on_gpu, cupy).check(device, max_norm=1.0).norm).tobytes())
        on_gpu.update()
    lanes = on_gpu._scaling
    assert [state.stats._grid for state in lanes.states.values()] == [1]  # the patched grid was used
    assert len(set(norms)) == 1
    norm = float(np.frombuffer(norms[0], np.float32)[0])
    assert np.isfinite(norm) and norm > 0
    assert abs(norm - reference) <= np.spacing(np.float32(reference)) and abs(norm - expected) <= np.spacing(
        np.float32(expected)
    )

    host, device = many_chunks_per_warp(dtype, nan=True)
    stats = open_step(on_gpu, cupy).check(device, report=True)
    assert not bool(stats.finite)
    rows = on_gpu.gradient_numerics()
    on_cpu.update()
    open_step(on_cpu).check(host, report=True)
    assert rows == on_cpu.gradient_numerics()
    for row in rows:
        assert (row.amax, row.zeros, row.subnormals) == on_the_bits(host[row.label]), row.label
    assert [row.label for row in rows if row.nonfinite] == ["c"]


@pytest.mark.parametrize("face", FACES)
def test_the_report_leaves_the_norm_bits_alone_on_the_gpu(face: type) -> None:
    rng = np.random.default_rng(7)
    grads = [cupy.asarray(rng.standard_normal(n).astype(np.float16)) for n in (70000, 300, 5)]
    plain, reported = open_step(face(init_scale=8.0), cupy), open_step(face(init_scale=8.0), cupy)
    a, b = plain.check(grads, max_norm=0.1), reported.check(grads, max_norm=0.1, report=True)
    assert cupy.asnumpy(a.norm).tobytes() == cupy.asnumpy(b.norm).tobytes()
    assert cupy.asnumpy(a.clip_coefficient).tobytes() == cupy.asnumpy(b.clip_coefficient).tobytes()


def test_a_captured_check_with_the_report_reports_each_replay() -> None:
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        grad = cupy.zeros(1000, cupy.float16)
        scaler = SyncFreeGradScaler(init_scale=1.0)
        prepared = scaler.prepare([grad])
        assert isinstance(prepared, GradientSet)
        loss = cupy.ones((), cupy.float32)

        def step() -> None:
            scaler.scale_loss(loss)
            scaler.check(prepared, report=True)
            scaler.update()

        step()
        graph = capture(stream, step)
        for zeros in (10, 400, 0):
            grad.fill(1.0)
            grad[:zeros] = 0.0
            graph.launch(stream)
            stream.synchronize()
            (row,) = scaler.gradient_numerics()  # the report of the captured step's last eager check() ...
            assert (row.zeros, row.amax) == (zeros, 1.0)  # ... read from the tables the replay refilled
