// Fused multi-tensor unscale and overflow check: one launch multiplies every element of every tensor
// of one dtype by the inverse of the state's scale, in place, and records which tensors held inf/nan
// before the multiplication. The tensors are described by device tables (no by-value argument limits):
// one Chunk record per block-sized piece of a tensor, and the layouts of strided tensors. Blocks walk
// the chunks grid-stride. NumPy reference: cupy_amp.twins.unscale_check.
#include "common.cuh"

namespace cupy_amp {

template <class Type>
__device__ void unscale_check(const UnscaleArgs& args) {
    const Chunk* chunks = reinterpret_cast<const Chunk*>(args.chunks);
    const long long* layouts = reinterpret_cast<const long long*>(args.layouts);
    State* state = reinterpret_cast<State*>(args.state);
    Multiply<Type> op(inverse_of(state->scale));
    const u64 epoch = state->epoch;
    for (long long c = blockIdx.x; c < args.chunk_count; c += gridDim.x) {
        const Chunk chunk = chunks[c];
        const long long* layout = chunk.layout < 0 ? nullptr : layouts + chunk.layout;
        const bool bad = walk(chunk.address, layout, chunk.first, chunk.last, op);
        if (__syncthreads_or(bad) && threadIdx.x == 0) {
            mark_culprit(state, reinterpret_cast<u64*>(args.tensor_found), reinterpret_cast<const int*>(args.positions),
                         args.call, chunk.tensor, epoch);
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
