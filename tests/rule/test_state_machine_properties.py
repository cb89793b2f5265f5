"""Property tests: both scaler faces against the reference model, step by step.

The sync-free face is always enabled: its examples draw no "disabled" steps and never start disabled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from helpers import FACES, GRAD_SCALER, Face, open_step
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from reference_model import (
    FLOAT32_MAX,
    RefConfig,
    RefScaler,
    f32,
    identical,
    is_overflowing,
    same_bits,
    scaled_loss,
    unscaled,
)

from cupy_amp import GradScalerCheckpoint

SMALLEST_SCALE = float.fromhex("0x1.000008p-128")  # the smallest float32 whose float32 inverse is finite
PROPERTY_SETTINGS = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

NAN_BITS = {
    np.float16: [0x7E00, 0x7C01, 0xFE3F, 0x7FFF],
    np.float32: [0x7FC00000, 0x7F800001, 0xFFC0BEEF, 0x7FFFFFFF],
    np.float64: [0x7FF8000000000000, 0x7FF0000000000001, 0xFFF80000DEADBEEF],
}
UINT = {np.float16: np.uint16, np.float32: np.uint32, np.float64: np.uint64}
KINDS = ["clean", "clean", "clean", "inf", "-inf", "nan", "nan_payload", "huge_finite"]


def float32s(low: float, high: float) -> st.SearchStrategy[float]:
    """float32 values in [low, high], boundaries and odd magnitudes included."""
    return st.floats(min_value=low, max_value=high, width=32, allow_nan=False, allow_infinity=False).map(float)


@st.composite
def configs(draw: st.DrawFn) -> RefConfig:
    growth_factor = draw(
        st.one_of(
            st.sampled_from([2.0, 1.5, 4.0, 1.0 + 2.0**-30, 1e30]),
            st.floats(min_value=1.0, max_value=1e6, exclude_min=True, allow_nan=False),
        )
    )
    backoff_factor = draw(
        st.one_of(
            st.sampled_from([0.5, 0.25, 1.0 - 2.0**-30, 1e-30]),
            st.floats(min_value=0.0, max_value=1.0, exclude_min=True, exclude_max=True),
        )
    )
    growth_interval = draw(st.integers(min_value=1, max_value=4))
    hysteresis = draw(st.integers(min_value=1, max_value=4))
    bound = st.one_of(float32s(SMALLEST_SCALE, FLOAT32_MAX), st.sampled_from([0.1, 0.3, 1.0, 1000.7, 2.0**24]))
    first, second = draw(bound), draw(bound)
    low, high = sorted([first, second], key=f32)
    min_scale = draw(st.sampled_from([None, low]))
    max_scale = draw(st.sampled_from([None, high]))
    lo = SMALLEST_SCALE if min_scale is None else f32(min_scale)
    hi = FLOAT32_MAX if max_scale is None else f32(max_scale)
    init_scale = draw(st.one_of(float32s(lo, hi), st.sampled_from([lo, hi])))
    return RefConfig(
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        min_scale=min_scale,
        max_scale=max_scale,
        hysteresis=hysteresis,
    )


@dataclass(frozen=True)
class Step:
    """One training step: what to plant in the gradients and how to pass them."""

    kind: str
    target: int  # which gradient gets the planted value
    element: int  # which element of it
    payload: int  # which NaN payload
    split: bool  # two unscale_and_check calls (list, then mapping) instead of one
    loss_dtype: Any


def steps_of(face: Face) -> st.SearchStrategy[Step]:
    """Steps for ``face``: GradScaler's include steps taken while disabled."""
    return st.builds(
        Step,
        kind=st.sampled_from([*KINDS, "disabled"] if face is GRAD_SCALER else KINDS),
        target=st.integers(0, 2),
        element=st.integers(0, 3),
        payload=st.integers(0, 2),
        split=st.booleans(),
        loss_dtype=st.sampled_from([np.float32, np.float64]),  # scale_loss refuses float16 losses
    )


def make_gradients(step: Step) -> list[np.ndarray]:
    """Three small gradients (fp16, a transposed fp32, a negatively strided fp64) with the planted value."""
    grads = [
        np.array([0.5, -3.0, 1000.0, 2.0**-20], np.float16),
        np.array([[1.0, -0.0], [7.5, 1e-38]], np.float32).T,
        np.array([1e300, -1.0, 3.25, 0.0, 5e-324, 2.0], np.float64)[::-2],
    ]
    target = grads[step.target]
    index = np.unravel_index(step.element % target.size, target.shape)
    dtype = target.dtype.type
    if step.kind == "inf":
        target[index] = np.inf
    elif step.kind == "-inf":
        target[index] = -np.inf
    elif step.kind == "nan":
        target[index] = np.nan
    elif step.kind == "nan_payload":
        target[index] = np.array([NAN_BITS[dtype][step.payload]], UINT[dtype]).view(dtype)[0]
    elif step.kind == "huge_finite":
        target[index] = np.finfo(dtype).max
    return grads


