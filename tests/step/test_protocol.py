"""Misuse of the scaler: each rule's error class, and proof that nothing was modified.

Every rule of the step machine is checked on both faces (the ``face`` fixture);
the tests of a disabled scaler and of ``set_enabled`` are GradScaler's only.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import types
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
from helpers import GRAD_SCALER, SYNC_FREE, Face, open_step
from reference_model import identical, same_bits, unscaled

from cupy_amp import (
    ArgumentTypeError,
    CupyAmpError,
    DuplicateGradientError,
    GradientTypeError,
    GradientValueError,
    GradScaler,
    GradScalerStats,
    ScalerProtocolError,
)


def snapshot(scaler: Any) -> tuple[GradScalerStats, bool, list[Any], float]:
    """Everything observable about the scaler's state (``stats().enabled`` is GradScaler's ``is_enabled()``)."""
    return (scaler.stats(), scaler.had_overflow(), list(scaler.nonfinite_gradients()), scaler.scale_factor())


def copies(arrays: list[Any]) -> list[Any]:
    return [None if a is None else a.copy() for a in arrays]


def assert_untouched(arrays: list[Any], before: list[Any]) -> None:
    for array, saved in zip(arrays, before, strict=True):
        if array is not None:
            assert identical(array, saved)


def read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def grads_with_history(face: Face = GRAD_SCALER) -> tuple[Any, list[np.ndarray]]:
    """A scaler that has run one overflowing step, so a reset of its state would show."""
    scaler = face(init_scale=1024.0, growth_interval=3, hysteresis=2)
    open_step(scaler)
    scaler.unscale_and_check([np.ones(2, np.float32), np.array([np.inf], np.float32)])
    scaler.update()
    grads = [
        np.array([1.0, 2.0, np.inf], np.float16),
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.array([0.5, np.nan], np.float64),
    ]
    return scaler, grads


def assert_error(info: pytest.ExceptionInfo[BaseException], package: type, builtin: type) -> None:
    assert isinstance(info.value, package)
    assert isinstance(info.value, builtin)
    assert isinstance(info.value, CupyAmpError)


# scale_loss


@pytest.mark.parametrize(
    "loss",
    [2.5, 3, [1.0, 2.0], (1.0,), np.float32(2.0), np.float64(2.0), np.float16(1.0), "1.0", None],
    ids=["float", "int", "list", "tuple", "np.float32", "np.float64", "np.float16", "str", "None"],
)
def test_scale_loss_rejects_non_arrays(face: Face, loss: Any) -> None:
    scaler, _ = grads_with_history(face)
    before = snapshot(scaler)
    with pytest.raises(GradientTypeError) as info:
        scaler.scale_loss(loss)
    assert_error(info, ArgumentTypeError, TypeError)
    assert type(loss).__name__ in str(info.value)
    assert snapshot(scaler) == before


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.bool_, np.complex64, np.complex128])
def test_scale_loss_rejects_non_float_arrays(face: Face, dtype: type) -> None:
    scaler, _ = grads_with_history(face)
    loss = np.ones(3, dtype=dtype)
    saved = loss.copy()
    before = snapshot(scaler)
    with pytest.raises(GradientTypeError) as info:
        scaler.scale_loss(loss)
    assert_error(info, ArgumentTypeError, TypeError)
    assert str(np.dtype(dtype)) in str(info.value)
    assert identical(loss, saved)
    assert snapshot(scaler) == before


@pytest.mark.parametrize("dtype", [np.float32, np.float64])  # float16 losses are refused whatever their flags
def test_scale_loss_rejects_read_only_arrays(face: Face, dtype: type) -> None:
    scaler, _ = grads_with_history(face)
    loss = read_only(np.array(1.5, dtype=dtype))
    before = snapshot(scaler)
    with pytest.raises(GradientValueError) as info:
        scaler.scale_loss(loss)
    assert_error(info, GradientValueError, ValueError)
    assert "read-only" in str(info.value)
    assert loss == dtype(1.5)
    assert snapshot(scaler) == before


def test_scale_loss_works_in_place_and_returns_none(face: Face) -> None:
    scaler = face(init_scale=8.0)
    loss = np.array([1.5, -2.0], np.float32)
    address = loss.__array_interface__["data"][0]
    assert scaler.scale_loss(loss) is None
    assert loss.__array_interface__["data"][0] == address
    assert loss.dtype == np.float32
    assert loss.tolist() == [12.0, -16.0]
    view = loss[::-1]
    scaler.scale_loss(view)
    assert loss.tolist() == [96.0, -128.0]


def test_scale_loss_while_disabled_is_a_no_op() -> None:
    scaler = GradScaler(init_scale=8.0, enabled=False)
    loss = np.array([1.5, np.inf], np.float32)
    saved = loss.copy()
    before = snapshot(scaler)
    assert scaler.scale_loss(loss) is None
    assert identical(loss, saved)
    assert snapshot(scaler) == before
    assert scaler._guard.states == {} and scaler._scaling.states == {}  # no state placed for the loss


def test_scale_loss_while_disabled_still_validates() -> None:
    # Documented: the argument is validated even while disabled.
    scaler = GradScaler(enabled=False)
    with pytest.raises(GradientTypeError):
        scaler.scale_loss(1.0)
    with pytest.raises(GradientValueError):
        scaler.scale_loss(read_only(np.ones(1, np.float32)))


# unscale_and_check: argument validation


def test_int_array_at_the_end_leaves_the_float_arrays_untouched(face: Face) -> None:
    scaler, grads = grads_with_history(face)
    arg = [*grads, np.arange(3, dtype=np.int32)]
    saved = copies(arg)
    before = snapshot(scaler)
    open_step(scaler)
    with pytest.raises(GradientTypeError) as info:
        scaler.unscale_and_check(arg)
    assert_error(info, ArgumentTypeError, TypeError)
    assert "#3" in str(info.value)
    assert "int32" in str(info.value)
    assert_untouched(arg, saved)
    assert snapshot(scaler) == before
    with pytest.raises(ScalerProtocolError):
        scaler.update()  # the rejected call did not open a step


@pytest.mark.parametrize(
    "bad", [1.0, [1.0, 2.0], np.float32(1.0), "grad", object()], ids=["float", "list", "np.float32", "str", "object"]
)
def test_non_array_entry_is_refused(face: Face, bad: Any) -> None:
    scaler, grads = grads_with_history(face)
    arg = [grads[0], None, bad, grads[1]]
    saved = copies([grads[0], None, None, grads[1]])
    before = snapshot(scaler)
    open_step(scaler)
    with pytest.raises(GradientTypeError) as info:
        scaler.unscale_and_check(arg)
    assert_error(info, ArgumentTypeError, TypeError)
    assert "#2" in str(info.value)
    assert_untouched([grads[0], None, None, grads[1]], saved)
    assert snapshot(scaler) == before


def test_non_float_entry_of_a_mapping_is_named(face: Face) -> None:
    scaler, grads = grads_with_history(face)
    arg = {"fc1.W": grads[1], "fc1.b": np.ones(3, np.int64)}
    saved = copies(list(arg.values()))
    open_step(scaler)
    with pytest.raises(GradientTypeError, match=r"'fc1\.b'"):
        scaler.unscale_and_check(arg)
    assert_untouched(list(arg.values()), saved)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_single_array_instead_of_a_list_is_refused(face: Face, dtype: type) -> None:
    scaler, _ = grads_with_history(face)
    grad = np.array([[1.0, 2.0], [np.inf, 4.0]], dtype=dtype)
    saved = grad.copy()
    before = snapshot(scaler)
    open_step(scaler)
    with pytest.raises(GradientTypeError) as info:
        scaler.unscale_and_check(grad)
    assert_error(info, ArgumentTypeError, TypeError)
    assert "[grad]" in str(info.value) or "list" in str(info.value)
    assert identical(grad, saved)
    assert snapshot(scaler) == before


@pytest.mark.parametrize("arg", [None, 3, 2.5, "abc", b"abc", np.float32(1.0)])
def test_non_iterable_argument_is_refused(face: Face, arg: Any) -> None:
    scaler, _ = grads_with_history(face)
    before = snapshot(scaler)
    open_step(scaler)
    with pytest.raises(GradientTypeError) as info:
        scaler.unscale_and_check(arg)
    assert_error(info, ArgumentTypeError, TypeError)
    assert snapshot(scaler) == before


def test_read_only_gradient_is_refused(face: Face) -> None:
    scaler, grads = grads_with_history(face)
    arg = [grads[0], grads[1], read_only(np.array([1.0, 2.0], np.float32))]
    saved = copies(arg)
    before = snapshot(scaler)
    open_step(scaler)
    with pytest.raises(GradientValueError) as info:
        scaler.unscale_and_check(arg)
    assert_error(info, GradientValueError, ValueError)
    assert "#2" in str(info.value)
    assert "read-only" in str(info.value)
    assert_untouched(arg, saved)
    assert snapshot(scaler) == before


def test_broadcast_view_is_refused_as_read_only(face: Face) -> None:
    scaler = face()
    base = np.ones(3, np.float32)
    open_step(scaler)
    with pytest.raises(GradientValueError):
        scaler.unscale_and_check([np.broadcast_to(base, (4, 3))])
    assert base.tolist() == [1.0, 1.0, 1.0]


def test_same_array_twice_is_refused(face: Face) -> None:
    scaler, grads = grads_with_history(face)
    arg = [grads[1], grads[0], grads[1]]
    saved = copies(arg)
    before = snapshot(scaler)
    open_step(scaler)
    with pytest.raises(DuplicateGradientError) as info:
        scaler.unscale_and_check(arg)
    assert_error(info, ScalerProtocolError, RuntimeError)
    assert isinstance(info.value, ValueError)
    assert "#0" in str(info.value)
    assert "#2" in str(info.value)
    assert_untouched(arg, saved)
    assert snapshot(scaler) == before


def test_same_array_under_two_names_is_refused(face: Face) -> None:
    scaler, grads = grads_with_history(face)
    arg = {"encoder.W": grads[2], "decoder.W": grads[2]}
    saved = grads[2].copy()
    open_step(scaler)
    with pytest.raises(DuplicateGradientError) as info:
        scaler.unscale_and_check(arg)
    assert "'encoder.W'" in str(info.value)
    assert "'decoder.W'" in str(info.value)
    assert identical(grads[2], saved)


@pytest.mark.parametrize(
    ("shape", "strides"),
    [((3, 3), (4, 4)), ((4,), (0,)), ((2, 3), (8, 4)), ((3, 2, 2), (8, 4, 12))],
    ids=["rows-overlap", "zero-stride", "sliding-window", "interleaved-repeat"],
)
def test_an_array_whose_elements_overlap_each_other_is_refused(
    face: Face, shape: tuple[int, ...], strides: tuple[int, ...]
) -> None:
    # Built writeable on purpose: multiplying it in place would divide the shared elements more than once.
    base = np.arange(1.0, 17.0, dtype=np.float32)
    tricky = np.lib.stride_tricks.as_strided(base, shape=shape, strides=strides, writeable=True)
    saved = base.copy()
    scaler = face(init_scale=2.0)
    open_step(scaler)
    with pytest.raises(GradientValueError, match="overlap in memory") as info:
        scaler.unscale_and_check([np.ones(2, np.float32), tricky])
    assert "gradient #1" in str(info.value)
    with pytest.raises(GradientValueError, match="overlap in memory"):
        scaler.scale_loss(tricky)
    assert identical(base, saved)


@pytest.mark.parametrize(
    "views",
    [
        lambda a: [a[:5], a[3:]],
        lambda a: [a, a[2:4]],
        lambda a: [a[::-1], a],
        lambda a: [a.reshape(2, 5), a[7:]],
        lambda a: [a[::3], a[::2]],  # both hold a[0] and a[6]
        lambda a: [a[9:], a[::-3]],  # both hold a[9]
    ],
    ids=["a[:5],a[3:]", "a,a[2:4]", "a[::-1],a", "reshape,a[7:]", "a[::3],a[::2]", "a[9:],a[::-3]"],
)
def test_overlapping_views_are_refused(face: Face, views: Any) -> None:
    scaler, grads = grads_with_history(face)
    base = np.arange(10, dtype=np.float32)
    saved = base.copy()
    arg = [grads[0], *views(base)]
    before = snapshot(scaler)
    saved0 = grads[0].copy()
    open_step(scaler)
    with pytest.raises(DuplicateGradientError) as info:
        scaler.unscale_and_check(arg)
    assert_error(info, ScalerProtocolError, RuntimeError)
    assert "#1" in str(info.value)
    assert "#2" in str(info.value)
    assert identical(base, saved)
    assert identical(grads[0], saved0)
    assert snapshot(scaler) == before


@pytest.mark.parametrize(
    "views",
    [
        lambda a: [a[::2], a[1::2]],
        lambda a: [a[:5], a[5:]],
        lambda a: [a[::2], a[::-2]],  # evens forwards, odds backwards
        lambda a: [a.reshape(5, 2)[:, 0], a.reshape(5, 2)[:, 1]],
        lambda a: [a.reshape(2, 5)[:, :2], a.reshape(2, 5)[:, 2:]],
        lambda a: [a[i::3] for i in range(3)],
    ],
    ids=["a[::2],a[1::2]", "halves", "a[::2],a[::-2]", "columns", "column blocks", "thirds"],
)
def test_disjoint_interleaved_views_are_accepted(face: Face, views: Any) -> None:
    scaler = face(init_scale=4.0)
    base = np.arange(10, dtype=np.float32)
    expected = unscaled(base, 4.0)
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check(views(base))) is True
    assert same_bits(base, expected)  # every element unscaled exactly once


def test_large_strided_disjoint_views_are_accepted(face: Face) -> None:
    scaler = face(init_scale=2.0)
    base = np.ones((256, 64), np.float32)
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check([base[:, i::8] for i in range(8)])) is True
    assert np.all(base == 0.5)


def test_same_array_in_two_calls_of_one_step_is_refused(face: Face) -> None:
    scaler, grads = grads_with_history(face)
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check([grads[1]])) is True
    after_first = snapshot(scaler)
    fresh = np.array([3.0, np.nan], np.float32)
    arg = [fresh, grads[1]]
    saved = copies(arg)
    with pytest.raises(DuplicateGradientError) as info:
        scaler.unscale_and_check(arg)
    assert_error(info, ScalerProtocolError, RuntimeError)
    assert "#1" in str(info.value)
    assert "update()" in str(info.value)
    assert_untouched(arg, saved)
    assert snapshot(scaler) == after_first
    assert scaler.had_overflow() is False  # the rejected call's nan was never seen
    scaler.update()
    assert scaler.stats().consecutive_good_steps == 1


def test_overlapping_view_in_a_later_call_of_the_step_is_refused(face: Face) -> None:
    scaler = face()
    base = np.ones(10, np.float32)
    open_step(scaler)
    scaler.unscale_and_check([base[:6]])
    saved = base.copy()
    with pytest.raises(DuplicateGradientError):
        scaler.unscale_and_check([base[4:]])
    assert identical(base, saved)
    assert face.ok(scaler.unscale_and_check([base[6:]])) is True  # the disjoint rest is fine


def test_same_array_may_be_unscaled_again_in_the_next_step(face: Face) -> None:
    scaler = face(init_scale=4.0)
    grad = np.array([8.0], np.float32)
    open_step(scaler)
    scaler.unscale_and_check([grad])
    scaler.update()
    open_step(scaler)
    scaler.unscale_and_check([grad])
    assert grad.tolist() == [0.5]


def test_several_calls_per_step_on_disjoint_sets(face: Face) -> None:
    scaler = face(init_scale=2.0, growth_interval=1)
    a, b, c = np.ones(2, np.float32), np.ones(2, np.float16), np.ones(2, np.float64)
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check([a])) is True
    assert face.ok(scaler.unscale_and_check({"b": b})) is True
    assert face.ok(scaler.unscale_and_check([None, c])) is True
    scaler.update()
    assert [a.tolist(), b.tolist(), c.tolist()] == [[0.5, 0.5]] * 3
    assert scaler.stats().steps == 1
    assert scaler.stats().scale == 4.0


def test_validation_error_in_a_later_call_keeps_the_earlier_calls(face: Face) -> None:
    scaler = face(init_scale=2.0)
    first = np.array([np.inf], np.float32)
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check([first])) is False
    with pytest.raises(GradientTypeError):
        scaler.unscale_and_check([np.ones(1, np.int8)])
    assert scaler.had_overflow() is True
    assert scaler.nonfinite_gradients() == [0]
    scaler.update()
    assert scaler.stats().skipped_steps == 1


class _FakeGpuArray:
    """Stands in for a CuPy array: exports the CUDA array interface, nothing else."""

    dtype = np.dtype(np.float32)
    shape = (2,)
    strides = (4,)
    itemsize = 4

    __cuda_array_interface__: dict[str, Any] = {}  # noqa: RUF012


@pytest.fixture
def fake_cupy_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replace the CuPy backend module (which needs a GPU) by a stub that may only validate."""
    import cupy_amp.gpu

    module = types.ModuleType("cupy_amp.gpu.backend")
    module.NAME = "cupy"  # type: ignore[attr-defined]
    module.as_array = lambda obj: obj if isinstance(obj, _FakeGpuArray) else None  # type: ignore[attr-defined]
    module.write_problem = lambda array, source: None  # type: ignore[attr-defined]

    def anything_else(name: str) -> Any:
        raise AssertionError(f"the CuPy backend must not be used for a rejected call ({name})")

    module.__getattr__ = anything_else  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "cupy_amp.gpu.backend", module)
    monkeypatch.setattr(cupy_amp.gpu, "backend", module, raising=False)  # an import made earlier binds it there


