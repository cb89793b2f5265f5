"""The read-only statistics pass and the fused optimizers on a GPU, against float64 and the NumPy reference."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import assert_same_bits, capture, open_step

cupy = pytest.importorskip("cupy")

from cupy_amp import GradScaler, RanksMayDisagreeError, SyncFreeGradScaler  # noqa: E402
from cupy_amp.dtypes import bfloat16  # noqa: E402
from cupy_amp.errors import CommunicatorError  # noqa: E402
from cupy_amp.kernel_interface import STATS  # noqa: E402
from cupy_amp.optim import SGD, AdamW  # noqa: E402
from cupy_amp.record import GradientStats, StatsRecord  # noqa: E402

SCALERS = [GradScaler, SyncFreeGradScaler]
BF16 = bfloat16()
PARAM_DTYPES = ["float16", "float32"] + (["bfloat16"] if BF16 is not None else [])
OPTIMIZERS: dict[str, Any] = {
    "adamw": lambda params: AdamW(params, lr=1e-3, weight_decay=0.01),
    "adamw-no-decay": lambda params: AdamW(params, lr=3e-4, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0),
    "adamw-large-lerp-weight": lambda params: AdamW(params, lr=1e-3, betas=(0.3, 0.999)),  # torch's lerp from the end
    "sgd": lambda params: SGD(params, lr=1e-2),
    "sgd-momentum": lambda params: SGD(params, lr=1e-2, momentum=0.9, weight_decay=1e-4),
    "sgd-nesterov": lambda params: SGD(params, lr=1e-2, momentum=0.9, nesterov=True),
    "sgd-dampening": lambda params: SGD(params, lr=1e-2, momentum=0.5, dampening=0.1, weight_decay=0.1),
}


def np_dtype(name: str) -> Any:
    return BF16 if name == "bfloat16" else np.dtype(name)


def host_record(stats: GradientStats) -> GradientStats:
    """Copy a device record to the host, as the NumPy optimizer reads it: the same factor and skip flag."""
    memory = cupy.cuda.UnownedMemory(stats.record.source, STATS.itemsize, None)
    raw = cupy.ndarray(STATS.itemsize, cupy.uint8, cupy.cuda.MemoryPointer(memory, 0)).get()
    record = np.frombuffer(raw.tobytes(), dtype=STATS).reshape(()).copy()
    finite = np.array(not record["skip"])
    owner = StatsRecord(record, -1)
    owner.completed(stats.step)
    return GradientStats(record["norm"], record["clip_coefficient"], record["factor"], finite, owner, stats.step)


def gradients(rng: np.random.Generator, dtype: str, scale: float) -> list[np.ndarray]:
    shapes = [(1,), (7,), (4096,), (65537,), (33, 129), (300_001,)]
    return [(rng.standard_normal(shape) * scale).astype(np_dtype(dtype)) for shape in shapes]


def float64_norm(grads: list[np.ndarray], inv_scale: float) -> float:
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(g, dtype=np.float64))) for g in grads)) * inv_scale)


@pytest.mark.parametrize("scaler_class", SCALERS)
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "mixed", "strided"])
def test_the_norm_is_within_one_ulp_of_float64_and_the_same_bits_every_run(scaler_class: type, dtype: str) -> None:
    rng = np.random.default_rng(3)
    if dtype == "mixed":
        host = gradients(rng, "float16", 300.0) + gradients(rng, "float32", 3.0)
        grads = [cupy.asarray(g) for g in host]
    elif dtype == "strided":  # every third element, and a transposed matrix: the same views on both sides
        bases = gradients(rng, "float32", 30.0)
        matrix = rng.standard_normal((40, 50)).astype(np.float32)
        host = [b[::3] for b in bases] + [matrix.T]
        grads = [cupy.asarray(b)[::3] for b in bases] + [cupy.asarray(matrix).T]
    else:
        host = gradients(rng, dtype, 300.0)
        grads = [cupy.asarray(g) for g in host]
    before = [cupy.asnumpy(g).tobytes() for g in grads]
    norms = set()
    for _ in range(10):
        scaler = scaler_class(init_scale=1024.0)
        stats = open_step(scaler, cupy).check(grads, max_norm=1.0)
        norms.add(cupy.asnumpy(stats.norm).tobytes())
        scaler.update()
    assert len(norms) == 1
    norm = np.frombuffer(norms.pop(), dtype=np.float32)[0]
    expected = float64_norm(host, 1.0 / 1024.0)
    assert abs(float(norm) - expected) <= float(np.spacing(np.float32(expected)))
    clip = np.float32(min(1.0, 1.0 / (float(norm) + 1e-6)))
    assert_same_bits(cupy.asnumpy(stats.clip_coefficient), np.asarray(clip))
    assert [cupy.asnumpy(g).tobytes() for g in grads] == before  # only read


@pytest.mark.parametrize("scaler_class", SCALERS)
def test_check_finds_every_nonfinite_gradient_and_reports_the_step_skipped(scaler_class: type) -> None:
    rng = np.random.default_rng(4)
    grads = [cupy.asarray(g) for g in gradients(rng, "float16", 1.0) + gradients(rng, "float32", 1.0)]
    grads[3][100] = cupy.inf
    grads[10][5, 6] = cupy.nan
    grads[8].reshape(-1)[-1] = -cupy.inf
    scaler = scaler_class()
    stats = open_step(scaler, cupy).check(grads, max_norm=1.0)
    assert not bool(stats.finite)
    assert scaler.had_overflow()
    assert sorted(scaler.nonfinite_gradients()) == [3, 8, 10]
    assert host_record(stats).record.source["skip"] == 1
    scaler.update()
    assert scaler.stats().skipped_steps == 1


def make_params(rng: np.random.Generator, dtype: str, misaligned: bool) -> list[np.ndarray]:
    shapes = [(3,), (16,), (1000,), (16385,), (17, 33)]
    params = [rng.standard_normal(shape).astype(np_dtype(dtype)) for shape in shapes]
    if misaligned:  # views one element in: the kernels' scalar path
        params = [np.concatenate([np.zeros(1, p.dtype), p.reshape(-1)])[1:].reshape(p.shape) for p in params]
    return params


def as_device(arrays: list[np.ndarray], misaligned: bool) -> list[Any]:
    if not misaligned:
        return [cupy.asarray(a) for a in arrays]
    out = []
    for a in arrays:
        padded = cupy.empty(a.size + 1, dtype=a.dtype)
        padded[1:] = cupy.asarray(a.reshape(-1))
        out.append(padded[1:].reshape(a.shape))
    return out


@pytest.mark.parametrize("misaligned", [False, True])
@pytest.mark.parametrize("dtype", PARAM_DTYPES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_optimizers_match_the_numpy_reference_bit_for_bit(name: str, dtype: str, misaligned: bool) -> None:
    rng = np.random.default_rng(5)
    host_params = make_params(rng, dtype, misaligned)
    device_params = as_device(host_params, misaligned)
    host_opt, device_opt = OPTIMIZERS[name](host_params), OPTIMIZERS[name](device_params)
    scaler = GradScaler(init_scale=2.0**12, growth_interval=3)
    for step in range(30):
        magnitude = 10.0 ** rng.uniform(-3, 1)
        host_grads = [(rng.standard_normal(p.shape) * magnitude).astype(p.dtype) for p in host_params]
        if step in (4, 11):
            host_grads[2][7] = np.inf
        device_grads = as_device(host_grads, misaligned)
        stats = open_step(scaler, cupy).check(device_grads, max_norm=None if step % 2 else 5.0)
        device_opt.step(device_grads, stats)
        host_opt.step(host_grads, host_record(stats))
        scaler.update()
        for g, h in zip(device_grads, host_grads):
            assert_same_bits(cupy.asnumpy(g), h)  # never written
    assert device_opt.step_count == host_opt.step_count == 28
    for d, h in zip(device_params, host_params):
        assert_same_bits(cupy.asnumpy(d), h)
    # The float32 masters and every moment buffer (the optimizer's layout names them), bit for bit.
    assert device_opt.state_dict()["buffers"] == host_opt.state_dict()["buffers"]


@pytest.mark.parametrize("name", ["adamw", "sgd-momentum"])
def test_a_skipped_step_changes_nothing_at_all(name: str) -> None:
    rng = np.random.default_rng(6)
    params = as_device(make_params(rng, "float16", False), False)
    opt = OPTIMIZERS[name](params)
    scaler = SyncFreeGradScaler(init_scale=256.0)
    grads = [cupy.asarray(rng.standard_normal(p.shape).astype(np.float16)) for p in params]
    opt.step(grads, open_step(scaler, cupy).check(grads))
    scaler.update()
    before = opt.state_dict()
    saved = [cupy.asnumpy(p) for p in params]
    grads[0][1] = cupy.nan
    opt.step(grads, open_step(scaler, cupy).check(grads))
    scaler.update()
    assert opt.state_dict() == before
    for p, s in zip(params, saved):
        assert_same_bits(cupy.asnumpy(p), s)


def test_a_captured_step_with_clipping_and_adamw_replays_bit_identically_to_eager_steps() -> None:
    rng = np.random.default_rng(7)
    batches = [rng.standard_normal((64, 32)).astype(np.float16) for _ in range(30)]
    for poisoned in (4, 5, 19):
        batches[poisoned][3, 4] = np.inf

    def run(captured: bool) -> tuple[np.ndarray, list[dict[str, Any]], list[float]]:
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            weights = cupy.asarray(np.random.default_rng(0).standard_normal(32).astype(np.float16))
            batch = cupy.empty((64, 32), cupy.float16)
            seed = cupy.empty((), cupy.float32)
            grad = cupy.empty(32, cupy.float16)
            scaler = SyncFreeGradScaler(init_scale=2.0**8, growth_interval=5)
            opt = AdamW([weights], lr=1e-2)
            prepared = scaler.prepare([grad])
            checked: list[GradientStats] = []  # the latest check()'s statistics (a replay reuses the captured ones)

            def step() -> None:
                seed.fill(1.0)
                scaler.scale_loss(seed)
                cupy.sum(batch, axis=0, out=grad)
                cupy.multiply(grad, weights, out=grad)
                cupy.multiply(grad, seed, out=grad)
                checked[:] = [scaler.check(prepared, max_norm=0.5)]
                opt.step([grad], checked[0])
                scaler.update()

            batch.set(batches[0])
            step()
            graph = capture(stream, step) if captured else None
            stats, norms = [], []
            for data in batches[1:]:
                batch.set(data, stream=stream)
                if graph is not None:
                    graph.launch(stream)
                else:
                    step()
                stats.append(scaler.stats().to_dict())
                norms.append(float(checked[0].norm))  # a view of the scaler's record: this step's norm
            stats.append({"optimizer_steps": opt.step_count})
            return cupy.asnumpy(weights), stats, norms

    eager = run(captured=False)
    graph = run(captured=True)
    assert graph[1] == eager[1]
    assert np.array(graph[2], np.float32).tobytes() == np.array(eager[2], np.float32).tobytes()  # NaN after inf
    assert eager[1][-2]["skipped_steps"] >= 3 and eager[1][-1]["optimizer_steps"] == 30 - eager[1][-2]["skipped_steps"]
    assert_same_bits(graph[0], eager[0])


def test_a_learning_rate_set_after_capture_reaches_the_replays() -> None:
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        weights = cupy.zeros(8, cupy.float32)
        grad = cupy.ones(8, cupy.float32)
        opt = SGD([weights], lr=1.0)
        opt.step([grad], None)
        graph = capture(stream, lambda: opt.step([grad], None))
        opt.lr = 0.25
        graph.launch(stream)
        stream.synchronize()
    assert cupy.asnumpy(weights).tolist() == [-1.25] * 8


def test_a_saved_state_resumes_bit_for_bit(tmp_path: Any) -> None:
    rng = np.random.default_rng(8)
    host = make_params(rng, "float16", False)
    grads = [[cupy.asarray(rng.standard_normal(p.shape).astype(np.float16)) for p in host] for _ in range(10)]
    params = as_device(host, False)
    opt = AdamW(params)
    for g in grads[:5]:
        opt.step(g, None)
    opt.save(tmp_path / "adamw.state")
    resumed_params = [p.copy() for p in params]
    resumed = AdamW(resumed_params)
    resumed.load(tmp_path / "adamw.state")
    for g in grads[5:]:
        opt.step(g, None)
        resumed.step(g, None)
    for a, b in zip(params, resumed_params):
        assert_same_bits(cupy.asnumpy(a), cupy.asnumpy(b))
    assert resumed.step_count == opt.step_count == 10


def test_check_can_be_captured_right_after_prepare() -> None:
    """prepare() loads the kernels and sizes the statistics buffer: no eager check() is needed first."""
    grads = [cupy.asarray(g) for g in gradients(np.random.default_rng(9), "float32", 1.0)]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        scaler = SyncFreeGradScaler(init_scale=4.0)
        prepared = scaler.prepare(grads)
        loss = cupy.ones((), cupy.float32)  # allocated before the capture
        stats: list[GradientStats] = []

        def step() -> None:
            scaler.scale_loss(loss)
            stats.append(scaler.check(prepared, max_norm=1.0))
            scaler.update()

        graph = capture(stream, step)
        graph.launch(stream)
        graph.launch(stream)
        stream.synchronize()
    host = [cupy.asnumpy(g) for g in grads]
    expected = float64_norm(host, 0.25)
    assert abs(float(stats[0].norm) - expected) <= float(np.spacing(np.float32(expected)))
    assert scaler.stats().steps == 2


class OtherRanks:
    """A communicator stand-in for one GPU: the all-reduce adds the other ranks' (overflowed, sum of squares)."""

    def __init__(self, overflowed: float, sum_of_squares: float) -> None:
        self.others = (overflowed, sum_of_squares)
        self.calls = 0
        self.counts: list[float] = []  # the count this rank put into each all-reduce

    def reduce_sum(self, values: Any, stream: Any) -> None:
        self.calls += 1
        if stream is None:  # a host pair (the poisoned vote, a join after a failure): summed at once
            self.counts.append(float(values[0]))
            values += np.array(self.others, dtype=np.float64)
            return
        self.counts.append(float(values[0:1].get(stream=stream)[0]))
        with stream:
            values += cupy.asarray(np.array(self.others, dtype=np.float64))


