// Shared device code for cupy-amp kernels. The Python loader inlines this file
// textually into each .cu file, so its text is part of CuPy's compile-cache key.
//
// Numerics must equal the NumPy path bit for bit on x86-64 hosts:
// - products are taken with explicit PTX `mul.rn` (no .ftz), because CuPy
//   compiles every module with -ftz=true, which would flush float32 subnormals;
// - a NaN input comes out as the same NaN with its quiet bit set (what x86
//   multiplication does), and a NaN produced by the multiplication (0 * inf,
//   only possible once the scale has underflowed to 0) is x86's default NaN;
// - inf/nan is detected on the bits, before multiplying.

// Launch shape, set by the Python side with -D (these defaults match it).
#ifndef CUPY_AMP_THREADS
#define CUPY_AMP_THREADS 512
#endif
#ifndef CUPY_AMP_MIN_BLOCKS
#define CUPY_AMP_MIN_BLOCKS 2
#endif
#ifndef CUPY_AMP_UNROLL
#define CUPY_AMP_UNROLL 4
#endif
// 1: load and store the vector body with streaming (evict-first) cache hints.
#ifndef CUPY_AMP_STREAMING
#define CUPY_AMP_STREAMING 1
#endif

typedef unsigned short cupy_amp_u16;
typedef unsigned int cupy_amp_u32;
typedef unsigned long long cupy_amp_u64;

// One chunk record: four int64 per chunk of the multi-tensor table.
#define CUPY_AMP_CHUNK_ADDRESS 0  // dense: address of the chunk's first element; strided: of element [0, ..., 0]
#define CUPY_AMP_CHUNK_FIRST 1    // dense: 0; strided: first element (C order) of the chunk
#define CUPY_AMP_CHUNK_LAST 2     // one past the chunk's last element (dense: its element count)
#define CUPY_AMP_CHUNK_META 3     // tensor index | ndim << 32 (ndim 0: dense, walked as flat memory)
#define CUPY_AMP_CHUNK_WORDS 4
#define CUPY_AMP_MAX_NDIM 64

