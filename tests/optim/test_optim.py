"""The fused optimizers on the NumPy path: PyTorch's updates, skips, masters, validation and state files."""

from __future__ import annotations

import hashlib
import itertools
import math
import re
import threading
import zlib
from fractions import Fraction
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from helpers import assert_same_bits, open_step

from cupy_amp import GradScaler, SyncFreeGradScaler
from cupy_amp.errors import (
    ArgumentTypeError,
    CheckpointCorruptError,
    CheckpointFieldError,
    ConfigError,
    GradientTypeError,
    GradientValueError,
)
from cupy_amp.optim import SGD, AdamW
from cupy_amp.record import GradientStats, StatsRecord
from cupy_amp.twins.optimizer import fma32

SHAPES = [(37, 5), (1000,), (3, 3, 3)]


def params(seed: int, dtype: Any = np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for shape in SHAPES]


def test_fma32_rounds_once_like_a_fused_multiply_add() -> None:
    rng = np.random.default_rng(0)
    a, b, c = ((rng.standard_normal(20000) * 10.0 ** rng.integers(-15, 15, 20000)).astype(np.float32) for _ in range(3))
    # Hard cases: products that nearly cancel c, and exact float32 midpoints after the addition.
    a[:5000], b[:5000] = np.float32(1 + 2**-12), np.float32(1 - 2**-12)
    c[:5000] = -np.float32(1.0)
    c[5000:6000] = np.float32(2**-25) * np.sign(c[5000:6000])
    a[5000:6000], b[5000:6000] = np.float32(1.0), np.float32(1.0)
    got = fma32(a, b, c)
    for x, y, z, r in zip(a[:8000], b[:8000], c[:8000], got[:8000]):
        exact = Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))
        nearest = np.float32(float(exact))  # float64 is exact enough to decide, except on float32 midpoints:
        candidates = [nearest, np.nextafter(nearest, np.float32(np.inf)), np.nextafter(nearest, np.float32(-np.inf))]
        best = min(candidates, key=lambda v: (abs(Fraction(float(v)) - exact), int(v.view(np.uint32)) & 1))
        assert r.view(np.uint32) == best.view(np.uint32), (x, y, z)


def torch_run(make_ours: Any, make_theirs: Any, steps: int, resync: bool) -> tuple[list[int], list[float]]:
    """Step ours and PyTorch's on the same gradients; return per-step counts of differing parameter elements."""
    torch = pytest.importorskip("torch")
    ours_params = params(1)
    theirs = [torch.tensor(p.copy(), requires_grad=True) for p in ours_params]
    ours, reference = make_ours(ours_params), make_theirs(theirs)
    rng = np.random.default_rng(2)
    differing, sqrt_differing = [], []
    for _ in range(steps):
        grads = [(rng.standard_normal(s) * 10 ** rng.uniform(-6, 1)).astype(np.float32) for s in SHAPES]
        ours.step(grads, None)
        for t, g in zip(theirs, grads):
            t.grad = torch.tensor(g)
        reference.step()
        count = 0
        sqrt_count = 0
        for index, (p, t) in enumerate(zip(ours_params, theirs)):
            expected = t.detach().numpy()
            count += int(np.sum(p != expected))
            if resync:
                state = reference.state[t]
                if "exp_avg_sq" in state:  # elements where PyTorch's float32 sqrt is not correctly rounded
                    v = state["exp_avg_sq"].numpy()
                    wrong = torch.tensor(v).sqrt().numpy() != np.sqrt(v.astype(np.float64)).astype(np.float32)
                    sqrt_count += int(np.sum((p != expected) & ~wrong))
                    ours._buffers["exp_avg"][index][...] = state["exp_avg"].numpy()
                    ours._buffers["exp_avg_sq"][index][...] = v
                p[...] = expected
        differing.append(count)
        sqrt_differing.append(sqrt_count)
    return differing, sqrt_differing


@pytest.mark.parametrize(
    "options",
    [{}, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-4},
     {"momentum": 0.5, "dampening": 0.1, "weight_decay": 0.1}],
)  # fmt: skip
def test_sgd_equals_torch_bit_for_bit_over_1000_steps(options: dict[str, Any]) -> None:
    torch = pytest.importorskip("torch")
    differing, _ = torch_run(
        lambda p: SGD(p, lr=1e-2, **options),
        lambda t: torch.optim.SGD(t, lr=1e-2, foreach=False, **options),
        steps=1000,
        resync=False,
    )
    assert sum(differing) == 0


