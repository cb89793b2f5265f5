// Fused multi-tensor unscale and overflow check: one launch multiplies every
// element of every listed tensor of one dtype by inv_scale, in place, and
// records which tensors held inf/nan before the multiplication.
//
// The tensor list lives in device tables (no by-value argument limits):
//   desc         CUPY_AMP_DESC_WORDS int64 per tensor (see cupy_amp_common.cuh)
//   chunk_first  first element of each chunk; chunk_tensor: its tensor index
//   layout       extents and strides of the strided tensors
// Each block walks chunks (grid-stride); a chunk belongs to one tensor.
// Flags are written as `epoch` (a per-launch number chosen by the host), so
// nothing needs clearing between launches: a flag equal to this launch's
// epoch was set by this launch.
#include "cupy_amp_common.cuh"

template <class Type>
__device__ void cupy_amp_unscale_check(
    const long long* desc, const long long* chunk_first, const long long* chunk_tensor, const long long* layout,
    long long chunks, long long chunk_size, float inv_scale, int epoch, int* found, int* tensor_found) {
    for (long long chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
        long long tensor = chunk_tensor[chunk];
        const long long* tensor_desc = desc + tensor * CUPY_AMP_DESC_WORDS;
        long long first = chunk_first[chunk];
        long long numel = tensor_desc[CUPY_AMP_DESC_NUMEL];
        long long last = first + chunk_size < numel ? first + chunk_size : numel;
        bool bad = cupy_amp_apply_range<Type>(tensor_desc, layout, first, last, inv_scale);
        if (__syncthreads_or(bad) && threadIdx.x == 0) {
            tensor_found[tensor] = epoch;
            *found = epoch;
        }
    }
}

#define CUPY_AMP_UNSCALE_CHECK_ENTRY(NAME, TYPE)                                                                  \
    extern "C" __global__ void __launch_bounds__(CUPY_AMP_THREADS, CUPY_AMP_MIN_BLOCKS) NAME(                                                     \
        const long long* desc, const long long* chunk_first, const long long* chunk_tensor, const long long* layout, \
        long long chunks, long long chunk_size, float inv_scale, int epoch, int* found, int* tensor_found) {    \
        cupy_amp_unscale_check<TYPE>(desc, chunk_first, chunk_tensor, layout, chunks, chunk_size, inv_scale, epoch, \
                                     found, tensor_found);                                                      \
    }

CUPY_AMP_UNSCALE_CHECK_ENTRY(cupy_amp_unscale_check_float16, CupyAmpHalf)
CUPY_AMP_UNSCALE_CHECK_ENTRY(cupy_amp_unscale_check_float32, CupyAmpSingle)
CUPY_AMP_UNSCALE_CHECK_ENTRY(cupy_amp_unscale_check_float64, CupyAmpDouble)
