"""The demo device step's own kernels, each bound once to the fixed buffers it works on.

Every buffer of :class:`~cupy_amp.demo.device_step.DeviceTrainer` is
allocated once, so each launch's arguments are built once too
(:class:`Launch`): queuing a step then costs the launches alone, which is what
an eager step spends its host time on. fp16 data travels as its bits
(``unsigned short``) with explicit round-to-nearest conversions, so no
compiler flag (CuPy's flush-to-zero among them) changes a value.
"""

from __future__ import annotations

from typing import Any

import cupy
import numpy as np

__all__ = ["ROW_THREADS", "Launch", "cast_all", "kernel"]

_SOURCE = r"""
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
#define EACH(i, n) for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
                        i += (long long)gridDim.x * blockDim.x)

// The batch of the step numbered *counter, drawn here as model.BatchOrder draws it on the host: a keyed
// Feistel permutation per epoch (four lowbias32 rounds over `bits` bits, halves trading widths each round),
// walked again while outside the examples. One thread per row of the batch.
__device__ unsigned int mix32(unsigned int x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    return x ^ (x >> 16);
}
__device__ unsigned int feistel(unsigned int value, const unsigned int* keys, int bits) {
    int left_bits = bits / 2, right_bits = bits - bits / 2;
    unsigned int left = value >> right_bits, right = value & ((1U << right_bits) - 1U);
    for (int round = 0; round < 4; ++round) {
        const unsigned int next = left ^ (mix32(right ^ keys[round]) & ((1U << left_bits) - 1U));
        left = right;
        right = next;
        const int width = left_bits;
        left_bits = right_bits;
        right_bits = width;
    }
    return (left << right_bits) | right;
}
extern "C" __global__ void cupy_amp_demo_gather(const float* x, const long long* y, const long long* counter,
                                                unsigned int key0, unsigned int key1, unsigned int key2,
                                                unsigned int key3, long long examples, int bits, long long rows,
                                                long long features, unsigned short* x_out, long long* y_out) {
    const unsigned long long per_epoch = examples / rows;
    const unsigned long long step = (unsigned long long)*counter, epoch = step / per_epoch;
    const unsigned long long first = (step % per_epoch) * rows;
    const unsigned int low = (unsigned int)epoch, high = (unsigned int)(epoch >> 32);
    const unsigned int seed_keys[4] = {key0, key1, key2, key3};
    unsigned int keys[4];
    for (int round = 0; round < 4; ++round) {
        keys[round] = mix32(seed_keys[round] ^ mix32(low ^ mix32(high ^ (0x9e3779b9U * (unsigned int)round))));
    }
    EACH(row, rows) {
        unsigned int example = feistel((unsigned int)(first + row), keys, bits);
        while (example >= (unsigned long long)examples) example = feistel(example, keys, bits);
        for (long long feature = 0; feature < features; ++feature) {
            x_out[row * features + feature] = to_half(x[(long long)example * features + feature]);
        }
        y_out[row] = y[example];
    }
}

// A forward layer's epilogue, in place: z + bias rounded to fp16, then ReLU except on the last layer.
extern "C" __global__ void cupy_amp_demo_bias_relu(unsigned short* z, const unsigned short* bias, long long rows,
                                                   long long width, int relu) {
    EACH(i, rows * width) {
        const unsigned short y = to_half(from_half(z[i]) + from_half(bias[i % width]));
        z[i] = relu && from_half(y) < 0.0f ? 0 : y;
    }
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
        const float picked = p[labels[row]];
        loss += -logf(picked < 1e-30f ? 1e-30f : picked);  // a NaN stays NaN, as in model.cross_entropy
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

// d(training loss)/d(logits) in fp32, rounded to fp16: the backward pass's seed is the loss weight times
// the scale (read on the device), divided by the batch size in float64 as model.backward does.
extern "C" __global__ void cupy_amp_demo_logit_grad(const float* probs, const long long* labels, const float* scale,
                                                    long long rows, long long classes, double loss_weight,
                                                    unsigned short* out) {
    const float factor = (float)((double)*scale * loss_weight / (double)rows);
    EACH(i, rows * classes) {
        out[i] = to_half((probs[i] - (labels[i / classes] == i % classes ? 1.0f : 0.0f)) * factor);
    }
}

// In place: the gradient flowing into a ReLU's input, zero where its output h was not positive.
extern "C" __global__ void cupy_amp_demo_relu_grad(unsigned short* g, const unsigned short* h, long long elements) {
    EACH(i, elements) {
        if (!(from_half(h[i]) > 0.0f)) g[i] = 0;
    }
}

// Casts between the fp16 copies and the fp32 arrays of every parameter (the step would otherwise pay a
// launch per array): table rows are (source address, destination address, elements).
template <typename From, typename To, To (*convert)(From)>
__device__ void cast_all(const unsigned long long* table, int arrays) {
    for (int t = 0; t < arrays; ++t) {
        const From* from = (const From*)table[3 * t];
        To* to = (To*)table[3 * t + 1];
        EACH(i, (long long)table[3 * t + 2]) to[i] = convert(from[i]);
    }
}
extern "C" __global__ void cupy_amp_demo_widen(const unsigned long long* table, int arrays) {
    cast_all<unsigned short, float, from_half>(table, arrays);
}
extern "C" __global__ void cupy_amp_demo_narrow(const unsigned long long* table, int arrays) {
    cast_all<float, unsigned short, to_half>(table, arrays);
}

// One record per step in a ring of `chunk` slots; then the step counter moves on.
extern "C" __global__ void cupy_amp_demo_record(const float* loss, const float* accuracy, const float* scale,
                                                const bool* finite, long long chunk, long long* counter,
                                                float* losses, float* accuracies, float* scales, bool* finites) {
    const long long slot = *counter % chunk;
    losses[slot] = *loss;
    accuracies[slot] = *accuracy;
    scales[slot] = *scale;
    finites[slot] = *finite;
    *counter += 1;
}
"""
_MODULE = cupy.RawModule(code=_SOURCE)  # compiled on the first get_function
ROW_THREADS = 512  # kRowThreads: the softmax kernel's one block
_THREADS, _BLOCKS_PER_SM = 256, 8  # the grid-stride kernels' launch: at most enough blocks to fill the GPU


