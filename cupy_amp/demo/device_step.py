"""The demo's amp step with nothing read back: ``--sync-free`` runs it eagerly, ``--graph`` replays it as a CUDA graph.

The same network, data and fused AdamW as :mod:`cupy_amp.demo.training`, with a
:class:`~cupy_amp.SyncFreeGradScaler`, written so that the host never waits:
every buffer is allocated once (a graph replays fixed addresses), the batch is
picked on the device from indices uploaded a chunk of steps at a time, AdamW
reads the scaler's factor and verdict on the device and leaves everything
untouched after an overflow, and each step's loss, accuracy, scale and verdict go to a ring of
device records that the host reads once per chunk. CuPy refuses cuBLAS calls
inside a stream capture, so the matrix products go through a cuBLAS handle of
the trainer's own (:mod:`cupy_amp.demo.products`): fp16 inputs, fp32 sums,
rounded to fp16, as in :func:`~cupy_amp.demo.model.forward`, though with
cuBLAS's fp16 kernels rather than the fp32 ones ``cupy.matmul`` picks there, so
the numbers differ from the synchronous demo's in the last bits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cupy
import numpy as np

from cupy_amp.demo.model import Dataset, batch_indices, cross_entropy, forward
from cupy_amp.demo.products import Products
from cupy_amp.demo.settings import Settings
from cupy_amp.demo.training import RunState, StepOutcome
from cupy_amp.sync_free import SyncFreeGradScaler

__all__ = ["DeviceTrainer"]

# The forward layer's epilogue: z + bias, then ReLU except on the last layer.
_BIAS_RELU = cupy.ElementwiseKernel(
    "T z, T bias, bool relu", "T out", "T y = z + bias; out = (relu && y < (T)0) ? (T)0 : y;", "cupy_amp_demo_bias"
)
# The batch of the step numbered *counter: rows of the training set, picked by the uploaded indices.
_GATHER = cupy.ElementwiseKernel(
    "raw float32 x, raw int64 y, raw int64 indices, raw int64 counter, int64 chunk, int64 batch, int64 features",
    "float16 x_out, raw int64 y_out",
    """
    const long long row = i / features, feature = i % features;
    const long long example = indices[(counter[0] % chunk) * batch + row];
    x_out = (float16)x[example * features + feature];
    if (feature == 0) y_out[row] = y[example];
    """,
    "cupy_amp_demo_gather",
)
# d(training loss)/d(logits) in fp32, rounded to fp16: the backward pass's seed is the loss weight times
# the scale (read on the device), divided by the batch size in float64 as model.backward does.
_LOGIT_GRAD = cupy.ElementwiseKernel(
    "float32 probs, raw int64 labels, raw float32 scale, int64 classes, float64 loss_weight, int64 batch",
    "float16 out",
    """
    const float factor = (float)((double)scale[0] * loss_weight / (double)batch);
    out = (float16)((probs - (labels[i / classes] == i % classes ? 1.0f : 0.0f)) * factor);
    """,
    "cupy_amp_demo_logit_grad",
)
_RELU_GRAD = cupy.ElementwiseKernel("T g, T h", "T out", "out = h > (T)0 ? g : (T)0;", "cupy_amp_demo_relu_grad")
# One record per step in a ring of `chunk` slots; then the step counter moves on.
_RECORD = cupy.ElementwiseKernel(
    "float32 loss, float32 accuracy, float32 scale, raw bool finite, int64 chunk",
    "raw int64 counter, raw float32 losses, raw float32 accuracies, raw float32 scales, raw bool finites",
    """
    const long long slot = counter[0] % chunk;
    losses[slot] = loss;
    accuracies[slot] = accuracy;
    scales[slot] = scale;
    finites[slot] = finite[0];
    counter[0] += 1;
    """,
    "cupy_amp_demo_record",
)


# The demo's kernels that CuPy's elementwise kernels cannot express in one launch.
_KERNELS = cupy.RawModule(
    code=r"""
