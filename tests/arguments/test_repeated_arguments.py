"""Repeated gradient arguments: the results never depend on whether a call was recognised.

Every test drives both scaler faces with NumPy arrays, in two modes. "validated":
as NumPy is, whose arrays can change their layout in place, so every call is
validated in full. "remembered": as CuPy is, whose arrays cannot, so a list,
tuple or dict whose entries are the same objects as an earlier call's reuses
that call (here NumPy is declared layout-fixed to drive that path on the CPU).
A reference scaler sees fresh copies in fresh containers, which nothing can
recognise, so whatever the two disagree on is a bug in the remembering.
Tests that change an array's layout in place run in the validated mode only.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Hashable
from typing import Any

import numpy as np
import pytest
from helpers import FACES, Face, assert_same_bits, open_step
from hypothesis import given, settings
from hypothesis import strategies as st

from cupy_amp import (
    DuplicateGradientError,
    GradientSet,
    GradientTypeError,
    GradientValueError,
    numpy_backend,
)
from cupy_amp import gradients as parsing

INF = float("inf")
NAN = float("nan")


@pytest.fixture(autouse=True, params=["validated", "remembered"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.node.get_closest_marker("layout_changes") and request.param == "remembered":
        pytest.skip("changes an array's layout in place, which only NumPy arrays allow (never remembered)")
    monkeypatch.setattr(numpy_backend, "LAYOUT_FIXED", request.param == "remembered")
    return str(request.param)


layout_changes = pytest.mark.layout_changes


def make_scaler(face: Face, init_scale: float = 4.0, growth_interval: int = 1) -> Any:
    # growth_interval=1 changes the scale on every clean step, so a stale result cannot hide.
    return face(init_scale=init_scale, growth_interval=growth_interval)


def fresh_copies(gradients: Any) -> Any:
    """Copy every array (keeping its writeable flag) into a new container of the same kind."""

    def copy(value: Any) -> Any:
        if not isinstance(value, np.ndarray):
            return value
        duplicate = value.copy()
        duplicate.flags.writeable = value.flags.writeable
        return duplicate

    if isinstance(gradients, GradientSet):
        labels = [label for label, _ in gradients.entries()]
        copies = [copy(value) for _, value in gradients.entries()]
        by_position = labels == list(range(len(labels)))
        return GradientSet(copies if by_position else dict(zip(labels, copies, strict=True)))
    if isinstance(gradients, dict):
        return {key: copy(value) for key, value in gradients.items()}
    return type(gradients)(copy(value) for value in gradients)


def values_of(gradients: Any) -> list[Any]:
    return list(gradients.values()) if isinstance(gradients, dict) else list(gradients)


def run_step(face: Face, scaler: Any, gradients: Any) -> tuple[str, Any, list[Hashable]]:
    """One unscale_and_check (+ update when it succeeded); return what a caller can observe."""
    open_step(scaler)
    try:
        finite = face.ok(scaler.unscale_and_check(gradients))
    except Exception as exc:
        return "raised", type(exc), []
    culprits = scaler.nonfinite_gradients()
    scaler.update()
    return "returned", finite, culprits


def step_both(face: Face, cached: Any, reference: Any, gradients: Any) -> tuple[str, Any, list[Hashable]]:
    """Step the cached scaler on ``gradients`` and the reference on fresh copies; assert they agree."""
    copies = fresh_copies(gradients)
    outcome = run_step(face, reference, copies)
    assert run_step(face, cached, gradients) == outcome
    for actual, expected in zip(values_of(gradients), values_of(copies), strict=True):
        assert_same_bits(actual, expected)
    assert cached.stats() == reference.stats()
    return outcome


def new_array(value: float, dtype: Any = np.float32, size: int = 3) -> np.ndarray:
    return np.full(size, value, dtype=dtype)


@pytest.fixture
def validations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count how often a gradient argument is validated from scratch."""
    calls = [0]
    real = parsing._parse

    def counting(argument: Any) -> Any:
        calls[0] += 1
        return real(argument)

    monkeypatch.setattr(parsing, "_parse", counting)
    return calls


# Repeated arguments


