"""The step journal on a real GPU: the device's entries are the NumPy path's, in eager steps and in graph replays."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import capture

cupy = pytest.importorskip("cupy")

from cupy_amp import GradScaler, GradScalerCheckpoint, SyncFreeGradScaler, journal  # noqa: E402

FACES = [GradScaler, SyncFreeGradScaler]
BIG = 70_000  # float16 elements: several chunks of one tensor, so several blocks may find its inf


def gradients(xp: Any, planted: tuple[int, ...]) -> dict[str, Any]:
    """Four gradients of exactly summable values (any order of the sum gives the same bits), with inf planted
    in the gradients at ``planted`` (the big one in two far-apart chunks)."""
    grads = {
        "embed": xp.full(BIG, 0.5, xp.float16),
        "w": xp.asarray(np.arange(6, dtype=np.float32).reshape(3, 2).T),  # transposed: strided
        "b": xp.full(5, 2.0, xp.float16),
        "head": xp.full(4, -1.0, xp.float32),
    }
    for position in planted:
        name = list(grads)[position]
        grads[name][(-1,) * grads[name].ndim] = xp.inf  # an index, not a reshape: "w" is a strided view
        if name == "embed":
            grads[name][7] = -xp.inf
    return grads


# (planted culprits, how the step passes its gradients): one unscale_and_check, two calls, or check().
SCRIPT = [
    ((), "one"), ((), "check"), ((3,), "one"), ((), "two"), ((0, 2), "two"), ((), "one"), ((), "one"),
    ((1,), "check"), ((), "check"), ((2, 3), "one"), ((), "two"), ((), "one"),
]  # fmt: skip


def run(face: type, xp: Any) -> tuple[np.ndarray, tuple[tuple[str, ...], ...], list[str]]:
    scaler = face(init_scale=2.0**10, growth_interval=2, hysteresis=2, max_scale=2.0**12)
    seen = []
    for planted, mode in SCRIPT:
        grads = gradients(xp, planted)
        scaler.scale_loss(xp.ones((), xp.float32))
        if mode == "check":
            scaler.check(grads, max_norm=3.0)
        elif mode == "two":
            items = list(grads.items())
            scaler.unscale_and_check(dict(items[:2]))
            scaler.unscale_and_check([value for _, value in items[2:]])
        else:
            scaler.unscale_and_check(grads)
        scaler.update()
        seen.append(str(scaler.nonfinite_gradients()))
    return scaler.journal(), scaler.journal_names(), seen


@pytest.mark.parametrize("face", FACES, ids=lambda face: face.__name__)
def test_the_devices_journal_is_the_numpy_paths_bit_for_bit(face: type) -> None:
    host, host_names, host_seen = run(face, np)
    device, device_names, device_seen = run(face, cupy)
    assert device_seen == host_seen
    assert device_names == host_names
    assert len(device) == len(SCRIPT)
    assert device.tobytes() == host.tobytes()
    # The entries say what happened: counts (a tensor counted once, however many blocks found it), the first
    # culprit, the skips, and check()'s norm only in check() steps.
    assert device["culprits"].tolist() == [len(planted) for planted, _ in SCRIPT]
    assert device["agreed"].tolist() == [int(bool(planted)) for planted, _ in SCRIPT]
    checked = np.array([mode == "check" for _, mode in SCRIPT])
    assert np.isnan(device["norm"][~checked]).all() and not np.isnan(device["norm"][checked]).any()
    fifth = device[4]  # two calls; inf in "embed" (call 0, position 0) and "b" (call 1, position 0)
    assert (fifth["culprit_call"], fifth["culprit"]) == (0, 0)
    tenth = device[9]  # one call; inf in "b" and "head"
    assert device_names[tenth["culprit_call"]][tenth["culprit"]] == "b"
    assert set(device["action"].tolist()) >= {journal.KEPT, journal.GREW, journal.HELD, journal.BACKED_OFF}


def test_a_captured_step_journals_every_replay() -> None:
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        grad = cupy.full(BIG, 0.25, cupy.float16)
        scaler = SyncFreeGradScaler(init_scale=2.0**8, growth_interval=3)
        prepared = scaler.prepare([grad])
        loss = cupy.ones((), cupy.float32)
        scaler.scale_loss(loss)
        scaler.check(prepared, max_norm=1.0)
        scaler.update()
        graph = capture(
            stream, lambda: (scaler.scale_loss(loss), scaler.check(prepared, max_norm=1.0), scaler.update())
        )
        reference = GradScaler(init_scale=2.0**8, growth_interval=3)
        host = np.full(BIG, 0.25, np.float16)
        reference.scale_loss(np.ones((), np.float32))
        reference.check([host.copy()], max_norm=1.0)
        reference.update()
        for replay in range(10):
            grad.fill(0.25)
            planted = host.copy()
            if replay in (2, 3, 7):
                grad[BIG - 1] = cupy.inf
                planted[BIG - 1] = np.inf
            graph.launch(stream)
            reference.scale_loss(np.ones((), np.float32))
            reference.check([planted], max_norm=1.0)
            reference.update()
        stream.synchronize()
    assert scaler.journal().tobytes() == reference.journal().tobytes()
    assert scaler.journal()["culprits"].tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 1, 0, 0]


@pytest.mark.parametrize("face", FACES, ids=lambda face: face.__name__)
def test_a_checkpoint_carries_the_journal_to_a_scaler_on_the_gpu(face: type) -> None:
    entries, names, _ = run(face, cupy)
    scaler = face(init_scale=2.0**10, growth_interval=2, hysteresis=2, max_scale=2.0**12)
    for planted, _mode in SCRIPT:
        scaler.scale_loss(cupy.ones((), cupy.float32))
        scaler.unscale_and_check(gradients(cupy, planted))
        scaler.update()
    saved = GradScalerCheckpoint.from_bytes(scaler.checkpoint().to_bytes())
    resumed = face(journal=5)
    resumed.scale_loss(cupy.ones((), cupy.float32))  # placed on the GPU before the load
    resumed.unscale_and_check([cupy.ones(3, cupy.float32)])
    resumed.update()
    resumed.load_checkpoint(saved)
    assert resumed.journal().tobytes() == saved.journal_entries()[-5:].tobytes()  # the newest that fit
    assert resumed.journal_names() == saved.journal_names
    resumed.scale_loss(cupy.ones((), cupy.float32))
    resumed.unscale_and_check(gradients(cupy, (1,)))
    resumed.update()
    after = resumed.journal()
    assert after["step"].tolist() == list(range(len(SCRIPT) - 3, len(SCRIPT) + 2))
    assert (after[-1]["culprits"], after[-1]["culprit"]) == (1, 1)


def test_a_scaler_placed_on_the_gpu_keeps_the_steps_it_made_before_any_array() -> None:
    # A guard's steps need no scale_loss: its first step (a rank without gradients) runs on the state that
    # stands for the scaler before any array; the state placed on the GPU then carries that step's entry.
    scaler = GradScaler.guard()
    scaler.unscale_and_check([])
    scaler.update()
    scaler.unscale_and_check([cupy.ones(2, cupy.float32), cupy.array([cupy.nan], cupy.float32)])
    scaler.update()
    entries = scaler.journal()
    assert entries["step"].tolist() == [1, 2]
    assert entries["agreed"].tolist() == [0, 1] and entries["culprit"].tolist() == [-1, 1]
    assert entries["action"].tolist() == [journal.KEPT, journal.AT_FLOOR]


@pytest.mark.parametrize("rule", ["pytorch", "headroom"])
def test_an_update_interrupted_at_any_line_journals_the_checks_norm(rule: str) -> None:
    # A repair of the state from the host mirror (after an interrupted update()) keeps the step's mark that
    # its check() finished, so the retried rule journals the norm (and the headroom rule reads it), as the
    # NumPy path does: the device's state and journal are those of an uninterrupted update().
    from interrupts import interrupted

    def checked(scaler: GradScaler) -> float:
        scaler.scale_loss(cupy.ones((), cupy.float32))
        return float(scaler.check([cupy.full(4, 8.0, cupy.float32)], max_norm=1.0).norm)

    whole, two = (GradScaler(init_scale=4.0, growth_interval=1, rule=rule) for _ in range(2))
    for steps in ([whole], [two, two]):
        for scaler in steps:
            checked(scaler)
            scaler.update()
    k, reached = 1, True
    while reached:
        scaler = GradScaler(init_scale=4.0, growth_interval=1, rule=rule)
        norm = checked(scaler)
        reached = interrupted(scaler.update, k)
        if scaler.is_step_open():
            scaler.update()
        (entry,) = scaler.journal()
        assert (entry["norm"], entry["clip_coefficient"]) == (norm, np.float32(1.0 / (norm + 1e-6))), f"line {k}"
        assert scaler.checkpoint() == whole.checkpoint(), f"line {k}"
        checked(scaler)  # the device's state goes on as the mirror's: its next entry is the uninterrupted one's
        scaler.update()
        assert scaler.checkpoint() == two.checkpoint(), f"line {k}"
        k += 1


def report_gradients(xp: Any, step: int) -> list[Any]:
    """Gradients of four dtypes (two chunks of one): zeros, float16 subnormals, equal largest magnitudes in
    two of them (the lower position is named), and a float64 beyond float32's range in one step."""
    rng = np.random.default_rng(step)
    half = (rng.standard_normal(BIG) * 4).astype(np.float16)
    half[rng.random(BIG) < 0.2] = 0.0
    half[:50] = np.float16(2.0**-20)  # subnormal in float16
    single = rng.standard_normal(300).astype(np.float32)
    single[7] = float(np.abs(half).max())  # as large as the float16 one, at a later position: not named
    double = rng.standard_normal(40) * (1e300 if step == 2 else 1.0)
    grads = [half, single, double, np.zeros(3, np.float32)]
    if step == 1:
        grads[1][3] = np.inf  # an overflowing step: the largest finite magnitude is still reported
    return [xp.asarray(grad) for grad in grads]


@pytest.mark.parametrize("face", FACES, ids=lambda face: face.__name__)
def test_the_reports_journal_fields_are_the_numpy_paths(face: type) -> None:
    def run_report(xp: Any) -> np.ndarray:
        scaler = face(init_scale=2.0**4, growth_interval=2)
        for step in range(5):
            scaler.scale_loss(xp.ones((), xp.float32))
            scaler.check(report_gradients(xp, step), max_norm=1.0, report=step != 3)
            scaler.update()
        return scaler.journal()

    host, device = run_report(np), run_report(cupy)
    assert device.tobytes() == host.tobytes()
    assert np.isnan(device["amax"][3]) and device["amax_position"][3] == -1  # no report in that step
    assert device["amax"][2] == np.finfo(np.float32).max and device["amax_position"][2] == 2
    assert (device["amax_call"][0], device["amax_position"][0]) == (0, 0)
    assert 0.2 < device["zero_fraction"][0] < 0.3 and device["subnormal_fraction"][0] > 0