@pytest.mark.usefixtures("fake_cupy_backend")
@pytest.mark.parametrize("gpu_first", [False, True])
def test_numpy_and_cupy_arrays_mixed_are_refused(face: Face, gpu_first: bool) -> None:
    scaler, grads = grads_with_history(face)
    arg: list[Any] = [grads[0], grads[1]]
    arg.insert(0 if gpu_first else 2, _FakeGpuArray())
    saved = copies(grads[:2])
    before = snapshot(scaler)
    open_step(scaler)
    with pytest.raises(GradientTypeError) as info:
        scaler.unscale_and_check(arg)
    assert_error(info, ArgumentTypeError, TypeError)
    message = str(info.value)
    assert ("#1" if gpu_first else "#2") in message
    assert "numpy" in message.lower()
    assert "cupy" in message.lower()
    assert_untouched(grads[:2], saved)
    assert snapshot(scaler) == before


def test_foreign_cpu_tensor_is_refused_with_a_package_error(face: Face) -> None:
    torch = pytest.importorskip("torch")
    scaler, grads = grads_with_history(face)
    saved = copies(grads)
    before = snapshot(scaler)
    with pytest.raises(GradientTypeError, match="Tensor"):
        scaler.scale_loss(torch.ones(2))
    open_step(scaler)
    with pytest.raises(GradientTypeError, match="#3"):
        scaler.unscale_and_check([*grads, torch.ones(2)])
    assert_untouched(grads, saved)
    assert snapshot(scaler) == before