def test_same_list_every_step_gives_the_same_results_as_fresh_lists(face: Face) -> None:
    cached, reference = make_scaler(face), make_scaler(face)
    gradients = [new_array(1.0), new_array(3.0, np.float16), None, new_array(-5.0, np.float64)]
    fills = [(2.0, 4.0, 8.0), (INF, 1.0, 1.0), (0.5, NAN, 1.0), (7.0, 6.0, 5.0), (1.0, 1.0, -INF), (9.0, 9.0, 9.0)]
    outcomes = []
    for fill in fills:
        for array, value in zip([g for g in gradients if g is not None], fill, strict=True):
            array[...] = value
        outcomes.append(step_both(face, cached, reference, gradients))
    assert [finite for _, finite, _ in outcomes] == [True, False, False, True, False, True]
    assert [culprits for _, _, culprits in outcomes] == [[], [0], [1], [], [3], []]


def test_same_dict_every_step_gives_the_same_results_as_fresh_dicts(face: Face) -> None:
    cached, reference = make_scaler(face), make_scaler(face)
    gradients: dict[str, Any] = {"fc.W": new_array(2.0), "fc.b": None, "out.W": new_array(8.0, np.float16)}
    for value in (1.0, INF, 3.0, 2.0**-20):
        gradients["out.W"][...] = value
        step_both(face, cached, reference, gradients)
    assert cached.stats().steps == 4


def test_repeated_list_is_validated_once_if_remembered_else_every_time(
    face: Face, mode: str, validations: list[int]
) -> None:
    scaler = make_scaler(face)
    first, second = new_array(4.0), new_array(8.0)
    grads = [first, None, second]
    for _ in range(3):
        open_step(scaler)
        assert face.ok(scaler.unscale_and_check(grads))
        scaler.update()
    assert validations[0] == (1 if mode == "remembered" else 3)
    # Same arrays, new list object: still recognised.
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check([first, None, second]))
    assert validations[0] == (1 if mode == "remembered" else 4)


# A list mutated in place is validated again


def test_entry_replaced_by_another_array_unscales_the_new_array(face: Face) -> None:
    scaler = make_scaler(face, init_scale=4.0, growth_interval=1000)
    old, other = new_array(8.0), new_array(8.0)
    gradients = [other, old]
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check(gradients))
    scaler.update()
    replacement = new_array(INF)
    gradients[1] = replacement
    other[...] = 8.0
    open_step(scaler)
    assert not face.ok(scaler.unscale_and_check(gradients))
    assert scaler.nonfinite_gradients() == [1]
    np.testing.assert_array_equal(old, new_array(2.0))  # unscaled once, by the first call only
    np.testing.assert_array_equal(other, new_array(2.0))


def test_entry_replaced_by_read_only_array_raises_and_modifies_nothing(face: Face) -> None:
    scaler = make_scaler(face)
    kept = new_array(8.0)
    gradients = [kept, new_array(8.0)]
    open_step(scaler)
    scaler.unscale_and_check(gradients)
    scaler.update()
    kept[...] = 8.0
    frozen = new_array(8.0)
    frozen.flags.writeable = False
    gradients[1] = frozen
    open_step(scaler)
    with pytest.raises(GradientValueError, match=r"gradient #1 .*read-only"):
        scaler.unscale_and_check(gradients)
    np.testing.assert_array_equal(kept, new_array(8.0))
    np.testing.assert_array_equal(frozen, new_array(8.0))


def test_entry_replaced_by_int_array_raises_type_error_and_modifies_nothing(face: Face) -> None:
    scaler = make_scaler(face)
    kept = new_array(8.0)
    gradients = [kept, new_array(8.0)]
    open_step(scaler)
    scaler.unscale_and_check(gradients)
    scaler.update()
    kept[...] = 8.0
    gradients[1] = np.full(3, 8, dtype=np.int32)
    open_step(scaler)
    with pytest.raises(GradientTypeError, match=r"gradient #1: dtype int32"):
        scaler.unscale_and_check(gradients)
    np.testing.assert_array_equal(kept, new_array(8.0))


