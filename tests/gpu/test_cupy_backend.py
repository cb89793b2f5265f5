"""The CuPy path against the NumPy path, bit for bit, on a real GPU."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
from helpers import assert_same_bits as assert_array_bits
from helpers import open_step

cupy = pytest.importorskip("cupy")

from cupy_amp import (  # noqa: E402
    CommunicatorError,
    DuplicateGradientError,
    GradientSet,
    GradientTypeError,
    GradientValueError,
    GradScaler,
)
from cupy_amp.gpu import tables as device_tables  # noqa: E402
from cupy_amp.gpu.device_state import DeviceState  # noqa: E402
from cupy_amp.kernel_interface import CHUNK_BYTES  # noqa: E402
from cupy_amp.rule import ScalerState  # noqa: E402

UINT = {np.dtype(np.float16): np.uint16, np.dtype(np.float32): np.uint32, np.dtype(np.float64): np.uint64}
NAN_PAYLOADS = {
    np.dtype(np.float16): [0x7E00, 0x7C01, 0xFD55, 0x7FFF],
    np.dtype(np.float32): [0x7FC00000, 0x7F800001, 0xFFA5A5A5, 0x7FFFFFFF],
    np.dtype(np.float64): [0x7FF8000000000000, 0x7FF0000000000001, 0xFFF5A5A5A5A5A5A5],
}


def bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).view(UINT[array.dtype])


def chunk_elements(itemsize: int) -> int:
    return CHUNK_BYTES // itemsize


def random_array(rng: np.random.Generator, size: int, dtype: np.dtype) -> np.ndarray:
    scale = {np.dtype(np.float16): 1e3, np.dtype(np.float32): 1e20, np.dtype(np.float64): 1e100}[np.dtype(dtype)]
    return (rng.standard_normal(size) * scale ** rng.uniform(-1, 1, size)).astype(dtype)


def unscale_both(host_grads: list[np.ndarray], views=None, scale: float = 2.0**16, **scaler_args):
    """Run the NumPy and the CuPy path on the same data; return both results and flags."""
    scaler_args = {"min_scale": None, "max_scale": None, **scaler_args}
    cpu = GradScaler(init_scale=scale, **scaler_args)
    gpu = GradScaler(init_scale=scale, **scaler_args)
    device_grads = [cupy.asarray(g) for g in host_grads]
    host_work = [g.copy() for g in host_grads]
    if views is not None:
        host_work = [view(g) for view, g in zip(views, host_work)]
        device_grads = [view(g) for view, g in zip(views, device_grads)]
    cpu_ok = open_step(cpu).unscale_and_check(host_work)
    gpu_ok = open_step(gpu, cupy).unscale_and_check(device_grads)
    return cpu, gpu, cpu_ok, gpu_ok, host_work, device_grads


def assert_same_bits(host: list[np.ndarray], device: list[object]) -> None:
    for h, d in zip(host, device, strict=True):
        assert_array_bits(d, h)


# Chunk lengths differ per dtype (a chunk is a fixed number of bytes): straddle each.
CHUNK_SIZE = chunk_elements(4)
CHUNK_EDGES = sorted({chunk_elements(size) + delta for size in (2, 4, 8) for delta in (-1, 0, 1)})
SIZES = [1, 2, 3, 7, 8, 9, 15, 16, 17, *CHUNK_EDGES, 3 * CHUNK_SIZE + 5, 1_000_003]


@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_lists_match_numpy_bits(seed: int) -> None:
    rng = np.random.default_rng(seed)
    dtypes = [np.float16, np.float32, np.float64]
    grads = [random_array(rng, int(rng.choice(SIZES)), rng.choice(dtypes)) for _ in range(int(rng.integers(1, 40)))]
    cpu, gpu, cpu_ok, gpu_ok, host, device = unscale_both(grads, scale=float(2.0 ** rng.integers(-20, 30)))
    assert cpu_ok and gpu_ok
    assert_same_bits(host, device)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("offset", [1, 2, 3])
def test_views_offset_from_alignment(dtype: type, offset: int) -> None:
    rng = np.random.default_rng(offset)
    grads = [random_array(rng, size + offset, dtype) for size in (5, 33, CHUNK_SIZE + 7, 100_000)]
    views = [lambda a, o=offset: a[o:] for _ in grads]
    _, _, _, _, host, device = unscale_both(grads, views)
    assert_same_bits(host, device)
    # The elements before the view were not touched.
    for original, d in zip(grads, device):
        assert np.array_equal(
            bits(cupy.asnumpy(d.base[:offset]) if d.base is not None else original[:offset]), bits(original[:offset])
        )


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_transposed_strided_and_reversed_views(dtype: type) -> None:
    rng = np.random.default_rng(7)
    shapes_and_views = [
        ((300, 257), lambda a: a.T),
        ((300, 257), lambda a: a[::3, 1::2]),
        ((64, 33, 5), lambda a: a.transpose(2, 0, 1)[:, ::-1]),
        ((1000,), lambda a: a[::-1]),
        ((1000,), lambda a: a[::-7]),
        ((4, 70000), lambda a: a[:, 3:-2]),
        ((2, 3, 4, 5, 6), lambda a: a[:, ::2, :, ::-1].transpose(4, 1, 3, 0, 2)),
    ]
    grads = [random_array(rng, int(np.prod(shape)), dtype).reshape(shape) for shape, _ in shapes_and_views]
    full_cpu = [g.copy() for g in grads]
    full_gpu = [cupy.asarray(g) for g in grads]
    host_views = [view(g) for (_, view), g in zip(shapes_and_views, full_cpu)]
    device_views = [view(g) for (_, view), g in zip(shapes_and_views, full_gpu)]
    assert open_step(GradScaler(init_scale=1024.0)).unscale_and_check(host_views)
    assert open_step(GradScaler(init_scale=1024.0), cupy).unscale_and_check(device_views)
    # Whole parent arrays compared: elements outside the views must be untouched on both.
    assert_same_bits(full_cpu, full_gpu)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("poison_kind", ["inf", "-inf", "nan_payloads"])
def test_planted_nonfinite_found_and_named(dtype: type, poison_kind: str) -> None:
    rng = np.random.default_rng(11)
    sizes = [CHUNK_SIZE + 3, 17, 9000, 4 * CHUNK_SIZE, 1]
    for grad_index in (0, 2, len(sizes) - 1):
        for where in ("first", "middle", "last"):
            grads = [random_array(rng, size, dtype) for size in sizes]
            target = grads[grad_index]
            element = {"first": 0, "middle": target.size // 2, "last": target.size - 1}[where]
            if poison_kind == "nan_payloads":
                payloads = NAN_PAYLOADS[np.dtype(dtype)]
                target.view(UINT[np.dtype(dtype)])[element] = payloads[grad_index % len(payloads)]
            else:
                target[element] = np.inf if poison_kind == "inf" else -np.inf
            cpu, gpu, cpu_ok, gpu_ok, host, device = unscale_both(grads)
            assert not cpu_ok and not gpu_ok, (grad_index, where)
            assert gpu.nonfinite_gradients() == cpu.nonfinite_gradients() == [grad_index]
            assert_same_bits(host, device)


def test_fp16_edge_values_and_float32_subnormals() -> None:
    half = np.array([65504, -65504, 6.1e-5, 5.96e-8, -5.96e-8, -0.0, 0.0, 1.0, 2049, 0.3333], dtype=np.float16)
    single = np.array([1e-45, -1e-45, 1.17e-38, 3e-39, -0.0, 3.4028235e38, 1.0], dtype=np.float32)
    for scale in (1.0, 2.0**-10, 2.0**16, 2.0**24, 3.0, 2.0**100):
        cpu, gpu, cpu_ok, gpu_ok, host, device = unscale_both([half, single], scale=scale)
        assert cpu_ok and gpu_ok, scale
        assert_same_bits(host, device)
    # Subnormal float32 results survive on the GPU despite CuPy's -ftz=true (explicit mul.rn.f32).
    tiny = cupy.asarray(np.array([2.0**-120], dtype=np.float32))
    open_step(GradScaler(init_scale=2.0**20), cupy).unscale_and_check([tiny])
    assert float(tiny.get()[0]) == 2.0**-140


def test_element_that_only_becomes_inf_is_not_an_overflow() -> None:
    grads = [np.array([60000, 1], dtype=np.float16), np.array([3e38], dtype=np.float32)]
    cpu, gpu, cpu_ok, gpu_ok, host, device = unscale_both(grads, scale=2.0**-10, min_scale=None)
    assert cpu_ok and gpu_ok
    assert np.isinf(cupy.asnumpy(device[0])[0]) and np.isinf(cupy.asnumpy(device[1])[0])
    assert_same_bits(host, device)


def test_at_the_smallest_scale_the_gpu_gives_numpys_bits() -> None:
    # The inverse is float32's near-maximum: fp16 results overflow to inf, tiny ones stay subnormal.
    smallest = float.fromhex("0x1.000008p-128")
    grads = [np.array([0.0, 1.0, -0.0, np.inf, 2.0**-140, -(2.0**-130)], dtype=t) for t in (np.float32, np.float64)]
    grads.append(np.array([0.0, 1.0, -0.0, np.inf, 6e-8], dtype=np.float16))
    cpu, gpu, cpu_ok, gpu_ok, host, device = unscale_both(grads, scale=smallest)
    assert not cpu_ok and not gpu_ok
    assert gpu.nonfinite_gradients() == cpu.nonfinite_gradients() == [0, 1, 2]
    assert_same_bits(host, device)
    assert not np.isnan(cupy.asnumpy(device[0])).any()  # no 0 * inf: the inverse is finite


def test_empty_arrays_and_empty_lists() -> None:
    scaler = GradScaler()
    assert open_step(scaler, cupy).unscale_and_check([])
    scaler.update()
    empties = [cupy.zeros((0,), cupy.float32), cupy.zeros((3, 0), cupy.float16), None]
    assert open_step(scaler, cupy).unscale_and_check(empties)
    scaler.update()
    assert scaler.stats().steps == 2


@pytest.mark.parametrize("dtype", [np.float32, np.float64])  # float16 losses are refused
def test_scale_loss_matches_numpy(dtype: type) -> None:
    rng = np.random.default_rng(3)
    losses = [
        np.array(1.2345, dtype=dtype),
        random_array(rng, 1, dtype),
        random_array(rng, 3 * CHUNK_SIZE + 11, dtype),
        random_array(rng, 600, dtype).reshape(20, 30).T,
        random_array(rng, 1000, dtype)[::-3],
        np.array([70000.0 / 65536, np.nan, -np.inf], dtype=dtype),
    ]
    for loss in losses:
        host = loss.copy() if loss.flags.c_contiguous else loss
        device = cupy.asarray(loss) if loss.flags.c_contiguous else None
        if device is None:  # rebuild the same non-contiguous view on the device
            base = cupy.asarray(loss.base if loss.base is not None else loss)
            device = base.T if loss.ndim == 2 else base[::-3]
            host = loss.base.copy().T if loss.ndim == 2 else loss.base.copy()[::-3]
        GradScaler().scale_loss(host)
        before = device.data.ptr
        GradScaler().scale_loss(device)
        assert device.data.ptr == before
        assert np.array_equal(bits(cupy.asnumpy(device)), bits(host))


def test_an_fp16_loss_on_the_gpu_is_refused_untouched() -> None:
    loss = cupy.asarray(np.array(2.0, dtype=np.float16))
    with pytest.raises(GradientTypeError, match="float16 loss"):
        GradScaler(init_scale=65536.0).scale_loss(loss)  # 2.0 * 65536 would be inf in float16
    assert float(loss.get()) == 2.0


SPIN_SOURCE = r"""
extern "C" __global__ void cupy_amp_test_spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
}
"""


def write_inf_late(grads: cupy.ndarray) -> None:
    """On the current stream: keep one SM busy ~50 ms, then write inf into the last element."""
    spin = cupy.RawKernel(SPIN_SOURCE, "cupy_amp_test_spin")
    spin((1,), (1,), (np.int64(100_000_000),))
    grads[-1:] = cupy.inf


def test_gradients_written_late_on_a_nonblocking_stream_are_seen() -> None:
    grads = cupy.ones(1 << 20, dtype=cupy.float32)
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    scaler = GradScaler()
    with stream:
        write_inf_late(grads)
        open_step(scaler, cupy)
        assert not scaler.unscale_and_check([grads])  # no explicit synchronize
    assert scaler.nonfinite_gradients() == [0]


def test_negative_control_an_unordered_check_misses_the_late_inf() -> None:
    # The same late write, but checked from another stream with no ordering between
    # them: the check runs first and misses the inf. So the test above can fail, and
    # passes only because launches follow the current stream.
    grads = cupy.ones(1 << 20, dtype=cupy.float32)
    writer = cupy.cuda.Stream(non_blocking=True)
    reader = cupy.cuda.Stream(non_blocking=True)
    scaler = GradScaler()
    with reader:  # places the scaler's state (which waits for the device) before the late write
        open_step(scaler, cupy)
        assert scaler.unscale_and_check([cupy.ones(4, cupy.float32)])
        scaler.update()
    cupy.cuda.Device().synchronize()
    with writer:
        write_inf_late(grads)
    with reader:
        open_step(scaler, cupy)
        unordered_result = scaler.unscale_and_check([grads])
    cupy.cuda.Device().synchronize()
    assert unordered_result is True
    assert bool(cupy.isinf(grads[-1]))


def test_end_to_end_loop_gives_identical_trajectories() -> None:
    rng = np.random.default_rng(5)
    shapes = [(64, 32), (32,), (32, 10), (10,)]
    kwargs = dict(init_scale=2.0**12, growth_interval=3, hysteresis=2, min_scale=None)
    cpu, gpu = GradScaler(**kwargs), GradScaler(**kwargs)
    trajectory_cpu, trajectory_gpu = [], []
    for step in range(120):
        host = [random_array(rng, int(np.prod(s)), np.float16).reshape(s) for s in shapes]
        if rng.random() < 0.25:
            host[int(rng.integers(len(host)))].flat[0] = np.nan
        device = [cupy.asarray(g) for g in host]
        loss_h, loss_d = np.array(0.5, np.float32), cupy.asarray(np.array(0.5, np.float32))
        cpu.scale_loss(loss_h)
        gpu.scale_loss(loss_d)
        assert float(loss_h) == float(loss_d.get())
        assert cpu.unscale_and_check(host) == gpu.unscale_and_check(device)
        assert cpu.nonfinite_gradients() == gpu.nonfinite_gradients()
        cpu.update()
        gpu.update()
        trajectory_cpu.append(cpu.stats())
        trajectory_gpu.append(gpu.stats())
        if step == 60:
            restored = GradScaler()
            restored.load_checkpoint(gpu.checkpoint())
            gpu = restored
    assert trajectory_cpu == trajectory_gpu
    assert cpu.checkpoint() == gpu.checkpoint()


def test_same_list_twice_reuses_the_cached_table_and_stays_correct() -> None:
    grads = [cupy.ones(1000, cupy.float32) * 2, cupy.ones(10, cupy.float32) * 4]
    scaler = GradScaler(init_scale=2.0)
    open_step(scaler, cupy).unscale_and_check(grads)
    scaler.update()
    tables = list(device_tables._cache.values())
    open_step(scaler, cupy).unscale_and_check(grads)
    scaler.update()
    assert list(device_tables._cache.values()) == tables
    assert float(grads[0][0]) == 0.5 and float(grads[1][0]) == 1.0
    # A changed list (a new array at a new address) gets a correct result too.
    grads[1] = cupy.full(10, 8.0, cupy.float32)
    grads[1][3] = cupy.nan
    assert not open_step(scaler, cupy).unscale_and_check(grads)
    assert scaler.nonfinite_gradients() == [1]
    assert float(grads[1][0]) == 4.0


def test_more_than_2_31_elements() -> None:
    n = 2**31 + 5
    try:
        big = cupy.ones(n, dtype=cupy.float16)
    except cupy.cuda.memory.OutOfMemoryError:
        pytest.skip("not enough GPU memory for 2**31 + 5 float16 elements")
    big[-1] = cupy.inf
    scaler = GradScaler(init_scale=2.0)
    assert not open_step(scaler, cupy).unscale_and_check([big])
    assert float(big[0]) == 0.5 and float(big[2**31 + 1]) == 0.5 and float(big[-2]) == 0.5
    assert int(cupy.count_nonzero(big == 0.5)) == n - 1
    del big  # a float16 loss is refused: the loss is a float32 array of its own
    try:
        loss = cupy.ones(2**31 + 1, dtype=cupy.float32)
    except cupy.cuda.memory.OutOfMemoryError:
        pytest.skip("not enough GPU memory for a float32 loss of 2**31 + 1 elements")
    GradScaler(init_scale=4.0).scale_loss(loss)
    assert int(cupy.count_nonzero(loss == 4.0)) == 2**31 + 1


def test_mixed_numpy_and_cupy_is_refused_untouched() -> None:
    host = np.ones(3, np.float32) * 2
    device = cupy.ones(3, cupy.float32) * 2
    scaler = open_step(GradScaler(init_scale=2.0), cupy)
    with pytest.raises(TypeError, match="numpy"):
        scaler.unscale_and_check([device, host])
    assert float(device[0]) == 2.0 and host[0] == 2.0


def test_int_gradient_on_gpu_refused_before_anything_changes() -> None:
    good = cupy.ones(3, cupy.float32) * 2
    scaler = open_step(GradScaler(init_scale=2.0), cupy)
    with pytest.raises(TypeError, match="gradient #1"):
        scaler.unscale_and_check([good, cupy.ones(3, cupy.int32)])
    assert float(good[0]) == 2.0


def test_overlapping_device_views_refused() -> None:
    base = cupy.ones(10, cupy.float32)
    scaler = open_step(GradScaler(), cupy)
    with pytest.raises(RuntimeError, match="share memory"):
        scaler.unscale_and_check([base[:6], base[4:]])
    assert open_step(GradScaler(init_scale=2.0), cupy).unscale_and_check([base[::2], base[1::2]])
    assert float(base[0]) == 0.5 and float(base[1]) == 0.5


def device_count() -> int:
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no driver: the gpu marker skips or fails the test already
        return 0


@pytest.mark.multi_gpu
def test_gradients_on_two_devices_in_one_call() -> None:
    if device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {device_count()}")
    rng = np.random.default_rng(9)
    host = [random_array(rng, 5000, np.float32) for _ in range(4)]
    host[3][7] = np.inf
    device = []
    for index, g in enumerate(host):
        with cupy.cuda.Device(index % 2):
            device.append(cupy.asarray(g))
    cpu, gpu = GradScaler(), GradScaler()
    host_work = [g.copy() for g in host]
    assert not open_step(cpu).unscale_and_check(host_work)
    assert not open_step(gpu, cupy).unscale_and_check(device)
    assert gpu.nonfinite_gradients() == [3]
    assert_same_bits(host_work, device)


def test_torch_cuda_tensors_are_unscaled_zero_copy() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    grad = torch.full((1000,), 8.0, device="cuda", dtype=torch.float16)
    grad[10] = float("nan")
    scaler = GradScaler(init_scale=4.0)
    assert not open_step(scaler, cupy).unscale_and_check({"w": grad})
    assert scaler.nonfinite_gradients() == ["w"]
    assert float(grad[0]) == 2.0
    scaler.update()  # backed off to 2.0
    loss = torch.tensor(1.5, device="cuda")
    scaler.scale_loss(loss)
    assert float(loss) == 3.0


def test_import_compiles_nothing() -> None:
    code = textwrap.dedent(
        """
        import cupy
        created = []
        real = cupy.RawModule
        cupy.RawModule = lambda *args, **kwargs: created.append(args) or real(*args, **kwargs)
        import cupy_amp, cupy_amp.gpu.backend
        assert not created, created
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


