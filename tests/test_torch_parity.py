"""Parity with PyTorch's own torch.amp.GradScaler on the CPU, step by step.

Both scalers see identical float32 gradient sequences with planted inf/nan;
after every update() the scale (bit for bit), the growth tracker, the skip
decision and the unscaled gradients (bit for bit) must agree. Random
configurations are drawn per segment so growth, backoff, float32 overflow of
the grown scale and underflow of the scale to 0 all occur.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupy_amp import GradScaler

torch = pytest.importorskip("torch")

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
    seen = {"skips": 0, "growths": 0, "zero_scale": 0}

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
        assert ours.scale_factor() == theirs.get_scale(), (seed, step)
        assert np.float32(ours.scale_factor()).tobytes() == np.float32(theirs.get_scale()).tobytes()
        assert ours.stats().consecutive_good_steps == theirs.state_dict()["_growth_tracker"], (seed, step)
        seen["skips"] += not finite
        seen["growths"] += ours.scale_factor() > old_scale
        seen["zero_scale"] += ours.scale_factor() == 0.0
    return seen


def test_matches_torch_grad_scaler_over_10000_random_steps() -> None:
    totals = {"skips": 0, "growths": 0, "zero_scale": 0}
    for seed in range(SEGMENTS):
        for key, value in _run_segment(seed).items():
            totals[key] += value
    # The random configurations must actually exercise both directions.
    assert totals["skips"] > 500
    assert totals["growths"] > 500


def test_scale_that_underflowed_to_zero_keeps_matching_torch() -> None:
    ours = GradScaler(init_scale=2.0**-140, backoff_factor=0.5, growth_interval=3, min_scale=None, max_scale=None)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**-140, backoff_factor=0.5, growth_interval=3)
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([param], lr=0.0)
    for step in range(40):
        grad = np.array([1.0, np.inf if step < 12 else 2.0, 3.0], dtype=np.float32)
        param.grad = torch.from_numpy(grad.copy())
        theirs.scale(torch.ones(()))
        ours.unscale_and_check([grad])
        theirs.unscale_(optimizer)
        assert np.array_equal(grad, param.grad.numpy(), equal_nan=True)
        theirs.step(optimizer)
        ours.update()
        theirs.update()
        assert ours.scale_factor() == theirs.get_scale()
    assert ours.scale_factor() == 0.0