def test_entry_replaced_by_none_skips_it_and_keeps_positions(face: Face) -> None:
    scaler = make_scaler(face, init_scale=4.0, growth_interval=1000)
    dropped, last = new_array(8.0), new_array(8.0)
    gradients: list[np.ndarray | None] = [dropped, last]
    open_step(scaler)
    scaler.unscale_and_check(gradients)
    scaler.update()
    gradients[0] = None
    last[...] = INF
    open_step(scaler)
    assert not face.ok(scaler.unscale_and_check(gradients))
    assert scaler.nonfinite_gradients() == [1]
    np.testing.assert_array_equal(dropped, new_array(2.0))  # left alone by the second call


def test_entry_appended_is_unscaled_and_checked(face: Face) -> None:
    scaler = make_scaler(face, init_scale=4.0, growth_interval=1000)
    first = new_array(8.0)
    gradients = [first]
    open_step(scaler)
    scaler.unscale_and_check(gradients)
    scaler.update()
    appended = new_array(NAN)
    gradients.append(appended)
    open_step(scaler)
    assert not face.ok(scaler.unscale_and_check(gradients))
    assert scaler.nonfinite_gradients() == [1]
    np.testing.assert_array_equal(first, new_array(0.5))


def test_entry_appended_that_aliases_another_raises_duplicate_and_modifies_nothing(face: Face) -> None:
    scaler = make_scaler(face)
    whole = np.full(6, 8.0, dtype=np.float32)
    gradients = [whole]
    open_step(scaler)
    scaler.unscale_and_check(gradients)
    scaler.update()
    whole[...] = 8.0
    gradients.append(whole[2:4])
    open_step(scaler)
    with pytest.raises(DuplicateGradientError, match=r"gradient #0 and gradient #1 share memory"):
        scaler.unscale_and_check(gradients)
    np.testing.assert_array_equal(whole, np.full(6, 8.0, dtype=np.float32))


@layout_changes
@pytest.mark.parametrize("kind", ["list", "GradientSet"])
def test_views_made_to_overlap_by_setting_strides_in_place_are_refused(face: Face, kind: str) -> None:
    base = np.full(8, 8.0, dtype=np.float32)
    first, second = base[:4], base[4:]
    grads: Any = [first, second] if kind == "list" else GradientSet([first, second])
    scaler = make_scaler(face, init_scale=2.0, growth_interval=1000)
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check(grads))
    scaler.update()
    base[...] = 8.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # NumPy 2.4 deprecates setting strides, still allows it
        first.strides = (8,)  # now base[0], base[2], base[4], base[6]: half of them are second's
    open_step(scaler)
    with pytest.raises(DuplicateGradientError, match=r"gradient #0 and gradient #1 share memory"):
        scaler.unscale_and_check(grads)
    assert base.tolist() == [8.0] * 8


@layout_changes
def test_an_array_made_to_overlap_itself_by_setting_strides_is_refused(face: Face) -> None:
    base = np.full(8, 8.0, dtype=np.float32)
    view = base[:4]
    grads = [view]
    scaler = make_scaler(face, init_scale=2.0, growth_interval=1000)
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check(grads))
    scaler.update()
    base[...] = 8.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        view.shape, view.strides = (2, 2), (4, 4)  # elements 0, 1, 1, 2: the middle one twice
    open_step(scaler)
    with pytest.raises(GradientValueError, match="overlap in memory"):
        scaler.unscale_and_check(grads)
    assert base.tolist() == [8.0] * 8


@layout_changes
def test_array_made_read_only_after_first_call_is_refused_on_next_call(face: Face) -> None:
    scaler = make_scaler(face, init_scale=4.0, growth_interval=1000)
    kept, frozen_later = new_array(8.0), new_array(8.0)
    gradients = [kept, frozen_later]
    open_step(scaler)
    scaler.unscale_and_check(gradients)
    scaler.update()
    kept[...] = 8.0
    frozen_later[...] = 8.0
    frozen_later.flags.writeable = False
    open_step(scaler)
    with pytest.raises(GradientValueError, match=r"gradient #1 .*read-only"):
        scaler.unscale_and_check(gradients)
    np.testing.assert_array_equal(kept, new_array(8.0))
    # Writeable again: accepted again, with the right result.
    frozen_later.flags.writeable = True
    assert face.ok(scaler.unscale_and_check(gradients))
    np.testing.assert_array_equal(frozen_later, new_array(2.0))


