// Fused optimizer updates (cupy_amp.optim): one launch per (gradient dtype, parameter dtype) updates every
// parameter of the group. Each update multiplies the gradient by the step's factor (inv_scale times the
// clip coefficient, from device memory), never writes the gradient, and does nothing at all when the
// step is skipped. float16/bfloat16 parameters are updated through float32 master weights and written
// back rounded, in the same pass. Every float32 operation is explicit non-flushing PTX, in the order
// its NumPy twin, cupy_amp.twins.optimizers, uses: the same bits.
#include "common.cuh"

namespace cupy_amp {

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

// torch.optim.AdamW's single-tensor update on the CPU, in float32: fused multiply-adds where it fuses.
struct AdamWRule {
    typedef AdamWState State;
    static __device__ __forceinline__ void update(const State& h, float g, float& p, float& m, float& v) {
        g = mul_f32(g, h.factor);
        p = mul_f32(p, h.decay);
        // torch's lerp of m towards g: from m for a small weight (beta1 > 0.5), from g for a large one.
        m = h.lerp_weight < 0.5f ? fma_f32(h.lerp_weight, sub_f32(g, m), m)
                                 : fma_f32(sub_f32(h.lerp_weight, 1.0f), sub_f32(g, m), g);
        v = fma_f32(mul_f32(h.one_minus_beta2, g), g, mul_f32(v, h.beta2_f));
        const float denom = add_f32(div_f32(sqrt_f32(v), h.bias_correction2_sqrt), h.eps_f);
        p = add_f32(p, div_f32(mul_f32(h.neg_step_size, m), denom));
    }
};

// torch.optim.SGD's single-tensor update on the CPU (`m` is the momentum buffer; `v` is unused).
struct SgdRule {
    typedef SgdState State;
    static __device__ __forceinline__ void update(const State& h, float g, float& p, float& m, float&) {
        g = mul_f32(g, h.factor);
        if (h.weight_decay != 0.0) g = fma_f32(p, h.weight_decay_f, g);
        if (h.momentum != 0.0) {
            m = h.first ? g : fma_f32(g, h.one_minus_dampening, mul_f32(m, h.momentum_f));
            g = h.nesterov ? fma_f32(m, h.momentum_f, g) : m;
        }
        p = fma_f32(g, h.neg_lr, p);
    }
};

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

// The step's constants, in float64 then rounded once, as cupy_amp/twins/optimizers.py computes them.
__device__ __forceinline__ bool begin(int& skip, float& factor, const BeginArgs& args) {
    const Stats* stats = reinterpret_cast<const Stats*>(args.stats);
    skip = stats != nullptr && stats->skip != 0;
    factor = stats != nullptr ? stats->factor : 1.0f;
    return !skip;
}

}  // namespace cupy_amp

extern "C" __global__ void __launch_bounds__(1) cupy_amp_adamw_begin(const cupy_amp::BeginArgs args) {
    cupy_amp::AdamWState* s = reinterpret_cast<cupy_amp::AdamWState*>(args.hyper);
    if (!cupy_amp::begin(s->skip, s->factor, args)) return;
    s->step += 1;
    s->beta1_power = __dmul_rn(s->beta1_power, s->beta1);
    s->beta2_power = __dmul_rn(s->beta2_power, s->beta2);
    const double correction1 = __dsub_rn(1.0, s->beta1_power);
    const double correction2 = __dsub_rn(1.0, s->beta2_power);
    s->decay = cupy_amp::narrow(__dsub_rn(1.0, __dmul_rn(s->lr, s->weight_decay)));
    s->neg_step_size = cupy_amp::narrow(-__ddiv_rn(s->lr, correction1));
    s->bias_correction2_sqrt = cupy_amp::narrow(__dsqrt_rn(correction2));
    s->lerp_weight = cupy_amp::narrow(__dsub_rn(1.0, s->beta1));
    s->beta2_f = cupy_amp::narrow(s->beta2);
    s->one_minus_beta2 = cupy_amp::narrow(__dsub_rn(1.0, s->beta2));
    s->eps_f = cupy_amp::narrow(s->eps);
}

extern "C" __global__ void __launch_bounds__(1) cupy_amp_sgd_begin(const cupy_amp::BeginArgs args) {
    cupy_amp::SgdState* s = reinterpret_cast<cupy_amp::SgdState*>(args.hyper);
    if (!cupy_amp::begin(s->skip, s->factor, args)) return;
    s->first = s->step == 0;
    s->step += 1;
    s->neg_lr = cupy_amp::narrow(-s->lr);
    s->momentum_f = cupy_amp::narrow(s->momentum);
    s->one_minus_dampening = cupy_amp::narrow(__dsub_rn(1.0, s->dampening));
    s->weight_decay_f = cupy_amp::narrow(s->weight_decay);
}

#define CUPY_AMP_OPTIMIZER(RULE, NAME, TYPE)                                             \
    extern "C" __global__ void __launch_bounds__(CUPY_AMP_THREADS, cupy_amp::kMinBlocks) \
        NAME(const cupy_amp::OptimizerArgs args) {                                       \
        cupy_amp::optimizer_step<cupy_amp::RULE, cupy_amp::TYPE, cupy_amp::TYPE>(args);  \
    }

// Gradients have their parameter's dtype.
CUPY_AMP_OPTIMIZER(AdamWRule, cupy_amp_adamw_float16, Half)
CUPY_AMP_OPTIMIZER(AdamWRule, cupy_amp_adamw_bfloat16, Bfloat)
CUPY_AMP_OPTIMIZER(AdamWRule, cupy_amp_adamw_float32, Single)
CUPY_AMP_OPTIMIZER(SgdRule, cupy_amp_sgd_float16, Half)
CUPY_AMP_OPTIMIZER(SgdRule, cupy_amp_sgd_bfloat16, Bfloat)
CUPY_AMP_OPTIMIZER(SgdRule, cupy_amp_sgd_float32, Single)
