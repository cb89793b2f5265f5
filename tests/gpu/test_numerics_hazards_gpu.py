"""The numerics report on the GPU against what is shared: the table cache, a call's several dtype groups."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import capture, open_step

cupy = pytest.importorskip("cupy")

from cupy_amp import GradScaler, SyncFreeGradScaler  # noqa: E402

FACES = [GradScaler, SyncFreeGradScaler]


@pytest.mark.parametrize("face", FACES)
def test_a_rank_without_gradients_takes_the_report(face: type) -> None:
    """check([], report=True) once the state is on the GPU: the pass over nothing, an empty report."""
    scaler: Any = face(init_scale=2.0)
    grads = [cupy.ones(4, cupy.float32)]
    open_step(scaler, cupy).check(grads, report=True)  # places the state on the GPU
    scaler.update()
    stats = open_step(scaler, cupy).check([], report=True)
    assert bool(stats.finite)
    assert scaler.gradient_numerics() == []


def test_another_scalers_report_over_the_same_memory_does_not_replace_this_ones() -> None:
    grad = cupy.asarray(np.array([1.0, 0.0, 0.0, 2.0], np.float32))
    first, second = GradScaler(init_scale=2.0), GradScaler(init_scale=2.0)
    open_step(first, cupy).check([grad], report=True)
    first.update()
    grad[...] = 5.0  # the next model's gradients, in the same memory (or new memory at the same address)
    open_step(second, cupy).check([grad], report=True)  # the same cache key: the same table and report buffer
    (row,) = first.gradient_numerics()  # first's last step: [1, 0, 0, 2]
    assert (row.amax, row.zeros) == (2.0, 2)


@pytest.mark.parametrize("face", FACES)
def test_a_call_of_several_dtypes_reports_each_gradient_in_its_place(face: type) -> None:
    rng = np.random.default_rng(8)
    host = [
        rng.standard_normal(70000).astype(np.float32),
        np.zeros(0, np.float64),  # a group with no elements between two that have some
        np.array([0.0, 1e-6, 3.0, 0.0], np.float16),
        np.array([0.0, -7.0], np.float32),
    ]
    on_gpu, on_cpu = open_step(face(init_scale=1.0), cupy), open_step(face(init_scale=1.0))
    on_gpu.check([cupy.asarray(g) for g in host], report=True)
    on_cpu.check(host, report=True)
    assert on_gpu.gradient_numerics() == on_cpu.gradient_numerics()
    assert [(row.label, row.zeros) for row in on_gpu.gradient_numerics()][1:] == [(1, 0), (2, 2), (3, 1)]


def test_a_replay_after_the_report_buffer_grew_is_reported() -> None:
    """A bigger plan prepared after the capture grows the record's report buffer; the graph captured before keeps
    writing the old one, which is the one gradient_numerics() must read (found by a reading review)."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        grad = cupy.zeros(1000, cupy.float16)
        scaler = SyncFreeGradScaler(init_scale=1.0)
        prepared = scaler.prepare([grad])
        loss = cupy.ones((), cupy.float32)

        def step() -> None:
            scaler.scale_loss(loss)
            scaler.check(prepared, report=True)
            scaler.update()

        step()  # eager: the report says 1000 zeros
        graph = capture(stream, step)
        others = [cupy.ones(10, cupy.float16) for _ in range(5)]
        scaler.prepare(others)  # 5 gradients: 15 report entries > 3, 5 blocks > 1: both buffers replaced
        grad.fill(1.0)
        grad[:10] = 0.0
        graph.launch(stream)
        stream.synchronize()
        (row,) = scaler.gradient_numerics()
        assert (row.zeros, row.amax) == (10, 1.0)  # the replay's, from the buffer the graph writes