@pytest.mark.parametrize("scaler_class", SCALERS)
def test_with_a_communicator_the_norm_and_the_verdict_cover_every_rank(scaler_class: type) -> None:
    host = gradients(np.random.default_rng(10), "float32", 1.0)
    grads = [cupy.asarray(g) for g in host]
    others = OtherRanks(0.0, 12345.0)
    scaler = scaler_class(init_scale=16.0, comm=others)
    stats = open_step(scaler, cupy).check(grads, max_norm=1.0)
    local = sum(float(np.sum(np.square(g.astype(np.float64)))) for g in host)
    expected = float(np.sqrt(local + 12345.0)) / 16.0
    assert abs(float(cupy.asnumpy(stats.norm)) - expected) <= float(np.spacing(np.float32(expected)))
    assert bool(stats.finite) and others.calls == 1
    scaler.update()
    weights = [cupy.zeros_like(g) for g in grads]
    optimizer = SGD(weights, lr=1.0)
    others.others = (1.0, 0.0)  # another rank overflows: every rank skips
    stats = open_step(scaler, cupy).check(grads, max_norm=1.0)
    optimizer.step(grads, stats)
    assert not bool(stats.finite) and scaler.had_overflow() and scaler.stats().last_overflow == "remote"
    assert optimizer.step_count == 0 and all(not bool(w.any()) for w in weights)
    scaler.update()
    assert scaler.stats().remote_skipped_steps == 1


