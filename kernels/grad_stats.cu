// Read-only statistics of the gradients: one launch per dtype reads every element once and records
// which tensors held inf/nan and each block's sum of squares (in float64: the squares of float16,
// bfloat16 and float32 values are exact there, and no finite gradient can overflow the sum); then one
// block sums the blocks' sums in index order and derives the norm, the clip coefficient and the
// optimizers' factor on the device. No float atomics, and a grid that depends only on the GPU model and the
// chunk count (the Python side's choice): the same bits on every run. NumPy reference:
// cupy_amp.twins.grad_stats (sums, then finish).
#include "common.cuh"

namespace cupy_amp {

// One warp's numerics of its chunks of one tensor into the tensor's report entry: a max and integer
// sums, whose order does not change the result. Shuffled as 32-bit words where the type allows (a warp's
// counts of one tensor stay far below 2**32). Must be reached by every thread of the warp.
template <class Op>
__device__ __forceinline__ void report_tensor(Op& op, u64* entry, u64* step, u32 position) {
    typedef decltype(typename Op::Type::bits() + 0u) word;  // u32, or u64 for float64
    u64 largest, zero_count, subnormal_count;
    op.tally.take(largest, zero_count, subnormal_count);
    unsigned long long* counts = reinterpret_cast<unsigned long long*>(entry);
    word amax = (word)largest;
    for (int offset = 16; offset > 0; offset /= 2) {
        const word other = __shfl_down_sync(0xffffffffu, amax, offset);
        amax = other > amax ? other : amax;
    }
    // An atomic whose result is not used does not hold the warp up (reading the entry first, to spare it, did).
    if (threadIdx.x % 32 == 0 && amax != 0) {
        atomicMax(counts, (unsigned long long)amax);
        u32 largest32 = __float_as_uint(narrow(Op::Type::value((typename Op::Type::bits)amax)));
        if (largest32 == 0x7f800000u) largest32 = 0x7f7fffffu;  // a float64 beyond float32's range: its largest
        atomicMax(reinterpret_cast<unsigned long long*>(step), ((unsigned long long)largest32 << 32) | ~position);
    }
    u32 zeros = (u32)zero_count, subnormals = (u32)subnormal_count;
    if (!__any_sync(0xffffffffu, (zeros | subnormals) != 0)) return;  // zeros and subnormals are rare
    for (int offset = 16; offset > 0; offset /= 2) {
        zeros += __shfl_down_sync(0xffffffffu, zeros, offset);
        subnormals += __shfl_down_sync(0xffffffffu, subnormals, offset);
    }
    if (threadIdx.x % 32 == 0) {
        unsigned long long* whole = reinterpret_cast<unsigned long long*>(step);
        if (zeros != 0)
            atomicAdd(counts + 1, (unsigned long long)zeros), atomicAdd(whole + 1, (unsigned long long)zeros);
        if (subnormals != 0)
            atomicAdd(counts + 2, (unsigned long long)subnormals), atomicAdd(whole + 2, (unsigned long long)subnormals);
    }
}

template <class Type, bool kReport>
__device__ void gradient_stats(const StatsArgs& args) {
    const Chunk* chunks = reinterpret_cast<const Chunk*>(args.chunks);
    const long long* layouts = reinterpret_cast<const long long*>(args.layouts);
    volatile State* state = reinterpret_cast<State*>(args.state);
    const u64 epoch = state->epoch;
    SumSquares<Type, kReport> op;
    u64* const entries = reinterpret_cast<u64*>(args.report);
    u64* const step = reinterpret_cast<u64*>(args.step_report);
    const int* const positions = reinterpret_cast<const int*>(args.positions);
    int reporting = -1;  // the tensor whose report the warp is keeping: a warp's chunks of one tensor add up first
    // Each warp walks chunks of its own, so a small tensor keeps only a warp busy, not a whole block, and the
    // other warps' loads stay in flight meanwhile. Neighbouring chunks go to warps of different blocks.
    const long long warps = (long long)gridDim.x * (blockDim.x / 32);
    for (long long c = (long long)(threadIdx.x / 32) * gridDim.x + blockIdx.x; c < args.chunk_count; c += warps) {
        const Chunk chunk = chunks[c];
        if constexpr (kReport) {
            if (chunk.tensor != reporting && reporting >= 0)
                report_tensor(op, entries + 3 * reporting, step, (u32)positions[reporting]);
            reporting = chunk.tensor;
        }
        const long long* layout = chunk.layout < 0 ? nullptr : layouts + chunk.layout;
        if (walk_by_warp(chunk.address, layout, chunk.first, chunk.last, op)) {
            // Every thread that saw inf/nan writes the same values: no barrier per chunk (this pass only reads,
            // so nothing else waits for the warp), and flags are written only on an overflow.
            mark_culprit(const_cast<State*>(state), reinterpret_cast<u64*>(args.tensor_found),
                         reinterpret_cast<const int*>(args.positions), args.call, chunk.tensor, epoch);
        }
        if constexpr (kReport) op.tally.settle();
    }
    if constexpr (kReport) {
        if (reporting >= 0) report_tensor(op, entries + 3 * reporting, step, (u32)positions[reporting]);
    }
    const double total = block_sum(op.sum);
    if (threadIdx.x == 0) reinterpret_cast<double*>(args.partials)[blockIdx.x] = total;
}

// The step's statistics from the blocks' sums (one block): the norm of the unscaled gradients,
// the clip coefficient min(1, max_norm / (norm + 1e-6)) and the factor the optimizers apply.
__device__ void finish_stats(const FinishArgs& args) {
    Stats* stats = reinterpret_cast<Stats*>(args.stats);
    State* state = reinterpret_cast<State*>(args.state);
    const int local = state->found;
    if (args.stage != kFinishOnly) {
        const double* partials = reinterpret_cast<const double*>(args.partials);
        double sum = 0.0;
        for (long long i = threadIdx.x; i < args.partial_count; i += blockDim.x) sum = __dadd_rn(sum, partials[i]);
        const double total = block_sum(sum);
        if (threadIdx.x == 0) {
            stats->sum_of_squares = total;
            stats->own_sum_of_squares = total;
            stats->overflowed = local != 0 ? 1.0 : 0.0;
        }
    }
    if (args.stage == kSumOnly || threadIdx.x != 0) return;
    // After an all-reduce (cupy_amp.distributed: overflow_count_verdict, refuse_impossible_sum): the count of
    // ranks that overflowed must be a whole number, at least this rank's own flag; without an overflow, the
    // sum of squares must be at least this rank's share (so not NaN, nor negative), and infinite only if the
    // share is. A NaN fails every comparison. Anything else is counted, and the step is skipped.
    const double count = stats->overflowed, total = stats->sum_of_squares, own = stats->own_sum_of_squares;
    bool bad = false;
    if (args.stage == kFinishOnly) {
        bad = take_count(state, count);
        if (!bad && state->agreed == 0 && !(total >= own && (!isinf(total) || isinf(own)))) {
            bad = true;  // an impossible sum of squares: counted as an impossible count is
            if (state->bad_vote_epoch != state->epoch) {
                state->bad_votes += 1;
                state->bad_vote_epoch = state->epoch;
            }
            state->agreed = 1;
            state->finite = 0;
        }
    }
    const bool agreed = args.stage == kFinishOnly && state->agreed != 0;
    const float inv_scale = inverse_of(state->scale);
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
    stats->skip = local != 0 || agreed || state->agreed != 0;
    if (args.step_report != 0) {  // the report's whole-call numbers, for the journal
        const u64* whole = reinterpret_cast<const u64*>(args.step_report);
        const double elements = (double)args.elements;
        const float nan = __int_as_float(0x7fc00000);
        state->report_amax = __uint_as_float((u32)(whole[0] >> 32));
        state->report_call = whole[0] == 0 ? -1 : (int)args.call;
        state->report_position = whole[0] == 0 ? -1 : (int)~(u32)whole[0];
        state->zero_fraction = args.elements > 0 ? narrow(__ddiv_rn((double)whole[1], elements)) : nan;
        state->subnormal_fraction = args.elements > 0 ? narrow(__ddiv_rn((double)whole[2], elements)) : nan;
        state->reported_epoch = state->epoch;
    }
    state->checked_norm = norm;           // the headroom rule's signal, read by the host with the verdict
    state->checked_epoch = state->epoch;  // the journal takes this step's norm and clip coefficient
}

}  // namespace cupy_amp