# unscale_and_check: accepted edge cases


@pytest.mark.parametrize("arg", [[], (), {}, [None, None], {"a": None}, iter([])], ids=str)
def test_empty_argument_is_a_clean_check(face: Face, arg: Any) -> None:
    scaler, _ = grads_with_history(face)
    assert scaler.had_overflow() is True
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check(arg)) is True
    assert scaler.had_overflow() is False
    assert scaler.nonfinite_gradients() == []
    scaler.update()
    stats = scaler.stats()
    assert (stats.steps, stats.skipped_steps, stats.consecutive_good_steps) == (2, 1, 1)


def test_generator_and_tuple_arguments_are_accepted(face: Face) -> None:
    scaler = face(init_scale=2.0)
    a, b = np.ones(2, np.float32), np.ones(2, np.float32)
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check(g for g in (a, None, b))) is True
    scaler.update()
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check((a, b))) is True
    assert a.tolist() == b.tolist() == [0.25, 0.25]


def test_every_gradient_is_unscaled_even_after_an_overflow(face: Face) -> None:
    scaler = face(init_scale=4.0)
    grads = [np.array([np.inf, 8.0], np.float32), np.array([8.0], np.float16), np.array([np.nan, 4.0])]
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check(grads)) is False
    assert grads[0].tolist() == [np.inf, 2.0]
    assert grads[1].tolist() == [2.0]
    assert np.isnan(grads[2][0])
    assert grads[2][1] == 1.0


