"""The headroom rule on a real GPU: the kernel's update_state follows cupy_amp.rule.headroom_state bit for bit,
in eager steps of both faces and in a captured step's replays."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import capture

cupy = pytest.importorskip("cupy")

from cupy_amp import GradScaler, SyncFreeGradScaler, journal  # noqa: E402

FACES = [GradScaler, SyncFreeGradScaler]
BIG = 70_000  # float16 elements: several blocks sum the norm


def values(step: int, scale: float, ceiling: float) -> np.ndarray:
    """A float16 gradient whose norm drifts by odd factors (so the rule's float64 estimate rounds), scaled
    by ``scale``, with inf once the scale passes this step's ceiling."""
    grad = np.full(BIG, 0.5 + (step % 7) / 13.0, np.float32) / (1 + step // 9)
    grad[: 1 + step % 5] *= 3.0
    if scale * float(grad.max()) > ceiling:
        grad[BIG // 2] = np.inf
    return (grad * np.float32(min(scale, 2.0**12))).astype(np.float16)  # float16 holds what the scale leaves


def run(face: type, xp: Any, start: float, steps: int = 40) -> tuple[bytes, bytes]:
    scaler = face(init_scale=start, growth_interval=4, min_scale=1.0, max_scale=2.0**30, rule="headroom")
    for step in range(steps):
        scale = float(scaler.stats().scale)
        scaler.scale_loss(xp.ones((), xp.float32))
        grads = [xp.asarray(values(step, scale, 2.0**12)), xp.full(3, 0.125, xp.float32)]
        if step % 6 == 5:
            scaler.unscale_and_check(grads)  # no norm: the rule's estimate waits for the next check()
        else:
            scaler.check(grads, max_norm=1.0)
        scaler.update()
    return scaler.checkpoint().to_bytes(), scaler.journal().tobytes()


@pytest.mark.parametrize("start", [1.0, 2.0**10, 2.0**24])
@pytest.mark.parametrize("face", FACES, ids=lambda face: face.__name__)
def test_the_devices_rule_is_the_numpy_paths_bit_for_bit(face: type, start: float) -> None:
    host = run(face, np, start)
    device = run(face, cupy, start)
    assert device == host
    assert run(GradScaler if face is SyncFreeGradScaler else SyncFreeGradScaler, cupy, start) == device


def test_a_captured_step_follows_the_rule_in_every_replay() -> None:
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        grad = cupy.zeros(BIG, cupy.float16)
        scaler = SyncFreeGradScaler(init_scale=2.0**20, growth_interval=2, rule="headroom", max_scale=None)
        reference = GradScaler(init_scale=2.0**20, growth_interval=2, rule="headroom", max_scale=None)
        prepared = scaler.prepare([grad])
        loss = cupy.ones((), cupy.float32)

        def step() -> None:
            scaler.scale_loss(loss)
            scaler.check(prepared, max_norm=1.0)
            scaler.update()

        grad.fill(0.25)
        step()
        graph = capture(stream, step)
        reference.scale_loss(np.ones((), np.float32))
        reference.check([np.full(BIG, 0.25, np.float16)], max_norm=1.0)
        reference.update()
        for replay in range(24):
            # The scale moves with every replay, which no host sees: the buffer gets what the scale the
            # reference holds would give, so the device's rule must have moved the same way.
            host = values(replay, reference.scale_factor(), 2.0**14)
            grad.set(host)
            graph.launch(stream)
            reference.scale_loss(np.ones((), np.float32))
            reference.check([host], max_norm=1.0)
            reference.update()
        stream.synchronize()
    assert scaler.journal().tobytes() == reference.journal().tobytes()
    assert scaler.checkpoint().to_bytes() == reference.checkpoint().to_bytes()
    assert len({float(scale) for scale in reference.journal()["scale"]}) > 3  # the rule did move the scale


@pytest.mark.parametrize("face", FACES, ids=lambda face: face.__name__)
def test_subnormal_scales_follow_the_rule_as_on_the_host(face: type) -> None:
    # Without a floor the descent reaches 2**-128 + 2**-149, a float32 subnormal, and the rule's memory holds
    # such scales: a zero test in float32 under -ftz would take them for "none" and climb instead.
    def subnormal_run(xp: Any) -> tuple[bytes, bytes]:
        scaler = face(init_scale=2.0**-100, min_scale=None, max_scale=None, growth_interval=2, rule="headroom")
        for step in range(24):
            scaler.scale_loss(xp.ones((), xp.float32))
            grad = xp.full(4, 0.5, xp.float32)
            if step < 8 or step in (12, 13, 17):
                grad[1] = xp.inf
            scaler.check([grad], max_norm=1.0)
            scaler.update()
        return scaler.checkpoint().to_bytes(), scaler.journal().tobytes()

    host = subnormal_run(np)
    assert subnormal_run(cupy) == host
    scales = np.frombuffer(host[1], dtype=journal.ENTRY)["scale"]
    assert scales.min() < np.finfo(np.float32).tiny  # the run did reach subnormal scales