@pytest.mark.parametrize("kinds", [("broken", "broken"), ("clean", "broken")])
def test_two_threads_on_one_stream_each_get_their_own_verdict(kinds: tuple[str, str]) -> None:
    # The verdict is read after the caller's own bookkeeping, so another thread can launch on the same
    # stream in between. With one flag per stream, a later launch that also overflowed overwrote the
    # earlier one's flag (its epoch), and the earlier caller read "clean".
    import threading

    rounds = 200

    def gradients(kind: str) -> list[object]:
        grads = [cupy.ones(1 << 16, dtype=cupy.float32) for _ in range(4)]
        if kind == "broken":
            grads[-1][-1] = cupy.inf
        return grads

    barrier = threading.Barrier(2)
    verdicts: list[list[bool]] = [[], []]

    def worker(index: int, grads: list[object]) -> None:
        scaler = GradScaler(init_scale=1.0, min_scale=None)
        with cupy.cuda.Stream.null:
            for _ in range(rounds):
                open_step(scaler, cupy)
                barrier.wait()
                verdicts[index].append(scaler.unscale_and_check(grads))
                scaler.update()

    threads = [threading.Thread(target=worker, args=(i, gradients(kind))) for i, kind in enumerate(kinds)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for kind, seen in zip(kinds, verdicts):
        assert seen == [kind == "clean"] * rounds, kind


# Hardening: what could once kill the CUDA context, race, or divide twice


class Exported:
    """A foreign CUDA array: only ``__cuda_array_interface__``, at any address, possibly read-only."""

    def __init__(self, pointer: int, size: int, read_only: bool = False) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "<f4",
            "data": (pointer, read_only),
            "version": 3,
            "strides": None,
        }