# disabled scaler


def test_disabled_unscale_and_check_touches_nothing() -> None:
    scaler, grads = grads_with_history()
    scaler.set_enabled(False)
    saved = copies(grads)
    before = snapshot(scaler)
    assert scaler.unscale_and_check(grads) is True
    assert scaler.unscale_and_check({"x": grads[0]}) is True
    assert_untouched(grads, saved)
    scaler.update()
    assert snapshot(scaler) == before
    assert scaler.scale_factor() == 1.0
    assert scaler.stats().scale == 1024.0
    scaler.set_enabled(True)
    with pytest.raises(ScalerProtocolError):
        scaler.update()  # nothing was recorded while disabled


def test_disabled_steps_leave_the_last_enabled_steps_report() -> None:
    # Disabled steps run on the null lane, whose records are its own: a disabled step with inf/nan
    # (unscale_and_check or check) changes nothing the scaler reports of the last enabled step.
    scaler, grads = grads_with_history()
    scaler.scale_loss(np.ones((), np.float32))
    scaler.unscale_and_check({"w": np.ones(2, np.float32), "b": np.array([np.nan], np.float32)})
    scaler.update()
    reported = (scaler.nonfinite_gradients(), scaler.had_overflow(), scaler.journal_names(), scaler.stats())
    assert reported[:3] == (["b"], True, (("w", "b"),))
    scaler.set_enabled(False)
    assert scaler.unscale_and_check(grads) is True
    assert scaler.unscale_and_check(grads) is True  # nothing claimed: the same gradients may come again
    scaler.update()
    assert bool(scaler.check([np.array([np.inf], np.float32)]).finite) is False  # the optimizer would skip
    scaler.update()
    now = (scaler.nonfinite_gradients(), scaler.had_overflow(), scaler.journal_names(), scaler.stats())
    assert now == (*reported[:3], dataclasses.replace(reported[3], enabled=False))


