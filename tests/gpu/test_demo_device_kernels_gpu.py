"""The demo device step's own kernels: cuBLAS products (eager and replayed), one-launch casts, the softmax and means."""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cupy_amp.demo.device_kernels import ROW_THREADS, Launch, cast_all  # noqa: E402
from cupy_amp.demo.model import BatchOrder  # noqa: E402
from cupy_amp.demo.products import Products  # noqa: E402


def fp16(rng: np.random.Generator, *shape: int) -> cupy.ndarray:
    return cupy.asarray(rng.standard_normal(shape).astype(np.float16))


def assert_is_the_product(
    got: np.ndarray, a: cupy.ndarray, b: cupy.ndarray, transpose_a: bool, transpose_b: bool
) -> None:
    """``got`` is within reach of op(a) @ op(b) summed in fp32 and rounded once to fp16.

    In float64 from the fp16 operands the product is exact; an fp32 sum of
    ``inner`` terms is off by at most ``inner`` fp32 rounding steps of the
    terms' magnitudes, and the fp16 rounding adds half an fp16 step.
    """
    left, right = cupy.asnumpy(a).astype(np.float64), cupy.asnumpy(b).astype(np.float64)
    left, right = (left.T if transpose_a else left), (right.T if transpose_b else right)
    exact, magnitudes = left @ right, np.abs(left) @ np.abs(right)
    fp32_error = left.shape[1] * 2.0**-23 * magnitudes  # 2**-23: room for accumulators that truncate
    bound = 0.5 * np.spacing(np.abs(exact) + fp32_error, dtype=np.float16).astype(np.float64) + fp32_error
    assert np.isfinite(got).all()
    assert (np.abs(got.astype(np.float64) - exact) <= bound).all()


@pytest.mark.parametrize(("transpose_a", "transpose_b"), [(False, False), (True, False), (False, True)])
# The demo's shapes, and a long inner dimension over a small output, where cuBLAS splits the sum (split-K).
@pytest.mark.parametrize(
    ("rows", "inner", "cols"), [(512, 2, 64), (64, 512, 64), (512, 64, 5), (1, 512, 64), (2, 8192, 64)]
)
def test_a_product_is_the_fp16_rounding_of_an_fp32_sum(
    rows: int, inner: int, cols: int, transpose_a: bool, transpose_b: bool
) -> None:
    rng = np.random.default_rng(rows * inner + cols)
    stream = cupy.cuda.Stream(non_blocking=True)
    products = Products(stream)
    with stream:
        a = fp16(rng, *((inner, rows) if transpose_a else (rows, inner)))
        b = fp16(rng, *((cols, inner) if transpose_b else (inner, cols)))
        out = cupy.full((rows, cols), np.nan, cupy.float16)
        products.bind(a, b, out, transpose_a=transpose_a, transpose_b=transpose_b)()
        got = cupy.asnumpy(out, stream=stream)
    assert_is_the_product(got, a, b, transpose_a, transpose_b)


def test_a_captured_product_reads_its_operands_at_each_replay() -> None:
    rng = np.random.default_rng(7)
    stream = cupy.cuda.Stream(non_blocking=True)
    products = Products(stream)
    with stream:
        a, b, out = fp16(rng, 512, 64), fp16(rng, 64, 64), cupy.zeros((512, 64), cupy.float16)
        product = products.bind(a, b, out)
        product()  # eager, once
        eager = cupy.asnumpy(out, stream=stream)
        out.fill(0)
        stream.begin_capture()
        try:
            product()
        finally:
            graph = stream.end_capture()
        assert not out.any()  # capturing ran nothing
        graph.launch(stream)
        assert cupy.asnumpy(out, stream=stream).tobytes() == eager.tobytes()  # same bits, replayed
        a[...] = fp16(rng, 512, 64)  # new data at the same address
        graph.launch(stream)
        replayed = cupy.asnumpy(out, stream=stream)
    assert replayed.tobytes() != eager.tobytes()
    assert_is_the_product(replayed, a, b, False, False)


def test_a_cublas_that_fails_to_open_is_a_demo_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from cupy_amp.demo import products
    from cupy_amp.demo.settings import DemoError

    products._library()  # loads CuPy's cuBLAS first: only the demo's own open fails below

    def refuse(name: str, *args: object, **kwargs: object) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(products.ctypes, "CDLL", refuse)
    with pytest.raises(DemoError, match=r"does not load: libcublas\.so\.\d+: cannot open shared object file"):
        products._library()


