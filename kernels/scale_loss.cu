// In-place loss scaling: loss *= the state's scale, float16/float32 in float32 arithmetic, float64 in
// float64, whatever the loss's shape and strides. Blocks walk chunks of `chunk_size` elements
// grid-stride. NumPy reference: cupy_amp.twins.scale_loss.
#include "common.cuh"

namespace cupy_amp {

template <class Type>
__device__ void scale_loss(const ScaleArgs& args) {
    Multiply<Type> op(reinterpret_cast<const State*>(args.state)->scale);
    for (long long first = (long long)blockIdx.x * args.chunk_size; first < args.numel;
         first += (long long)gridDim.x * args.chunk_size) {
        long long last = first + args.chunk_size < args.numel ? first + args.chunk_size : args.numel;
        walk(args.base, reinterpret_cast<const long long*>(args.layout), first, last, op);
    }
}

}  // namespace cupy_amp

#define CUPY_AMP_SCALE_LOSS(NAME, TYPE)                                                  \
    extern "C" __global__ void __launch_bounds__(CUPY_AMP_THREADS, cupy_amp::kMinBlocks) \
        NAME(const cupy_amp::ScaleArgs args) {                                           \
        cupy_amp::scale_loss<cupy_amp::TYPE>(args);                                      \
    }

CUPY_AMP_SCALE_LOSS(cupy_amp_scale_loss_float16, Half)
CUPY_AMP_SCALE_LOSS(cupy_amp_scale_loss_float32, Single)
CUPY_AMP_SCALE_LOSS(cupy_amp_scale_loss_float64, Double)