# update()


def test_update_without_unscale_is_refused(face: Face) -> None:
    scaler = face()
    before = snapshot(scaler)
    with pytest.raises(ScalerProtocolError) as info:
        scaler.update()
    assert_error(info, ScalerProtocolError, RuntimeError)
    message = str(info.value)
    assert "unscale_and_check" in message
    assert "accumulation" in message
    assert snapshot(scaler) == before


def test_second_update_in_a_row_is_refused(face: Face) -> None:
    scaler, _ = grads_with_history(face)
    before = snapshot(scaler)
    with pytest.raises(ScalerProtocolError):
        scaler.update()
    assert snapshot(scaler) == before


def test_gradient_accumulation_misuse_is_caught(face: Face) -> None:
    scaler = face(growth_interval=100)
    grads = [np.ones(3, np.float32)]
    for _micro_batch in range(2):
        scaler.scale_loss(np.ones((), np.float32))
    scaler.unscale_and_check(grads)
    scaler.update()
    with pytest.raises(ScalerProtocolError):
        scaler.update()
    assert scaler.stats().steps == 1


# set_enabled, checkpoint and load_checkpoint around an open step


def test_set_enabled_switch_while_a_step_is_open_is_refused() -> None:
    scaler = GradScaler()
    open_step(scaler)
    scaler.unscale_and_check([np.ones(2, np.float32)])
    before = snapshot(scaler)
    with pytest.raises(ScalerProtocolError) as info:
        scaler.set_enabled(False)
    assert_error(info, ScalerProtocolError, RuntimeError)
    assert "update()" in str(info.value)
    assert snapshot(scaler) == before
    scaler.set_enabled(True)  # not a switch: allowed
    scaler.update()
    scaler.set_enabled(False)
    assert scaler.is_enabled() is False