class RecordingRanks(OtherRanks):
    """OtherRanks that also keeps what this rank put into each all-reduce (read on the host: synchronizes)."""

    def __init__(self, overflowed: float, sum_of_squares: float) -> None:
        super().__init__(overflowed, sum_of_squares)
        self.sent: list[list[float]] = []

    def reduce_sum(self, values: Any, stream: Any) -> None:
        self.sent.append(values.get(stream=stream).tolist())
        super().reduce_sum(values, stream)


@pytest.mark.parametrize("scaler_class", SCALERS)
def test_a_rank_without_gradients_sends_its_own_zero_sums_every_step(scaler_class: type) -> None:
    """check([]) on a GPU state puts this step's pair (0, 0) into the all-reduce, not the last step's answer."""
    others = RecordingRanks(1.0, 64.0)  # another rank overflows in the first step
    scaler = scaler_class(init_scale=1.0, comm=others)
    seen = []
    for _ in range(3):
        stats = open_step(scaler, cupy).check([])
        seen.append((bool(stats.finite), float(cupy.asnumpy(stats.norm))))
        scaler.update()
        others.others = (0.0, 64.0)  # from now on every rank is clean
    assert others.sent == [[0.0, 0.0]] * 3
    assert seen[0][0] is False and seen[1:] == [(True, 8.0), (True, 8.0)]
    assert scaler.stats().skipped_steps == 1