def assert_matches_reference(scaler: Any, ref: RefScaler) -> None:
    """Compare every field of stats() and checkpoint() (between steps) with the reference."""
    assert scaler.stats().to_dict() == ref.stats_dict()
    assert scaler.checkpoint().to_dict() == ref.checkpoint_dict()


def run_step(face: Face, scaler: Any, ref: RefScaler, step: Step, previous_overflow: bool) -> bool:
    """Drive one step through ``scaler`` (of ``face``), check it against ``ref``, and return had_overflow()."""
    grads = make_gradients(step)
    saved = [g.copy() for g in grads]
    loss = np.array([1.5, -2.0], step.loss_dtype)
    loss_saved = loss.copy()

    if step.kind == "disabled":
        scaler.set_enabled(False)
        ref.enabled = False
        assert scaler.scale_factor() == 1.0
        scaler.scale_loss(loss)
        assert identical(loss, loss_saved)
        assert scaler.unscale_and_check(grads) is True
        scaler.update()
        for grad, before in zip(grads, saved, strict=True):
            assert identical(grad, before)
        assert_matches_reference(scaler, ref)
        assert scaler.had_overflow() is previous_overflow
        scaler.set_enabled(True)
        ref.enabled = True
        return previous_overflow

    assert scaler.scale_factor() == ref.scale
    expected_loss = scaled_loss(loss, ref.scale)
    scaler.scale_loss(loss)
    assert same_bits(loss, expected_loss)

    expected = [unscaled(g, ref.scale) for g in grads]
    bad = [is_overflowing(g) for g in grads]
    overflow = any(bad)
    if step.split:
        first = face.ok(scaler.unscale_and_check([grads[0], None, grads[1]]))
        assert first is not (bad[0] or bad[1])
        second = face.ok(scaler.unscale_and_check({"head": grads[2]}))
        assert second is not (bad[0] or bad[1] or bad[2])  # each call answers for the step so far
        labels = [position for position, flag in ((0, bad[0]), (2, bad[1])) if flag]
        labels += ["head"] if bad[2] else []
    else:
        assert face.ok(scaler.unscale_and_check(grads)) is not overflow
        labels = [position for position, flag in enumerate(bad) if flag]
    for grad, want in zip(grads, expected, strict=True):
        assert same_bits(grad, want)
    assert scaler.had_overflow() is overflow
    assert scaler.nonfinite_gradients() == labels

    scaler.update()
    if step.split:  # the first call's arrays are grads[0] and grads[1] (None is left out), the second's grads[2]
        names, where = (("0", "2"), ("head",)), [(0, 0), (0, 1), (1, 0)]
    else:
        names, where = (("0", "1", "2"),), [(0, 0), (0, 1), (0, 2)]
    first = next((at for at, flag in zip(where, bad) if flag), (-1, -1))
    ref.step(overflow, sum(bad), first, names)
    assert_matches_reference(scaler, ref)
    assert scaler.had_overflow() is overflow
    assert scaler.nonfinite_gradients() == labels
    return overflow


@pytest.mark.parametrize("face", FACES)
@PROPERTY_SETTINGS
@given(config=configs(), data=st.data())
def test_scaler_follows_the_reference(face: Face, config: RefConfig, data: st.DataObject) -> None:
    steps = data.draw(st.lists(steps_of(face), min_size=1, max_size=30), label="steps")
    scaler = face(**config.kwargs())
    ref = RefScaler(config)
    assert_matches_reference(scaler, ref)
    overflow = False
    for step in steps:
        overflow = run_step(face, scaler, ref, step, overflow)
        note_coverage(ref)


def note_coverage(ref: RefScaler) -> None:
    """Record which corners of the rule an example reached (shown by --hypothesis-show-statistics)."""
    if ref.scale == 0.0:
        event("scale underflowed to 0")
    if ref.scale == ref.max_scale:
        event("scale at max_scale")
    if ref.scale == ref.min_scale:
        event("scale at min_scale")
    if ref.scale > 0 and f32(ref.scale * ref.config.growth_factor) == float("inf"):
        event("next growth would overflow float32")
    if ref.hysteresis_tracker not in (0, ref.config.hysteresis):
        event("hysteresis delaying a backoff")