def assert_context_alive() -> None:
    probe = cupy.arange(8, dtype=cupy.float32)
    assert float(probe.sum()) == 28.0
    grads = [cupy.full(1000, 8.0, cupy.float32)]
    assert open_step(GradScaler(init_scale=4.0), cupy).unscale_and_check(grads)
    assert float(grads[0][-1]) == 2.0


@pytest.mark.parametrize("offset", [1, 2, 3])
def test_a_misaligned_pointer_is_refused_before_any_launch(offset: int) -> None:
    base = cupy.full(16, 8.0, dtype=cupy.float32)
    misaligned = cupy.ndarray((4,), cupy.float32, base.data + offset)
    scaler = open_step(GradScaler(init_scale=4.0), cupy)
    with pytest.raises(GradientValueError, match="misaligned") as info:
        scaler.unscale_and_check([base[8:], misaligned])
    assert "gradient #1" in str(info.value)
    with pytest.raises(GradientValueError, match="misaligned"):
        scaler.scale_loss(misaligned)
    with pytest.raises(GradientValueError, match="misaligned"):
        scaler.unscale_and_check([Exported(base.data.ptr + offset, 4)])
    assert_context_alive()
    assert float(base[0]) == 8.0 and float(base[-1]) == 8.0  # nothing was written


