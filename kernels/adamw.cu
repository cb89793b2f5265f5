// The fused AdamW (cupy_amp.optim.adamw): torch.optim.AdamW's update. NumPy twin: cupy_amp.twins.adamw.
#include "common.cuh"
#include "optimizer.cuh"

namespace cupy_amp {

// AdamW's device-resident state besides its buffers. The host writes the hyperparameters; the begin kernel
// derives the step's float32 constants (cupy_amp.twins.adamw computes the same bits).
struct AdamWState {
    u64 step;  // updates applied; a skipped step leaves it unchanged
    double lr;
    double beta1;
    double beta2;
    double eps;
    double weight_decay;
    double beta1_power;  // beta1 ** step, as one product per applied update
    double beta2_power;
    float factor;  // the step's gradient factor (inv_scale * clip_coefficient)
    float decay;   // 1 - lr * weight_decay
    float neg_step_size;
    float bias_correction2_sqrt;
    float lerp_weight;  // 1 - beta1
    float beta2_f;
    float one_minus_beta2;
    float eps_f;
    int skip;
};

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

}  // namespace cupy_amp

// The step's constants, in float64 then rounded once.
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

CUPY_AMP_OPTIMIZER_ENTRIES(AdamWRule, adamw)