def test_products_refuse_what_they_cannot_multiply() -> None:
    stream = cupy.cuda.Stream(non_blocking=True)
    products = Products(stream)
    a, b = cupy.zeros((4, 8), cupy.float16), cupy.zeros((8, 3), cupy.float16)
    with pytest.raises(ValueError, match=r"'a': expected a 2-D C-contiguous float16 array, got float32"):
        products.bind(a.astype(cupy.float32), b, cupy.zeros((4, 3), cupy.float16))
    with pytest.raises(ValueError, match=r"'b': expected a 2-D C-contiguous"):
        products.bind(a, cupy.zeros((3, 8), cupy.float16).T, cupy.zeros((4, 3), cupy.float16))
    with pytest.raises(ValueError, match=r"cannot multiply \(4, 8\) by \(8, 3\) into \(4, 4\)"):
        products.bind(a, b, cupy.zeros((4, 4), cupy.float16))
    with pytest.raises(ValueError, match=r"transpose_a=True"):
        products.bind(a, b, cupy.zeros((4, 3), cupy.float16), transpose_a=True)


def every_kind_of_float32() -> np.ndarray:
    """Normals, fp16 subnormals and ties, overflow to inf, inf and nan, both signs."""
    values = [0.0, 1.0, 65504.0, 65520.0, 1e6, np.inf, np.nan, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-14]
    values += [1 + 2.0**-11, 1 + 3 * 2.0**-11, 6e-8, 1e-9, 0.1]
    values = np.array(values + [-v for v in values], dtype=np.float32)
    return np.concatenate([values, np.random.default_rng(3).standard_normal(5000).astype(np.float32) * 100])


def assert_same_values(got: np.ndarray, expected: np.ndarray) -> None:
    """Bit for bit, except that a NaN may carry another payload (the GPU writes its canonical NaN)."""
    nan = np.isnan(expected)
    assert (np.isnan(got) == nan).all()
    assert got[~nan].tobytes() == expected[~nan].tobytes()


def test_one_launch_casts_every_array_as_numpy_does() -> None:
    base = every_kind_of_float32()
    sources = [cupy.asarray(base), cupy.asarray(base[:7].reshape(1, 7)), cupy.asarray(base[::-1].copy())]
    narrow_out = [cupy.full(s.shape, 7, cupy.float16) for s in sources]
    cast_all(sources, narrow_out)()
    with np.errstate(over="ignore"):
        for source, out in zip(sources, narrow_out):
            assert_same_values(cupy.asnumpy(out), cupy.asnumpy(source).astype(np.float16))
    widened = [cupy.full(s.shape, 7, cupy.float32) for s in narrow_out]
    cast_all(narrow_out, widened)()
    for half, out in zip(narrow_out, widened):  # subnormal halves survive: the cast does not flush to zero
        assert_same_values(cupy.asnumpy(out), cupy.asnumpy(half).astype(np.float32))
    assert (cupy.asnumpy(widened[0])[np.abs(base) == 2.0**-24] != 0).all()
    with pytest.raises(ValueError, match=r"cannot cast \(3,\) into \(4,\)"):
        cast_all([cupy.zeros(3, cupy.float32)], [cupy.zeros(4, cupy.float16)])
    with pytest.raises(ValueError, match=r"cannot cast float32 into float32"):
        cast_all([cupy.zeros(3, cupy.float32)], [cupy.zeros(3, cupy.float32)])


@pytest.mark.parametrize("rows", [512, 700, 3])
def test_the_softmax_kernel_gives_numpys_probabilities_loss_and_accuracy(rows: int) -> None:
    rng = np.random.default_rng(rows)
    classes = 5
    logits = (rng.standard_normal((rows, classes)) * 4).astype(np.float16)
    labels = rng.integers(0, classes, rows)
    overflowed = rows == 3  # an fp16 forward pass that overflowed: the loss is NaN, as on the host
    if overflowed:
        logits[1, 2] = np.inf
    probs, loss, accuracy, seed = (cupy.full(shape, np.nan, cupy.float32) for shape in ((rows, classes), (), (), ()))
    arguments = (cupy.asarray(logits), cupy.asarray(labels), np.int64(rows), np.int64(classes), probs, loss, accuracy)
    Launch("softmax_xent", *arguments, seed, grid=1, block=ROW_THREADS)()
    z = logits.astype(np.float64)
    with np.errstate(invalid="ignore"):
        expected = np.exp(z - z.max(axis=1, keepdims=True))
        expected /= expected.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(cupy.asnumpy(probs), expected, rtol=1e-5, atol=1e-7)
    expected_loss = -np.log(np.maximum(expected[np.arange(rows), labels], 1e-30)).mean()
    if overflowed:
        assert np.isnan(expected_loss) and np.isnan(float(loss))
    else:
        assert float(loss) == pytest.approx(expected_loss, rel=1e-5)
    assert float(accuracy) == pytest.approx((logits.argmax(axis=1) == labels).mean(), rel=1e-6)
    assert float(seed) == 1.0