def test_an_export_marked_read_only_is_refused() -> None:
    base = cupy.full(4, 8.0, dtype=cupy.float32)
    scaler = open_step(GradScaler(), cupy)
    with pytest.raises(GradientValueError, match="read-only"):
        scaler.unscale_and_check([Exported(base.data.ptr, 4, read_only=True)])
    assert open_step(GradScaler(init_scale=4.0), cupy).unscale_and_check([Exported(base.data.ptr, 4)])
    assert float(base[0]) == 2.0


def test_an_array_whose_elements_overlap_is_refused_on_the_gpu_too() -> None:
    base = cupy.arange(1.0, 17.0, dtype=cupy.float32)
    tricky = cupy.lib.stride_tricks.as_strided(base, shape=(3, 3), strides=(4, 4))
    scaler = open_step(GradScaler(init_scale=2.0), cupy)
    with pytest.raises(GradientValueError, match="overlap in memory"):
        scaler.unscale_and_check([tricky])
    assert base.get().tolist() == list(range(1, 17))


def test_two_threads_passing_the_same_list_divide_it_once_on_the_gpu() -> None:
    import threading

    scaler = GradScaler(init_scale=4.0, growth_interval=1000)
    grads = [cupy.full(1 << 20, 8.0, cupy.float32) for _ in range(8)]
    open_step(scaler, cupy)
    barrier = threading.Barrier(2)
    outcomes: list[object] = []

    def call() -> None:
        barrier.wait()
        try:
            outcomes.append(scaler.unscale_and_check(grads))
        except DuplicateGradientError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(type(outcome).__name__ for outcome in outcomes) == ["DuplicateGradientError", "bool"]
    assert all(float(cupy.max(g)) == float(cupy.min(g)) == 2.0 for g in grads)