@pytest.mark.parametrize("face", FACES)
@PROPERTY_SETTINGS
@given(config=configs(), data=st.data())
def test_checkpoint_round_trip_continues_identically(face: Face, config: RefConfig, data: st.DataObject) -> None:
    steps = data.draw(st.lists(steps_of(face), min_size=1, max_size=24), label="steps")
    cut = data.draw(st.integers(0, len(steps)), label="cut")
    start_disabled = face is GRAD_SCALER and data.draw(st.booleans(), label="start_disabled")
    original = face(**config.kwargs())
    ref = RefScaler(config)
    overflow = False
    for step in steps[:cut]:
        overflow = run_step(face, original, ref, step, overflow)

    if start_disabled:
        original.set_enabled(False)
        ref.enabled = False
    checkpoint = original.checkpoint()
    assert checkpoint.to_dict() == ref.checkpoint_dict()
    assert checkpoint.found_overflow_local is checkpoint.found_overflow
    assert checkpoint.remote_skipped_steps == 0
    # Through the file format and back, as a resumed run would read it.
    checkpoint = GradScalerCheckpoint.from_bytes(checkpoint.to_bytes())
    # Load into a scaler with a different configuration and some history of its own.
    resumed = face(init_scale=4.0, growth_interval=9, hysteresis=2, min_scale=None, max_scale=None)
    open_step(resumed)
    resumed.unscale_and_check([np.array([np.nan], np.float32)])
    resumed.update()
    resumed.load_checkpoint(checkpoint)
    assert resumed.stats() == original.stats()
    assert resumed.had_overflow() is original.had_overflow()
    assert resumed.scale_factor() == original.scale_factor()
    assert resumed.checkpoint() == checkpoint
    if start_disabled:
        for scaler in (original, resumed):
            scaler.set_enabled(True)
        ref.enabled = True

    twin = RefScaler(config)
    twin.__dict__.update({k: list(v) if isinstance(v, list) else v for k, v in ref.__dict__.items() if k != "config"})
    for step in steps[cut:]:
        overflow_a = run_step(face, original, ref, step, overflow)
        overflow_b = run_step(face, resumed, twin, step, overflow)
        assert overflow_a is overflow_b
        overflow = overflow_a
        assert resumed.stats() == original.stats()
        assert resumed.checkpoint() == original.checkpoint()


@pytest.mark.parametrize("face", FACES)
def test_trajectory_matches_pytorch(face: Face) -> None:
    """With both clamps off and hysteresis 1, the scale follows torch.amp's update exactly."""
    torch = pytest.importorskip("torch")

    @settings(max_examples=80, deadline=None)
    @given(
        init_scale=float32s(SMALLEST_SCALE, FLOAT32_MAX),
        growth_factor=st.floats(min_value=1.0, max_value=1e6, exclude_min=True),
        backoff_factor=st.floats(min_value=0.0, max_value=1.0, exclude_min=True, exclude_max=True),
        growth_interval=st.integers(1, 4),
        overflows=st.lists(st.booleans(), min_size=1, max_size=40),
    )
    def check(
        init_scale: float, growth_factor: float, backoff_factor: float, growth_interval: int, overflows: list[bool]
    ) -> None:
        scaler = face(
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            min_scale=None,
            max_scale=None,
        )
        torch_scale = torch.tensor([init_scale], dtype=torch.float32)
        torch_tracker = torch.zeros(1, dtype=torch.int32)
        for overflow in overflows:
            grad = np.array([np.inf if overflow else 1.0], np.float32)
            torch_grad = torch.from_numpy(grad.copy())
            found_inf = torch.zeros(1)
            inv = torch_scale.double().reciprocal().float()
            torch._amp_foreach_non_finite_check_and_unscale_([torch_grad], found_inf, inv)
            open_step(scaler)
            assert face.ok(scaler.unscale_and_check([grad])) is (found_inf.item() == 0.0)
            assert same_bits(grad, torch_grad.numpy())
            scaler.update()
            torch._amp_update_scale_(
                torch_scale, torch_tracker, found_inf, growth_factor, backoff_factor, growth_interval
            )
            stats = scaler.stats()
            if torch_scale.item() < SMALLEST_SCALE:
                # PyTorch's scale went below the smallest one whose inverse is finite; ours stops there.
                assert stats.scale == SMALLEST_SCALE
                return
            assert stats.scale == torch_scale.item()
            assert stats.consecutive_good_steps == torch_tracker.item()

    check()