def test_the_elementwise_kernels_compute_what_numpy_computes_in_fp16() -> None:
    rng = np.random.default_rng(11)
    rows, width, classes = 300, 64, 5
    z = (rng.standard_normal((rows, width)) * 3).astype(np.float16)
    bias = rng.standard_normal(width).astype(np.float16)
    edges = np.array([-0.0, np.nan, np.inf, -np.inf, 65504, 2.0**-24, -(2.0**-24), 0.0], dtype=np.float16)
    z[0, :8], z[1, :8], bias[:8] = edges, edges[::-1], edges  # inf - inf, nan + x, 65504 + 65504, -0 + 0...
    for relu in (0, 1):
        out = cupy.asarray(z)
        Launch("bias_relu", out, cupy.asarray(bias), np.int64(rows), np.int64(width), np.int32(relu), elements=z.size)()
        with np.errstate(invalid="ignore", over="ignore"):
            expected = (z.astype(np.float32) + bias.astype(np.float32)).astype(np.float16)
        if relu:
            expected = np.where(expected < 0, np.float16(0), expected)
        assert_same_values(cupy.asnumpy(out), expected)

    g, h = rng.standard_normal((rows, width)).astype(np.float16), np.where(z > 0, z, np.float16(0))
    g[0, :8] = edges  # a NaN or inf gradient passes where the output was positive, as it is
    h[0, :8] = [1, 1, 1, 1, 0, np.nan, -1, 1]
    out = cupy.asarray(g)
    Launch("relu_grad", out, cupy.asarray(h), np.int64(g.size), elements=g.size)()
    with np.errstate(invalid="ignore"):
        assert cupy.asnumpy(out).tobytes() == np.where(h > 0, g, np.float16(0)).tobytes()

    probs = rng.random((rows, classes)).astype(np.float32)
    labels = rng.integers(0, classes, rows)
    scale, loss_weight = np.float32(2.0**20), 2.0**-13
    out = cupy.empty((rows, classes), cupy.float16)
    arguments = (cupy.asarray(probs), cupy.asarray(labels), cupy.asarray(scale), np.int64(rows), np.int64(classes))
    Launch("logit_grad", *arguments, np.float64(loss_weight), out, elements=probs.size)()
    factor = np.float32(float(scale) * loss_weight / rows)
    expected = ((probs - np.eye(classes, dtype=np.float32)[labels]) * factor).astype(np.float16)
    assert cupy.asnumpy(out).tobytes() == expected.tobytes()


@pytest.mark.parametrize(("examples", "batch"), [(100, 8), (8192, 512), (1437, 512), (5, 5), (1, 1)])
def test_the_gather_kernel_draws_the_hosts_batch_of_the_counted_step(examples: int, batch: int) -> None:
    """The device draws exactly BatchOrder's batches: the same run on the CPU and the GPU, resumed anywhere."""
    rng = np.random.default_rng(examples)
    features = 3
    x, y = rng.standard_normal((examples, features)).astype(np.float32), rng.integers(0, 5, examples)
    order = BatchOrder(11, examples)
    x_out, y_out = cupy.empty((batch, features), cupy.float16), cupy.empty(batch, cupy.int64)
    per_epoch = examples // batch
    for step in (0, 1, per_epoch - 1, per_epoch, 7 * per_epoch + 3, 2**33 * per_epoch + 1):
        keys = (np.uint32(key) for key in order.keys)
        sizes = (np.int64(examples), np.int32(order.bits), np.int64(batch), np.int64(features))
        arguments = (cupy.asarray(x), cupy.asarray(y), cupy.asarray(np.int64(step)), *keys, *sizes)
        Launch("gather", *arguments, x_out, y_out, elements=batch)()
        picked = order.batch(step, batch)
        assert cupy.asnumpy(y_out).tolist() == y[picked].tolist(), step
        assert cupy.asnumpy(x_out).tobytes() == x[picked].astype(np.float16).tobytes()


def test_the_record_kernel_fills_the_counted_slot_and_counts_on() -> None:
    chunk = 4
    records = [cupy.zeros(chunk, dtype) for dtype in (cupy.float32,) * 3 + (cupy.bool_,)]
    counter = cupy.asarray(np.int64(7))
    values = [cupy.asarray(np.float32(v)) for v in (2.5, 0.75, 2.0**20)] + [cupy.asarray(np.bool_(True))]
    Launch("record", *values, np.int64(chunk), counter, *records, grid=1, block=1)()
    assert int(counter) == 8
    for record, value in zip(records, (2.5, 0.75, 2.0**20, True)):
        assert cupy.asnumpy(record).tolist() == [0, 0, 0, value]  # slot 7 % 4
