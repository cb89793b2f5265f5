// Read-only statistics of the gradients: one launch per dtype reads every element once and records
// which tensors held inf/nan and each block's sum of squares (in float64: the squares of float16,
// bfloat16 and float32 values are exact there, and no finite gradient can overflow the sum); then one
// block sums the blocks' sums in index order and derives the norm, the clip coefficient and the
// optimizers' factor on the device. No float atomics, and a grid fixed per GPU model (the Python side's
// choice): the same bits on every run.
#include "common.cuh"

namespace cupy_amp {

// Elements [first, last) of a dense tensor: a scalar head up to 16-byte alignment, 16-byte vectors
// (kUnroll loads in flight per thread, streaming: every byte is read once), a scalar tail.
template <class Type>
__device__ bool read_dense(u64 base, long long first, long long last, double& sum) {
    typedef typename Type::bits bits;
    const int vec = 16 / sizeof(bits);
    const bits* data = reinterpret_cast<const bits*>(base);
    bool bad = false;

    u64 first_address = base + (u64)first * sizeof(bits);
    long long head = (long long)(((16u - (first_address & 15u)) & 15u) / sizeof(bits));
    long long body_first = first + head < last ? first + head : last;
    for (long long i = first + threadIdx.x; i < body_first; i += blockDim.x) {
        const bits x = data[i];
        bad |= Type::nonfinite(x);
        sum = fma(Type::value(x), Type::value(x), sum);
    }

    union Vector {
        uint4 raw;
        bits lanes[vec];
    };
    long long vectors = (last - body_first) / vec;
    const Vector* body = reinterpret_cast<const Vector*>(data + body_first);
    for (long long v = threadIdx.x; v < vectors; v += (long long)kUnroll * blockDim.x) {
        Vector loaded[kUnroll];
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
            long long index = v + (long long)k * blockDim.x;
            if (index < vectors) loaded[k].raw = __ldcs(&body[index].raw);
        }
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
            long long index = v + (long long)k * blockDim.x;
            if (index < vectors) {
                bad |= Type::vector_nonfinite(loaded[k].raw);
#pragma unroll
                for (int lane = 0; lane < vec; ++lane) {
                    const double d = Type::value(loaded[k].lanes[lane]);
                    sum = fma(d, d, sum);
                }
            }
        }
    }

    for (long long i = body_first + vectors * vec + threadIdx.x; i < last; i += blockDim.x) {
        const bits x = data[i];
        bad |= Type::nonfinite(x);
        sum = fma(Type::value(x), Type::value(x), sum);
    }
    return bad;
}

template <class Type>
__device__ bool read_range(u64 base, const long long* layout, long long first, long long last, double& sum) {
    if (layout == nullptr) return read_dense<Type>(base, first, last, sum);
    const long long* staged = stage_layout(layout);
    const typename Type::bits* origin = reinterpret_cast<const typename Type::bits*>(base);
    bool bad = false;
    for (long long i = first + threadIdx.x; i < last; i += blockDim.x) {
        const typename Type::bits x = origin[strided_offset(staged, i)];
        bad |= Type::nonfinite(x);
        sum = fma(Type::value(x), Type::value(x), sum);
    }
    return bad;
}

template <class Type>
__device__ void gradient_stats(const StatsArgs& args) {
    const Chunk* chunks = reinterpret_cast<const Chunk*>(args.chunks);
    const long long* layouts = reinterpret_cast<const long long*>(args.layouts);
    const State* state = reinterpret_cast<const State*>(args.state);
    const u64 epoch = state != nullptr ? state->epoch : args.epoch;
    double sum = 0.0;
    for (long long c = blockIdx.x; c < args.chunk_count; c += gridDim.x) {
        const Chunk chunk = chunks[c];
        const long long* layout = chunk.layout < 0 ? nullptr : layouts + chunk.layout;
        if (read_range<Type>(chunk.address, layout, chunk.first, chunk.last, sum)) {
            // Every thread that saw inf/nan writes the same values: no barrier per chunk (this pass only reads,
            // so nothing else waits for the block), and flags are written only on an overflow.
            reinterpret_cast<volatile u64*>(args.tensor_found)[chunk.tensor] = epoch;
            if (args.finite != 0) *reinterpret_cast<volatile unsigned char*>(args.finite) = 0;
            *reinterpret_cast<volatile int*>(args.found) = 1;
        }
    }
    const double total = block_sum(sum);
    if (threadIdx.x == 0) reinterpret_cast<double*>(args.partials)[blockIdx.x] = total;
}

