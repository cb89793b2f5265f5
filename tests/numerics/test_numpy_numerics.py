"""Bit-exact numerics of scale_loss and unscale_and_check on NumPy arrays, against the reference."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from helpers import open_step
from reference_model import f32, identical, inv_scale, is_overflowing, same_bits, scaled_loss, unscaled

from cupy_amp import GradScaler

FLOAT_DTYPES = [np.float16, np.float32, np.float64]
LOSS_DTYPES = [np.float32, np.float64]  # scale_loss refuses float16 (tests/step/test_step_opens.py)
BITS = {np.float16: np.uint16, np.float32: np.uint32, np.float64: np.uint64}
NAN_PAYLOADS = {
    np.float16: [0x7E00, 0x7C01, 0xFE00, 0xFD55, 0x7FFF],
    np.float32: [0x7FC00000, 0x7F800001, 0xFFC00000, 0xFFA00123, 0x7FFFFFFF],
    np.float64: [0x7FF8000000000000, 0x7FF0000000000001, 0xFFF8000000000ABC, 0x7FFFFFFFFFFFFFFF],
}
# Stored scales are float32 values; the reference is fed the same values.
SMALLEST_SCALE = float.fromhex("0x1.000008p-128")  # the smallest float32 whose float32 inverse is finite
SCALES = [f32(s) for s in (1.0, 2.0, 65536.0, 2.0**24, 3.0, 0.1, 7.77, 1e-3, 2.0**-20, 1e30, 1e-30, SMALLEST_SCALE)]


@pytest.fixture(autouse=True)
def no_warnings() -> Iterator[None]:
    """Fail any test in which a warning (a RuntimeWarning from NumPy, say) escapes."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def scaler_at(scale: float, **kwargs: Any) -> GradScaler:
    return GradScaler(init_scale=scale, min_scale=None, max_scale=None, **kwargs)


def open_at(scale: float) -> GradScaler:
    """Return a scaler at ``scale`` whose step is open (a loss was scaled), ready for a gradient call."""
    scaler = scaler_at(scale)
    open_step(scaler)
    return scaler


def nan_with_bits(dtype: type, bits: int) -> Any:
    return np.array([bits], dtype=BITS[dtype]).view(dtype)[0]


def special_values(dtype: type) -> np.ndarray:
    info = np.finfo(dtype)
    tiny_sub = info.smallest_subnormal
    values = [
        0.0,
        -0.0,
        1.0,
        -1.0,
        0.5,
        3.0,
        1.0 / 3.0,
        float(info.max),
        -float(info.max),
        float(info.smallest_normal),
        -float(info.smallest_normal),
        float(tiny_sub),
        -float(tiny_sub),
        float(tiny_sub) * 3,
        float(info.smallest_normal) - float(tiny_sub),  # largest subnormal
        float(info.max) / 3,
        1e-3,
        123.456,
    ]
    return np.array(values, dtype=dtype)


def check_unscale(scale: float, grads: list[Any], **kwargs: Any) -> GradScaler:
    """Unscale ``grads`` with a scaler at ``scale`` and compare every bit with the reference."""
    scaler = scaler_at(scale, **kwargs)
    expected = [None if g is None else unscaled(g, scale) for g in grads]
    overflowed = [g is not None and is_overflowing(g) for g in grads]
    open_step(scaler)
    assert scaler.unscale_and_check(grads) is (not any(overflowed))
    assert scaler.had_overflow() is any(overflowed)
    assert scaler.nonfinite_gradients() == [i for i, flag in enumerate(overflowed) if flag]
    for grad, want in zip(grads, expected, strict=True):
        if grad is not None:
            assert same_bits(grad, want), (grad, want)
    return scaler


# unscale_and_check


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("scale", SCALES)
def test_unscale_special_finite_values(dtype: type, scale: float) -> None:
    grad = special_values(dtype)
    check_unscale(scale, [grad])


