// Shared device code for cupy-amp's kernels. cupy_amp/kernel_sources.py inlines this file into each
// .cu file (so its text is part of CuPy's compile-cache key), and cupy_amp/kernel_interface.py appends
// static_asserts that the structs below match their NumPy mirrors, field by field.
//
// Numerics must equal the NumPy path bit for bit on x86-64 hosts:
// - products are taken with explicit PTX `mul.rn` (no .ftz), because CuPy compiles every module
//   with -ftz=true, which would flush float32 subnormals;
// - a NaN input comes out as the same NaN with its quiet bit set (what x86 multiplication does),
//   and a NaN produced by the multiplication (0 * inf) is x86's default NaN;
// - inf/nan is detected on the bits, before multiplying.

// Threads per block: the Python side passes it with -D and launches with the same number.
#ifndef CUPY_AMP_THREADS
#error "compile with -DCUPY_AMP_THREADS=<threads per block>, as cupy_amp/kernel_interface.py does"
#endif
// Bytes per chunk of the multi-tensor tables (cupy_amp/kernel_interface.py: CHUNK_BYTES), for the bounds
// that the report's float-valued counts rely on.
#ifndef CUPY_AMP_CHUNK_BYTES
#error "compile with -DCUPY_AMP_CHUNK_BYTES=<bytes per chunk>, as cupy_amp/kernel_interface.py does"
#endif

