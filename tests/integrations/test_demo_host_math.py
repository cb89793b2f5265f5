"""The CPU demo's arithmetic gives one answer on every machine: exact products, its own exp/log/sin/cos, batches."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from cupy_amp.demo import host_math
from cupy_amp.demo.model import BatchOrder, batch_indices


def exact_sums(a: np.ndarray, b: np.ndarray) -> list[list[Fraction]]:
    return [
        [sum((Fraction(float(a[i, k])) * Fraction(float(b[k, j])) for k in range(a.shape[1])), Fraction(0))
         for j in range(b.shape[1])]
        for i in range(a.shape[0])
    ]  # fmt: skip


def correctly_rounded(value: Fraction, dtype: type) -> np.floating:
    """The float nearest ``value`` (ties to even), found among the neighbours of a near guess."""
    with np.errstate(over="ignore"):
        guess = dtype(float(value))
    if not np.isfinite(guess):
        return guess
    bits = np.uint16 if dtype is np.float16 else np.uint32
    candidates = [np.nextafter(guess, dtype(-np.inf)), guess, np.nextafter(guess, dtype(np.inf))]
    candidates = [c for c in candidates if np.isfinite(c)]
    return min(candidates, key=lambda c: (abs(Fraction(float(c)) - value), int(c.view(bits)) & 1))


def random_matrix(
    rng: np.random.Generator, shape: tuple[int, int], dtype: type, binades: int, lowest: int | None = None
) -> np.ndarray:
    """Values of both signs spread evenly over ``binades`` powers of two (from 2**lowest), a fifth of them 0."""
    lowest = -binades // 2 if lowest is None else lowest
    exponents = rng.integers(lowest, lowest + binades, size=shape)
    values = rng.choice([-1.0, 1.0], size=shape) * rng.uniform(1.0, 2.0, size=shape) * 2.0**exponents
    values[rng.random(shape) < 0.2] = 0.0
    with np.errstate(over="ignore"):  # float16's values from 65520 up round to inf
        return values.astype(dtype)


def assert_within_the_bound(a: np.ndarray, b: np.ndarray, product: np.ndarray) -> None:
    """The exact sum rounded once, but for float64's rounding of four exact partial sums: at most 2**-50 of the
    sum of the terms' magnitudes beyond half a unit in the last place."""
    magnitudes = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    for (i, j), value in np.ndenumerate(np.array(exact_sums(a, b), dtype=object)):
        got = product[i, j]
        assert np.isfinite(got) or abs(value) > float(np.finfo(product.dtype).max), (value, got)
        if np.isfinite(got):
            size = np.abs(got)
            up, down = np.nextafter(size, np.inf, dtype=got.dtype), np.nextafter(size, 0, dtype=got.dtype)
            ulp = float(max(size - down, up - size if np.isfinite(up) else 0, np.finfo(got.dtype).smallest_subnormal))
            assert abs(Fraction(float(got)) - value) <= Fraction(ulp) / 2 + Fraction(2**-50 * magnitudes[i, j])


# float16 over its whole range, subnormals included; float32 over 16 binades, where its values keep every bit
@pytest.mark.parametrize(("dtype", "binades", "lowest"), [(np.float16, 39, -24), (np.float32, 16, -8)])
def test_products_are_the_exact_sums_rounded_once_to_float64s_accuracy(dtype: type, binades: int, lowest: int) -> None:
    rng = np.random.default_rng(0)
    for _ in range(150):
        m, k, n = (int(v) for v in rng.integers(1, 9, 3))
        a, b = random_matrix(rng, (m, k), dtype, binades, lowest), random_matrix(rng, (k, n), dtype, binades, lowest)
        product = host_math.exact_matmul(a, b)
        assert product.dtype == dtype
        assert_within_the_bound(a, b, product)


def test_float16_products_are_mostly_correctly_rounded() -> None:
    """Without heavy cancellation the four partial sums add exactly enough: the exact sum, rounded once."""
    rng = np.random.default_rng(1)
    a, b = random_matrix(rng, (16, 24), np.float16, 20), random_matrix(rng, (24, 16), np.float16, 20)
    expected = [[correctly_rounded(value, np.float16) for value in row] for row in exact_sums(a, b)]
    assert host_math.exact_matmul(a, b).tolist() == np.array(expected, np.float16).tolist()