def test_adamw_differs_from_torch_only_where_torchs_sqrt_is_not_correctly_rounded() -> None:
    """Each step from PyTorch's state: every element equal except where its float32 sqrt is off (ours is IEEE)."""
    torch = pytest.importorskip("torch")
    differing, unexplained = torch_run(
        lambda p: AdamW(p, lr=1e-3, weight_decay=0.01),
        lambda t: torch.optim.AdamW(t, lr=1e-3, weight_decay=0.01, foreach=False),
        steps=300,
        resync=True,
    )
    assert sum(unexplained) == 0
    assert 0 < sum(differing) < 0.001 * 300 * sum(int(np.prod(s)) for s in SHAPES)


@pytest.mark.parametrize("beta1", [0.5, 0.3, 0.0])
def test_adamw_with_a_first_beta_of_at_most_a_half_follows_torchs_lerp(beta1: float) -> None:
    """torch's lerp goes from the end when its weight (1 - beta1) is at least 0.5: the same roundings here."""
    torch = pytest.importorskip("torch")
    differing, unexplained = torch_run(
        lambda p: AdamW(p, lr=1e-3, weight_decay=0.01, betas=(beta1, 0.999)),
        lambda t: torch.optim.AdamW(t, lr=1e-3, weight_decay=0.01, betas=(beta1, 0.999), foreach=False),
        steps=100,
        resync=True,
    )
    assert sum(unexplained) == 0