def test_checkpoint_while_a_step_is_open_is_refused(face: Face) -> None:
    scaler = face()
    open_step(scaler)
    scaler.unscale_and_check([np.ones(2, np.float32)])
    with pytest.raises(ScalerProtocolError) as info:
        scaler.checkpoint()
    assert_error(info, ScalerProtocolError, RuntimeError)
    scaler.update()
    assert scaler.checkpoint().steps == 1


def test_load_checkpoint_while_a_step_is_open_is_refused(face: Face) -> None:
    donor = face(init_scale=2.0, growth_interval=7, hysteresis=3)
    ckpt = donor.checkpoint()
    scaler, grads = grads_with_history(face)
    open_step(scaler)
    scaler.unscale_and_check([grads[1]])
    before = snapshot(scaler)
    with pytest.raises(ScalerProtocolError) as info:
        scaler.load_checkpoint(ckpt)
    assert_error(info, ScalerProtocolError, RuntimeError)
    assert snapshot(scaler) == before
    scaler.update()  # the step is still open and can end normally
    assert scaler.stats().steps == 2


# A step opens at scale_loss: nothing may change the scale between the loss and its gradients

CHANGES = ["load_checkpoint", "checkpoint"]  # and GradScaler's set_enabled


@pytest.mark.parametrize(
    ("face", "change"),
    [(GRAD_SCALER, "set_enabled"), *((face, change) for face in (GRAD_SCALER, SYNC_FREE) for change in CHANGES)],
    ids=str,
)
def test_changing_the_scaler_between_scale_loss_and_unscale_is_refused(face: Face, change: str) -> None:
    # With set_enabled(False) or another checkpoint here, the loss got one scale and the gradients
    # would be divided by another, and unscale_and_check would still say True.
    scaler = face(init_scale=8.0)
    other = face(init_scale=2.0).checkpoint()
    loss = np.array(1.0, np.float32)
    scaler.scale_loss(loss)
    before = snapshot(scaler)
    with pytest.raises(ScalerProtocolError, match=r"scale_loss\(\) was called and update\(\) was not yet"):
        {
            "set_enabled": lambda: scaler.set_enabled(False),
            "load_checkpoint": lambda: scaler.load_checkpoint(other),
            "checkpoint": scaler.checkpoint,
        }[change]()
    assert snapshot(scaler) == before
    grad = np.full(2, 8.0, np.float32)  # as the backward pass from the scaled loss would give
    assert face.ok(scaler.unscale_and_check([grad])) is True
    assert grad.tolist() == [1.0, 1.0]
    scaler.update()
    scaler.load_checkpoint(other)  # between steps: fine


def test_scale_loss_after_unscale_without_update_says_update_was_forgotten(face: Face) -> None:
    scaler = face(init_scale=4.0)
    scaler.scale_loss(np.array(1.0, np.float32))
    assert face.ok(scaler.unscale_and_check([np.ones(2, np.float32)]))
    loss = np.array(1.0, np.float32)
    with pytest.raises(ScalerProtocolError, match=r"update\(\) was forgotten") as info:
        scaler.scale_loss(loss)
    assert_error(info, ScalerProtocolError, RuntimeError)
    assert loss == 1.0  # not scaled
    scaler.update()
    scaler.scale_loss(loss)
    assert loss == 4.0