@pytest.mark.parametrize("scaler_class", SCALERS)
def test_an_impossible_count_from_the_all_reduce_skips_the_step_and_is_reported(scaler_class: type) -> None:
    grads = [cupy.asarray(g) for g in gradients(np.random.default_rng(11), "float32", 1.0)]
    scaler = open_step(scaler_class(comm=OtherRanks(0.5, 0.0)), cupy)
    if scaler_class is GradScaler:
        with pytest.raises(CommunicatorError, match="impossible"):
            scaler.check(grads)
    else:
        stats = scaler.check(grads)
        assert not bool(stats.finite)
        with pytest.raises(CommunicatorError, match="impossible"):
            scaler.stats()
    assert scaler.had_overflow()


_SPIN = cupy.RawKernel(
    'extern "C" __global__ void spin(long long cycles) { long long t = clock64(); while (clock64() - t < cycles) {} }',
    "spin",
)


def test_an_optimizer_step_on_another_stream_waits_for_the_check_it_reads() -> None:
    """The record is finished late on stream A (behind a long kernel); the step on stream B must see it."""
    grads = [cupy.ones(1000, cupy.float32)]
    weights = [cupy.zeros(1000, cupy.float32)]
    optimizer = SGD(weights, lr=1.0)
    scaler = SyncFreeGradScaler(init_scale=1.0)
    first, second = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with first:
        grads[0][0] = cupy.inf
        optimizer.step(grads, open_step(scaler, cupy).check(grads))  # skipped: the record says skip
        scaler.update()
        grads[0][0] = 1.0
        _SPIN((1,), (1,), (np.int64(500_000_000),))  # about a quarter of a second
        stats = open_step(scaler, cupy).check(grads)
    with second:
        optimizer.step(grads, stats)
    cupy.cuda.Device().synchronize()
    assert optimizer.step_count == 1
    assert cupy.asnumpy(weights[0]).tolist() == [-1.0] * 1000