def test_a_call_that_fails_while_waiting_counts_and_its_arrays_are_never_divided_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grads = [cupy.full(1000, 8.0, cupy.float32)]
    scaler = GradScaler(init_scale=4.0)
    real = DeviceState.read

    def lost(self: object) -> object:
        raise RuntimeError("the device went away while the kernels ran")

    open_step(scaler, cupy)
    monkeypatch.setattr(DeviceState, "read", lost)
    with pytest.raises(RuntimeError, match="went away"):
        scaler.unscale_and_check(grads)
    monkeypatch.setattr(DeviceState, "read", real)
    with pytest.raises(DuplicateGradientError):
        scaler.unscale_and_check(grads)
    cupy.cuda.Device().synchronize()
    assert float(grads[0][0]) == 2.0  # the kernel ran once
    scaler.update()
    assert scaler.stats().skipped_steps == 1
    assert open_step(scaler, cupy).unscale_and_check(grads)
    assert float(grads[0][0]) == 1.0


def test_steps_on_a_new_stream_each_time_see_the_last_steps_scale() -> None:
    scaler = GradScaler(init_scale=2.0, growth_interval=1, max_scale=2.0**40)
    for step in range(30):
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            grad = cupy.full(100, 2.0 ** (step + 1), cupy.float32)
            assert open_step(scaler, cupy).unscale_and_check([grad])
            scaler.update()
            assert float(grad[0]) == 1.0  # divided by the scale the last step (on another stream) left
        del stream
    assert scaler.scale_factor() == 2.0**31