@layout_changes
def test_array_reinterpreted_as_int_after_first_call_is_refused_on_next_call(face: Face) -> None:
    scaler = make_scaler(face)
    kept, retyped = new_array(8.0), new_array(8.0)
    gradients = [kept, retyped]
    open_step(scaler)
    scaler.unscale_and_check(gradients)
    scaler.update()
    kept[...] = 8.0
    retyped.dtype = np.int32  # type: ignore[misc,assignment]  # same object, same memory, new dtype
    open_step(scaler)
    with pytest.raises(GradientTypeError, match=r"gradient #1: dtype int32"):
        scaler.unscale_and_check(gradients)
    np.testing.assert_array_equal(kept, new_array(8.0))


def test_dict_with_same_keys_and_a_different_array_is_revalidated(face: Face) -> None:
    scaler = make_scaler(face, init_scale=4.0, growth_interval=1000)
    weight, bias = new_array(8.0), new_array(8.0)
    gradients = {"w": weight, "b": bias}
    open_step(scaler)
    scaler.unscale_and_check(gradients)
    scaler.update()
    frozen = new_array(8.0)
    frozen.flags.writeable = False
    weight[...] = 8.0
    open_step(scaler)
    with pytest.raises(GradientValueError, match=r"gradient 'b' .*read-only"):
        scaler.unscale_and_check({"w": weight, "b": frozen})
    np.testing.assert_array_equal(weight, new_array(8.0))
    replacement = new_array(INF)
    assert not face.ok(scaler.unscale_and_check({"w": weight, "b": replacement}))
    assert scaler.nonfinite_gradients() == ["b"]
    np.testing.assert_array_equal(weight, new_array(2.0))
    np.testing.assert_array_equal(bias, new_array(2.0))  # only the first call touched it


def test_dict_with_same_arrays_under_other_keys_reports_the_new_names(face: Face) -> None:
    scaler = make_scaler(face)
    clean, broken = new_array(1.0), new_array(INF)
    open_step(scaler)
    assert not face.ok(scaler.unscale_and_check({"w": clean, "b": broken}))
    assert scaler.nonfinite_gradients() == ["b"]
    scaler.update()
    open_step(scaler)
    assert not face.ok(scaler.unscale_and_check({"b": broken, "w": clean}))  # same arrays, keys reordered
    assert scaler.nonfinite_gradients() == ["b"]
    scaler.update()
    open_step(scaler)
    assert not face.ok(scaler.unscale_and_check({"weight": clean, "bias": broken}))  # same arrays, renamed
    assert scaler.nonfinite_gradients() == ["bias"]


def test_keys_that_compare_equal_are_reported_as_passed(face: Face) -> None:
    # 1, True and 1.0 are equal dict keys; a remembered call must not answer with another call's key.
    scaler = make_scaler(face)
    broken = new_array(INF)
    for key in (1, True, 1.0):
        open_step(scaler)
        assert not face.ok(scaler.unscale_and_check({key: broken}))
        (reported,) = scaler.nonfinite_gradients()
        assert reported == key and type(reported) is type(key)
        scaler.update()
        broken[...] = INF


def test_a_key_that_looks_like_an_internal_marker_is_an_ordinary_key(face: Face) -> None:
    scaler = make_scaler(face, init_scale=4.0, growth_interval=1000)
    in_set, in_dict = new_array(8.0), new_array(INF)
    gradient_set = GradientSet([in_set])
    for _ in range(2):
        open_step(scaler)
        assert face.ok(scaler.unscale_and_check(gradient_set))
        assert not face.ok(scaler.unscale_and_check({"<GradientSet>": in_dict}))
        assert scaler.nonfinite_gradients() == ["<GradientSet>"]
        scaler.update()
    np.testing.assert_array_equal(in_set, new_array(1.0))  # 8 / 4, then / 2 after the backoff