__device__ float from_half(unsigned short h) {
    float x;
    asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(h));
    return x;
}
__device__ unsigned short to_half(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

// Casts between the fp16 copies and the fp32 arrays of every parameter (the step would otherwise pay a
// launch per array): table rows are (source address, destination address, elements).
template <typename From, typename To, To (*convert)(From)>
__device__ void cast_all(const unsigned long long* table, int arrays) {
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (int t = 0; t < arrays; ++t) {
        const From* from = (const From*)table[3 * t];
        To* to = (To*)table[3 * t + 1];
        const long long elements = (long long)table[3 * t + 2];
        for (long long i = first; i < elements; i += stride) to[i] = convert(from[i]);
    }
}
extern "C" __global__ void cupy_amp_demo_widen(const unsigned long long* table, int arrays) {
    cast_all<unsigned short, float, from_half>(table, arrays);
}
extern "C" __global__ void cupy_amp_demo_narrow(const unsigned long long* table, int arrays) {
    cast_all<float, unsigned short, to_half>(table, arrays);
}

// One block of kRowThreads: per row, the softmax of the fp16 logits in fp32, then the batch's mean
// cross-entropy and accuracy (summed in a fixed order: the same bits on every run), and the backward
// pass's seed, d(loss)/d(loss) = 1, for scale_loss to scale.
constexpr int kRowThreads = 512;
extern "C" __global__ void __launch_bounds__(kRowThreads) cupy_amp_demo_softmax_xent(
    const unsigned short* logits, const long long* labels, long long rows, long long classes,
    float* probs, float* mean_loss, float* accuracy, float* seed) {
    __shared__ float losses[kRowThreads], rights[kRowThreads];
    float loss = 0.0f, right = 0.0f;
    for (long long row = threadIdx.x; row < rows; row += kRowThreads) {
        const unsigned short* z = logits + row * classes;
        float* p = probs + row * classes;
        float top = from_half(z[0]);
        long long best = 0;
        for (long long c = 1; c < classes; ++c) {
            if (from_half(z[c]) > top) {
                top = from_half(z[c]);
                best = c;
            }
        }
        float total = 0.0f;
        for (long long c = 0; c < classes; ++c) {
            p[c] = expf(from_half(z[c]) - top);
            total += p[c];
        }
        for (long long c = 0; c < classes; ++c) p[c] /= total;
        loss += -logf(fmaxf(p[labels[row]], 1e-30f));
        right += best == labels[row] ? 1.0f : 0.0f;
    }
    losses[threadIdx.x] = loss;
    rights[threadIdx.x] = right;
    for (int half = kRowThreads / 2; half > 0; half /= 2) {
        __syncthreads();
        if (threadIdx.x < half) {
            losses[threadIdx.x] += losses[threadIdx.x + half];
            rights[threadIdx.x] += rights[threadIdx.x + half];
        }
    }
    if (threadIdx.x == 0) {
        *mean_loss = losses[0] / (float)rows;
        *accuracy = rights[0] / (float)rows;
        *seed = 1.0f;
    }
}
""",
)
_ROW_THREADS = 512  # kRowThreads
_CAST_BLOCKS, _CAST_THREADS = 64, 256


class _CastAll:
    """``to[k] = from_[k]`` cast, for fixed lists of same-shaped C-contiguous arrays (fp16 <-> fp32), in one launch."""

    def __init__(self, from_: list[Any], to: list[Any]) -> None:
        for source, target in zip(from_, to, strict=True):
            if source.shape != target.shape or not (source.flags.c_contiguous and target.flags.c_contiguous):
                raise ValueError(f"cannot cast {source.shape} into {target.shape}: same-shaped C-contiguous only")
        widen = from_[0].dtype == cupy.float16
        self._kernel = _KERNELS.get_function("cupy_amp_demo_widen" if widen else "cupy_amp_demo_narrow")
        rows = [(source.data.ptr, target.data.ptr, source.size) for source, target in zip(from_, to)]
        self._table = cupy.asarray(np.array(rows, dtype=np.uint64))
        self._keep = (from_, to)  # the table holds their addresses
        self._arguments = (self._table, np.int32(len(rows)))

    def __call__(self) -> None:
        self._kernel((_CAST_BLOCKS,), (_CAST_THREADS,), self._arguments)


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
        self._indices = cupy.zeros((self.chunk, batch), cupy.int64)
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
        self._ones = cupy.ones((1, batch), cupy.float16)  # a bias gradient is the column sums: ones @ delta
        self._products = Products(self.stream)  # bound to the trainer's stream, where every step runs
        self._widen_grads = _CastAll(list(self._grads16.values()), self._grad_list)
        self._narrow_weights = _CastAll(list(masters.values()), list(self._weights.values()))
        self._softmax_xent = _KERNELS.get_function("cupy_amp_demo_softmax_xent")
        logits, classes = self._outputs[-1], widths[-1]
        sizes = (np.int64(batch), np.int64(classes))
        self._softmax_arguments = (logits, self._y, *sizes, self._probs, self._loss, self._accuracy, self._scale)

    def step(self) -> None:
        """Queue one step on the trainer's stream: device work only, capturable (in a capture of that stream).

        Its batch comes from the indices :meth:`upload_batches` put on the device.
        """
        with self.stream:  # where the products' cuBLAS handle queues its work
            self._queue_step()

    def _queue_step(self) -> None:
        settings, layers = self.settings, self._layers
        batch, features = self._x.shape
        _GATHER(
            self._x_train, self._y_train, self._indices, self._counter, self.chunk, batch, features, self._x, self._y
        )
        inputs = [self._x, *self._outputs[:-1]]
        for i in range(1, layers + 1):
            self._products(inputs[i - 1], self._weights[f"W{i}"], self._outputs[i - 1])
            _BIAS_RELU(self._outputs[i - 1], self._weights[f"b{i}"], i < layers, self._outputs[i - 1])
        classes = self._probs.shape[1]
        self._softmax_xent((1,), (_ROW_THREADS,), self._softmax_arguments)
        # The scale, as a loss of 1.0 scaled (a framework's backward pass would start from the scaled loss).
        self.scaler.scale_loss(self._scale)
        _LOGIT_GRAD(self._probs, self._y, self._scale, classes, settings.loss_weight, batch, self._deltas[-1])
        for i in range(layers, 0, -1):
            delta = self._deltas[i - 1]
            self._products(inputs[i - 1], delta, self._grads16[f"W{i}"], transpose_a=True)
            self._products(self._ones, delta, self._grads16[f"b{i}"].reshape(1, -1))
            if i > 1:
                below = self._deltas[i - 2]
                self._products(delta, self._weights[f"W{i}"], below, transpose_b=True)
                _RELU_GRAD(below, self._outputs[i - 2], below)
        self._widen_grads()  # the scaled fp16 gradients, upcast to fp32
        # One read of the gradients for inf/nan and the norm; the fused AdamW unscales, clips and updates the
        # masters in one pass, or leaves everything untouched after an overflow (its verdict stays on the device).
        stats = self.scaler.check(self._prepared, max_norm=settings.clip * settings.loss_weight)
        self.state.optimizer.step(self._grad_list, stats)
        self._narrow_weights()
        self.scaler.update()
        _RECORD(self._loss, self._accuracy, self._scale, stats.finite, self.chunk, self._counter, *self._records)

    def run(
        self, total: int, on_step: Callable[[StepOutcome], None], on_chunk: Callable[[int], None], boundary: int
    ) -> None:
        """Train until step ``total``, a chunk of steps at a time.

        After each chunk its records are read back (the one wait), ``on_step``
        is called for each of its steps, then ``on_chunk`` with the step reached.
        Chunks also end at every multiple of ``boundary`` (where a run is saved).
        """

        def next_chunk(first: int) -> np.ndarray:
            count = min(self.chunk, total - first, boundary - first % boundary)
            return self.batches(first, count)

        with self.stream:
            upcoming = next_chunk(self.state.step)
            while self.state.step < total:
                first, count = self.state.step, len(upcoming)
                self.upload_batches(first, upcoming)  # the previous chunk was read back: its slots are free
                for _ in range(count):
                    self.launch()
                if first + count < total:  # drawn on the host while the GPU runs this chunk
                    upcoming = next_chunk(first + count)
                for outcome in self.read_back(first, count):
                    self.state.step = outcome.step
                    self.state.history.append(outcome)
                    on_step(outcome)
                on_chunk(self.state.step)

    def batches(self, first: int, count: int) -> np.ndarray:
        """Return the batch indices of steps ``first`` to ``first + count - 1``, drawn on the host."""
        size, examples = self.settings.batch_size, self._examples
        return np.stack(
            [batch_indices(self.settings.seed, step, size, examples) for step in range(first, first + count)]
        )

    def upload_batches(self, first: int, indices: np.ndarray) -> None:
        """Put the :meth:`batches` of the steps from ``first`` on the device (at most one chunk of them)."""
        slots = [step % self.chunk for step in range(first, first + len(indices))]
        self._indices[slots] = cupy.asarray(indices)

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
            finally:
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