@pytest.mark.parametrize("scale", [f32(s) for s in (65536.0, 3.0, 0.1, 2.0**-10, 2.0**20, 1e-30)])
def test_unscale_every_float16_value(scale: float) -> None:
    grad = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    scaler = scaler_at(scale)
    expected = unscaled(grad, scale)
    open_step(scaler)
    assert scaler.unscale_and_check([grad]) is False  # the NaN and inf patterns are in there
    assert same_bits(grad, expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("scale", [f32(s) for s in (65536.0, 3.0, 0.1, 2.0**-60, 1e30)])
def test_unscale_random_bit_patterns(dtype: type, scale: float) -> None:
    rng = np.random.default_rng(1234)
    bits = rng.integers(0, np.iinfo(BITS[dtype]).max, size=3000, dtype=BITS[dtype], endpoint=True)
    grad = bits.view(dtype)
    finite = grad[np.isfinite(grad)].copy()
    check_unscale(scale, [grad.copy(), finite])


def test_float16_is_computed_in_float32() -> None:
    # In float16, 1/3 is 0.33325 and 3 * 0.33325 rounds to 0.99976; in float32 the product rounds to 1.0.
    grad = np.array([3.0, 6.0, -9.0], np.float16)
    open_at(3.0).unscale_and_check([grad])
    assert grad.tolist() == [1.0, 2.0, -3.0]


def test_float64_uses_the_float32_inverse_scale() -> None:
    grad = np.array([3.0, 1.0], np.float64)
    open_at(3.0).unscale_and_check([grad])
    inv = float(np.float32(1.0 / 3.0))
    assert grad.tolist() == [3.0 * inv, inv]
    assert grad[0] != 1.0


def test_inverse_scale_is_float32_of_the_float64_reciprocal() -> None:
    for scale in SCALES:
        with np.errstate(over="ignore"):
            assert inv_scale(scale) == np.float32(1.0 / np.float64(scale))
        grad = np.array([1.0], np.float32)
        open_at(scale).unscale_and_check([grad])
        assert grad[0] == inv_scale(scale)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("kind", ["inf", "-inf", *[f"nan{i}" for i in range(4)]])
def test_nonfinite_element_is_an_overflow(dtype: type, where: str, kind: str) -> None:
    grad = np.linspace(-4, 4, 9).astype(dtype)
    index = {"first": 0, "middle": 4, "last": 8}[where]
    if kind == "inf":
        grad[index] = np.inf
    elif kind == "-inf":
        grad[index] = -np.inf
    else:
        grad[index] = nan_with_bits(dtype, NAN_PAYLOADS[dtype][int(kind[3:])])
    clean = np.ones(3, dtype)
    scaler = check_unscale(8.0, [clean, grad, None])
    assert scaler.nonfinite_gradients() == [1]
    assert not np.isfinite(grad[index])
    assert np.all(np.isfinite(np.delete(grad, index)))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_nonfinite_at_the_end_of_a_long_array(dtype: type) -> None:
    grad = np.ones(100_003, dtype)
    grad[-1] = np.nan
    scaler = scaler_at(2.0)
    open_step(scaler)
    assert scaler.unscale_and_check([grad]) is False
    assert np.all(grad[:-1] == 0.5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_extreme_finite_values_are_not_overflow(dtype: type) -> None:
    info = np.finfo(dtype)
    grad = np.array([info.max, -info.max, info.smallest_subnormal, -0.0, 0.0], dtype)
    check_unscale(1.0, [grad])
    assert grad.tolist() == [info.max, -info.max, info.smallest_subnormal, 0.0, 0.0]
    assert np.signbit(grad[3])
    assert not np.signbit(grad[4])


def test_float16_65504_is_finite() -> None:
    grad = np.array([65504.0, -65504.0], np.float16)
    scaler = scaler_at(65536.0)
    open_step(scaler)
    assert scaler.unscale_and_check([grad]) is True
    assert grad.tolist() == [65504.0 / 65536.0, -65504.0 / 65536.0]


@pytest.mark.parametrize(
    ("dtype", "value", "scale"),
    [(np.float16, 60000.0, 0.5), (np.float16, 40000.0, 2.0**-10), (np.float32, 3e38, 0.25), (np.float64, 1e308, 0.01)],
)
def test_element_becoming_inf_only_through_unscaling_is_not_overflow(dtype: type, value: float, scale: float) -> None:
    grad = np.array([value, -value, 1.0], dtype)
    scaler = scaler_at(f32(scale), growth_interval=1)
    expected = unscaled(grad, f32(scale))
    open_step(scaler)
    assert scaler.unscale_and_check([grad]) is True
    assert same_bits(grad, expected)
    assert grad.tolist()[:2] == [np.inf, -np.inf]
    assert scaler.had_overflow() is False
    assert scaler.nonfinite_gradients() == []
    scaler.update()
    assert scaler.stats().skipped_steps == 0
    assert scaler.stats().growths == 1


def test_float16_subnormals() -> None:
    tiny = np.finfo(np.float16).smallest_subnormal
    grad = np.array([tiny, 2 * tiny, 3 * tiny, 1023 * tiny, 1.0, 2.0**-14], np.float16)
    check_unscale(2.0**-4, [grad.copy()])  # subnormals grow
    check_unscale(2.0, [grad.copy()])  # 3 * tiny / 2 is a tie: rounds to even
    check_unscale(2.0**20, [grad.copy()])  # 1.0 becomes a subnormal
    check_unscale(2.0**25, [grad])  # 1.0 / 2**25 is half the smallest subnormal: rounds to 0
    assert grad[4] == 0.0


def test_float32_subnormals() -> None:
    tiny = float(np.finfo(np.float32).smallest_subnormal)
    grad = np.array([tiny, 3 * tiny, 1e-40, -1e-39, 1.0], np.float32)
    check_unscale(0.5, [grad.copy()])
    check_unscale(2.0, [grad.copy()])
    check_unscale(2.0**120, [grad])
    assert grad[-1] == np.float32(2.0**-120)


# memory layouts


LAYOUTS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "transposed": lambda a: a.reshape(6, 7).T,
    "fortran": lambda a: a.reshape(6, 7, order="F"),
    "step-slice": lambda a: a[1::3],
    "negative-stride": lambda a: a[::-2],
    "2d-negative": lambda a: a.reshape(6, 7)[::-1, ::2],
    "column": lambda a: a.reshape(6, 7)[:, 3],
    "0-d": lambda a: a[5, ...],
    "empty": lambda a: a[3:3],
    "empty-2d": lambda a: a.reshape(6, 7)[:, 7:],
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_non_contiguous_layouts(dtype: type, layout: str) -> None:
    make_view = LAYOUTS[layout]
    rng = np.random.default_rng(7)
    base = (rng.standard_normal(42) * 1000).astype(dtype)
    before = base.copy()
    view = make_view(base)
    assert view.size == 0 or np.shares_memory(view, base)
    covered = np.zeros(42, bool)
    make_view(covered)[...] = True  # which elements of base the view holds
    expected = unscaled(view, 3.0)
    assert open_at(3.0).unscale_and_check([view]) is True
    assert same_bits(view, expected)
    assert identical(base[~covered], before[~covered])
    assert covered.sum() == view.size
    if view.size:
        assert not identical(base[covered], before[covered])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_only_the_elements_of_a_strided_view_are_checked(dtype: type) -> None:
    base = np.ones((4, 5), dtype)
    base[2, 3] = np.nan  # in no view below
    base[1, 1] = np.inf  # only in the second view
    scaler = scaler_at(2.0)
    open_step(scaler)
    assert scaler.unscale_and_check([base[::-2, ::2].T]) is True  # rows 3, 1; columns 0, 2, 4
    scaler.update()
    open_step(scaler)
    assert scaler.unscale_and_check([base[::-2, 1::2].T]) is False  # rows 3, 1; columns 1, 3
    assert np.isnan(base[2, 3])
    assert base[0, 0] == 1.0
    assert base[3, 0] == 0.5
    assert base[3, 1] == 0.5


# scale_loss


@pytest.mark.parametrize("dtype", LOSS_DTYPES)
@pytest.mark.parametrize("scale", SCALES)
def test_scale_loss_special_values(dtype: type, scale: float) -> None:
    loss = special_values(dtype)
    expected = scaled_loss(loss, scale)
    scaler_at(scale).scale_loss(loss)
    assert same_bits(loss, expected)


@pytest.mark.parametrize("dtype", LOSS_DTYPES)
def test_scale_loss_zero_d_and_strided(dtype: type) -> None:
    scaler = scaler_at(f32(0.1) * 1024)
    factor = scaler.scale_factor()
    loss = np.array(2.5, dtype)
    expected = scaled_loss(loss, factor)
    scaler.scale_loss(loss)
    assert loss.shape == ()
    assert same_bits(loss, expected)
    base = np.arange(10, dtype=dtype)
    before = base.copy()
    view = base[::-3]
    expected = scaled_loss(view, factor)
    scaler.scale_loss(view)
    assert same_bits(view, expected)
    assert identical(np.delete(base, [9, 6, 3, 0]), np.delete(before, [9, 6, 3, 0]))


def test_scale_loss_float32_is_rounded_and_float64_is_not() -> None:
    scale = f32(0.1)
    loss32 = np.array([3.0], np.float32)
    loss64 = np.array([3.0], np.float64)
    scaler = scaler_at(scale)
    scaler.scale_loss(loss32)
    scaler.scale_loss(loss64)
    assert loss32[0] == np.float32(np.float32(3.0) * np.float32(scale))
    assert loss64[0] == 3.0 * scale
    assert float(loss32[0]) != loss64[0]


def test_scale_loss_uses_the_current_scale_after_updates() -> None:
    scaler = GradScaler(init_scale=4.0, growth_interval=1)
    open_step(scaler)
    scaler.unscale_and_check([np.ones(1, np.float32)])
    scaler.update()
    loss = np.array([1.0], np.float32)
    scaler.scale_loss(loss)
    assert loss[0] == 8.0


# The smallest scale


def test_scale_at_its_floor_unscales_finite_gradients_to_their_products() -> None:
    scaler = GradScaler(init_scale=SMALLEST_SCALE, min_scale=None, growth_interval=2)
    open_step(scaler)
    assert scaler.unscale_and_check([np.array([np.inf], np.float32)]) is False
    scaler.update()
    assert scaler.stats().scale == SMALLEST_SCALE  # no lower: the inverse of anything lower overflows float32
    assert np.isfinite(inv_scale(SMALLEST_SCALE))

    loss = np.array([3.0, -2.0, np.inf], np.float32)
    scaler.scale_loss(loss)
    assert loss.tobytes() == scaled_loss(np.array([3.0, -2.0, np.inf], np.float32), SMALLEST_SCALE).tobytes()

    for dtype in FLOAT_DTYPES:
        grad = np.array([1.0, -2.0, 0.0, -0.0, np.finfo(dtype).smallest_subnormal], dtype)
        expected = unscaled(grad, SMALLEST_SCALE)
        open_step(scaler)
        assert scaler.unscale_and_check([grad]) is True  # finite inputs: not an overflow
        assert same_bits(grad, expected)
        assert not np.isnan(grad).any()  # PyTorch at scale 0 would make 0 * inf = nan here
        scaler.update()
        open_step(scaler)
        scaler.unscale_and_check([np.array([np.nan], dtype)])
        scaler.update()
        assert scaler.stats().scale == SMALLEST_SCALE
    assert scaler.had_overflow() is True
    ckpt = scaler.checkpoint()
    resumed = GradScaler()
    resumed.load_checkpoint(ckpt)
    assert resumed.stats() == scaler.stats()
    open_step(resumed)
    assert resumed.unscale_and_check([np.ones(1, np.float32)]) is True


# PyTorch as an oracle (fp16 and fp32 gradients)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_unscale_matches_pytorch(dtype: type) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(99)
    bits = rng.integers(0, np.iinfo(BITS[dtype]).max, size=2000, dtype=BITS[dtype], endpoint=True)
    random_values = bits.view(dtype)
    finite_values = special_values(dtype)
    for scale in SCALES:
        for values in (random_values, finite_values):
            ours = values.copy()
            theirs = torch.from_numpy(values.copy())
            found_inf = torch.zeros(1)
            torch._amp_foreach_non_finite_check_and_unscale_(
                [theirs], found_inf, torch.tensor([float(inv_scale(scale))], dtype=torch.float32)
            )
            assert open_at(scale).unscale_and_check([ours]) is (found_inf.item() == 0.0)
            assert same_bits(ours, theirs.numpy())