def test_dead_gradient_then_none_at_its_position_is_not_mistaken_for_the_cached_call(face: Face) -> None:
    # A dead weak reference returns None, which once let [None, b] pass for [a, b].
    scaler = make_scaler(face, init_scale=4.0, growth_interval=1000)
    survivor = new_array(8.0)
    gradients = [new_array(8.0), survivor]
    open_step(scaler)
    scaler.unscale_and_check(gradients)
    scaler.update()
    del gradients
    gc.collect()
    survivor[...] = INF
    open_step(scaler)
    assert not face.ok(scaler.unscale_and_check([None, survivor]))
    assert scaler.nonfinite_gradients() == [1]
    scaler.update()
    assert scaler.scale_factor() == 2.0  # backed off
    survivor[...] = 8.0
    newcomer = new_array(8.0)  # may reuse the dead array's memory and id
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check([newcomer, survivor]))
    np.testing.assert_array_equal(newcomer, new_array(4.0))
    np.testing.assert_array_equal(survivor, new_array(4.0))


def test_new_array_reusing_a_dead_entrys_id_is_validated_afresh(face: Face) -> None:
    # Lists are recognised by the id() of their entries: an id freed by a dead entry and
    # reused by a new object must not pass for the cached entry. The newcomer here is a
    # view of the other entry, which only a fresh validation can catch.
    scaler = make_scaler(face, init_scale=4.0, growth_interval=1000)
    survivor = new_array(8.0)
    gradients = [new_array(8.0), survivor]
    open_step(scaler)
    scaler.unscale_and_check(gradients)
    scaler.update()
    dead_id = id(gradients[0])
    gradients[0] = None
    keep = []
    newcomer = survivor.view()
    while id(newcomer) != dead_id and len(keep) < 1000:
        keep.append(newcomer)
        newcomer = survivor.view()
    assert id(newcomer) == dead_id, "the allocator never reused the id; this test needs it"
    open_step(scaler)
    with pytest.raises(DuplicateGradientError):
        scaler.unscale_and_check([newcomer, survivor])
    np.testing.assert_array_equal(survivor, new_array(2.0))  # unscaled by the first call only


def test_dead_gradient_in_a_list_with_none_entries_is_not_mistaken(face: Face) -> None:
    scaler = make_scaler(face, init_scale=4.0, growth_interval=1000)
    survivor = new_array(8.0)
    gradients = [None, new_array(8.0), survivor]
    open_step(scaler)
    scaler.unscale_and_check(gradients)
    scaler.update()
    del gradients
    gc.collect()
    survivor[...] = 8.0
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check([None, None, survivor]))
    np.testing.assert_array_equal(survivor, new_array(2.0))


def test_same_list_twice_in_one_step_raises_duplicate_and_unscales_once(face: Face) -> None:
    scaler = make_scaler(face, init_scale=4.0, growth_interval=1000)
    gradients = [new_array(8.0)]
    open_step(scaler)
    scaler.unscale_and_check(gradients)
    scaler.update()
    gradients[0][...] = 8.0
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check(gradients))  # recognised from the cache
    with pytest.raises(DuplicateGradientError, match="earlier unscale_and_check call of this step"):
        scaler.unscale_and_check(gradients)
    np.testing.assert_array_equal(gradients[0], new_array(2.0))


def test_reused_mapping_is_validated_on_every_call(face: Face) -> None:
    scaler = face(init_scale=2.0)
    w = np.ones(2, np.float32)
    grads: dict[str, Any] = {"w": w}
    open_step(scaler)
    scaler.unscale_and_check(grads)
    scaler.update()
    grads["w_again"] = w
    open_step(scaler)
    with pytest.raises(DuplicateGradientError, match="'w_again'"):
        scaler.unscale_and_check(grads)
    del grads["w_again"]
    grads["bias"] = np.zeros(2, np.int64)
    with pytest.raises(GradientTypeError, match="'bias'"):
        scaler.unscale_and_check(grads)
    assert w.tolist() == [0.5, 0.5]
    grads["bias"] = np.array([np.nan], np.float32)
    assert face.ok(scaler.unscale_and_check(grads)) is False
    assert scaler.nonfinite_gradients() == ["bias"]
    assert w.tolist() == [0.25, 0.25]