class GarbageVote:
    """A communicator whose all-reduce writes ``count`` as the count of overflowed ranks, whatever was voted."""

    def __init__(self, count: float) -> None:
        self.count = count

    def reduce_sum(self, values: Any, stream: Any) -> None:
        if stream is None:  # a host pair: the join of a call refused before its launch
            values[0] = self.count
        else:
            with stream:
                values[0:1].fill(self.count)


def test_a_device_count_below_this_ranks_own_overflow_is_a_communicator_error() -> None:
    grads = [cupy.ones(10, cupy.float32)]
    grads[0][3] = cupy.inf
    scaler = GradScaler(init_scale=2.0, comm=GarbageVote(0))  # "nobody overflowed", against this rank's inf
    open_step(scaler, cupy)
    with pytest.raises(CommunicatorError, match="impossible"):
        scaler.unscale_and_check(grads)
    assert scaler.had_overflow() is True
    honest = GradScaler(init_scale=2.0, comm=GarbageVote(0))
    assert open_step(honest, cupy).unscale_and_check([cupy.ones(10, cupy.float32)]) is True


def gradients_on_two_devices() -> list[Any]:
    """One float32 gradient of 8s on each of devices 0 and 1."""
    grads = []
    for device in (0, 1):
        with cupy.cuda.Device(device):
            grads.append(cupy.full(10, 8.0, cupy.float32))
    return grads