def test_long_products_are_summed_in_pieces() -> None:
    rng = np.random.default_rng(2)
    a, b = random_matrix(rng, (2, 20000), np.float16, 20), random_matrix(rng, (20000, 3), np.float16, 20)
    assert_within_the_bound(a, b, host_math.exact_matmul(a, b))


def test_a_product_meeting_inf_or_nan_is_ieees() -> None:
    a = np.array([[np.inf, 1.0], [0.0, 1.0], [1.0, 2.0], [-np.inf, 0.0]], np.float16)
    b = np.array([[0.0, 1.0, 2.0], [1.0, np.nan, 3.0]], np.float16)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = a.astype(np.float64) @ b.astype(np.float64)
        product = host_math.exact_matmul(a, b)
    np.testing.assert_array_equal(product, expected.astype(np.float16))  # NaN where NaN, inf with its sign


@pytest.mark.parametrize("threads", [1, 2])
def test_the_product_does_not_depend_on_the_blas_thread_count(threads: int) -> None:
    threadpoolctl = pytest.importorskip("threadpoolctl")
    rng = np.random.default_rng(3)
    a, b = random_matrix(rng, (512, 300), np.float16, 36), random_matrix(rng, (300, 257), np.float16, 36)
    with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
        reference = host_math.exact_matmul(a, b)
    with threadpoolctl.threadpool_limits(limits=threads, user_api="blas"):
        assert host_math.exact_matmul(a, b).view(np.uint16).tolist() == reference.view(np.uint16).tolist()


def test_a_split_serves_as_its_own_transpose() -> None:
    rng = np.random.default_rng(4)
    a, b = random_matrix(rng, (40, 30), np.float16, 30), random_matrix(rng, (40, 20), np.float16, 30)
    through_split = host_math.exact_matmul(host_math.Split(a).T, host_math.Split(b))
    np.testing.assert_array_equal(through_split, host_math.exact_matmul(np.ascontiguousarray(a.T), b))


def test_exp_and_log_are_float64s_rounded_to_float32() -> None:
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(100_000) * 30).astype(np.float32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 88.72, 88.73, -103.9, -150.0], np.float32)
    x = np.concatenate([x, specials])
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(host_math.exp(x), np.exp(x.astype(np.float64)).astype(np.float32))
    positive = np.concatenate([np.abs(x) ** 3, np.array([0.0, -1.0, np.inf, np.nan, 1e-45, 3.4e38], np.float32)])
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        expected = np.log(positive.astype(np.float64)).astype(np.float32)
        np.testing.assert_array_equal(host_math.log(positive), expected)


def test_sin_and_cos_are_within_half_an_ulp_of_float64() -> None:
    x = np.random.default_rng(6).uniform(-50, 50, 100_000)
    sine, cosine = host_math.sin_cos(x)
    assert np.max(np.abs(sine - np.sin(x))) <= np.spacing(1.0) / 2
    assert np.max(np.abs(cosine - np.cos(x))) <= np.spacing(1.0) / 2


@pytest.mark.parametrize("examples", [1, 2, 3, 5, 64, 1437, 8192, 8193])
def test_each_epoch_is_a_permutation_of_the_examples(examples: int) -> None:
    order = BatchOrder(7, examples)
    for epoch in (0, 1, 2**40 + 5):
        assert sorted(order.permute(epoch, np.arange(examples)).tolist()) == list(range(examples))


def test_an_epochs_batches_visit_distinct_examples_and_epochs_differ() -> None:
    first_epoch = np.concatenate([batch_indices(0, step, 512, 8192) for step in range(16)])
    assert len(set(first_epoch.tolist())) == 8192
    second_epoch = np.concatenate([batch_indices(0, step, 512, 8192) for step in range(16, 32)])
    assert sorted(second_epoch.tolist()) == list(range(8192))
    assert not np.array_equal(first_epoch, second_epoch)


def test_batches_are_a_function_of_seed_and_step() -> None:
    assert np.array_equal(batch_indices(3, 41, 100, 1437), batch_indices(3, 41, 100, 1437))
    assert not np.array_equal(batch_indices(3, 41, 100, 1437), batch_indices(4, 41, 100, 1437))
    assert not np.array_equal(batch_indices(3, 41, 100, 1437), batch_indices(3, 42, 100, 1437))
    # A huge seed works: the keys come from NumPy's SeedSequence
    assert len(set(batch_indices(2**100, 0, 100, 1437).tolist())) == 100