_OPS = ("same", "fill", "replace", "none", "append", "pop", "read_only", "writeable")
_VALUES = (1.0, 3.0, -2.5, 2.0**-24, 60000.0, INF, -INF, NAN)
_DTYPES = (np.float16, np.float32, np.float64)


@pytest.mark.parametrize("face", FACES)
@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(_OPS), st.integers(0, 7), st.sampled_from(_VALUES), st.sampled_from(_DTYPES)),
        min_size=1,
        max_size=10,
    )
)
def test_list_mutated_in_place_between_steps_matches_fresh_lists(
    face: Face, ops: list[tuple[str, int, float, Any]]
) -> None:
    cached, reference = make_scaler(face, init_scale=2.0**10), make_scaler(face, init_scale=2.0**10)
    gradients: list[np.ndarray | None] = [new_array(1.0), new_array(2.0, np.float16), None]
    step_both(face, cached, reference, gradients)
    for op, index, value, dtype in ops:
        position = index % len(gradients)
        target = gradients[position]
        if op == "fill" and target is not None and target.flags.writeable:
            target[...] = value
        elif op == "replace":
            gradients[position] = new_array(value, dtype)
        elif op == "none":
            gradients[position] = None
        elif op == "append":
            gradients.append(new_array(value, dtype))
        elif op == "pop" and len(gradients) > 1:
            gradients.pop(position)
        elif op in ("read_only", "writeable") and target is not None and not numpy_backend.LAYOUT_FIXED:
            target.flags.writeable = op == "writeable"
        step_both(face, cached, reference, gradients)


# GradientSet


def test_gradient_set_rejects_duplicate_array_at_construction() -> None:
    shared = new_array(1.0)
    with pytest.raises(DuplicateGradientError, match=r"gradient #0 and gradient #2 share memory") as info:
        GradientSet([shared, new_array(1.0), shared])
    assert isinstance(info.value, RuntimeError)
    assert isinstance(info.value, ValueError)


def test_gradient_set_rejects_overlapping_views_at_construction() -> None:
    base = np.ones(8, dtype=np.float32)
    with pytest.raises(DuplicateGradientError, match=r"gradient 'a' and gradient 'b' share memory"):
        GradientSet({"a": base[:5], "b": base[4:]})
    GradientSet({"a": base[:4], "b": base[4:]})  # adjacent, disjoint: accepted


def test_gradient_set_rejects_int_dtype_at_construction() -> None:
    with pytest.raises(GradientTypeError, match=r"gradient 'steps': dtype int64"):
        GradientSet({"w": new_array(1.0), "steps": np.arange(3, dtype=np.int64)})


def test_gradient_set_rejects_read_only_array_at_construction() -> None:
    frozen = new_array(1.0)
    frozen.flags.writeable = False
    with pytest.raises(GradientValueError, match=r"gradient #1 .*read-only"):
        GradientSet([new_array(1.0), frozen])


@pytest.mark.parametrize(
    ("gradients", "message"),
    [
        ([np.ones(2, np.float32), [1.0, 2.0]], r"gradient #1: expected a NumPy or CuPy float array, got list"),
        ({"w": np.ones(2, np.float32), "b": 3.0}, r"gradient 'b': expected a NumPy or CuPy float array, got float"),
        (np.ones(2, np.float32), r"got a single ndarray; wrap it in a list"),
        (42, r"expected an iterable of gradient arrays or a mapping name -> array, got int"),
    ],
)
def test_gradient_set_rejects_entries_of_other_kinds_at_construction(gradients: Any, message: str) -> None:
    with pytest.raises(GradientTypeError, match=message):
        GradientSet(gradients)