@pytest.mark.multi_gpu
def test_with_a_communicator_gradients_on_two_devices_are_refused_before_any_launch() -> None:
    if device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {device_count()}")
    grads = gradients_on_two_devices()
    votes: list[bool] = []

    class CountingVote(GarbageVote):
        def reduce_sum(self, values: Any, stream: Any) -> None:
            votes.append(float(values[0]))
            values[0] = 1.0

    scaler = open_step(GradScaler(init_scale=2.0, comm=CountingVote(0)), cupy)
    with pytest.raises(GradientValueError, match="one device"):
        scaler.unscale_and_check(grads)
    assert votes == [1.0]  # joined once as an overflowed rank, from the host
    assert [float(g[0]) for g in grads] == [8.0, 8.0]


@pytest.mark.multi_gpu
@pytest.mark.parametrize("face", ["GradScaler", "SyncFreeGradScaler"])
def test_a_check_of_gradients_on_two_devices_is_refused_with_its_reason(face: str) -> None:
    if device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {device_count()}")
    import cupy_amp

    grads = gradients_on_two_devices()
    scaler = open_step(getattr(cupy_amp, face)(init_scale=2.0), cupy)
    with pytest.raises(GradientValueError, match=r"check\(\) takes the gradients of one device"):
        scaler.check(grads)
    if face == "SyncFreeGradScaler":
        with pytest.raises(GradientValueError, match="works on one device"):
            open_step(cupy_amp.SyncFreeGradScaler(init_scale=2.0), cupy).unscale_and_check(grads)
    assert [float(g[0]) for g in grads] == [8.0, 8.0]


