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
from collections.abc import Callable
from typing import Any

import cupy
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
        self._records = [cupy.zeros(self.chunk, dtype) for dtype in (cupy.float32,) * 3 + (cupy.bool_,)]
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
        self, total: int, on_step: Callable[[StepOutcome], None], on_chunk: Callable[[int], None], boundary: int
    ) -> None:
        """Train until step ``total``, a chunk of steps at a time.

        After each chunk its records are read back (the one wait), ``on_step``
        is called for each of its steps, then ``on_chunk`` with the step reached.
        Chunks also end at every multiple of ``boundary`` (where a run is saved).
        """
        with self.stream:
            while self.state.step < total:
                first = self.state.step
                count = min(self.chunk, total - first, boundary - first % boundary)
                for _ in range(count):
                    self.launch()
                for outcome in self.read_back(first, count):
                    self.state.step = outcome.step
                    self.state.history.append(outcome)
                    on_step(outcome)
                on_chunk(self.state.step)

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
        """Wait for the chunk's steps and turn their records into outcomes (events come from the scales)."""
        losses, accuracies, scales, finites = (cupy.asnumpy(record, stream=self.stream) for record in self._records)
        stats = self.scaler.stats()
        skipped_before = stats.skipped_steps - sum(
            not finites[step % self.chunk] for step in range(first, first + count)
        )
        outcomes = []
        for offset, step in enumerate(range(first, first + count)):
            slot = step % self.chunk
            scale = float(scales[slot])
            after = float(scales[(step + 1) % self.chunk]) if offset + 1 < count else stats.scale
            skipped = not bool(finites[slot])
            skipped_before += skipped
            outcomes.append(
                StepOutcome(
                    step=step + 1,
                    loss=float(losses[slot]),
                    accuracy=float(accuracies[slot]),
                    scale=scale,
                    skipped=skipped,
                    backoff=(scale, after) if after < scale else None,
                    growth=(scale, after) if after > scale else None,
                    skipped_total=skipped_before,
                )
            )
        return outcomes

    def evaluate(self) -> tuple[float, float]:
        """Return the held-out (loss, accuracy) of the current fp16 weights (synchronizes)."""
        with self.stream:
            fwd = forward(cupy, self._weights, self._x_eval)
            loss = float(cross_entropy(cupy, fwd.probs, self._y_eval))
            accuracy = float((fwd.probs.argmax(axis=1) == self._y_eval).mean())
        return loss, accuracy