@pytest.mark.parametrize("kind", [list, tuple, dict])
def test_gradient_set_gives_the_same_results_as_plain_arguments(face: Face, kind: type) -> None:
    entries = [new_array(3.0), None, new_array(INF, np.float16), new_array(-7.0, np.float64)]
    names = ["a", "skipped", "b", "c"]

    def build() -> Any:
        copies = [None if e is None else e.copy() for e in entries]
        return dict(zip(names, copies, strict=True)) if kind is dict else kind(copies)

    as_set, plain = build(), build()
    set_scaler, plain_scaler = make_scaler(face), make_scaler(face)
    gradient_set = GradientSet(as_set)
    assert len(gradient_set) == 4
    for step in range(3):
        outcome = run_step(face, set_scaler, gradient_set)
        assert outcome == run_step(face, plain_scaler, plain)
        for actual, expected in zip(values_of(as_set), values_of(plain), strict=True):
            assert_same_bits(actual, expected)
        assert set_scaler.stats() == plain_scaler.stats()
        assert outcome[1] is (step > 0)
        assert outcome[2] == ([] if step > 0 else ["b"] if kind is dict else [2])
        if step == 0:
            (as_set["b"] if kind is dict else as_set[2])[...] = 1.0
            (plain["b"] if kind is dict else plain[2])[...] = 1.0


def test_gradient_set_reports_nonfinite_positions_counting_none_entries(face: Face) -> None:
    scaler = make_scaler(face)
    gradient_set = GradientSet((None, new_array(1.0), None, new_array(NAN), new_array(-INF)))
    open_step(scaler)
    assert not face.ok(scaler.unscale_and_check(gradient_set))
    assert scaler.nonfinite_gradients() == [3, 4]


def test_gradient_set_reports_nonfinite_names(face: Face) -> None:
    scaler = make_scaler(face)
    broken = new_array(INF)
    gradient_set = GradientSet({"fc1.W": new_array(1.0), "fc1.b": broken, "fc2.W": None})
    open_step(scaler)
    assert not face.ok(scaler.unscale_and_check(gradient_set))
    assert scaler.nonfinite_gradients() == ["fc1.b"]
    scaler.update()
    broken[...] = 2.0
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check(gradient_set))
    assert scaler.nonfinite_gradients() == []


def test_two_scalers_can_share_one_gradient_set(face: Face) -> None:
    first, second = make_scaler(face, init_scale=4.0), make_scaler(face, init_scale=8.0)
    weight = new_array(64.0)
    gradient_set = GradientSet([weight])
    open_step(first)
    assert face.ok(first.unscale_and_check(gradient_set))
    np.testing.assert_array_equal(weight, new_array(16.0))
    open_step(second)
    assert face.ok(second.unscale_and_check(gradient_set))
    np.testing.assert_array_equal(weight, new_array(2.0))
    first.update()
    second.update()
    weight[...] = 64.0
    open_step(first)
    assert face.ok(first.unscale_and_check(gradient_set))  # scale grew to 8
    np.testing.assert_array_equal(weight, new_array(8.0))
    weight[...] = INF
    open_step(second)
    assert not face.ok(second.unscale_and_check(gradient_set))
    assert second.nonfinite_gradients() == [0]
    assert first.nonfinite_gradients() == []


def test_two_gradient_sets_on_one_scaler_are_told_apart(face: Face) -> None:
    scaler = make_scaler(face, init_scale=4.0, growth_interval=1000)
    first, second = new_array(8.0), new_array(8.0)
    set_a, set_b = GradientSet({"a": first}), GradientSet({"b": None, "c": second})
    for _ in range(2):
        open_step(scaler)
        assert face.ok(scaler.unscale_and_check(set_a))
        assert face.ok(scaler.unscale_and_check(set_b))
        scaler.update()
    np.testing.assert_array_equal(first, new_array(0.5))
    second[...] = INF
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check(set_a))
    assert not face.ok(scaler.unscale_and_check(set_b))
    assert scaler.nonfinite_gradients() == ["c"]


def test_gradient_set_in_two_calls_of_one_step_raises_duplicate_and_unscales_once(face: Face) -> None:
    scaler = make_scaler(face, init_scale=4.0)
    weight = new_array(8.0)
    gradient_set = GradientSet([weight])
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check(gradient_set))
    with pytest.raises(RuntimeError, match="earlier unscale_and_check call of this step") as info:
        scaler.unscale_and_check(gradient_set)
    assert isinstance(info.value, DuplicateGradientError)
    np.testing.assert_array_equal(weight, new_array(2.0))
    # A plain list naming the same array in the same step is refused too.
    with pytest.raises(DuplicateGradientError):
        scaler.unscale_and_check([weight])
    scaler.update()
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check(gradient_set))  # a new step: fine again