// The step's statistics from the blocks' sums (one block): the norm of the unscaled gradients,
// the clip coefficient min(1, max_norm / (norm + 1e-6)) and the factor the optimizers apply.
__device__ void finish_stats(const FinishArgs& args) {
    Stats* stats = reinterpret_cast<Stats*>(args.stats);
    State* state = reinterpret_cast<State*>(args.state);
    const int local = state != nullptr ? state->found : stats->found;
    if (args.stage != kFinishOnly) {
        const double* partials = reinterpret_cast<const double*>(args.partials);
        double sum = 0.0;
        for (long long i = threadIdx.x; i < args.partial_count; i += blockDim.x) sum = __dadd_rn(sum, partials[i]);
        const double total = block_sum(sum);
        if (threadIdx.x == 0) {
            stats->sum_of_squares = total;
            stats->overflowed = local != 0 ? 1.0 : 0.0;
        }
    }
    if (args.stage == kSumOnly || threadIdx.x != 0) return;
    // After an all-reduce: the count of ranks that overflowed must be a whole number, at least this rank's
    // own flag (a NaN fails every comparison). Anything else is counted, and the step is skipped.
    const double count = stats->overflowed;
    const bool bad = args.stage == kFinishOnly && !(count >= (double)local && count == floor(count) && count < 1e15);
    const bool agreed = args.stage == kFinishOnly && (bad || count > 0.0);
    if (state != nullptr && args.stage == kFinishOnly) {
        if (bad) state->bad_votes += 1;
        state->agreed = agreed ? 1 : 0;
        if (agreed) state->finite = 0;
    }
    const float inv_scale = state != nullptr ? inverse_of(state->scale) : args.inv_scale;
    const float norm = narrow(__dmul_rn(__dsqrt_rn(stats->sum_of_squares), widen(inv_scale)));
    float clip = 1.0f;
    if (widen(args.max_norm) > 0.0) {
        const double quotient = __ddiv_rn(widen(args.max_norm), __dadd_rn(widen(norm), 1e-6));
        if (quotient < 1.0) clip = narrow(quotient);
    }
    stats->norm = norm;
    stats->clip_coefficient = clip;
    stats->factor = mul_f32(inv_scale, clip);
    stats->found = local;
    stats->bad_vote = bad ? 1 : 0;
    stats->skip = local != 0 || agreed || (state != nullptr && state->agreed != 0);
}

}  // namespace cupy_amp

#define CUPY_AMP_GRADIENT_STATS(NAME, TYPE)                                              \
    extern "C" __global__ void __launch_bounds__(CUPY_AMP_THREADS, cupy_amp::kMinBlocks) \
        NAME(const cupy_amp::StatsArgs args) {                                           \
        cupy_amp::gradient_stats<cupy_amp::TYPE>(args);                                  \
    }

CUPY_AMP_GRADIENT_STATS(cupy_amp_gradient_stats_float16, Half)
CUPY_AMP_GRADIENT_STATS(cupy_amp_gradient_stats_bfloat16, Bfloat)
CUPY_AMP_GRADIENT_STATS(cupy_amp_gradient_stats_float32, Single)
CUPY_AMP_GRADIENT_STATS(cupy_amp_gradient_stats_float64, Double)

extern "C" __global__ void __launch_bounds__(CUPY_AMP_THREADS) cupy_amp_finish_stats(const cupy_amp::FinishArgs args) {
    cupy_amp::finish_stats(args);
}
