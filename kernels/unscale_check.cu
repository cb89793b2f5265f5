// Fused multi-tensor unscale and overflow check: one launch multiplies every element of every tensor
// of one dtype by inv_scale, in place, and records which tensors held inf/nan before the
// multiplication. The tensors are described by device tables (no by-value argument limits): one
// Chunk record per block-sized piece of a tensor, and the layouts of strided tensors. Blocks walk
// the chunks grid-stride.
#include "common.cuh"

namespace cupy_amp {

template <class Type>
__device__ void unscale_check(const UnscaleArgs& args) {
    const Chunk* chunks = reinterpret_cast<const Chunk*>(args.chunks);
    const long long* layouts = reinterpret_cast<const long long*>(args.layouts);
    const State* state = reinterpret_cast<const State*>(args.state);
    const float factor = state != nullptr ? inverse_of(state->scale) : args.inv_scale;
    const u64 epoch = state != nullptr ? state->epoch : args.epoch;
    for (long long c = blockIdx.x; c < args.chunk_count; c += gridDim.x) {
        const Chunk chunk = chunks[c];
        const long long* layout = chunk.layout < 0 ? nullptr : layouts + chunk.layout;
        bool bad = apply_range<Type>(chunk.address, layout, chunk.first, chunk.last, factor);
        if (__syncthreads_or(bad) && threadIdx.x == 0) {
            reinterpret_cast<u64*>(args.tensor_found)[chunk.tensor] = epoch;
            if (args.finite != 0) *reinterpret_cast<unsigned char*>(args.finite) = 0;
            *reinterpret_cast<volatile int*>(args.found) = 1;  // may live in mapped host memory
            __threadfence_system();
        }
    }
}

}  // namespace cupy_amp

#define CUPY_AMP_UNSCALE_CHECK(NAME, TYPE)                                               \
    extern "C" __global__ void __launch_bounds__(CUPY_AMP_THREADS, cupy_amp::kMinBlocks) \
        NAME(const cupy_amp::UnscaleArgs args) {                                         \
        cupy_amp::unscale_check<cupy_amp::TYPE>(args);                                   \
    }

CUPY_AMP_UNSCALE_CHECK(cupy_amp_unscale_check_float16, Half)
CUPY_AMP_UNSCALE_CHECK(cupy_amp_unscale_check_float32, Single)
CUPY_AMP_UNSCALE_CHECK(cupy_amp_unscale_check_float64, Double)