def test_skipped_steps_match_torch_grad_scaler_and_adamw() -> None:
    torch = pytest.importorskip("torch")
    ours_params = params(3)
    theirs = [torch.tensor(p.copy(), requires_grad=True) for p in ours_params]
    ours, reference = AdamW(ours_params), torch.optim.AdamW(theirs, foreach=False)
    our_scaler = GradScaler(init_scale=2.0**10, growth_interval=7, min_scale=None, max_scale=None)
    their_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=7)
    rng = np.random.default_rng(4)
    for step in range(200):
        grads = [(rng.standard_normal(s) * 2.0**10).astype(np.float32) for s in SHAPES]
        if step % 13 in (3, 4):
            grads[step % 3].reshape(-1)[step % 5] = np.inf if step % 2 else np.nan
        open_step(our_scaler)
        ours.step(grads, our_scaler.check(grads))
        our_scaler.update()
        their_scaler.scale(torch.ones(()))  # sets up its scale, as scaling a loss does
        for t, g in zip(theirs, grads):
            t.grad = torch.tensor(g)
        their_scaler.step(reference)
        their_scaler.update()
        assert our_scaler.scale_factor() == their_scaler.get_scale()
    assert ours.step_count == reference.state[theirs[0]]["step"].item() < 200
    for p, t in zip(ours_params, theirs):
        np.testing.assert_allclose(p, t.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scaler_class", [GradScaler, SyncFreeGradScaler])
@pytest.mark.parametrize("optimizer", [AdamW, lambda p: SGD(p, lr=0.1, momentum=0.9)])
def test_a_skipped_step_changes_nothing_and_gradients_are_never_written(scaler_class: type, optimizer: Any) -> None:
    weights = params(5, np.float16)
    opt = optimizer(weights)
    scaler = scaler_class()
    grads = params(6, np.float16)
    open_step(scaler)
    opt.step(grads, scaler.check(grads, max_norm=1.0))
    scaler.update()
    saved, state = [w.copy() for w in weights], opt.state_dict()
    grads[1][7] = np.nan
    kept = [g.copy() for g in grads]
    open_step(scaler)
    opt.step(grads, scaler.check(grads, max_norm=1.0))
    scaler.update()
    assert opt.state_dict() == state and opt.step_count == 1
    for w, s in zip(weights, saved):
        assert_same_bits(w, s)
    for g, k in zip(grads, kept):
        assert_same_bits(g, k)


def test_float16_parameters_are_their_float32_masters_rounded() -> None:
    weights = params(7, np.float16)
    opt = AdamW(weights, lr=0.01)
    for seed in range(5):
        opt.step(params(10 + seed, np.float16), None)
    masters = opt.state_dict()["buffers"]["master"]
    for w, m in zip(weights, masters):
        assert_same_bits(w, np.frombuffer(m, dtype=np.float32).reshape(w.shape).astype(np.float16))


def test_the_clip_coefficient_and_inverse_scale_multiply_the_gradient_inside_the_update() -> None:
    """Clipped and unscaled inside: the same as SGD on gradients multiplied by the factor beforehand."""
    weights, expected = params(8), params(8)
    grads = [g * np.float32(64) for g in params(9)]
    scaler = GradScaler(init_scale=64.0)
    open_step(scaler)
    stats = scaler.check(grads, max_norm=0.5)
    SGD(weights, lr=0.1).step(grads, stats)
    factor = np.float32(stats.record.source["factor"])
    SGD(expected, lr=0.1).step([g * factor for g in grads], None)
    assert float(stats.clip_coefficient) < 1
    for w, e in zip(weights, expected):
        assert_same_bits(w, e)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: AdamW(p, lr=-1), "'lr'"),
        (lambda p: AdamW(p, lr=10**400), "'lr'"),
        (lambda p: AdamW(p, betas=(1.0, 0.9)), "'betas\\[0\\]'"),
        (lambda p: AdamW(p, betas=(0.9,)), "'betas'"),
        (lambda p: AdamW(p, eps=float("nan")), "'eps'"),
        (lambda p: AdamW(p, weight_decay=-0.1), "'weight_decay'"),
        (lambda p: SGD(p, momentum=-1), "'momentum'"),
        (lambda p: SGD(p, nesterov=True), "Nesterov"),
        (lambda p: SGD(p, momentum=0.9, dampening=0.1, nesterov=True), "Nesterov"),
        (lambda p: SGD(p, nesterov=1), "'nesterov'"),
    ],
)
def test_bad_hyperparameters_are_refused_by_name(make: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make(params(0))


def test_bad_parameters_and_gradients_are_refused_before_anything_changes() -> None:
    with pytest.raises(ArgumentTypeError, match="non-empty"):
        AdamW([])
    with pytest.raises(GradientTypeError, match="dtype float64"):
        AdamW([np.zeros(3)])
    with pytest.raises(GradientValueError, match="C-contiguous"):
        AdamW([np.zeros((4, 4), np.float32).T])
    with pytest.raises(GradientValueError, match="aligned"):
        AdamW([np.frombuffer(bytearray(17), dtype=np.uint8)[1:].view(np.float32)])
    shared = np.zeros(8, np.float32)
    with pytest.raises(GradientValueError, match="share memory"):
        AdamW([shared[:5], shared[4:]])
    weights = params(1)
    opt = AdamW(weights)
    saved = [w.copy() for w in weights]
    grads = params(2)
    with pytest.raises(ArgumentTypeError, match="Expected 3 gradients"):
        opt.step(grads[:2], None)
    with pytest.raises(GradientTypeError, match="of shape"):
        opt.step([grads[0].T, *grads[1:]], None)
    with pytest.raises(GradientValueError, match="share memory"):
        opt.step([weights[0], *grads[1:]], None)  # a gradient that is its own parameter
    with pytest.raises(ArgumentTypeError, match="GradientStats"):
        opt.step(grads, stats=object())  # type: ignore[arg-type]
    device_record = StatsRecord(0x7F0000000000, 0)
    device_stats = GradientStats(np.float32(0), np.float32(1), np.float32(1), np.True_, device_record, 1)
    with pytest.raises(ArgumentTypeError, match="ran on device 0"):
        opt.step(grads, stats=device_stats)
    assert opt.step_count == 0
    for w, s in zip(weights, saved):
        assert_same_bits(w, s)


def test_the_learning_rate_can_change_between_steps() -> None:
    weights = [np.zeros(4, np.float32)]
    opt = SGD(weights, lr=1.0)
    opt.step([np.ones(4, np.float32)], None)
    opt.lr = 0.25
    opt.step([np.ones(4, np.float32)], None)
    assert weights[0].tolist() == [-1.25] * 4 and opt.lr == 0.25
    with pytest.raises(ConfigError, match="'lr'"):
        opt.lr = float("inf")


@pytest.mark.parametrize("make", [lambda p: AdamW(p, lr=0.01), lambda p: SGD(p, lr=0.1, momentum=0.9)])
def test_a_saved_state_resumes_bit_for_bit(tmp_path: Path, make: Any) -> None:
    weights = params(11, np.float16)
    opt = make(weights)
    steps = [params(20 + i, np.float16) for i in range(6)]
    for grads in steps[:3]:
        opt.step(grads, None)
    opt.save(tmp_path / "state")
    resumed_weights = [w.copy() for w in weights]
    resumed = make(resumed_weights)
    resumed.load(tmp_path / "state")
    for grads in steps[3:]:
        opt.step(grads, None)
        resumed.step(grads, None)
    assert resumed.step_count == opt.step_count == 6
    for a, b in zip(weights, resumed_weights):
        assert_same_bits(a, b)


def test_a_damaged_or_foreign_state_file_changes_nothing(tmp_path: Path) -> None:
    weights = params(12)
    opt = AdamW(weights)
    opt.step(params(13), None)
    opt.save(tmp_path / "good")
    data = (tmp_path / "good").read_bytes()
    target_weights = params(14)
    target = AdamW(target_weights)
    before = target.state_dict()
    cases: dict[str, tuple[bytes, type]] = {
        "flipped": (data[:100] + bytes([data[100] ^ 1]) + data[101:], CheckpointCorruptError),
        "truncated": (data[:-10], CheckpointCorruptError),
        "empty": (b"", CheckpointCorruptError),
    }
    for name, (content, error) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(error):
            target.load(tmp_path / name)
    with pytest.raises(CheckpointFieldError, match="'sgd'"):
        SGD(params(12), lr=0.1).load(tmp_path / "good")
    with pytest.raises(CheckpointFieldError, match="weight_decay"):
        AdamW(params(12), weight_decay=0.5).load(tmp_path / "good")
    with pytest.raises((CheckpointFieldError, CheckpointCorruptError)):
        AdamW([np.zeros(5, np.float32)]).load(tmp_path / "good")
    assert target.state_dict() == before


def test_every_field_of_the_state_round_trips() -> None:
    weights = params(15, np.float16)
    opt = AdamW(weights, lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    for seed, _ in zip(itertools.count(30), range(4)):
        opt.step(params(seed, np.float16), None)
    state = opt.state_dict()
    other = AdamW(params(16, np.float16), lr=0.5, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    other.load_state_dict(state)
    assert other.state_dict() == state and other.lr == 0.02


@pytest.mark.parametrize("lr", [-5.0, 10**400, float("nan")])
def test_a_state_with_a_bad_learning_rate_is_refused(lr: Any) -> None:
    opt = AdamW(params(17))
    state = opt.state_dict()
    state["record"]["lr"] = lr
    with pytest.raises(CheckpointFieldError, match=r"Invalid 'record\.lr': expected"):
        opt.load_state_dict(state)
    assert opt.lr == 1e-3


def ramp(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Return float32 values in [-4, 4) from integer arithmetic alone (the same on every NumPy and platform)."""
    i = np.arange(int(np.prod(shape)), dtype=np.int64)
    k = (i * 2654435761 + seed * 40503) % 65521
    return ((k.astype(np.float32) - np.float32(32760)) * np.float32(2**-13)).reshape(shape)


def state_digest(make: Any, dtype: Any) -> str:
    """Step an optimizer 40 times (two of them skipped by a scaler) and return a SHA-256 of everything it holds."""
    weights = [ramp(s, i).astype(dtype) for i, s in enumerate(SHAPES)]
    opt = make(weights)
    scaler = GradScaler(init_scale=2.0**10, growth_interval=5)
    for step in range(40):
        grads = [(ramp(s, 100 + 3 * step + i) * np.float32(2**10)).astype(dtype) for i, s in enumerate(SHAPES)]
        if step in (7, 8):
            grads[step % 3].reshape(-1)[step] = np.inf
        open_step(scaler)
        opt.step(grads, scaler.check(grads))
        scaler.update()
    assert opt.step_count == 38
    state = opt.state_dict()
    digest = hashlib.sha256(repr(sorted(state["record"].items())).encode())
    for name in sorted(state["buffers"]):
        for data in state["buffers"][name]:
            digest.update(b"-" if data is None else data)
    for w in weights:
        digest.update(w.tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize(
    ("make", "dtype", "expected"),
    [
        (
            lambda p: AdamW(p, lr=0.01, weight_decay=0.1),
            np.float32,
            "afff9047f848d6ef8ca3aaad89b0043538f18699567627b85a25a97d494dadf5",
        ),
        (
            lambda p: AdamW(p, lr=0.01, betas=(0.5, 0.75)),
            np.float16,
            "3c2274094bc82c4ad69805e188d1ebe01b3443fa5fee647ad4d9b2f7151d2397",
        ),
        (
            lambda p: SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
            np.float32,
            "84642f0ec35859f802024d99752e7cf00541eecdd8c61c5d22618fd8a5b7b383",
        ),
        (
            lambda p: SGD(p, lr=0.05, momentum=0.5, dampening=0.25),
            np.float16,
            "160b0682bcad4ed29ccc56e9f0331bfa34f3c79f065f0093135063bf805bf034",
        ),
    ],
    ids=["adamw-float32", "adamw-float16", "sgd-nesterov-float32", "sgd-dampening-float16"],
)
def test_the_updates_have_the_same_bits_on_every_supported_numpy(make: Any, dtype: Any, expected: str) -> None:
    """The digests were taken with NumPy 2; CI runs this with NumPy 1.x too (uint64 + int was float64 there)."""
    assert state_digest(make, dtype) == expected


def replayed(beta: float, steps: int) -> float:
    """1.0 multiplied by ``beta`` ``steps`` times in float64: the power a state holds after that many updates."""
    power = 1.0
    for _ in range(steps):
        power *= beta
    return power


def set_element(data: bytes, index: int, value: float) -> bytes:
    values = np.frombuffer(data, dtype=np.float32).copy()
    values[index] = value
    return values.tobytes()


def adamw_after(steps: int, beta1: float = 0.8) -> AdamW:
    opt = AdamW(params(40, np.float16), lr=0.01, betas=(beta1, 0.9))
    for seed in range(steps):
        opt.step(params(41 + seed, np.float16), None)
    return opt


def sgd_after(steps: int) -> SGD:
    opt = SGD(params(50, np.float16), lr=0.1, momentum=0.9)
    for seed in range(steps):
        opt.step(params(51 + seed, np.float16), None)
    return opt


def with_record(**fields: Any) -> Any:
    return lambda state: state["record"].update(fields)


def with_element(buffer: str, param: int, index: int, value: float) -> Any:
    def change(state: dict[str, Any]) -> None:
        state["buffers"][buffer][param] = set_element(state["buffers"][buffer][param], index, value)

    return change


@pytest.mark.parametrize(
    ("make", "change", "field"),
    [
        (lambda: adamw_after(3), with_element("exp_avg_sq", 1, 7, -1.5), "buffers.exp_avg_sq[1]"),
        (lambda: adamw_after(3), with_element("exp_avg_sq", 1, 7, -0.0), "buffers.exp_avg_sq[1]"),
        (lambda: adamw_after(3), with_element("exp_avg_sq", 2, 0, np.inf), "buffers.exp_avg_sq[2]"),
        (lambda: adamw_after(3), with_element("exp_avg", 0, 3, np.nan), "buffers.exp_avg[0]"),
        (lambda: adamw_after(3), with_element("master", 2, 26, -np.inf), "buffers.master[2]"),
        (lambda: adamw_after(0), with_element("exp_avg", 0, 0, 1e-30), "buffers.exp_avg[0]"),
        (lambda: adamw_after(3), with_record(step=2**64 - 1), "record.step"),
        (lambda: adamw_after(3), with_record(step=2**64), "record.step"),
        (lambda: adamw_after(3), with_record(step=-1), "record.step"),
        (lambda: adamw_after(3), with_record(step=4), "record.beta1_power"),
        (lambda: adamw_after(3), with_record(step=0), "record.beta1_power"),
        (lambda: adamw_after(3), with_record(beta1_power=math.nextafter(replayed(0.8, 3), 1)), "record.beta1_power"),
        (lambda: adamw_after(3), with_record(beta2_power=math.nextafter(replayed(0.9, 3), 0)), "record.beta2_power"),
        (lambda: adamw_after(0), with_record(beta2_power=0.9), "record.beta2_power"),
        (lambda: adamw_after(3, beta1=0.0), with_record(beta1_power=-0.0), "record.beta1_power"),
        (lambda: sgd_after(2), with_element("momentum_buffer", 0, 5, np.nan), "buffers.momentum_buffer[0]"),
        (lambda: sgd_after(2), with_element("master", 1, 5, np.inf), "buffers.master[1]"),
        (lambda: sgd_after(2), with_record(step=2**64 - 1), "record.step"),
        (lambda: sgd_after(0), with_element("momentum_buffer", 2, 1, 2.0), "buffers.momentum_buffer[2]"),
    ],
    ids=[
        "negative-second-moment",
        "negative-zero-second-moment",
        "infinite-second-moment",
        "nan-first-moment",
        "infinite-master",
        "a-moment-before-the-first-step",
        "step-that-would-wrap",
        "step-beyond-uint64",
        "negative-step",
        "one-step-more-than-the-powers",
        "step-0-with-powers-of-3",
        "beta1-power-one-ulp-off",
        "beta2-power-one-ulp-off",
        "powers-before-the-first-step",
        "negative-zero-power",
        "sgd-nan-momentum",
        "sgd-infinite-master",
        "sgd-step-that-would-wrap",
        "sgd-momentum-before-the-first-step",
    ],
)
def test_a_state_no_step_could_reach_is_refused_by_field_and_changes_nothing(
    make: Any, change: Any, field: str
) -> None:
    opt = make()
    state = opt.state_dict()
    weights = [p.copy() for p in opt.params]
    change(state)
    with pytest.raises(CheckpointFieldError, match=rf"^Invalid '{re.escape(field)}': expected .+, got .+\.$"):
        opt.load_state_dict(state)
    assert opt.state_dict() == make().state_dict()  # the same as an optimizer that never saw the state
    for p, w in zip(opt.params, weights):
        assert_same_bits(p, w)


def test_a_state_file_no_step_could_reach_is_refused(tmp_path: Path) -> None:
    opt = adamw_after(2)
    state = opt.state_dict()
    state["record"]["step"] = 3  # the powers are those of two steps
    body = msgpack.packb(state, use_bin_type=True, use_single_float=False)
    (tmp_path / "state").write_bytes(body + zlib.crc32(body).to_bytes(4, "big"))
    with pytest.raises(
        CheckpointFieldError, match=re.escape(f"Invalid 'record.beta1_power': expected {replayed(0.8, 3)!r} ")
    ):
        opt.load(tmp_path / "state")
    assert opt.step_count == 2


def test_states_the_steps_do_reach_load_including_powers_past_their_last_change() -> None:
    """The powers stop changing once beta**t is tiny (subnormal or 0): any later step count holds those values."""
    opt = AdamW(params(60), betas=(0.5, 0.75))
    state = opt.state_dict()
    state["record"].update(step=2**64 - 2, beta1_power=replayed(0.5, 1100), beta2_power=replayed(0.75, 2700))
    assert replayed(0.75, 2700) == replayed(0.75, 2701) > 0.0  # a subnormal that 0.75 no longer changes
    opt.load_state_dict(state)
    assert opt.step_count == 2**64 - 2
    for steps in (1, 2, 1000):
        fresh = adamw_after(0)
        state = fresh.state_dict()
        state["record"].update(step=steps, beta1_power=replayed(0.8, steps), beta2_power=replayed(0.9, steps))
        state["buffers"]["exp_avg_sq"][0] = set_element(state["buffers"]["exp_avg_sq"][0], 0, 3.0)
        fresh.load_state_dict(state)
        assert fresh.step_count == steps


def test_steps_from_several_threads_take_turns() -> None:
    """Two threads stepping one optimizer: every step applies whole, as the same steps made one after another."""
    weights, expected = params(70, np.float16), params(70, np.float16)
    grads = params(71, np.float16)
    opt, sequential = AdamW(weights, lr=0.01), AdamW(expected, lr=0.01)
    for _ in range(60):
        sequential.step(grads, None)
    threads = [threading.Thread(target=lambda: [opt.step(grads, None) for _ in range(30)]) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert opt.step_count == 60 and opt.state_dict() == sequential.state_dict()
    for w, e in zip(weights, expected):
        assert_same_bits(w, e)
