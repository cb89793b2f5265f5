"""The demo's amp step with nothing read back: ``--sync-free`` runs it eagerly, ``--graph`` replays it as a CUDA graph.

The same network, data and fused AdamW as :mod:`cupy_amp.demo.training`, with a
:class:`~cupy_amp.SyncFreeGradScaler`, written so that the host never waits:
every buffer is allocated once (a graph replays fixed addresses), the batch is
drawn on the device from the step counter there (the same indices as
:class:`~cupy_amp.demo.model.BatchOrder` draws on the host), AdamW
reads the scaler's factor and verdict on the device and leaves everything
untouched after an overflow, and each step's loss, accuracy, scale and verdict go to a ring of
device records that the host reads once per chunk. Every launch is built once
with its arguments: the demo's own kernels (:mod:`cupy_amp.demo.device_kernels`)
and the matrix products, which go through a cuBLAS handle of the trainer's own
(:mod:`cupy_amp.demo.products`; CuPy refuses cuBLAS calls inside a stream
capture): fp16 inputs, fp32 sums, rounded to fp16, as in
:func:`~cupy_amp.demo.model.forward`, though with cuBLAS's fp16 kernels rather
than the fp32 ones ``cupy.matmul`` picks there, so the numbers differ from the
synchronous demo's in the last bits.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import cupy
import cupyx
import numpy as np

from cupy_amp.demo.device_kernels import ROW_THREADS, Launch, cast_all, kernel
from cupy_amp.demo.model import BatchOrder, Dataset, cross_entropy, forward
from cupy_amp.demo.products import Products
from cupy_amp.demo.settings import Settings
from cupy_amp.demo.training import RunState, StepOutcome
from cupy_amp.sync_free import SyncFreeGradScaler

__all__ = ["DeviceTrainer"]


class DeviceTrainer:
    """Runs the demo's amp steps without host synchronization; reads the records back a chunk at a time.

    ``state`` (the fp32 masters and the optimizer, whose state stays on the
    device) is updated in place.
    With ``graph``, the step is captured once (after one eager step that
    loads every kernel) and each later step is one graph launch.
    """

    def __init__(
        self,
        settings: Settings,
        dataset: Dataset,
        state: RunState,
        scaler: SyncFreeGradScaler,
        *,
        graph: bool,
        chunk: int = 50,
    ) -> None:
        self.settings, self.state, self.scaler, self.chunk = settings, state, scaler, chunk
        self._examples = len(dataset.y_train)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        # The masters and the optimizer's state were written on the caller's stream, which a non-blocking
        # stream does not wait for by itself.
        self.stream.wait_event(cupy.cuda.get_current_stream().record())
        with self.stream:
            self._allocate(settings, dataset, state)
        self._graph_wanted = graph
        self._graph: Any = None
        self.first_chunk_done: tuple[int, float] | None = None  # (step reached, time) as run() read its first chunk
        self.underflow = None  # measured by the synchronous trainer only

    def _allocate(self, settings: Settings, dataset: Dataset, state: RunState) -> None:
        masters = state.masters
        layers = len(masters) // 2
        batch, features = settings.batch_size, dataset.features
        self._layers = layers
        self._x_train, self._y_train = cupy.asarray(dataset.x_train), cupy.asarray(dataset.y_train)
        self._x_eval, self._y_eval = cupy.asarray(dataset.x_eval), cupy.asarray(dataset.y_eval)
        self._counter = cupy.full((), state.step, cupy.int64)
        self._x = cupy.empty((batch, features), cupy.float16)
        self._y = cupy.empty(batch, cupy.int64)
        self._weights = {name: master.astype(cupy.float16) for name, master in masters.items()}
        widths = [masters[f"W{i}"].shape[1] for i in range(1, layers + 1)]
        self._outputs = [cupy.empty((batch, width), cupy.float16) for width in widths]  # after bias (and ReLU)
        self._deltas = [cupy.empty((batch, width), cupy.float16) for width in widths]  # gradients of the outputs
        self._probs = cupy.empty((batch, widths[-1]), cupy.float32)
        self._loss, self._accuracy = cupy.empty((), cupy.float32), cupy.empty((), cupy.float32)
        self._scale = cupy.empty((), cupy.float32)
        self._grads16 = {name: cupy.empty(master.shape, cupy.float16) for name, master in masters.items()}
        self._master_grads = {name: cupy.zeros_like(master) for name, master in masters.items()}
        self._grad_list = list(self._master_grads.values())  # in the optimizer's parameter order
        dtypes = (cupy.float32,) * 3 + (cupy.bool_,)  # loss, accuracy, scale, finite
        self._records = [cupy.zeros(self.chunk, dtype) for dtype in dtypes]
        # Two sets of pinned host records: one chunk's copy lands in one while the host reads the other.
        self._host_records = [[cupyx.empty_pinned(self.chunk, dtype) for dtype in dtypes] for _ in range(2)]
        self._prepared = self.scaler.prepare(self._master_grads)
        self._bind_launches(settings, batch, features, widths)

    def _bind_launches(self, settings: Settings, batch: int, features: int, widths: list[int]) -> None:
        """Build every launch of a step once, arguments and all (the buffers never move)."""
        layers, rows = self._layers, np.int64(batch)
        products = Products(self.stream)  # bound to the trainer's stream, where every step runs
        inputs = [self._x, *self._outputs[:-1]]
        order = BatchOrder(settings.seed, int(self._y_train.size))
        forward: list[Callable[[], None]] = [
            Launch(
                "gather",
                self._x_train,
                self._y_train,
                self._counter,
                *(np.uint32(key) for key in order.keys),
                np.int64(order.examples),
                np.int32(order.bits),
                rows,
                np.int64(features),
                self._x,
                self._y,
                elements=batch,
            )
        ]
        for i in range(1, layers + 1):
            out = self._outputs[i - 1]
            forward.append(products.bind(inputs[i - 1], self._weights[f"W{i}"], out))
            relu = np.int32(i < layers)
            forward.append(
                Launch("bias_relu", out, self._weights[f"b{i}"], rows, np.int64(out.shape[1]), relu, elements=out.size)
            )
        classes = np.int64(widths[-1])
        forward.append(
            Launch(
                "softmax_xent",
                self._outputs[-1],
                self._y,
                rows,
                classes,
                self._probs,
                self._loss,
                self._accuracy,
                self._scale,
                grid=1,
                block=ROW_THREADS,
            )
        )
        backward: list[Callable[[], None]] = [
            Launch(
                "logit_grad",
                self._probs,
                self._y,
                self._scale,
                rows,
                classes,
                np.float64(settings.loss_weight),
                self._deltas[-1],
                elements=self._probs.size,
            )
        ]
        ones = cupy.ones((1, batch), cupy.float16)  # a bias gradient is the column sums: ones @ delta
        for i in range(layers, 0, -1):
            delta = self._deltas[i - 1]
            backward.append(products.bind(inputs[i - 1], delta, self._grads16[f"W{i}"], transpose_a=True))
            backward.append(products.bind(ones, delta, self._grads16[f"b{i}"].reshape(1, -1)))
            if i > 1:
                below = self._deltas[i - 2]
                backward.append(products.bind(delta, self._weights[f"W{i}"], below, transpose_b=True))
                backward.append(
                    Launch("relu_grad", below, self._outputs[i - 2], np.int64(below.size), elements=below.size)
                )
        backward.append(cast_all(list(self._grads16.values()), self._grad_list))  # upcast the scaled fp16 grads
        self._forward, self._backward = forward, backward
        self._narrow_weights = cast_all(list(self.state.masters.values()), list(self._weights.values()))
        self._record = kernel("record")  # its argument stats.finite is check()'s, given at each step

    def step(self) -> None:
        """Queue one step on the trainer's stream: device work only, capturable (in a capture of that stream).

        Its batch is drawn on the device from the step counter there.
        """
        with self.stream:  # where the products' cuBLAS handle queues its work
            self._queue_step()

    def _queue_step(self) -> None:
        for launch in self._forward:  # the batch, the layers, the softmax: loss, accuracy and the seed 1.0
            launch()
        # The seed scaled, as a framework's backward pass would start from the scaled loss.
        self.scaler.scale_loss(self._scale)
        for launch in self._backward:
            launch()
        # One read of the gradients for inf/nan and the norm; the fused AdamW unscales, clips and updates the
        # masters in one pass, or leaves everything untouched after an overflow (its verdict stays on the device).
        stats = self.scaler.check(self._prepared, max_norm=self.settings.clip * self.settings.loss_weight)
        self.state.optimizer.step(self._grad_list, stats)
        self._narrow_weights()
        self.scaler.update()
        self._record(
            (1,),
            (1,),
            (
                self._loss,
                self._accuracy,
                self._scale,
                stats.finite,
                np.int64(self.chunk),
                self._counter,
                *self._records,
            ),
        )

    def run(
        self, total: int, on_step: Callable[[StepOutcome], None], on_boundary: Callable[[int], None], boundary: int
    ) -> None:
        """Train until step ``total``, in chunks queued one ahead of the host.

        While the GPU runs a chunk, the host turns the records of the chunk
        before it into outcomes (``on_step`` for each): the host waits only for
        a chunk that is already done. A chunk that ends at a multiple of
        ``boundary``, or at ``total``, is finished before anything more is
        queued; then ``on_boundary`` is called with the step reached, while the
        state is that step's (where a run is saved).
        """
        skipped = self.scaler.stats().skipped_steps  # nothing is queued yet: a short wait
        pending: _Chunk | None = None
        held: list[_Row] = []  # the last step read, until the next chunk's first scale says what its update did
        first, buffer = self.state.step, 0
        with self.stream:
            while first < total or pending is not None:
                ahead = None
                if first < total and (pending is None or not pending.ends_at(boundary, total)):
                    count = min(self.chunk, total - first, boundary - first % boundary)
                    ahead = self._queue_chunk(first, count, self._host_records[buffer])
                    first, buffer = first + count, 1 - buffer
                if pending is not None:
                    pending.done.synchronize()
                    if self.first_chunk_done is None:
                        self.first_chunk_done = (pending.first + pending.count, time.perf_counter())
                    rows = held + pending.rows(self.chunk)
                    held = [rows.pop()] if ahead is not None else []
                    after = held[0].scale if held else self.scaler.stats().scale  # queue empty: a short wait
                    for outcome in _outcomes(rows, after, skipped):
                        skipped = outcome.skipped_total
                        self.state.step = outcome.step
                        self.state.history.append(outcome)
                        on_step(outcome)
                    if ahead is None:
                        on_boundary(self.state.step)
                pending = ahead

    def _queue_chunk(self, first: int, count: int, host_records: list[np.ndarray]) -> _Chunk:
        """Queue ``count`` steps, then the copy of their records into ``host_records`` (pinned memory)."""
        for _ in range(count):
            self.launch()
        for record, host in zip(self._records, host_records):
            cupy.asnumpy(record, stream=self.stream, out=host, blocking=False)
        return _Chunk(first, count, host_records, self.stream.record())

    def launch(self) -> None:
        """Run one step: eagerly, or as a replay of the graph captured after the first eager step."""
        if self._graph is not None:
            self._graph.launch(self.stream)
            return
        self.step()
        if self._graph_wanted:  # every kernel is loaded now: capture the step (capturing runs nothing)
            self.stream.begin_capture()
            try:
                self.step()
            except BaseException:
                with contextlib.suppress(cupy.cuda.runtime.CUDARuntimeError):  # an invalidated capture
                    self.stream.end_capture()  # the failed capture ends here, its partial graph dropped
                raise
            self._graph = self.stream.end_capture()

    def read_back(self, first: int, count: int) -> list[StepOutcome]:
        """Wait for every step queued so far and return the outcomes of the last ``count``, from step ``first``."""
        records = [cupy.asnumpy(record, stream=self.stream) for record in self._records]
        rows = _Chunk(first, count, records, None).rows(self.chunk)
        stats = self.scaler.stats()
        return _outcomes(rows, stats.scale, stats.skipped_steps - sum(not row.finite for row in rows))

    def evaluate(self) -> tuple[float, float]:
        """Return the held-out (loss, accuracy) of the current fp16 weights (synchronizes)."""
        with self.stream:
            fwd = forward(cupy, self._weights, self._x_eval)
            loss = float(cross_entropy(cupy, fwd.probs, self._y_eval))
            accuracy = float((fwd.probs.argmax(axis=1) == self._y_eval).mean())
        return loss, accuracy


class _Row(NamedTuple):
    """One step's record as read back: its number (from 0), loss, accuracy, the scale it used, its verdict."""

    step: int
    loss: float
    accuracy: float
    scale: float
    finite: bool