def test_a_loop_that_forgets_update_stops_at_its_second_step_holding_one_steps_arrays(face: Face) -> None:
    # Without the check, every step's fresh arrays stayed referenced by the open step and the scale never moved.
    scaler = face(init_scale=4.0, growth_interval=1)
    first_step = [np.ones(1000, np.float32)]
    watch = weakref.ref(first_step[0])
    scaler.scale_loss(np.array(1.0, np.float32))
    scaler.unscale_and_check(first_step)
    del first_step
    with pytest.raises(ScalerProtocolError, match="forgotten"):
        scaler.scale_loss(np.array(1.0, np.float32))
    assert watch() is not None  # the open step still holds its own arrays (so none can be reused in it)...
    scaler.update()
    gc.collect()
    assert watch() is None  # ...and lets go of them when it ends


def test_gradient_accumulation_scales_every_micro_batch_loss_with_the_step_scale(face: Face) -> None:
    scaler = face(init_scale=4.0)
    losses = [np.array(float(i + 1), np.float32) for i in range(3)]
    for loss in losses:
        scaler.scale_loss(loss)
    assert [float(loss) for loss in losses] == [4.0, 8.0, 12.0]
    assert face.ok(scaler.unscale_and_check([np.full(2, 12.0, np.float32)]))
    scaler.update()
    assert scaler.stats().steps == 1


@pytest.mark.parametrize("change", ["set_enabled", "load_checkpoint"])
def test_enabling_the_scaler_between_a_disabled_scale_loss_and_the_unscale_is_refused(change: str) -> None:
    # The loss was not scaled (disabled); enabling now would divide its gradients by a scale never applied.
    scaler = GradScaler(enabled=False)
    enabled = GradScaler(init_scale=8.0).checkpoint()
    scaler.scale_loss(np.array(2.0, np.float32))
    with pytest.raises(ScalerProtocolError, match=r"scale_loss\(\) was called"):
        {"set_enabled": lambda: scaler.set_enabled(True), "load_checkpoint": lambda: scaler.load_checkpoint(enabled)}[
            change
        ]()
    grad = np.array([1.0], np.float32)
    assert scaler.unscale_and_check([grad]) is True
    assert grad.tolist() == [1.0]
    scaler.update()
    scaler.set_enabled(True)  # between steps: fine


def test_a_disabled_scaler_keeps_the_step_order_too() -> None:
    scaler = GradScaler(enabled=False)
    scaler.scale_loss(np.array(1.0, np.float32))
    assert scaler.unscale_and_check([np.ones(2, np.float32)]) is True
    with pytest.raises(ScalerProtocolError, match="forgotten"):
        scaler.scale_loss(np.array(1.0, np.float32))
    scaler.update()
    scaler.scale_loss(np.array(1.0, np.float32))


def test_misaligned_numpy_arrays_are_refused_as_on_the_gpu(face: Face) -> None:
    raw = np.zeros(40, dtype=np.uint8)
    misaligned = raw[1:33].view(np.float32)
    assert not misaligned.flags.aligned
    scaler = face()
    open_step(scaler)
    with pytest.raises(GradientValueError, match="misaligned"):
        scaler.unscale_and_check([misaligned])
    with pytest.raises(GradientValueError, match="misaligned"):
        face().scale_loss(misaligned)


def test_a_disabled_scaler_still_validates_unscale_and_checks_argument() -> None:
    scaler = GradScaler(enabled=False)
    with pytest.raises(GradientTypeError, match="#1"):
        scaler.unscale_and_check([np.ones(2, np.float32), np.ones(2, np.int32)])
    with pytest.raises(GradientValueError, match="read-only"):
        scaler.unscale_and_check([read_only(np.ones(2, np.float32))])
    shared = np.ones(4, np.float32)
    with pytest.raises(DuplicateGradientError):
        scaler.unscale_and_check([shared, shared[1:]])
    assert scaler.unscale_and_check([np.full(2, 3.0, np.float32)]) is True


@pytest.mark.parametrize("bad", [None, {}, "ckpt", b"\x80", 1.0])
def test_load_checkpoint_of_a_non_checkpoint_is_refused(face: Face, bad: Any) -> None:
    scaler, _ = grads_with_history(face)
    before = snapshot(scaler)
    with pytest.raises(TypeError) as info:
        scaler.load_checkpoint(bad)
    assert isinstance(info.value, CupyAmpError)
    assert snapshot(scaler) == before


