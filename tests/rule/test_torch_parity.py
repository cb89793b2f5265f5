"""Parity with PyTorch's own torch.amp.GradScaler on the CPU, step by step.

Both scalers see identical float32 gradient sequences with planted inf/nan;
after every update() the scale (bit for bit), the growth tracker, the skip
decision and the unscaled gradients (bit for bit) must agree. Random
configurations are drawn per segment so growth, backoff and float32 overflow
of the grown scale all occur. The one intended difference: PyTorch's scale may
fall below 2**-128, where its float32 inverse is inf and finite gradients come
back inf/nan; ours stops at the smallest scale with a finite inverse, and a
segment that gets there stops comparing.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import open_step

from cupy_amp import GradScaler

torch = pytest.importorskip("torch")

SMALLEST_SCALE = float.fromhex("0x1.000008p-128")
SEGMENTS = 25
STEPS_PER_SEGMENT = 400  # 10,000 randomized steps in all


def _planted_gradients(rng: np.random.Generator, sizes: list[int], overflow_rate: float) -> list[np.ndarray]:
    magnitude = 10.0 ** rng.uniform(-6, 6)
    grads = [(rng.standard_normal(size) * magnitude).astype(np.float32) for size in sizes]
    if rng.random() < overflow_rate:
        target = grads[rng.integers(len(grads))]
        poison = rng.choice([np.inf, -np.inf, np.nan, np.float32(np.nan) * -1])
        target[rng.integers(target.size)] = poison
    return grads


def _run_segment(seed: int) -> dict[str, int]:
    rng = np.random.default_rng(seed)
    init_scale = float(np.float32(2.0 ** rng.uniform(-10, 40)))
    growth_factor = float(rng.choice([2.0, 1.5, 1.0001, float(rng.uniform(1.01, 8.0))]))
    backoff_factor = float(rng.choice([0.5, 0.25, 0.999, float(rng.uniform(0.01, 0.99))]))
    growth_interval = int(rng.integers(1, 12))
    overflow_rate = float(rng.choice([0.05, 0.3, 0.7]))
    sizes = [int(s) for s in rng.integers(1, 24, size=int(rng.integers(1, 5)))]

    ours = GradScaler(
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        min_scale=None,
        max_scale=None,
        hysteresis=1,
    )
    theirs = torch.amp.GradScaler(
        "cpu",
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
    )
    params = [torch.nn.Parameter(torch.zeros(size)) for size in sizes]
    optimizer = torch.optim.SGD(params, lr=0.0)
    torch_steps_taken = []
    real_step = optimizer.step

    def counting_step(*args: object, **kwargs: object) -> object:
        torch_steps_taken.append(True)
        return real_step(*args, **kwargs)

    optimizer.step = counting_step  # type: ignore[method-assign]
    seen = {"skips": 0, "growths": 0, "floor": 0}

    for step in range(STEPS_PER_SEGMENT):
        grads = _planted_gradients(rng, sizes, overflow_rate)
        for param, grad in zip(params, grads):
            param.grad = torch.from_numpy(grad.copy())

        loss = np.array(rng.standard_normal() * 10.0 ** rng.uniform(-3, 3), dtype=np.float32)
        their_loss = theirs.scale(torch.from_numpy(loss.copy()))
        ours.scale_loss(loss)
        assert loss.tobytes() == their_loss.numpy().tobytes(), (seed, step)

        finite = ours.unscale_and_check(grads)
        theirs.unscale_(optimizer)
        for index, (param, grad) in enumerate(zip(params, grads)):
            expected = param.grad.numpy()
            assert np.array_equal(grad.view(np.uint32), expected.view(np.uint32)), (seed, step, index)

        before = len(torch_steps_taken)
        theirs.step(optimizer)
        torch_stepped = len(torch_steps_taken) > before
        assert finite == torch_stepped, (seed, step)
        assert ours.had_overflow() == (not torch_stepped)

        old_scale = ours.scale_factor()
        ours.update()
        theirs.update()
        if theirs.get_scale() < SMALLEST_SCALE:
            assert ours.scale_factor() == SMALLEST_SCALE, (seed, step)
            seen["floor"] += 1
            break
        assert ours.scale_factor() == theirs.get_scale(), (seed, step)
        assert np.float32(ours.scale_factor()).tobytes() == np.float32(theirs.get_scale()).tobytes()
        assert ours.stats().consecutive_good_steps == theirs.state_dict()["_growth_tracker"], (seed, step)
        seen["skips"] += not finite
        seen["growths"] += ours.scale_factor() > old_scale
    return seen


def test_matches_torch_grad_scaler_over_10000_random_steps() -> None:
    totals = {"skips": 0, "growths": 0, "floor": 0}
    for seed in range(SEGMENTS):
        for key, value in _run_segment(seed).items():
            totals[key] += value
    # The random configurations must actually exercise both directions.
    assert totals["skips"] > 500
    assert totals["growths"] > 500


def test_below_the_smallest_scale_pytorch_makes_finite_gradients_inf_and_we_stop_at_the_floor() -> None:
    ours = GradScaler(init_scale=2.0**-126, backoff_factor=0.5, growth_interval=3, min_scale=None, max_scale=None)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**-126, backoff_factor=0.5, growth_interval=3)
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([param], lr=0.0)
    for step in range(4):  # 2**-126 -> 2**-127 -> 2**-128 (ours: SMALLEST_SCALE) -> 2**-129
        grad = np.array([1.0, np.inf, 3.0], dtype=np.float32)
        param.grad = torch.from_numpy(grad.copy())
        theirs.scale(torch.ones(()))
        open_step(ours)
        ours.unscale_and_check([grad])
        theirs.unscale_(optimizer)
        theirs.step(optimizer)
        ours.update()
        theirs.update()
        expected = max(2.0 ** (-127 - step), SMALLEST_SCALE)
        assert ours.scale_factor() == expected
        assert theirs.get_scale() == 2.0 ** (-127 - step)
    # Gradients as small as this scale makes them, whose unscaled values are ordinary numbers.
    finite = np.array([2.0**-130, -(2.0**-129), 3 * 2.0**-131], dtype=np.float32)
    finite_copy = finite.copy()
    param.grad = torch.from_numpy(finite.copy())
    theirs.scale(torch.ones(()))
    open_step(ours)
    assert ours.unscale_and_check([finite]) is True
    theirs.unscale_(optimizer)
    assert finite.tolist() == [float(np.float32(v * np.float32(1 / SMALLEST_SCALE))) for v in finite_copy]
    assert np.isinf(param.grad.numpy()).all()  # what PyTorch hands its optimizer at scale 2**-129
