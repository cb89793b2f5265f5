"""No silent wrong update: a step opens at scale_loss, and scale_loss refuses a float16 loss.

A gradient call in a step that had no ``scale_loss`` would unscale gradients
that were never scaled (scale times too small); a float16 loss times the
scale is inf in float16. Both are refused on both faces, before anything is
touched. Scalers whose scale is fixed at 1 (guards, a disabled GradScaler)
need no ``scale_loss``; the float16 refusal holds for every scaler.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fake_comm import FakeVote, FakeWorld, run_ranks
from helpers import Face, bits, open_step

from cupy_amp import GradientTypeError, GradScaler, ScalerProtocolError, SyncFreeGradScaler
from cupy_amp.rule import ScalerConfig
from cupy_amp.step import scale_fixed_at_one

CALLS = ["unscale_and_check", "check"]


def gradients() -> list[np.ndarray]:
    """Gradients with an inf, so that a refused call which counted anything would show an overflow."""
    return [np.full(3, 8.0, np.float32), np.array([np.inf, 4.0], np.float16), np.full(2, 2.0, np.float64)]


def gradient_call(scaler: Any, name: str, grads: Any) -> Any:
    return getattr(scaler, name)(grads)


def observable(scaler: Any) -> tuple[Any, ...]:
    """Everything a caller can read of the scaler between steps, the checkpoint's bytes included."""
    return (
        scaler.stats(),
        scaler.had_overflow(),
        list(scaler.nonfinite_gradients()),
        scaler.scale_factor(),
        scaler.checkpoint().to_bytes(),
    )


@pytest.mark.parametrize("name", CALLS)
def test_a_gradient_call_without_scale_loss_is_refused_and_changes_nothing(face: Face, name: str) -> None:
    scaler = face(init_scale=4.0)
    grads = gradients()
    saved = [bits(g).copy() for g in grads]
    before = observable(scaler)
    with pytest.raises(ScalerProtocolError, match=r"had no scale_loss\(\)") as info:
        gradient_call(scaler, name, grads)
    message = str(info.value)
    assert message.startswith(f"{name}() was called")
    assert "call scaler.scale_loss(loss) before the backward pass" in message
    assert "scale times too small" in message
    assert isinstance(info.value, RuntimeError)
    for grad, old in zip(grads, saved, strict=True):
        np.testing.assert_array_equal(bits(grad), old)  # untouched, the inf included
    assert observable(scaler) == before  # no overflow counted, and no step open (checkpoint() works)
    with pytest.raises(ScalerProtocolError, match="without an unscale_and_check"):
        scaler.update()  # the refused call opened no step
    # The next proper step works as if nothing had happened.
    grads[1][0] = 4.0
    open_step(scaler)
    finite = gradient_call(scaler, name, grads)
    assert (face.ok(finite) if name == "unscale_and_check" else bool(finite.finite)) is True
    if name == "unscale_and_check":
        assert [g.tolist() for g in grads] == [[2.0] * 3, [1.0, 1.0], [0.5, 0.5]]
    scaler.update()
    stats = scaler.stats()
    assert (stats.steps, stats.skipped_steps, stats.scale) == (1, 0, 4.0)


@pytest.mark.parametrize("name", CALLS)
def test_every_step_opens_at_its_own_scale_loss(face: Face, name: str) -> None:
    scaler = face(init_scale=4.0)
    open_step(scaler)
    gradient_call(scaler, name, [np.ones(2, np.float32)])
    scaler.update()
    with pytest.raises(ScalerProtocolError, match=r"had no scale_loss\(\)"):
        gradient_call(scaler, name, [np.ones(2, np.float32)])  # the last step's scale_loss does not count
    assert scaler.stats().steps == 1


def test_gradient_accumulation_scales_each_loss_and_unscales_disjoint_gradients(face: Face) -> None:
    scaler = face(init_scale=4.0, growth_interval=1000)
    first, second = [np.full(2, 8.0, np.float32)], {"head": np.full(3, 16.0, np.float32)}
    losses = [np.array(1.5, np.float32), np.array(2.5, np.float32)]
    for loss in losses:  # one scale_loss per micro-batch
        scaler.scale_loss(loss)
    assert [float(loss) for loss in losses] == [6.0, 10.0]
    assert face.ok(scaler.unscale_and_check(first)) is True
    assert face.ok(scaler.unscale_and_check(second)) is True  # a later call of the same step
    assert first[0].tolist() == [2.0, 2.0] and second["head"].tolist() == [4.0] * 3
    scaler.update()
    assert (scaler.stats().steps, scaler.stats().skipped_steps) == (1, 0)


