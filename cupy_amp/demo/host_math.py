"""The CPU demo's arithmetic, with the same bits on every x86-64 CPU, BLAS kernel, thread count and NumPy.

A run of the demo is chaotic: one different rounding anywhere changes when its
scale overflows. On the CPU it therefore computes with nothing whose rounding
depends on the machine. NumPy's basic operations (+ - * /, sqrt, comparisons,
conversions) round correctly everywhere and its summation order is fixed,
but three things are not fixed:

- **BLAS products**: OpenBLAS picks its kernel, and so the order of the partial
  sums, per CPU model and thread count. :func:`exact_matmul` makes every BLAS
  call exact, so no order can show.
- **NumPy's float32 exp and log** are vectorized per instruction set (AVX512,
  AVX2, or the C library's): they differ in the last bit. :func:`exp` and
  :func:`log` use basic operations only.
- **sin and cos** (the spirals' data) likewise: :func:`sin_cos`.

The product. Each matrix is divided by the power of two P above its largest
magnitude and cut in two slices: a high one, a multiple of 2**-20, and a low
one, a multiple of 2**-41 at most 2**-21 in magnitude. The float64 product of
two slices (high x high, high x low, low x high or low x low) sums terms on the
grid 2**-(40 + 21 d), d the number of low slices in it, each at most 2**-21d in
magnitude: at most 2**13 of them fit float64's 53 bits, so every partial sum is
exact, in any order. The four exact products are added, the smallest first,
multiplied back by the two powers and rounded once to the inputs' dtype.
Longer products are cut into pieces of 2**13 terms, added in order. Every
float16 value is kept whole (float16 spans 40 binades, subnormals included,
and P <= 2**16 leaves 41 bits for them); a float32 value loses its low bits
where it is 2**17 times smaller than the largest of its matrix. The result is
the exact sum of the (so kept) products rounded once, but for float64's
rounding as the four exact partial sums are added: an error below 2**-50 of the
sum of the terms' magnitudes (a float32 BLAS's is below K * 2**-24 of it).

The functions compute in float64 to about 1e-16, so their float32 results are
the correctly rounded ones but for rare double roundings: the same on every
machine either way.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["Split", "exact_matmul", "exp", "log", "sin_cos"]

_HIGH_MAGIC = np.float64(1.5 * 2.0**32)  # x + m - m rounds |x| < 1 to a multiple of 2**-20 (half to even)
_LOW_MAGIC = np.float64(1.5 * 2.0**11)  # ... and |x| <= 2**-21 to a multiple of 2**-41
_MOST_TERMS = 2**13  # the longest product whose partial products stay exact (module docstring)
_BLOCK_ELEMENTS = 16384  # rows at a time, so float64 temporaries stay at 128 KiB (many large ones are slow to allocate)


class Split:
    """A float16 or float32 matrix cut into its two exact slices, reusable as its own transpose (``.T``).

    Attributes:
        dtype: The matrix's dtype, which a product of two splits is rounded to.
        power: The power of two the matrix was divided by (the one above its largest finite magnitude).
        high: The high slice, float64, multiples of 2**-20.
        low: The low slice, float64, multiples of 2**-41.
        nonfinite: The positions of inf and NaN (taken as 0 in the slices), or None when all are finite.
        original: The matrix.
    """

    def __init__(self, matrix: np.ndarray) -> None:
        if matrix.dtype not in (np.float16, np.float32) or matrix.ndim != 2:
            raise TypeError(f"Split takes a float16 or float32 matrix, got a {matrix.ndim}-d {matrix.dtype} array")
        rest = matrix.astype(np.float64)
        finite = np.isfinite(rest)
        self.nonfinite = None if finite.all() else ~finite
        if self.nonfinite is not None:
            rest[self.nonfinite] = 0.0
        largest = np.abs(rest).max(initial=0.0)
        self.power = np.float64(np.ldexp(1.0, np.frexp(largest)[1]))  # dividing by it is exact and leaves |x| < 1
        rest /= self.power
        self.high = rest + _HIGH_MAGIC
        self.high -= _HIGH_MAGIC
        rest -= self.high  # exact, at most 2**-21
        rest += _LOW_MAGIC  # float16's low slice is already on the grid; float32's is rounded to it
        rest -= _LOW_MAGIC
        self.low = rest
        self.dtype, self.original = matrix.dtype, matrix

    @property
    def T(self) -> Split:
        """The transpose, slices and all (views: nothing is recomputed)."""
        transposed = object.__new__(Split)
        transposed.dtype, transposed.power = self.dtype, self.power
        transposed.high, transposed.low, transposed.original = self.high.T, self.low.T, self.original.T
        transposed.nonfinite = None if self.nonfinite is None else self.nonfinite.T
        return transposed


def exact_matmul(a: np.ndarray | Split, b: np.ndarray | Split) -> np.ndarray:
    """Return ``a @ b`` for float16 or float32 matrices (or their splits), with no order-dependent rounding.

    The result has the inputs' dtype. A product that meets inf or NaN is that
    of a plain float64 product (no order dependence there either: finite
    float32 products cannot overflow float64), every NaN the one canonical NaN.

    Raises:
        TypeError: The inputs are not two matrices of one dtype, float16 or float32.
    """
    left = a if isinstance(a, Split) else Split(a)
    right = b if isinstance(b, Split) else Split(b)
    if left.dtype != right.dtype:
        raise TypeError(f"exact_matmul takes two matrices of one dtype, got {left.dtype} and {right.dtype}")
    rows, terms, columns = left.high.shape[0], left.high.shape[1], right.high.shape[1]
    result = np.empty((rows, columns), dtype=left.dtype)
    block_rows = max(1, _BLOCK_ELEMENTS // max(terms, columns, 1))
    for top in range(0, rows, block_rows):
        block = slice(top, top + block_rows)
        total = np.zeros((min(rows, top + block_rows) - top, columns), dtype=np.float64)
        for start in range(0, terms, _MOST_TERMS):  # pieces added in one fixed order
            piece = slice(start, start + _MOST_TERMS)
            a_high, a_low = left.high[block, piece], left.low[block, piece]
            b_high, b_low = right.high[piece], right.low[piece]
            total += a_low @ b_low  # each product exact (module docstring); the smallest first
            total += a_low @ b_high
            total += a_high @ b_low
            total += a_high @ b_high
        total *= left.power * right.power  # exact: powers of two, far from float64's limits
        with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN are results here, as IEEE's
            if left.nonfinite is not None or right.nonfinite is not None:
                plain = left.original[block].astype(np.float64) @ right.original.astype(np.float64)
                total = np.where(np.isfinite(plain), total, np.where(np.isnan(plain), np.nan, plain))
            result[block] = total
    return result


_ROUND = np.float64(1.5 * 2.0**52)  # x + _ROUND - _ROUND is x rounded to an integer (|x| < 2**51)
_LN2_HIGH = np.float64(6.93147180369123816490e-01)  # ln 2 in two parts: n * _LN2_HIGH is exact for |n| < 2**20
_LN2_LOW = np.float64(1.90821492927058770002e-10)
_INV_LN2 = np.float64(1.44269504088896338700e00)
_SQRT_HALF = np.float64(0.70710678118654752440)
_PIO2 = (  # pi / 2 in three parts, the first two exact times any k below 2**20
    np.float64(1.57079632673412561417e00),
    np.float64(6.07710050630396597660e-11),
    np.float64(2.02226624871116645580e-21),
)
_TWO_OVER_PI = np.float64(6.36619772367581382433e-01)


def _horner(x: np.ndarray, coefficients: list[float]) -> np.ndarray:
    """Return sum(c_k * x**k) by Horner's rule, ``coefficients`` from the highest power down."""
    result = np.full_like(x, coefficients[0])
    for coefficient in coefficients[1:]:
        result *= x
        result += coefficient
    return result


