// In-place loss scaling: loss *= scale, float16/float32 in float32 arithmetic,
// float64 in float64, whatever the loss's shape and strides. The loss is one
// tensor passed by value (base address, size, ndim); a strided loss also
// passes a layout table (extents then strides). Blocks stride over chunks.
#include "cupy_amp_common.cuh"

template <class Type>
__device__ void cupy_amp_scale_loss(
    cupy_amp_u64 base, long long numel, int ndim, const long long* layout, long long chunk_size, float scale) {
    for (long long first = (long long)blockIdx.x * chunk_size; first < numel; first += (long long)gridDim.x * chunk_size) {
        long long last = first + chunk_size < numel ? first + chunk_size : numel;
        cupy_amp_apply_range<Type>(base, ndim, layout, first, last, scale);
    }
}

#define CUPY_AMP_SCALE_LOSS_ENTRY(NAME, TYPE)                                                                    \
    extern "C" __global__ void __launch_bounds__(CUPY_AMP_THREADS, CUPY_AMP_MIN_BLOCKS)                                                          \
        NAME(cupy_amp_u64 base, long long numel, int ndim, const long long* layout, long long chunk_size,       \
             float scale) {                                                                                     \
        cupy_amp_scale_loss<TYPE>(base, numel, ndim, layout, chunk_size, scale);                               \
    }

CUPY_AMP_SCALE_LOSS_ENTRY(cupy_amp_scale_loss_float16, CupyAmpHalf)
CUPY_AMP_SCALE_LOSS_ENTRY(cupy_amp_scale_loss_float32, CupyAmpSingle)
CUPY_AMP_SCALE_LOSS_ENTRY(cupy_amp_scale_loss_float64, CupyAmpDouble)