__device__ __forceinline__ float cupy_amp_mul_f32(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ float cupy_amp_f16_to_f32(cupy_amp_u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ cupy_amp_u16 cupy_amp_f32_to_f16(float f) {
    cupy_amp_u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Each type also handles a 16-byte vector (uint4) at once: vector_nonfinite
// tests its lanes on the bits; multiply_finite is the product when neither the
// lanes nor the factor are inf/nan, so no NaN can come out and the NaN rules
// above need not be checked.
struct CupyAmpHalf {
    typedef cupy_amp_u16 bits;
    static __device__ __forceinline__ bool word_nonfinite(cupy_amp_u32 w) {
        return ((w & 0x7c00u) == 0x7c00u) | ((w & 0x7c000000u) == 0x7c000000u);
    }
    static __device__ __forceinline__ bool vector_nonfinite(uint4 v) {
        return word_nonfinite(v.x) | word_nonfinite(v.y) | word_nonfinite(v.z) | word_nonfinite(v.w);
    }
    static __device__ __forceinline__ cupy_amp_u32 pair_multiply_finite(cupy_amp_u32 w, float factor) {
        float low = cupy_amp_mul_f32(cupy_amp_f16_to_f32((cupy_amp_u16)(w & 0xffffu)), factor);
        float high = cupy_amp_mul_f32(cupy_amp_f16_to_f32((cupy_amp_u16)(w >> 16)), factor);
#if __CUDA_ARCH__ >= 800
        cupy_amp_u32 packed;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
        return packed;
#else
        return (cupy_amp_u32)cupy_amp_f32_to_f16(low) | ((cupy_amp_u32)cupy_amp_f32_to_f16(high) << 16);
#endif
    }
    static __device__ __forceinline__ void multiply_finite(uint4& v, float factor) {
        v.x = pair_multiply_finite(v.x, factor);
        v.y = pair_multiply_finite(v.y, factor);
        v.z = pair_multiply_finite(v.z, factor);
        v.w = pair_multiply_finite(v.w, factor);
    }
    static __device__ __forceinline__ bool nonfinite(bits x) { return (x & 0x7c00u) == 0x7c00u; }
    static __device__ __forceinline__ bits multiply(bits x, float factor) {
        if ((x & 0x7fffu) > 0x7c00u) return (bits)(x | 0x0200u);
        cupy_amp_u32 r = __float_as_uint(cupy_amp_mul_f32(cupy_amp_f16_to_f32(x), factor));
        if ((r & 0x7fffffffu) > 0x7f800000u) return (bits)0xfe00u;
        return cupy_amp_f32_to_f16(__uint_as_float(r));
    }
};

struct CupyAmpSingle {
    typedef cupy_amp_u32 bits;
    static __device__ __forceinline__ bool vector_nonfinite(uint4 v) {
        return nonfinite(v.x) | nonfinite(v.y) | nonfinite(v.z) | nonfinite(v.w);
    }
    static __device__ __forceinline__ cupy_amp_u32 lane_multiply_finite(cupy_amp_u32 w, float factor) {
        return __float_as_uint(cupy_amp_mul_f32(__uint_as_float(w), factor));
    }
    static __device__ __forceinline__ void multiply_finite(uint4& v, float factor) {
        v.x = lane_multiply_finite(v.x, factor);
        v.y = lane_multiply_finite(v.y, factor);
        v.z = lane_multiply_finite(v.z, factor);
        v.w = lane_multiply_finite(v.w, factor);
    }
    static __device__ __forceinline__ bool nonfinite(bits x) { return (x & 0x7f800000u) == 0x7f800000u; }
    static __device__ __forceinline__ bits multiply(bits x, float factor) {
        if ((x & 0x7fffffffu) > 0x7f800000u) return x | 0x00400000u;
        cupy_amp_u32 r = __float_as_uint(cupy_amp_mul_f32(__uint_as_float(x), factor));
        if ((r & 0x7fffffffu) > 0x7f800000u) return 0xffc00000u;
        return r;
    }
};

struct CupyAmpDouble {
    typedef cupy_amp_u64 bits;
    static __device__ __forceinline__ cupy_amp_u64 join(cupy_amp_u32 low, cupy_amp_u32 high) {
        return (cupy_amp_u64)low | ((cupy_amp_u64)high << 32);
    }
    static __device__ __forceinline__ bool vector_nonfinite(uint4 v) {
        return nonfinite(join(v.x, v.y)) | nonfinite(join(v.z, v.w));
    }
    static __device__ __forceinline__ void multiply_finite(uint4& v, float factor) {
        double a = __dmul_rn(__longlong_as_double((long long)join(v.x, v.y)), (double)factor);
        double b = __dmul_rn(__longlong_as_double((long long)join(v.z, v.w)), (double)factor);
        cupy_amp_u64 ra = (cupy_amp_u64)__double_as_longlong(a), rb = (cupy_amp_u64)__double_as_longlong(b);
        v.x = (cupy_amp_u32)ra;
        v.y = (cupy_amp_u32)(ra >> 32);
        v.z = (cupy_amp_u32)rb;
        v.w = (cupy_amp_u32)(rb >> 32);
    }
    static __device__ __forceinline__ bool nonfinite(bits x) {
        return (x & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
    }
    static __device__ __forceinline__ bits multiply(bits x, float factor) {
        if ((x & 0x7fffffffffffffffull) > 0x7ff0000000000000ull) return x | 0x0008000000000000ull;
        cupy_amp_u64 r = (cupy_amp_u64)__double_as_longlong(__dmul_rn(__longlong_as_double((long long)x), (double)factor));
        if ((r & 0x7fffffffffffffffull) > 0x7ff0000000000000ull) return 0xfff8000000000000ull;
        return r;
    }
};

// Check then multiply one element in place; returns true if it was inf/nan.
template <class Type>
__device__ __forceinline__ bool cupy_amp_apply(typename Type::bits* element, float factor) {
    typename Type::bits x = *element;
    *element = Type::multiply(x, factor);
    return Type::nonfinite(x);
}

// Elements [first, last) of a dense tensor starting at `base`: a scalar head up
// to 16-byte alignment, a body of 16-byte vectors (several loads in flight per
// thread), and a scalar tail.
template <class Type>
__device__ bool cupy_amp_apply_dense(cupy_amp_u64 base, long long first, long long last, float factor) {
    typedef typename Type::bits bits;
    const int vec = 16 / sizeof(bits);
    const int unroll = CUPY_AMP_UNROLL;
    bits* data = reinterpret_cast<bits*>(base);
    bool bad = false;

    cupy_amp_u64 first_address = base + (cupy_amp_u64)first * sizeof(bits);
    long long head = (long long)(((16u - (first_address & 15u)) & 15u) / sizeof(bits));
    long long body_first = first + head < last ? first + head : last;
    for (long long i = first + threadIdx.x; i < body_first; i += blockDim.x) {
        bad |= cupy_amp_apply<Type>(data + i, factor);
    }

    const bool finite_factor = (__float_as_uint(factor) & 0x7f800000u) != 0x7f800000u;
    union Vector {
        uint4 raw;
        bits lanes[vec];
    };
    long long vectors = (last - body_first) / vec;
    Vector* body = reinterpret_cast<Vector*>(data + body_first);
    for (long long v = threadIdx.x; v < vectors; v += (long long)unroll * blockDim.x) {
        Vector loaded[unroll];
#pragma unroll
        for (int k = 0; k < unroll; ++k) {
            long long index = v + (long long)k * blockDim.x;
#if CUPY_AMP_STREAMING
            if (index < vectors) loaded[k].raw = __ldcs(&body[index].raw);
#else
            if (index < vectors) loaded[k].raw = body[index].raw;
#endif
        }
#pragma unroll
        for (int k = 0; k < unroll; ++k) {
            long long index = v + (long long)k * blockDim.x;
            if (index < vectors) {
                bool vector_bad = Type::vector_nonfinite(loaded[k].raw);
                if (!vector_bad && finite_factor) {
                    Type::multiply_finite(loaded[k].raw, factor);
                } else {
#pragma unroll
                    for (int lane = 0; lane < vec; ++lane) {
                        loaded[k].lanes[lane] = Type::multiply(loaded[k].lanes[lane], factor);
                    }
                }
                bad |= vector_bad;
#if CUPY_AMP_STREAMING
                __stcs(&body[index].raw, loaded[k].raw);
#else
                body[index].raw = loaded[k].raw;
#endif
            }
        }
    }

    for (long long i = body_first + vectors * vec + threadIdx.x; i < last; i += blockDim.x) {
        bad |= cupy_amp_apply<Type>(data + i, factor);
    }
    return bad;
}

// Elements [first, last) (in C order) of a strided tensor; `layout` holds
// ndim extents then ndim strides (in elements, possibly negative), already
// staged in shared memory by the caller.
template <class Type>
__device__ bool cupy_amp_apply_strided(
    cupy_amp_u64 base, int ndim, const long long* layout, long long first, long long last, float factor) {
    typedef typename Type::bits bits;
    bits* origin = reinterpret_cast<bits*>(base);
    bool bad = false;
    for (long long i = first + threadIdx.x; i < last; i += blockDim.x) {
        long long rest = i;
        long long offset = 0;
        for (int dim = ndim - 1; dim >= 0; --dim) {
            long long extent = layout[dim];
            offset += (rest % extent) * layout[ndim + dim];
            rest /= extent;
        }
        bad |= cupy_amp_apply<Type>(origin + offset, factor);
    }
    return bad;
}

// Elements [first, last) of one tensor, whichever its layout: `ndim` 0 means
// dense memory starting at `base`; otherwise `layout` holds its extents then
// strides. Must be reached by every thread of the block (it synchronizes).
template <class Type>
__device__ bool cupy_amp_apply_range(
    cupy_amp_u64 base, int ndim, const long long* layout, long long first, long long last, float factor) {
    __shared__ long long staged_layout[2 * CUPY_AMP_MAX_NDIM];
    if (ndim == 0) return cupy_amp_apply_dense<Type>(base, first, last, factor);
    __syncthreads();  // the previous chunk may still be reading staged_layout
    for (int k = threadIdx.x; k < 2 * ndim; k += blockDim.x) staged_layout[k] = layout[k];
    __syncthreads();
    return cupy_amp_apply_strided<Type>(base, ndim, staged_layout, first, last, factor);
}