#define CUPY_AMP_GRADIENT_STATS(NAME, TYPE, REPORT)                                      \
    extern "C" __global__ void __launch_bounds__(CUPY_AMP_THREADS, cupy_amp::kMinBlocks) \
        NAME(const cupy_amp::StatsArgs args) {                                           \
        cupy_amp::gradient_stats<cupy_amp::TYPE, REPORT>(args);                          \
    }

CUPY_AMP_GRADIENT_STATS(cupy_amp_gradient_stats_float16, Half, false)
CUPY_AMP_GRADIENT_STATS(cupy_amp_gradient_stats_bfloat16, Bfloat, false)
CUPY_AMP_GRADIENT_STATS(cupy_amp_gradient_stats_float32, Single, false)
CUPY_AMP_GRADIENT_STATS(cupy_amp_gradient_stats_float64, Double, false)
// The same pass with the numerics report (cupy_amp.twins.grad_stats.numerics is its NumPy reference).
CUPY_AMP_GRADIENT_STATS(cupy_amp_gradient_report_float16, Half, true)
CUPY_AMP_GRADIENT_STATS(cupy_amp_gradient_report_bfloat16, Bfloat, true)
CUPY_AMP_GRADIENT_STATS(cupy_amp_gradient_report_float32, Single, true)
CUPY_AMP_GRADIENT_STATS(cupy_amp_gradient_report_float64, Double, true)

extern "C" __global__ void __launch_bounds__(CUPY_AMP_THREADS) cupy_amp_finish_stats(const cupy_amp::FinishArgs args) {
    cupy_amp::finish_stats(args);
}
