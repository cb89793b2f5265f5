// The fused SGD with momentum (cupy_amp.optim.sgd): torch.optim.SGD's update. NumPy twin: cupy_amp.twins.sgd.
#include "common.cuh"
#include "optimizer.cuh"

namespace cupy_amp {

// SGD's device-resident state besides its buffers (cupy_amp.twins.sgd computes the same bits).
struct SgdState {
    u64 step;
    double lr;
    double momentum;
    double dampening;
    double weight_decay;
    float factor;
    float neg_lr;
    float momentum_f;
    float one_minus_dampening;
    float weight_decay_f;
    int nesterov;
    int first;  // this update is the first applied one: the momentum buffer starts as the gradient
    int skip;
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

}  // namespace cupy_amp

// The step's constants, in float64 then rounded once.
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

CUPY_AMP_OPTIMIZER_ENTRIES(SgdRule, sgd)