_EXP_TAYLOR = [1.0 / math.factorial(k) for k in range(14, -1, -1)]  # |r| <= ln(2)/2: error below 1e-18
_LOG_SERIES = [1.0 / (2 * k + 1) for k in range(12, -1, -1)]  # atanh series, |s| <= 0.1716: below 1e-19
_SIN_TAYLOR = [(-1.0) ** k / math.factorial(2 * k + 1) for k in range(11, -1, -1)]  # |r| <= pi/4
_COS_TAYLOR = [(-1.0) ** k / math.factorial(2 * k) for k in range(11, -1, -1)]


def exp(x: np.ndarray) -> np.ndarray:
    """Return e**x for a float32 array, from basic float64 operations (inf, -inf and NaN as IEEE's exp)."""
    wide = np.clip(x.astype(np.float64), -200.0, 100.0)  # e**-200 rounds to 0 in float32, e**100 to inf
    nan = np.isnan(wide)
    wide[nan] = 0.0
    n = (wide * _INV_LN2 + _ROUND) - _ROUND
    r = (wide - n * _LN2_HIGH) - n * _LN2_LOW  # |r| <= ln(2)/2, to about 1e-19
    result: np.ndarray = _horner(r, _EXP_TAYLOR) * _power_of_two(n)
    result[nan] = np.nan
    with np.errstate(over="ignore"):
        return result.astype(np.float32)


def log(x: np.ndarray) -> np.ndarray:
    """Return ln x for a float32 array, from basic float64 operations (0, negatives, inf, NaN as IEEE's log)."""
    wide = x.astype(np.float64)
    special = ~(np.isfinite(wide) & (wide > 0))
    mantissa, exponent = np.frexp(np.where(special, 1.0, wide))  # exact; mantissa in [0.5, 1)
    low = mantissa < _SQRT_HALF  # centre the mantissa on 1: [sqrt(1/2), sqrt(2))
    mantissa[low] *= 2.0
    exponent[low] -= 1
    s = (mantissa - 1.0) / (mantissa + 1.0)  # ln m = 2 atanh(s), |s| <= 0.1716
    n = exponent.astype(np.float64)
    result: np.ndarray = n * _LN2_HIGH + (n * _LN2_LOW + 2.0 * s * _horner(s * s, _LOG_SERIES))
    with np.errstate(invalid="ignore", divide="ignore"):
        result[special] = np.log(wide[special])  # 0, negatives, inf, NaN: exact by definition
    return result.astype(np.float32)


def sin_cos(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return (sin x, cos x) for finite float64 values below 2**20 in magnitude, to about 1e-16."""
    k = (x * _TWO_OVER_PI + _ROUND) - _ROUND
    r = ((x - k * _PIO2[0]) - k * _PIO2[1]) - k * _PIO2[2]  # |r| <= pi/4
    squared = r * r
    sine, cosine = r * _horner(squared, _SIN_TAYLOR), _horner(squared, _COS_TAYLOR)
    quadrant = k.astype(np.int64) % 4  # x = r + quadrant * pi/2, modulo 2 pi
    sin_x = np.choose(quadrant, [sine, cosine, -sine, -cosine])
    cos_x = np.choose(quadrant, [cosine, -sine, -cosine, sine])
    return sin_x, cos_x


def _power_of_two(n: np.ndarray) -> np.ndarray:
    """Return 2.0**n for integral float64 values in float64's normal range, written into the bits."""
    return ((n.astype(np.int64) + 1023) << 52).view(np.float64)