def test_a_finish_that_fails_after_the_all_reduce_sends_the_poison_instead_of_a_second_vote(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The all-reduce answered "all finite": the other ranks finish and apply the step. This rank's finish
    fails, so it cannot: it must neither vote again (that vote would pair with the others' next one) nor go
    on as if it had overflowed alone. It sends the poisoned vote once and refuses every later call."""
    from cupy_amp.gpu import stats as device_stats

    grads = [cupy.ones(100, cupy.float32)]
    others = OtherRanks(0.0, 0.0)
    scaler = GradScaler(comm=others)

    def broken_finish(self: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("launch failed")

    open_step(scaler, cupy)
    monkeypatch.setattr(device_stats.DeviceStatsRecord, "finish", broken_finish)
    with pytest.raises(RuntimeError, match="launch failed"):
        scaler.check(grads)
    scaler._step.poison_sender.join(10.0)  # sent from a thread of its own
    assert others.counts == [0.0, 2.0**40]  # the vote, then the poisoned vote: never a second vote
    with pytest.raises(RanksMayDisagreeError):
        scaler.had_overflow()


def test_the_clip_coefficient_has_the_same_bits_on_the_gpu_and_the_host() -> None:
    host = [np.full(10, 1.0, np.float32), np.arange(7, dtype=np.float32)]
    for max_norm in (0.1, 0.3, 7.7):
        on_gpu = open_step(GradScaler(init_scale=1.0), cupy).check([cupy.asarray(g) for g in host], max_norm=max_norm)
        on_host = open_step(GradScaler(init_scale=1.0)).check(host, max_norm=max_norm)
        assert cupy.asnumpy(on_gpu.norm).tobytes() == np.asarray(on_host.norm).tobytes()
        assert cupy.asnumpy(on_gpu.clip_coefficient).tobytes() == np.asarray(on_host.clip_coefficient).tobytes()


def test_a_learning_rate_cannot_change_inside_a_capture() -> None:
    from cupy_amp.errors import ScalerProtocolError

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        weights = cupy.zeros(8, cupy.float32)
        optimizer = SGD([weights], lr=1.0)
        stream.begin_capture()
        try:
            with pytest.raises(ScalerProtocolError, match="learning rate"):
                optimizer.lr = 0.5
        finally:
            stream.end_capture()
    assert optimizer.lr == 1.0


def test_an_empty_check_on_a_gpu_state_reports_no_culprits() -> None:
    scaler = SyncFreeGradScaler()
    scaler.prepare([cupy.ones(4, cupy.float32)])  # the state is on the GPU now
    stats = open_step(scaler, cupy).check([])
    assert bool(stats.finite) and scaler.nonfinite_gradients() == []
    scaler.update()