def test_load_checkpoint_of_a_checkpoint_dict_is_refused(face: Face) -> None:
    scaler, _ = grads_with_history(face)
    as_dict = scaler.checkpoint().to_dict()
    before = snapshot(scaler)
    with pytest.raises(TypeError, match="GradScalerCheckpoint"):
        scaler.load_checkpoint(as_dict)
    assert snapshot(scaler) == before


# had_overflow / nonfinite_gradients lifecycle


def test_had_overflow_lifecycle(face: Face) -> None:
    scaler = face(init_scale=16.0)
    assert scaler.had_overflow() is False
    # Step 1 overflows.
    scaler.scale_loss(np.ones((), np.float32))
    assert scaler.had_overflow() is False
    assert face.ok(scaler.unscale_and_check([np.array([np.inf], np.float32)])) is False
    assert scaler.had_overflow() is True
    scaler.update()
    assert scaler.had_overflow() is True  # still the last step's result
    scaler.scale_loss(np.ones((), np.float32))
    assert scaler.had_overflow() is True  # scale_loss does not start a step
    # Step 2: clean first call, then an overflowing one.
    assert face.ok(scaler.unscale_and_check([np.ones(1, np.float32)])) is True
    assert scaler.had_overflow() is False
    assert face.ok(scaler.unscale_and_check([np.array([np.nan], np.float16)])) is False
    assert scaler.had_overflow() is True
    assert face.ok(scaler.unscale_and_check([np.ones(1, np.float32)])) is False  # the step's verdict so far
    assert scaler.had_overflow() is True
    scaler.update()
    assert scaler.had_overflow() is True
    # Step 3: clean.
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check([np.ones(1, np.float32)])) is True
    assert scaler.had_overflow() is False
    scaler.update()
    assert scaler.had_overflow() is False


def test_nonfinite_gradients_positions_count_none_entries(face: Face) -> None:
    scaler = face()
    grads = [
        np.ones(2, np.float32),
        None,
        np.array([1.0, np.inf], np.float16),
        None,
        np.array(np.nan),
        np.ones(3, np.float64),
        np.array([-np.inf], np.float32),
    ]
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check(grads)) is False
    assert scaler.nonfinite_gradients() == [2, 4, 6]
    scaler.update()
    assert scaler.nonfinite_gradients() == [2, 4, 6]


def test_nonfinite_gradients_names_for_a_mapping(face: Face) -> None:
    scaler = face()
    grads = OrderedDict(
        [
            ("fc2.b", np.array([np.nan], np.float32)),
            ("fc1.W", np.ones((2, 2), np.float16)),
            ("fc1.b", None),
            ("emb", np.array([[1.0], [-np.inf]], np.float64)),
        ]
    )
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check(grads)) is False
    assert scaler.nonfinite_gradients() == ["fc2.b", "emb"]


def test_nonfinite_gradients_over_several_calls_and_steps(face: Face) -> None:
    scaler = face()
    assert scaler.nonfinite_gradients() == []
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check([np.ones(1, np.float32), np.array([np.inf], np.float32)])) is False
    assert face.ok(scaler.unscale_and_check({"head": np.ones(1, np.float32)})) is False  # the step's verdict so far
    assert face.ok(scaler.unscale_and_check([None, np.array([np.nan], np.float32)])) is False
    assert face.ok(scaler.unscale_and_check({"tail": np.array([np.inf], np.float16), "x": np.ones(1)})) is False
    assert scaler.nonfinite_gradients() == [1, 1, "tail"]
    scaler.update()
    assert scaler.nonfinite_gradients() == [1, 1, "tail"]  # kept after update()
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check([np.ones(1, np.float32)])) is True
    assert scaler.nonfinite_gradients() == []  # the new step started
    assert face.ok(scaler.unscale_and_check({"late": np.array([np.nan], np.float32)})) is False
    assert scaler.nonfinite_gradients() == ["late"]
    scaler.update()
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check([])) is True
    scaler.update()
    assert scaler.nonfinite_gradients() == []


def test_nonfinite_gradients_survive_a_rejected_first_call_of_the_next_step(face: Face) -> None:
    scaler = face()
    open_step(scaler)
    scaler.unscale_and_check([np.array([np.inf], np.float32)])
    scaler.update()
    open_step(scaler)
    with pytest.raises(GradientTypeError):
        scaler.unscale_and_check([np.ones(1, np.int32)])
    assert scaler.had_overflow() is True
    assert scaler.nonfinite_gradients() == [0]