@layout_changes
def test_gradient_set_member_made_read_only_later_is_refused_before_anything_is_modified(face: Face) -> None:
    scaler = make_scaler(face)
    first, second = new_array(8.0), new_array(8.0)
    gradient_set = GradientSet([first, second])
    second.flags.writeable = False
    open_step(scaler)
    try:
        scaler.unscale_and_check(gradient_set)
    except GradientValueError:
        pass
    except ValueError as exc:
        raise AssertionError(f"expected GradientValueError, got {type(exc).__name__}: {exc}") from exc
    else:
        raise AssertionError("a read-only member was accepted")
    np.testing.assert_array_equal(first, new_array(8.0))


# The cache keeps nothing alive, and holds several arguments


def test_cache_holds_no_strong_reference_to_gradients_in_a_list(face: Face) -> None:
    scaler = make_scaler(face)
    gradients = [new_array(1.0), None, new_array(2.0)]
    watchers = [weakref.ref(gradients[0]), weakref.ref(gradients[2])]
    for _ in range(2):
        open_step(scaler)
        scaler.unscale_and_check(gradients)
        scaler.update()
    del gradients
    gc.collect()
    assert [watcher() for watcher in watchers] == [None, None]
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check([new_array(1.0)]))  # the scaler is alive and working


def test_cache_holds_no_strong_reference_to_a_gradient_set(face: Face) -> None:
    scaler = make_scaler(face)
    weight = new_array(1.0)
    gradient_set = GradientSet({"w": weight})
    watchers: list[weakref.ref[Any]] = [weakref.ref(gradient_set), weakref.ref(weight)]
    for _ in range(2):
        open_step(scaler)
        scaler.unscale_and_check(gradient_set)
        scaler.update()
    del gradient_set, weight
    gc.collect()
    assert [watcher() for watcher in watchers] == [None, None]
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check(GradientSet([new_array(1.0)])))


def rotation_groups() -> list[Any]:
    """Seven distinct gradient arguments: more than the cache holds."""
    groups: list[Any] = [[new_array(float(i + 1)), None] for i in range(3)]
    groups.append({"x": new_array(1.0, np.float16), "y": None})
    groups.append((new_array(5.0),))
    groups.append(GradientSet([None, new_array(3.0, np.float64)]))
    groups.append(GradientSet({"z": new_array(6.0, np.float16)}))
    return groups


def test_more_distinct_arguments_than_cache_capacity_in_one_step_give_correct_results(face: Face) -> None:
    cached, reference = make_scaler(face), make_scaler(face)
    groups = rotation_groups()
    for step in range(6):
        shift = step % len(groups)
        open_step(cached)
        open_step(reference)
        for group in groups[shift:] + groups[:shift]:
            copies = fresh_copies(group)
            assert face.ok(cached.unscale_and_check(group)) is face.ok(reference.unscale_and_check(copies))
            for actual, expected in zip(values_of(group), values_of(copies), strict=True):
                assert_same_bits(actual, expected)
        assert cached.nonfinite_gradients() == reference.nonfinite_gradients()
        cached.update()
        reference.update()
        assert cached.stats() == reference.stats()
        if step == 2:
            groups[0][1] = new_array(INF)  # a list that has left the cache, mutated
        if step == 3:
            groups[0][1] = None
    assert [cached.stats().skipped_steps, cached.stats().steps] == [1, 6]


def test_more_distinct_arguments_than_cache_capacity_one_per_step_give_correct_results(face: Face) -> None:
    cached, reference = make_scaler(face), make_scaler(face)
    groups = rotation_groups()
    outcomes = []
    for step in range(3 * len(groups)):
        group = groups[step % len(groups)]
        if step == len(groups):
            group[0][...] = NAN  # the first list, evicted since its last call, now overflows
        if step == 2 * len(groups):
            group[0][...] = 1.0
        outcomes.append(step_both(face, cached, reference, group))
    overflowed = [index for index, (_, finite, _) in enumerate(outcomes) if not finite]
    assert overflowed == [len(groups)]
    assert outcomes[len(groups)][2] == [0]
