// Fused multi-tensor unscale and overflow check: one launch multiplies every
// element of every listed tensor of one dtype by inv_scale, in place, and
// records which tensors held inf/nan before the multiplication.
//
// The tensor list lives in device tables (no by-value argument limits):
//   chunks          CUPY_AMP_CHUNK_WORDS int64 per chunk (see cupy_amp_common.cuh):
//                   a dense chunk carries everything needed, in one 32-byte record
//   layout_offsets  per tensor, where its extents and strides start in `layout`
//                   (used by strided tensors only)
// Each block walks chunks (grid-stride); a chunk belongs to one tensor.
// `found` may point to mapped pinned host memory, read by the host after a
// stream synchronization. Flags are written as `epoch` (a per-launch number chosen by the host), so
// nothing needs clearing between launches: a flag equal to this launch's
// epoch was set by this launch.
#include "cupy_amp_common.cuh"

template <class Type>
__device__ void cupy_amp_unscale_check(
    const long long* chunks, const long long* layout_offsets, const long long* layout, long long chunk_count,
    float inv_scale, int epoch, int* found, int* tensor_found) {
    for (long long chunk = blockIdx.x; chunk < chunk_count; chunk += gridDim.x) {
        const longlong2* record = reinterpret_cast<const longlong2*>(chunks + chunk * CUPY_AMP_CHUNK_WORDS);
        longlong2 address_first = record[0];
        longlong2 last_meta = record[1];
        long long tensor = last_meta.y & 0xffffffffll;
        int ndim = (int)(last_meta.y >> 32);
        const long long* tensor_layout = ndim ? layout + layout_offsets[tensor] : layout;
        bool bad = cupy_amp_apply_range<Type>(
            (cupy_amp_u64)address_first.x, ndim, tensor_layout, address_first.y, last_meta.x, inv_scale);
        if (__syncthreads_or(bad) && threadIdx.x == 0) {
            tensor_found[tensor] = epoch;
            *(volatile int*)found = epoch;  // found may live in mapped host memory
            __threadfence_system();
        }
    }
}

#define CUPY_AMP_UNSCALE_CHECK_ENTRY(NAME, TYPE)                                                              \
    extern "C" __global__ void __launch_bounds__(CUPY_AMP_THREADS, CUPY_AMP_MIN_BLOCKS)                    \
        NAME(const long long* chunks, const long long* layout_offsets, const long long* layout,             \
             long long chunk_count, float inv_scale, int epoch, int* found, int* tensor_found) {            \
        cupy_amp_unscale_check<TYPE>(chunks, layout_offsets, layout, chunk_count, inv_scale, epoch, found,  \
                                     tensor_found);                                                         \
    }

CUPY_AMP_UNSCALE_CHECK_ENTRY(cupy_amp_unscale_check_float16, CupyAmpHalf)
CUPY_AMP_UNSCALE_CHECK_ENTRY(cupy_amp_unscale_check_float32, CupyAmpSingle)
CUPY_AMP_UNSCALE_CHECK_ENTRY(cupy_amp_unscale_check_float64, CupyAmpDouble)