@pytest.mark.parametrize("name", CALLS)
def test_a_guard_scaler_needs_no_scale_loss(face: Face, name: str) -> None:
    scaler = face.cls.guard()
    for step in range(3):
        grads = [np.array([np.inf if step == 1 else 3.0, 2.0], np.float32)]
        verdict = gradient_call(scaler, name, grads)
        finite = face.ok(verdict) if name == "unscale_and_check" else bool(verdict.finite)
        assert finite is (step != 1)
        assert grads[0][1] == 2.0  # a scale of 1: unscaled or read, the values are the same
        scaler.update()
    assert (scaler.stats().steps, scaler.stats().skipped_steps, scaler.scale_factor()) == (3, 1, 1.0)


@pytest.mark.parametrize(
    ("kwargs", "exempt"),
    [
        ({"init_scale": 1.0, "min_scale": 1.0, "max_scale": 1.0}, True),  # what guard() builds
        ({"init_scale": 1.0, "min_scale": None, "max_scale": 1.0}, False),  # a backoff takes it below 1
        ({"init_scale": 1.0, "min_scale": 1.0, "max_scale": 2.0}, False),  # a growth takes it above 1
        ({"init_scale": 2.0, "min_scale": 2.0, "max_scale": 2.0}, False),  # fixed, but not at 1
    ],
)
def test_only_a_scale_fixed_at_one_is_exempt(face: Face, kwargs: dict[str, Any], exempt: bool) -> None:
    assert scale_fixed_at_one(ScalerConfig(**{k: v for k, v in kwargs.items() if k != "init_scale"})) is exempt
    scaler = face(**kwargs)
    grads = [np.full(2, 4.0, np.float32)]
    if exempt:
        assert face.ok(scaler.unscale_and_check(grads)) is True
    else:
        with pytest.raises(ScalerProtocolError, match=r"had no scale_loss\(\)"):
            scaler.unscale_and_check(grads)
        assert grads[0].tolist() == [4.0, 4.0]


def test_a_guard_that_loads_a_scaling_checkpoint_needs_scale_loss_again(face: Face) -> None:
    scaler = face.cls.guard()
    scaler.load_checkpoint(GradScaler(init_scale=8.0).checkpoint())
    grads = [np.full(2, 4.0, np.float32)]
    with pytest.raises(ScalerProtocolError, match=r"had no scale_loss\(\)"):
        scaler.unscale_and_check(grads)
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check(grads)) is True
    assert grads[0].tolist() == [0.5, 0.5]


@pytest.mark.parametrize("name", CALLS)
def test_a_disabled_grad_scaler_needs_no_scale_loss_until_it_is_enabled(name: str) -> None:
    scaler = GradScaler(init_scale=4.0, enabled=False)
    grads = [np.full(2, 8.0, np.float32)]
    gradient_call(scaler, name, grads)
    assert grads[0].tolist() == [8.0, 8.0]  # disabled: nothing unscaled
    scaler.update()
    scaler.set_enabled(True)
    with pytest.raises(ScalerProtocolError, match=r"had no scale_loss\(\)"):
        gradient_call(scaler, name, grads)
    open_step(scaler)
    gradient_call(scaler, name, grads)
    scaler.update()
    assert scaler.stats().steps == 1


@pytest.mark.parametrize("name", CALLS)
def test_with_a_communicator_every_rank_refuses_alike_and_nobody_joins(face: Face, name: str) -> None:
    # Every rank runs the same loop, so every rank makes the same refused call: none may wait in a
    # collective, and joining as an overflow would count a skip for a step that never opened.
    world = FakeWorld(2, timeout=3.0)

    def body(world: FakeWorld, rank: int) -> tuple[Any, ...]:
        scaler = face(init_scale=4.0, comm=FakeVote(world, rank))
        grads = [np.full(2, 8.0, np.float32)]
        with pytest.raises(ScalerProtocolError, match=r"had no scale_loss\(\)"):
            gradient_call(scaler, name, grads)
        refused = (world.vote_count(rank), scaler.had_overflow(), grads[0].tolist())
        world.sync()  # both ranks refused before either goes on
        open_step(scaler)
        gradient_call(scaler, name, grads)
        scaler.update()
        joined = world.vote_count(rank)
        return refused, joined, scaler.stats().steps, scaler.stats().skipped_steps

    assert run_ranks(world, body) == [((0, False, [8.0, 8.0]), 1, 1, 0)] * 2


SCALERS = {
    "GradScaler": GradScaler,
    "GradScaler.guard": GradScaler.guard,
    "GradScaler-disabled": lambda: GradScaler(enabled=False),
    "SyncFree": SyncFreeGradScaler,
    "SyncFree.guard": SyncFreeGradScaler.guard,
}