namespace cupy_amp {

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// Registers for two blocks per multiprocessor; four 16-byte vectors in flight per thread
// (the best launch shape measured on an H200: BENCHMARKS.md).
constexpr int kMinBlocks = 2;
constexpr int kUnroll = 4;
constexpr int kMaxNdim = 64;

// The records below are written by the Python side (cupy_amp/kernel_interface.py mirrors each with a NumPy
// dtype, and every compile checks that the two agree field by field). Device addresses are u64.

// One chunk of a multi-tensor table: one block's unit of work (in the statistics pass, one warp's), inside one tensor.
struct __align__(16) Chunk {
    u64 address;      // dense: the chunk's first element; strided: the tensor's element [0, ..., 0]
    long long first;  // dense: 0; strided: the chunk's first element, counted in C order
    long long last;   // one past the chunk's last element (dense: its element count)
    int tensor;       // the tensor's index in the table
    int layout;       // -1: dense, walked as flat memory; else the offset of the tensor's layout
};

// A strided tensor's layout, at `layouts + Chunk::layout` (long long words): ndim, then ndim extents,
// then ndim strides in elements (possibly negative).

struct UnscaleArgs {
    u64 chunks;   // const Chunk[chunk_count]
    u64 layouts;  // const long long[]
    long long chunk_count;
    u64 tensor_found;  // u64 per tensor, set to the step's epoch if it held inf/nan (so none needs clearing)
    u64 state;         // State*: the factor is the inverse of its scale; inf/nan sets its found and clears finite
    u64 positions;     // const int per tensor: its position in the call (for the journal's first culprit)
    u64 call;          // the call's number in the step (0 for the first)
};

struct ScaleArgs {
    u64 base;  // dense: the lowest element; strided: element [0, ..., 0]
    long long numel;
    u64 layout;            // 0: dense; else the loss's layout (const long long[]), as above
    long long chunk_size;  // elements per block per turn
    u64 state;             // State*: the loss is multiplied by its scale
};

// A scaler's state and configuration, in device memory. Every kernel reads the scale and the step's
// epoch from here rather than from arguments, so one captured launch stays right step after step
// (and after a checkpoint is loaded into the same memory).
struct State {
    u64 consecutive_good_steps;
    u64 hysteresis_tracker;
    u64 steps;
    u64 skipped_steps;
    u64 growths;
    u64 backoffs;
    u64 remote_skipped_steps;
    u64 epoch;             // the open (or last) step's number: the scaler's own number << 32, plus a step count
    u64 updated_epoch;     // the epoch the rule was last applied in: a repeated update of a step does nothing
    u64 folded_step;       // the host's step number of the last update() that also began the next step here
    double growth_factor;  // the update rule's configuration: cupy_amp.rule.ScalerConfig
    double backoff_factor;
    double floor;      // min_scale, or the smallest scale with a finite float32 inverse
    double max_scale;  // inf without a ceiling
    u64 growth_interval;
    u64 hysteresis;
    u64 bad_votes;         // steps whose all-reduce answer no ranks can produce (the host raises on them)
    u64 bad_vote_epoch;    // the step last counted there: finishing a vote twice counts it once
    u64 stats;             // Stats*: the statistics record, which says "skip" from each step's opening and close on
    u64 journal;           // JournalEntry[journal_capacity]: the step of number n is at (n - 1) % capacity
    u64 journal_capacity;  // 0: no journal
    u64 first_culprit;     // the step's lowest (call << 32 | position) that held inf/nan here; all ones: none
    u64 checked_epoch;     // the epoch of the last check() whose statistics were finished
    u64 reported_epoch;    // the epoch of the last check(report=True) whose statistics were finished
    u64 overflows_in_row;  // the headroom rule's memory (cupy_amp.rule.ScalerState); 0 under PyTorch's rule
    u64 rule;              // kPytorch or kHeadroom (cupy_amp.rule.RULES)
    double vote_count;  // unscale_and_check's all-reduced pair: this rank's 0/1 overflow flag, then the ranks' count,
    double vote_sum;    // and 0 beside it, as in check()'s pair (count, sum of squares): one kind of collective
    float scale;
    float overflow_scale;  // the headroom rule's memory: the latest overflow's scale, the norm before it,
    float overflow_norm;
    float clean_scale;  // the highest scale seen clean below it, and the last clean step's norm (0: none)
    float clean_norm;
    float checked_norm;   // the norm of the last finished check() (at checked_epoch), for the host's read
    float report_amax;    // that check's report (at reported_epoch): the largest finite magnitude (float32),
    float zero_fraction;  // the fractions of the elements that are 0 and subnormal,
    float subnormal_fraction;
    int report_call;  // and where the largest is (-1, -1: no element above 0)
    int report_position;
    int found;             // 1 once this rank's gradients of the step held inf/nan
    int agreed;            // with a communicator: 1 if any rank's did (from the all-reduced count)
    int poisoned;          // 1 once an all-reduce answered a poisoned vote (cupy_amp.distributed.POISON): for good
    int culprits;          // the step's gradients that held inf/nan here, each counted once
    unsigned char finite;  // the verdict handed to users (1: finite); the rule never reads it back
};

// One step of the journal (cupy_amp.journal), written by the rule when it closes the step.
struct JournalEntry {
    u64 step;                // the step's number: the scaler's count of steps, this one included
    float scale;             // the scale the step used
    float next_scale;        // the scale the rule left for the next step
    float norm;              // check()'s norm of the unscaled gradients; NaN in a step without check()
    float clip_coefficient;  // check()'s clip coefficient; NaN likewise
    int culprits;            // this rank's gradients that held inf/nan
    int culprit_call;        // the first of them: its call's number in the step, and its position there;
    int culprit;             // -1 and -1 without one
    unsigned char local;     // 1: this rank's gradients held inf/nan
    unsigned char agreed;    // 1: the step overflowed (here or on another rank), so it was skipped
    unsigned char action;    // cupy_amp.journal: kKept, kGrew, kBackedOff, kHeld, kAtFloor, kAtCeiling
    float amax;              // with check(report=True): the largest finite |g| (float32); NaN without a report
    float zero_fraction;     // the fractions of the step's checked elements that are 0, and subnormal; NaN likewise
    float subnormal_fraction;
    int amax_call;  // where the largest |g| is: its call and position (-1 without one)
    int amax_position;
};

constexpr u64 kPytorch = 0, kHeadroom = 1;

constexpr unsigned char kKept = 0, kGrew = 1, kBackedOff = 2, kHeld = 3, kAtFloor = 4, kAtCeiling = 5;

struct StateArgs {
    u64 state;  // State*
};

struct UpdateArgs {
    u64 state;  // State*
    u64 step;   // the host's number of the step being closed (cupy_amp.step.Step.number)
};

constexpr double kPoison = 1099511627776.0;  // 2**40, cupy_amp.distributed.POISON: a multiple of POISON plus a
                                             // count of ranks holds poisoned votes; from 2**60 on (inf...) garbage

// The verdict of an all-reduced count of overflowed ranks (cupy_amp.distributed.count_verdict), into the State:
// whether any rank overflowed, this rank's own flag included; a poisoned count; an impossible one (counted
// once per step in bad_votes). Returns whether the count was bad. A NaN fails every comparison.
__device__ __forceinline__ bool take_count(State* s, double count) {
    if (count >= kPoison && count < kPoison * 1048576.0) s->poisoned = 1;  // one or several poisoned votes
    const bool bad = s->poisoned == 0 && !(count >= (double)s->found && count < kPoison && count == floor(count));
    if (bad && s->bad_vote_epoch != s->epoch) {
        s->bad_votes += 1;
        s->bad_vote_epoch = s->epoch;
    }
    const bool agreed = bad || s->poisoned != 0 || count > 0.0;
    s->agreed = agreed ? 1 : 0;
    if (agreed || s->found != 0) s->finite = 0;
    return bad;
}

// One step's read-only statistics of the gradients (cupy_amp.statistics): the optimizers read `factor`
// and `skip` from here, so neither the scale nor the verdict passes through the host.
struct Stats {
    double overflowed;      // 1 if this rank's gradients held inf/nan, else 0; after an all-reduce, the ranks' sum
    double sum_of_squares;  // of the gradients as given (still scaled), this rank's; after an all-reduce, all ranks'
    double own_sum_of_squares;  // this rank's share, kept to check the all-reduced sum against
    float norm;                 // the unscaled gradients' L2 norm: float32(sqrt(sum_of_squares) * inv_scale)
    float clip_coefficient;     // min(1, max_norm / (norm + 1e-6)), or 1 without clipping
    float factor;               // inv_scale * clip_coefficient: what the optimizers multiply gradients by
    int found;                  // 1 once this rank's gradients of the step held inf/nan
    int skip;                   // 1: the step overflowed (here, or on another rank); the optimizers do nothing
    int bad_vote;               // 1: the all-reduced count or sum of squares was none the ranks' shares can add up to
};

struct StatsArgs {
    u64 chunks;  // const Chunk[chunk_count], as for UnscaleArgs
    u64 layouts;
    long long chunk_count;
    u64 partials;      // double per block: each block's sum of squares
    u64 tensor_found;  // as for UnscaleArgs
    u64 state;         // State*: the epoch is read from it; inf/nan sets its found and clears finite
    u64 report;        // the report entries only: u64[3] per tensor, zeroed before: amax bits, zeros, subnormals
    u64 positions;     // as for UnscaleArgs
    u64 call;
    u64 step_report;  // with the report: u64[3], zeroed before, the whole call's (kReportHeader), else 0
};

// The whole call's numerics report, beside the per-tensor entries, for the step journal: the largest magnitude
// as float32 bits in the high word with (all ones - its gradient's position) below (so atomicMax keeps the
// largest, and the lowest position among equals), then the zeros and the subnormals.
constexpr int kReportHeader = 3;

// What a FinishArgs launch does: sum the blocks' sums and finish; or only sum (an all-reduce of
// Stats::overflowed and Stats::sum_of_squares comes next); or only finish (after that all-reduce).
constexpr int kSumAndFinish = 0, kSumOnly = 1, kFinishOnly = 2;

// A tensor that held inf/nan: its flag gets the step's epoch and the state's found is set. The first time in
// the step (the exchange tells), the state also counts it and keeps the step's lowest (call, position).
__device__ __forceinline__ void mark_culprit(State* state, u64* flags, const int* positions, u64 call, int tensor,
                                             u64 epoch) {
    if (atomicExch(reinterpret_cast<unsigned long long*>(flags + tensor), epoch) != epoch) {
        atomicAdd(&state->culprits, 1);
        atomicMin(reinterpret_cast<unsigned long long*>(&state->first_culprit),
                  (call << 32) | (u64)(u32)positions[tensor]);
    }
    state->found = 1;
    state->finite = 0;
}

struct FinishArgs {
    u64 stats;     // Stats*
    u64 partials;  // const double[partial_count]: the blocks' sums of this call's launches, in order
    long long partial_count;
    u64 state;           // State*: the scale and this rank's flag are read from it, the vote's verdict written
    float max_norm;      // <= 0: no clipping
    int stage;           // kSumAndFinish, kSumOnly or kFinishOnly
    u64 step_report;     // the call's StatsArgs::step_report (0: no report), into the State for the journal
    long long elements;  // the reported gradients' elements
    long long call;      // the call's number in the step
};

// float32 <-> float64 conversions and the inverse scale, in explicit PTX without .ftz: the scale may be
// a float32 subnormal (down to 2**-128), which -ftz=true would flush to zero.
__device__ __forceinline__ double widen(float f) {
    double d;
    asm("cvt.f64.f32 %0, %1;" : "=d"(d) : "f"(f));
    return d;
}

__device__ __forceinline__ float narrow(double d) {
    float f;
    asm("cvt.rn.f32.f64 %0, %1;" : "=f"(f) : "d"(d));
    return f;
}

// float32(1 / float64(scale)): what cupy_amp.rule.inverse_scale computes on the host.
__device__ __forceinline__ float inverse_of(float scale) {
    return narrow(__drcp_rn(widen(scale)));
}

// Binary float32 operations, rounded to nearest, without .ftz.
#define CUPY_AMP_F32_BINARY(NAME, PTX)                        \
    __device__ __forceinline__ float NAME(float a, float b) { \
        float r;                                              \
        asm(PTX " %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));   \
        return r;                                             \
    }
CUPY_AMP_F32_BINARY(mul_f32, "mul.rn.f32")
CUPY_AMP_F32_BINARY(add_f32, "add.rn.f32")
CUPY_AMP_F32_BINARY(sub_f32, "sub.rn.f32")
CUPY_AMP_F32_BINARY(div_f32, "div.rn.f32")

__device__ __forceinline__ float fma_f32(float a, float b, float c) {
    float r;
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
    return r;
}

__device__ __forceinline__ float sqrt_f32(float a) {
    float r;
    asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __uint_as_float((u32)h << 16);
}

// Round to nearest even, as ml_dtypes does; a NaN becomes ml_dtypes' quiet NaN of the same sign.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)(((u >> 16) & 0x8000u) | 0x7fc0u);
    return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Whether either 16-bit half of `w`, or any of a vector's eight, has all of `kExponent`'s bits set (inf/nan).
template <u32 kExponent>
__device__ __forceinline__ bool word_nonfinite(u32 w) {
    return ((w & kExponent) == kExponent) | ((w & (kExponent << 16)) == (kExponent << 16));
}

template <u32 kExponent>
__device__ __forceinline__ bool halves_nonfinite(uint4 v) {
    return word_nonfinite<kExponent>(v.x) | word_nonfinite<kExponent>(v.y) | word_nonfinite<kExponent>(v.z) |
           word_nonfinite<kExponent>(v.w);
}

// The one family of element types. value() is an element in float64 (the statistics' sums); load() and
// store() are its float32 value and back (the optimizers); the masks on the bits classify a magnitude
// (below kMinNormal and not 0: subnormal; kInfinity and above: inf/nan). Each type also handles a 16-byte vector
// (uint4) at once: vector_nonfinite tests its lanes on the bits; multiply_finite is the product when
// neither the lanes nor the factor are inf/nan, so no NaN can come out and the NaN rules above need not
// be checked.
struct Half {
    typedef u16 bits;
    static constexpr bits kMagnitude = 0x7fffu, kInfinity = 0x7c00u, kMinNormal = 0x0400u;
    static __device__ __forceinline__ double value(bits x) { return widen(f16_to_f32(x)); }
    static __device__ __forceinline__ float load(bits x) { return f16_to_f32(x); }
    static __device__ __forceinline__ bits store(float f) { return f32_to_f16(f); }
    static __device__ __forceinline__ bool vector_nonfinite(uint4 v) { return halves_nonfinite<0x7c00u>(v); }
    static __device__ __forceinline__ u32 pair_multiply_finite(u32 w, float factor) {
        float low = mul_f32(f16_to_f32((u16)(w & 0xffffu)), factor);
        float high = mul_f32(f16_to_f32((u16)(w >> 16)), factor);
#if __CUDA_ARCH__ >= 800
        u32 packed;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
        return packed;
#else
        return (u32)f32_to_f16(low) | ((u32)f32_to_f16(high) << 16);
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
        u32 r = __float_as_uint(mul_f32(f16_to_f32(x), factor));
        if ((r & 0x7fffffffu) > 0x7f800000u) return (bits)0xfe00u;
        return f32_to_f16(__uint_as_float(r));
    }
};

struct Single {
    typedef u32 bits;
    static constexpr bits kMagnitude = 0x7fffffffu, kInfinity = 0x7f800000u, kMinNormal = 0x00800000u;
    static __device__ __forceinline__ double value(bits x) { return widen(__uint_as_float(x)); }
    static __device__ __forceinline__ float load(bits x) { return __uint_as_float(x); }
    static __device__ __forceinline__ bits store(float f) { return __float_as_uint(f); }
    static __device__ __forceinline__ bool vector_nonfinite(uint4 v) {
        return nonfinite(v.x) | nonfinite(v.y) | nonfinite(v.z) | nonfinite(v.w);
    }
    static __device__ __forceinline__ u32 lane_multiply_finite(u32 w, float factor) {
        return __float_as_uint(mul_f32(__uint_as_float(w), factor));
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
        u32 r = __float_as_uint(mul_f32(__uint_as_float(x), factor));
        if ((r & 0x7fffffffu) > 0x7f800000u) return 0xffc00000u;
        return r;
    }
};

struct Double {
    typedef u64 bits;
    static constexpr bits kMagnitude = 0x7fffffffffffffffull, kInfinity = 0x7ff0000000000000ull,
                          kMinNormal = 0x0010000000000000ull;
    static __device__ __forceinline__ double value(bits x) { return __longlong_as_double((long long)x); }
    static __device__ __forceinline__ u64 join(u32 low, u32 high) { return (u64)low | ((u64)high << 32); }
    static __device__ __forceinline__ bool vector_nonfinite(uint4 v) {
        return nonfinite(join(v.x, v.y)) | nonfinite(join(v.z, v.w));
    }
    static __device__ __forceinline__ void multiply_finite(uint4& v, float factor) {
        double a = __dmul_rn(__longlong_as_double((long long)join(v.x, v.y)), widen(factor));
        double b = __dmul_rn(__longlong_as_double((long long)join(v.z, v.w)), widen(factor));
        u64 ra = (u64)__double_as_longlong(a), rb = (u64)__double_as_longlong(b);
        v.x = (u32)ra;
        v.y = (u32)(ra >> 32);
        v.z = (u32)rb;
        v.w = (u32)(rb >> 32);
    }
    static __device__ __forceinline__ bool nonfinite(bits x) {
        return (x & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
    }
    static __device__ __forceinline__ bits multiply(bits x, float factor) {
        if ((x & 0x7fffffffffffffffull) > 0x7ff0000000000000ull) return x | 0x0008000000000000ull;
        u64 r = (u64)__double_as_longlong(__dmul_rn(__longlong_as_double((long long)x), widen(factor)));
        if ((r & 0x7fffffffffffffffull) > 0x7ff0000000000000ull) return 0xfff8000000000000ull;
        return r;
    }
};

// bfloat16 is only read (statistics, optimizers), never unscaled in place.
struct Bfloat {
    typedef u16 bits;
    static constexpr bits kMagnitude = 0x7fffu, kInfinity = 0x7f80u, kMinNormal = 0x0080u;
    static __device__ __forceinline__ double value(bits x) { return widen(bf16_to_f32(x)); }
    static __device__ __forceinline__ float load(bits x) { return bf16_to_f32(x); }
    static __device__ __forceinline__ bits store(float f) { return f32_to_bf16(f); }
    static __device__ __forceinline__ bool vector_nonfinite(uint4 v) { return halves_nonfinite<0x7f80u>(v); }
    static __device__ __forceinline__ bool nonfinite(bits x) { return (x & 0x7f80u) == 0x7f80u; }
};

// The offset (in elements) of element `i` (counted in C order) of a strided layout: ndim, extents, strides.
__device__ __forceinline__ long long strided_offset(const long long* staged, long long i) {
    const int ndim = (int)staged[0];
    const long long* extents = staged + 1;
    const long long* strides = staged + 1 + ndim;
    long long offset = 0;
    for (int dim = ndim - 1; dim >= 0; --dim) {
        offset += (i % extents[dim]) * strides[dim];
        i /= extents[dim];
    }
    return offset;
}

// Stage a strided layout in shared memory; must be reached by every thread of the block.
__device__ __forceinline__ const long long* stage_layout(const long long* layout) {
    __shared__ long long staged[1 + 2 * kMaxNdim];
    __syncthreads();  // the previous chunk may still be reading `staged`
    const int words = 1 + 2 * (int)layout[0];
    for (int k = threadIdx.x; k < words; k += blockDim.x) staged[k] = layout[k];
    __syncthreads();
    return staged;
}

// A 16-byte vector of elements: the unit the walks below load and store.
template <class Type>
union Vector {
    uint4 raw;
    typename Type::bits lanes[16 / sizeof(typename Type::bits)];
};

// What a walk does per element, each op reporting whether it saw inf/nan. Multiply: in place, by a
// factor (the loss's scale, the gradients' inverse scale), checked before multiplying.
template <class T>
struct Multiply {
    typedef T Type;
    static constexpr bool kWrites = true;
    float factor;
    bool finite_factor;
    __device__ explicit Multiply(float f)
        : factor(f), finite_factor((__float_as_uint(f) & 0x7f800000u) != 0x7f800000u) {}
    __device__ __forceinline__ bool one(typename T::bits& x) {
        const typename T::bits old = x;
        x = T::multiply(old, factor);
        return T::nonfinite(old);
    }
    __device__ __forceinline__ bool vector(Vector<T>& v) {
        const bool bad = T::vector_nonfinite(v.raw);
        if (!bad && finite_factor) {
            T::multiply_finite(v.raw, factor);
        } else {
#pragma unroll
            for (int lane = 0; lane < 16 / (int)sizeof(typename T::bits); ++lane) {
                v.lanes[lane] = T::multiply(v.lanes[lane], factor);
            }
        }
        return bad;
    }
};

// One thread's numerics report of the elements it walked in a chunk: the largest finite magnitude (in the
// type's bits, whose order is the magnitudes' order), the count of zeros and of subnormals. one() takes any
// element, on the integer pipe; finite() takes a vector known to hold no inf/nan. The walk already keeps
// the integer pipe busy, so float32 and float16 (sm_80 and later) count finite vectors on the float pipes.
template <class T>
struct ScalarTally {
    typedef typename T::bits bits;
    bits amax = 0;
    u32 zeros = 0, subnormals = 0;
    __device__ __forceinline__ void one(bits x) {
        const bits magnitude = x & T::kMagnitude;
        if (magnitude < T::kInfinity && magnitude > amax) amax = magnitude;
        zeros += magnitude == 0;
        subnormals += (bits)(magnitude - 1) < (bits)(T::kMinNormal - 1);  // 0 < magnitude < kMinNormal
    }
    __device__ __forceinline__ void finite(const Vector<T>& v) {
#pragma unroll
        for (int lane = 0; lane < 16 / (int)sizeof(bits); ++lane) one(v.lanes[lane]);
    }
    // After each chunk: the counts kept in float lanes are added to the integer ones (see FloatTally).
    __device__ __forceinline__ void settle() {}
    // The report so far (amax as its bits), then zero again for the next tensor.
    __device__ __forceinline__ void take(u64& largest, u64& zero_count, u64& subnormal_count) {
        largest = amax, zero_count = zeros, subnormal_count = subnormals;
        amax = 0;
        zeros = subnormals = 0;
    }
};

template <class T>
struct Tally : ScalarTally<T> {};

// One 32-bit word of PTX on 32-bit values: `r = OP a` or `r = a OP b`. No .ftz anywhere, so subnormals are
// compared as they are (CuPy compiles with -ftz=true, which inline PTX escapes).
#define CUPY_AMP_WORD_UNARY(NAME, PTX)                  \
    static __device__ __forceinline__ u32 NAME(u32 a) { \
        u32 r;                                          \
        asm(PTX " %0, %1;" : "=r"(r) : "r"(a));         \
        return r;                                       \
    }
#define CUPY_AMP_WORD_BINARY(NAME, PTX)                        \
    static __device__ __forceinline__ u32 NAME(u32 a, u32 b) { \
        u32 r;                                                 \
        asm(PTX " %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));    \
        return r;                                              \
    }
// count + (1 where `a` compares to `b`, else 0), lane by lane, in the float type TYPE.
#define CUPY_AMP_WORD_COUNT(NAME, CMP, TYPE)                                                                     \
    static __device__ __forceinline__ u32 NAME(u32 count, u32 a, u32 b) {                                        \
        u32 r;                                                                                                   \
        asm("{ .reg .b32 hit;\n\t set." CMP "." TYPE "." TYPE " hit, %1, %2;\n\t add.rn." TYPE " %0, %3, hit; }" \
            : "=r"(r)                                                                                            \
            : "r"(a), "r"(b), "r"(count));                                                                       \
        return r;                                                                                                \
    }

// A tally of finite vectors on the float pipes, for a type whose 32-bit words those pipes take as they are
// (`Lanes`: one float32 or two float16 values per word). The largest magnitude is kept per lane; zeros and
// subnormals are rare, so a vector's smallest magnitude decides whether they are counted at all, as float
// values per lane (exact far beyond a thread's share of one chunk), added to the integers per chunk.
template <class T, class Lanes>
struct FloatTally : ScalarTally<T> {
    u32 largest_finite = 0, zero_lanes = 0, small_lanes = 0;  // small: below the normal range, zeros too
    __device__ __forceinline__ void finite(const Vector<T>& v) {
        const u32 a = Lanes::abs(v.raw.x), b = Lanes::abs(v.raw.y), c = Lanes::abs(v.raw.z), d = Lanes::abs(v.raw.w);
        largest_finite = Lanes::max(largest_finite, Lanes::max(Lanes::max(a, b), Lanes::max(c, d)));
        if (!Lanes::any_below(Lanes::min(Lanes::min(a, b), Lanes::min(c, d)), Lanes::kMinNormal)) return;
        const u32 words[4] = {a, b, c, d};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            zero_lanes = Lanes::count_equal(zero_lanes, words[k], 0u);
            small_lanes = Lanes::count_below(small_lanes, words[k], Lanes::kMinNormal);
        }
    }
    __device__ __forceinline__ void settle() {
        if (small_lanes == 0) return;  // zeros are counted among the small lanes too
        const u32 zero = Lanes::total(zero_lanes), small = Lanes::total(small_lanes);
        this->zeros += zero;
        this->subnormals += small - zero;
        zero_lanes = small_lanes = 0;
    }
    __device__ __forceinline__ void take(u64& largest, u64& zero_count, u64& subnormal_count) {
        settle();
        ScalarTally<T>::take(largest, zero_count, subnormal_count);
        const u64 lanes = Lanes::largest(largest_finite);
        largest = largest > lanes ? largest : lanes;
        largest_finite = 0;
    }
};

struct SingleLanes {
    static constexpr u32 kMinNormal = 0x00800000u;
    CUPY_AMP_WORD_UNARY(abs, "abs.f32")
    CUPY_AMP_WORD_BINARY(max, "max.f32")
    CUPY_AMP_WORD_BINARY(min, "min.f32")
    CUPY_AMP_WORD_COUNT(count_equal, "eq", "f32")
    CUPY_AMP_WORD_COUNT(count_below, "lt", "f32")
    static __device__ __forceinline__ bool any_below(u32 a, u32 b) { return a < b; }  // magnitudes order as bits
    static __device__ __forceinline__ u32 total(u32 count) { return (u32)__uint_as_float(count); }
    static __device__ __forceinline__ u64 largest(u32 word) { return word; }
};

template <>
struct Tally<Single> : FloatTally<Single, SingleLanes> {};

#if __CUDA_ARCH__ >= 800
// A warp walks a statistics chunk (grad_stats.cu): each thread counts at most this many halves per chunk.
static_assert(CUPY_AMP_CHUNK_BYTES / 2 / 32 <= 2048, "float16-valued counts would round");

struct HalfLanes {
    static constexpr u32 kMinNormal = 0x04000400u;  // 2**-14 in both lanes
    CUPY_AMP_WORD_UNARY(abs, "abs.f16x2")
    CUPY_AMP_WORD_BINARY(max, "max.f16x2")
    CUPY_AMP_WORD_BINARY(min, "min.f16x2")
    CUPY_AMP_WORD_BINARY(below, "set.lt.u32.f16x2")
    CUPY_AMP_WORD_COUNT(count_equal, "eq", "f16x2")
    CUPY_AMP_WORD_COUNT(count_below, "lt", "f16x2")
    static __device__ __forceinline__ bool any_below(u32 a, u32 b) { return below(a, b) != 0; }
    static __device__ __forceinline__ u32 total(u32 count) {
        return (u32)f16_to_f32((u16)(count & 0xffffu)) + (u32)f16_to_f32((u16)(count >> 16));
    }
    static __device__ __forceinline__ u64 largest(u32 word) {
        return (word & 0xffffu) > (word >> 16) ? (word & 0xffffu) : (word >> 16);
    }
};

template <>
struct Tally<Half> : FloatTally<Half, HalfLanes> {};
#endif

// SumSquares: read only, adding each element's square in float64 to this thread's sum, in walk order. With
// kReport it also keeps the numerics report of the chunks walked (settled after each chunk, taken and reset by
// the caller when the tensor changes).
template <class T, bool kReport = false>
struct SumSquares {
    typedef T Type;
    typedef typename T::bits bits;
    static constexpr bool kWrites = false;
    double sum = 0.0;
    Tally<T> tally;
    __device__ __forceinline__ bool one(const bits& x) {
        sum = fma(T::value(x), T::value(x), sum);
        if constexpr (kReport) tally.one(x);
        return T::nonfinite(x);
    }
    __device__ __forceinline__ bool vector(const Vector<T>& v) {
#pragma unroll
        for (int lane = 0; lane < 16 / (int)sizeof(bits); ++lane) {
            const double d = T::value(v.lanes[lane]);
            sum = fma(d, d, sum);
        }
        const bool bad = T::vector_nonfinite(v.raw);
        if constexpr (kReport) {
            if (bad) {
#pragma unroll
                for (int lane = 0; lane < 16 / (int)sizeof(bits); ++lane) tally.one(v.lanes[lane]);
            } else {
                tally.finite(v);
            }
        }
        return bad;
    }
};

// The one walk: elements [first, last) of a dense tensor starting at `base`, shared by `threads` threads
// (this one is `thread`), as a scalar head up to 16-byte alignment, a body of 16-byte vectors (kUnroll loads
// in flight per thread, streaming cache hints: every byte is read, and written, once), and a scalar tail.
// Returns true if any was inf/nan.
template <class Op>
__device__ bool walk_dense(u64 base, long long first, long long last, Op& op, u32 thread, u32 threads) {
    typedef typename Op::Type::bits bits;
    bits* data = reinterpret_cast<bits*>(base);
    bool bad = false;

    const u64 first_address = base + (u64)first * sizeof(bits);
    const long long head = (long long)(((16u - (first_address & 15u)) & 15u) / sizeof(bits));
    const long long body_first = first + head < last ? first + head : last;
    for (long long i = first + thread; i < body_first; i += threads) bad |= op.one(data[i]);

    const long long lanes = 16 / sizeof(bits), vectors = (last - body_first) / lanes;
    Vector<typename Op::Type>* body = reinterpret_cast<Vector<typename Op::Type>*>(data + body_first);
    for (long long v = thread; v < vectors; v += (long long)kUnroll * threads) {
        Vector<typename Op::Type> loaded[kUnroll];
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
            const long long index = v + (long long)k * threads;
            if (index < vectors) loaded[k].raw = __ldcs(&body[index].raw);
        }
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
            const long long index = v + (long long)k * threads;
            if (index < vectors) {
                bad |= op.vector(loaded[k]);
                if constexpr (Op::kWrites) __stcs(&body[index].raw, loaded[k].raw);
            }
        }
    }

    for (long long i = body_first + vectors * lanes + thread; i < last; i += threads) bad |= op.one(data[i]);
    return bad;
}

// Elements [first, last) (in C order) of a strided tensor whose element [0, ..., 0] is at `base`, shared by
// `threads` threads as walk_dense's; `layout` as stage_layout copies it. Returns true if any was inf/nan.
template <class Op>
__device__ bool walk_strided(u64 base, const long long* layout, long long first, long long last, Op& op, u32 thread,
                             u32 threads) {
    typename Op::Type::bits* origin = reinterpret_cast<typename Op::Type::bits*>(base);
    bool bad = false;
    for (long long i = first + thread; i < last; i += threads) bad |= op.one(origin[strided_offset(layout, i)]);
    return bad;
}

// Elements [first, last) (in C order) of one tensor, whichever its layout (null: dense), walked by the block.
// Must be reached by every thread of the block (it synchronizes to stage a strided layout in shared memory).
template <class Op>
__device__ bool walk(u64 base, const long long* layout, long long first, long long last, Op& op) {
    if (layout == nullptr) return walk_dense(base, first, last, op, threadIdx.x, blockDim.x);
    return walk_strided(base, stage_layout(layout), first, last, op, threadIdx.x, blockDim.x);
}

// The same, walked by one warp alone (a strided layout read where it is, not staged: no block barrier).
template <class Op>
__device__ bool walk_by_warp(u64 base, const long long* layout, long long first, long long last, Op& op) {
    if (layout == nullptr) return walk_dense(base, first, last, op, threadIdx.x % 32, 32u);
    return walk_strided(base, layout, first, last, op, threadIdx.x % 32, 32u);
}

// The sum of `x` over the block, in a fixed order (the same bits every run); valid in thread 0.
// Must be reached by every thread of the block.
__device__ __forceinline__ double block_sum(double x) {
    __shared__ double warp_sums[CUPY_AMP_THREADS / 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    __syncthreads();  // a previous call may still be reading `warp_sums`
    for (int offset = 16; offset > 0; offset /= 2) x = __dadd_rn(x, __shfl_down_sync(0xffffffffu, x, offset));
    if (lane == 0) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        x = lane < (int)(blockDim.x / 32) ? warp_sums[lane] : 0.0;
        for (int offset = 16; offset > 0; offset /= 2) x = __dadd_rn(x, __shfl_down_sync(0xffffffffu, x, offset));
    }
    return x;
}

}  // namespace cupy_amp