@dataclass(frozen=True)
class _Chunk:
    """Steps queued together, and the host arrays their records are copied into (complete once ``done`` is)."""

    first: int
    count: int
    records: list[np.ndarray]
    done: Any  # the cupy.cuda.Event recorded after the copy, or None when the records were read already

    def ends_at(self, boundary: int, total: int) -> bool:
        """Whether the chunk's last step is a multiple of ``boundary`` or ``total``."""
        end = self.first + self.count
        return end == total or end % boundary == 0

    def rows(self, slots: int) -> list[_Row]:
        """Return the chunk's steps' records, from a ring of ``slots`` records indexed by step."""
        losses, accuracies, scales, finites = self.records
        return [
            _Row(step, float(losses[s]), float(accuracies[s]), float(scales[s]), bool(finites[s]))
            for step, s in ((step, step % slots) for step in range(self.first, self.first + self.count))
        ]


def _outcomes(rows: list[_Row], after_last: float, skipped_before: int) -> list[StepOutcome]:
    """Turn consecutive steps' records into outcomes; a step's update did what the next step's scale shows
    (``after_last`` for the last); ``skipped_before`` counts the skipped steps before the first."""
    outcomes = []
    for row, after in zip(rows, [row.scale for row in rows[1:]] + [after_last]):
        skipped_before += not row.finite
        outcomes.append(
            StepOutcome(
                step=row.step + 1,
                loss=row.loss,
                accuracy=row.accuracy,
                scale=row.scale,
                skipped=not row.finite,
                backoff=(row.scale, after) if after < row.scale else None,
                growth=(row.scale, after) if after > row.scale else None,
                skipped_total=skipped_before,
            )
        )
    return outcomes