@pytest.mark.parametrize("shape", [(), (3,)])
@pytest.mark.parametrize("make", list(SCALERS.values()), ids=list(SCALERS))
def test_scale_loss_refuses_a_float16_loss_on_every_scaler(make: Any, shape: tuple[int, ...]) -> None:
    # Guards and a disabled scaler scale by 1, where nothing would overflow; they refuse all the same, so
    # that a loop does not break when scaling is turned on (and a guard needs no scale_loss at all).
    scaler = make()
    loss = np.full(shape, 1.5, np.float16)
    before = observable(scaler)
    with pytest.raises(GradientTypeError, match="float16 loss") as info:
        scaler.scale_loss(loss)
    assert isinstance(info.value, TypeError)
    assert "Compute the loss in float32" in str(info.value) and "inf in float16" in str(info.value)
    assert np.all(loss == 1.5)
    assert observable(scaler) == before  # no step opened: checkpoint() still works
    scaler.scale_loss(loss.astype(np.float32))  # the same loss in float32 is taken


# abandon_step(): a step whose backward pass failed, dropped before any gradient call.


@pytest.mark.parametrize("name", CALLS)
def test_is_step_open_from_the_first_call_of_a_step_until_it_ends(face: Face, name: str) -> None:
    scaler = face(init_scale=4.0)
    assert not scaler.is_step_open()
    open_step(scaler)
    assert scaler.is_step_open()
    scaler.abandon_step()
    assert not scaler.is_step_open()
    open_step(scaler)
    gradient_call(scaler, name, [np.full(2, 8.0, np.float32)])
    assert scaler.is_step_open()  # update() is due: abandon_step() would be refused
    scaler.update()
    assert not scaler.is_step_open()
    guard = face.cls.guard()
    gradient_call(guard, name, [np.full(2, 8.0, np.float32)])  # a guard's step opens at its gradient call
    assert guard.is_step_open()


def test_abandon_step_after_scale_loss_leaves_the_scaler_as_before_the_step(face: Face) -> None:
    scaler = face(init_scale=4.0, growth_interval=1)
    open_step(scaler)
    scaler.unscale_and_check([np.array([np.inf], np.float32)])
    scaler.update()  # a step with a verdict and a culprit, which the abandoned step must not hide
    before = observable(scaler)
    open_step(scaler)
    with pytest.raises(ScalerProtocolError, match=r"in the middle of a step .* abandon_step\(\) drops the step"):
        scaler.checkpoint()  # the Ctrl-C handler's save, refused while the loss is scaled
    scaler.abandon_step()
    assert observable(scaler) == before  # no step counted, the last verdict and culprits kept, checkpoint() works
    scaler.abandon_step()  # between steps: nothing to do
    assert observable(scaler) == before
    with pytest.raises(ScalerProtocolError, match="without an unscale_and_check"):
        scaler.update()  # the dropped step left nothing to end
    with pytest.raises(ScalerProtocolError, match=r"had no scale_loss\(\)"):
        scaler.unscale_and_check([np.ones(2, np.float32)])  # its scale_loss does not open the next step
    # The next step runs as if the abandoned one had never been: the same as a scaler that never saw it.
    twin = face(init_scale=4.0, growth_interval=1)
    twin.load_checkpoint(scaler.checkpoint())
    for each in (scaler, twin):
        open_step(each)
        each.unscale_and_check([np.full(2, 8.0, np.float32)])
        each.update()
    assert observable(scaler) == observable(twin)
    assert scaler.stats().steps == 2 and scaler.scale_factor() == 4.0


@pytest.mark.parametrize("name", CALLS)
@pytest.mark.parametrize("bad", [False, True], ids=["finite", "inf"])
def test_abandon_step_after_a_gradient_call_is_refused_and_changes_nothing(face: Face, name: str, bad: bool) -> None:
    scaler = face(init_scale=4.0)
    open_step(scaler)
    gradient_call(scaler, name, [np.array([np.inf if bad else 8.0], np.float32)])
    with pytest.raises(ScalerProtocolError, match=r"abandon_step\(\) was called after .* Call update\(\)"):
        scaler.abandon_step()
    scaler.update()  # the step's verdict is applied as it would have been
    assert (scaler.stats().steps, scaler.stats().skipped_steps) == (1, int(bad))


def test_abandon_step_after_a_failed_gradient_call_is_refused(face: Face, monkeypatch: pytest.MonkeyPatch) -> None:
    # A call that fails once it may have written counts the step as an overflow: that step must reach update().
    from cupy_amp.twins.step_state import HostState

    def broken(self: Any, call: Any, number: int = 0) -> Any:
        raise RuntimeError("the device broke")

    scaler = face(init_scale=4.0)
    open_step(scaler)
    monkeypatch.setattr(HostState, "unscale", broken)
    with pytest.raises(RuntimeError, match="the device broke"):
        scaler.unscale_and_check([np.full(2, 8.0, np.float32)])
    monkeypatch.undo()
    with pytest.raises(ScalerProtocolError, match=r"abandon_step\(\) was called after"):
        scaler.abandon_step()
    scaler.update()
    assert scaler.stats().skipped_steps == 1