def kernel(name: str) -> Any:
    """Return the compiled kernel ``cupy_amp_demo_<name>`` (compiled and cached per device by CuPy)."""
    return _MODULE.get_function(f"cupy_amp_demo_{name}")


class Launch:
    """One kernel launch with its arguments fixed: a grid-stride kernel over ``elements``, or the given grid."""

    def __init__(
        self, name: str, *arguments: Any, elements: int = 0, grid: int = 0, block: int = _THREADS, keep: Any = None
    ) -> None:
        self._kernel = kernel(name)
        most = _BLOCKS_PER_SM * cupy.cuda.Device().attributes["MultiProcessorCount"]
        self._grid = (grid or max(1, min(most, -(-elements // block))),)
        self._block = (block,)
        self._arguments = arguments  # the arrays too: their buffers stay alive as long as the launch
        self._keep = keep  # arrays that the arguments reach only by address

    def __call__(self) -> None:
        self._kernel(self._grid, self._block, self._arguments)


def cast_all(sources: list[Any], targets: list[Any]) -> Launch:
    """Return one launch casting each ``sources[k]`` into ``targets[k]`` (fp16 to fp32, or fp32 to fp16).

    Raises:
        ValueError: A pair differs in shape, is not C-contiguous, or is not fp16/fp32 one way or the other.
    """
    widen = sources[0].dtype == np.float16
    source_dtype, target_dtype = (np.float16, np.float32) if widen else (np.float32, np.float16)
    for source, target in zip(sources, targets, strict=True):
        if source.dtype != source_dtype or target.dtype != target_dtype:
            raise ValueError(f"cannot cast {source.dtype} into {target.dtype}: fp16 to fp32 or fp32 to fp16 only")
        if source.shape != target.shape or not (source.flags.c_contiguous and target.flags.c_contiguous):
            raise ValueError(f"cannot cast {source.shape} into {target.shape}: same-shaped C-contiguous only")
    rows = [(source.data.ptr, target.data.ptr, source.size) for source, target in zip(sources, targets)]
    table = cupy.asarray(np.array(rows, dtype=np.uint64))
    largest = max(source.size for source in sources)
    # The table holds the arrays' addresses, so the launch keeps the arrays themselves alive as well.
    return Launch("widen" if widen else "narrow", table, np.int32(len(rows)), elements=largest, keep=(sources, targets))
