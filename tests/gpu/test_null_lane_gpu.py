"""A disabled GradScaler on CuPy arrays: its null lane (state_set.GuardSet) scales, unscales and claims nothing,
its check() still computes the statistics on the device (inverse scale 1), and the scaler keeps reporting the
last enabled step; the same calls on NumPy arrays give the same answers."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cupy_amp import GradScaler  # noqa: E402


def gradients(xp: Any) -> list[Any]:
    """Values no kernel may touch: a subnormal (-ftz would flush it), a NaN with a payload, an inf, -0."""
    half = np.array([6e-8, 1.5, -0.0, 3.0], np.float16)
    single = np.array([1e-40, 2.0, np.inf], np.float32)
    payload = np.array([0x7FC01234], np.uint32).view(np.float32)
    return [xp.asarray(half), xp.asarray(single), xp.asarray(payload)]


def bits(arrays: list[Any]) -> list[bytes]:
    return [(a.get() if hasattr(a, "get") else a).tobytes() for a in arrays]


def run(xp: Any) -> dict[str, Any]:
    scaler = GradScaler(init_scale=8.0, growth_interval=1)
    scaler.scale_loss(xp.ones((), xp.float32))
    scaler.unscale_and_check({"w": xp.ones(2, xp.float32), "b": xp.full(1, np.nan, xp.float32)})
    scaler.update()  # the last enabled step: overflowed at "b"
    reported = (scaler.nonfinite_gradients(), scaler.had_overflow(), scaler.journal_names(), scaler.stats())
    scaler.set_enabled(False)
    loss, grads = xp.full((), 3.0, xp.float32), gradients(xp)
    before = bits([loss, *grads])
    scaler.scale_loss(loss)
    assert scaler._guard.states == {}, "a disabled scale_loss placed a state"
    assert scaler.unscale_and_check(grads) is True
    assert scaler.unscale_and_check(grads) is True  # nothing claimed: the same gradients again
    scaler.update()
    assert bits([loss, *grads]) == before, "a disabled step wrote an array"
    finite = [xp.full(3, 0.5, xp.float32), xp.full(2, 1.5, xp.float16)]
    stats = scaler.check(finite, max_norm=1.0)
    norm, clip, ok = float(stats.norm), float(stats.clip_coefficient), bool(stats.finite)
    scaler.update()
    inf = scaler.check([xp.full(3, np.inf, xp.float32)])
    not_finite = bool(inf.finite)
    scaler.update()
    after = (scaler.nonfinite_gradients(), scaler.had_overflow(), scaler.journal_names(), scaler.stats())
    scaler.set_enabled(True)
    scaler.scale_loss(xp.ones((), xp.float32))
    scaler.unscale_and_check([xp.ones(2, xp.float32)])
    scaler.update()
    return {
        "reported": reported[:3],
        "unchanged": after[:3] == reported[:3] and after[3].scale == reported[3].scale,
        "check": (norm, clip, ok, not_finite),
        "resumed": scaler.stats().scale,
        "journal": scaler.journal()["step"].tolist(),
    }


def test_a_disabled_gradscaler_on_the_gpu_touches_nothing_and_reports_as_on_numpy() -> None:
    on_gpu, on_host = run(cupy), run(np)
    assert on_gpu["reported"] == (["b"], True, (("w", "b"),))
    assert on_gpu["unchanged"] and on_host["unchanged"]
    expected_norm = float(np.sqrt(np.float32(3 * 0.25 + 2 * 2.25)))
    assert on_gpu["check"][0] == pytest.approx(expected_norm, rel=1e-6)
    assert on_gpu["check"][2:] == (True, False)  # clean: apply; inf: skip (computed with inverse scale 1)
    assert on_gpu == on_host  # the same bits: norm, clip coefficient, verdicts, the resumed scale, the journal
    assert on_gpu["resumed"] == 8.0  # back from 4.0 (the overflow's backoff) after one clean enabled step