def test_a_gradient_set_built_on_a_busy_stream_is_complete_when_used_on_another() -> None:
    # Its device tables are uploaded on the stream current at construction; a launch from another
    # stream must not read them before they arrive (it read stale or freed records before).
    for _ in range(3):
        grads = [cupy.full(1000 + i, 4.0, cupy.float32) for i in range(8)]
        grads[5][123] = cupy.inf
        cupy.cuda.Device().synchronize()
        busy, other = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
        with busy:
            spin = cupy.RawKernel(SPIN_SOURCE, "cupy_amp_test_spin")
            spin((1,), (1,), (np.int64(100_000_000),))  # about 50 ms
            gradient_set = GradientSet(grads)
        with other:
            scaler = GradScaler(init_scale=2.0)
            assert open_step(scaler, cupy).unscale_and_check(gradient_set) is False
            assert scaler.nonfinite_gradients() == [5]
        assert float(grads[0][0]) == 2.0


@pytest.mark.multi_gpu
def test_flags_of_a_busy_second_device_are_read_after_its_kernels() -> None:
    # The inf is on device 1, whose stream is busy; device 0 is current. Its flag must be read after
    # device 1's kernel, not after a synchronization of device 0's stream.
    if device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {device_count()}")
    with cupy.cuda.Device(0):
        first = cupy.ones(1000, cupy.float32)
    with cupy.cuda.Device(1):
        second = cupy.ones(1 << 20, cupy.float32)
        cupy.cuda.Device().synchronize()
        write_inf_late(second)  # spins ~50 ms on device 1's current stream, then writes the inf
    with cupy.cuda.Device(0):
        scaler = GradScaler()
        assert open_step(scaler, cupy).unscale_and_check([first, second]) is False
        assert scaler.nonfinite_gradients() == [1]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_host_mirror_never_disagrees_with_the_device_state(seed: int) -> None:
    # GradScaler answers scale_factor(), stats() and checkpoint() from its host mirror without waiting; the
    # kernels read the scale from the device state. After every update() the two must be the same state.
    rng = np.random.default_rng(seed)
    scaler = GradScaler(init_scale=2.0**10, growth_interval=3, hysteresis=2, min_scale=None, max_scale=2.0**14)
    grads = [cupy.ones(64, cupy.float32), cupy.ones((8, 8), cupy.float16)]
    for _ in range(80):
        for grad in grads:
            grad.fill(1.0)
        if rng.random() < 0.3:
            grads[int(rng.integers(2))][int(rng.integers(8))] = cupy.inf
        open_step(scaler, cupy)
        if rng.random() < 0.5:
            scaler.unscale_and_check(grads)
        else:
            scaler.check(grads, max_norm=1.0)
        (device_state,) = scaler._scaling.states.values()
        _, overflow, local, epoch, bad_votes, poisoned = device_state.snapshot()
        assert (overflow, local, bad_votes, poisoned) == (scaler.had_overflow(), scaler.had_overflow(), 0, False)
        scaler.update()
        state, overflow, local, next_epoch, bad_votes, poisoned = device_state.snapshot()
        stats = scaler.stats()
        assert state == ScalerState(
            stats.scale, stats.consecutive_good_steps, stats.hysteresis_tracker, stats.steps, stats.skipped_steps,
            stats.growths, stats.backoffs, stats.remote_skipped_steps,
        )  # fmt: skip
        # update() began the next step in its own launch: a new epoch, flags that say "finite".
        assert (overflow, local, next_epoch, bad_votes, poisoned) == (False, False, epoch + 1, 0, False)
    assert scaler.stats().skipped_steps > 0 and scaler.stats().growths > 0
