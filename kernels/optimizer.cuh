// What every fused optimizer (cupy_amp.optim) shares: the chunks and arguments of its launches, the loads
// and stores of its elements, the step's loop over the chunks, the opening of a step, and the entry points.
// Each optimizer's file (adamw.cu, sgd.cu) adds its State struct, its Rule and its begin kernel. NumPy twin:
// cupy_amp.twins.optimizer, and each optimizer's own (cupy_amp.twins.adamw...), which run the same float32
// operations in the same order: the same bits. Every float32 operation is explicit non-flushing PTX.
// Include after common.cuh.

namespace cupy_amp {

// The fused optimizers' work (cupy_amp.optim): one chunk of one parameter; each address points at the
// chunk's first element.
struct ParamChunk {
    u64 grad;
    u64 param;
    u64 master;         // float32 master weights; 0 when the parameter is float32 (updated in place)
    u64 first_moment;   // AdamW: exp_avg; SGD: the momentum buffer (0 without momentum)
    u64 second_moment;  // AdamW: exp_avg_sq; SGD: 0
    long long count;    // elements
};

struct OptimizerArgs {
    u64 chunks;  // const ParamChunk[chunk_count]
    long long chunk_count;
    u64 hyper;  // the optimizer's State (AdamWState, SgdState): its hyperparameters and this step's constants
};

struct BeginArgs {
    u64 hyper;  // the optimizer's State
    u64 stats;  // 0 (no scaler: factor 1, never skip), or the step's Stats
};

// Elements as the optimizers see them (the common family's load and store): float32 values, four at a time.
template <class T>
__device__ __forceinline__ void load4(u64 address, float out[4]) {
    if constexpr (sizeof(typename T::bits) == 2) {
        const uint2 v = *reinterpret_cast<const uint2*>(address);
        out[0] = T::load((u16)(v.x & 0xffffu));
        out[1] = T::load((u16)(v.x >> 16));
        out[2] = T::load((u16)(v.y & 0xffffu));
        out[3] = T::load((u16)(v.y >> 16));
    } else {
        const uint4 v = *reinterpret_cast<const uint4*>(address);
        out[0] = T::load(v.x);
        out[1] = T::load(v.y);
        out[2] = T::load(v.z);
        out[3] = T::load(v.w);
    }
}

template <class T>
__device__ __forceinline__ void store4(u64 address, const float in[4]) {
    if constexpr (sizeof(typename T::bits) == 2) {
        uint2 v;
        v.x = (u32)T::store(in[0]) | ((u32)T::store(in[1]) << 16);
        v.y = (u32)T::store(in[2]) | ((u32)T::store(in[3]) << 16);
        *reinterpret_cast<uint2*>(address) = v;
    } else {
        *reinterpret_cast<uint4*>(address) =
            make_uint4(T::store(in[0]), T::store(in[1]), T::store(in[2]), T::store(in[3]));
    }
}

template <class T>
__device__ __forceinline__ float load1(u64 address, long long i) {
    return T::load(reinterpret_cast<const typename T::bits*>(address)[i]);
}

template <class T>
__device__ __forceinline__ void store1(u64 address, long long i, float f) {
    reinterpret_cast<typename T::bits*>(address)[i] = T::store(f);
}

// One launch per (gradient dtype, parameter dtype) updates every parameter of the group. Each update
// multiplies the gradient by the step's factor (inv_scale times the clip coefficient, from device memory),
// never writes the gradient, and does nothing at all when the step is skipped. float16/bfloat16 parameters
// are updated through float32 master weights and written back rounded, in the same pass. `Rule::update`
// takes (state, gradient, weight, first moment, second moment); a rule without a moment ignores it.
template <class Rule, class Grad, class Param>
__device__ void optimizer_step(const OptimizerArgs& args) {
    const typename Rule::State h = *reinterpret_cast<const typename Rule::State*>(args.hyper);
    if (h.skip) return;
    constexpr bool kMaster = sizeof(typename Param::bits) == 2;  // else the float32 parameter itself
    const ParamChunk* chunks = reinterpret_cast<const ParamChunk*>(args.chunks);
    for (long long c = blockIdx.x; c < args.chunk_count; c += gridDim.x) {
        const ParamChunk chunk = chunks[c];
        const u64 weights = kMaster ? chunk.master : chunk.param;
        const bool aligned = chunk.grad % (4 * sizeof(typename Grad::bits)) == 0 &&
                             chunk.param % (4 * sizeof(typename Param::bits)) == 0 && weights % 16 == 0 &&
                             chunk.first_moment % 16 == 0 && chunk.second_moment % 16 == 0;
        const long long quads = aligned ? chunk.count / 4 : 0;
        for (long long q = threadIdx.x; q < quads; q += blockDim.x) {
            const long long offset = 4 * q;
            float g[4], p[4], m[4] = {0, 0, 0, 0}, v[4] = {0, 0, 0, 0};
            load4<Grad>(chunk.grad + offset * sizeof(typename Grad::bits), g);
            load4<Single>(weights + offset * 4, p);
            if (chunk.first_moment != 0) load4<Single>(chunk.first_moment + offset * 4, m);
            if (chunk.second_moment != 0) load4<Single>(chunk.second_moment + offset * 4, v);
#pragma unroll
            for (int k = 0; k < 4; ++k) Rule::update(h, g[k], p[k], m[k], v[k]);
            store4<Single>(weights + offset * 4, p);
            if constexpr (kMaster) store4<Param>(chunk.param + offset * sizeof(typename Param::bits), p);
            if (chunk.first_moment != 0) store4<Single>(chunk.first_moment + offset * 4, m);
            if (chunk.second_moment != 0) store4<Single>(chunk.second_moment + offset * 4, v);
        }
        for (long long i = 4 * quads + threadIdx.x; i < chunk.count; i += blockDim.x) {
            const float g = load1<Grad>(chunk.grad, i);
            float p = load1<Single>(weights, i);
            float m = chunk.first_moment != 0 ? load1<Single>(chunk.first_moment, i) : 0.0f;
            float v = chunk.second_moment != 0 ? load1<Single>(chunk.second_moment, i) : 0.0f;
            Rule::update(h, g, p, m, v);
            store1<Single>(weights, i, p);
            if constexpr (kMaster) store1<Param>(chunk.param, i, p);
            if (chunk.first_moment != 0) store1<Single>(chunk.first_moment, i, m);
            if (chunk.second_moment != 0) store1<Single>(chunk.second_moment, i, v);
        }
    }
}

// A step's opening, for every optimizer: skip, and the gradients' factor, from the scaler's statistics
// record (no record: factor 1, never skip). Returns whether the step applies.
__device__ __forceinline__ bool begin(int& skip, float& factor, const BeginArgs& args) {
    const Stats* stats = reinterpret_cast<const Stats*>(args.stats);
    skip = stats != nullptr && stats->skip != 0;
    factor = stats != nullptr ? stats->factor : 1.0f;
    return !skip;
}

}  // namespace cupy_amp

// An optimizer's element-wise entry points, one per parameter dtype (gradients have their parameter's).
#define CUPY_AMP_OPTIMIZER_ENTRY(RULE, NAME, TYPE)                                       \
    extern "C" __global__ void __launch_bounds__(CUPY_AMP_THREADS, cupy_amp::kMinBlocks) \
        NAME(const cupy_amp::OptimizerArgs args) {                                       \
        cupy_amp::optimizer_step<cupy_amp::RULE, cupy_amp::TYPE, cupy_amp::TYPE>(args);  \
    }
#define CUPY_AMP_OPTIMIZER_ENTRIES(RULE, KIND)                         \
    CUPY_AMP_OPTIMIZER_ENTRY(RULE, cupy_amp_##KIND##_float16, Half)    \
    CUPY_AMP_OPTIMIZER_ENTRY(RULE, cupy_amp_##KIND##_bfloat16, Bfloat) \
    CUPY_AMP_OPTIMIZER_ENTRY(RULE, cupy_amp_##KIND##_float32, Single)
