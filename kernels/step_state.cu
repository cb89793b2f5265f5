// A scaler's step, on its State in device memory: each entry runs as one thread, so the
// host never reads the state to decide anything and a captured graph replays the whole step.
// NumPy reference: cupy_amp.twins.step_state.HostState and cupy_amp.rule.next_state.
#include "common.cuh"

namespace cupy_amp {

__device__ __forceinline__ u32 bits_of(float f) {
    return __float_as_uint(f);
}

// The next step's epoch: the count in the low 32 bits goes up, skipping 0; the scaler's number stays.
__device__ __forceinline__ u64 next_epoch(u64 epoch) {
    u32 count = (u32)epoch + 1u;
    return (epoch & 0xffffffff00000000ull) | (u64)(count == 0u ? 1u : count);
}

// The journal's entry of the step the rule just closed (cupy_amp.journal; NumPy: HostState.update), at the slot
// of its number, so that a state restored to an earlier count writes over what it rolled back.
__device__ void write_journal(State* s, float old, bool overflow, unsigned char action) {
    JournalEntry* e = reinterpret_cast<JournalEntry*>(s->journal) + (s->steps - 1) % s->journal_capacity;
    const bool checked = s->checked_epoch == s->epoch;
    const Stats* stats = reinterpret_cast<const Stats*>(s->stats);
    const float nan = __int_as_float(0x7fc00000);
    const bool culprit = s->first_culprit != ~0ull;
    e->step = s->steps;
    e->scale = old;
    e->next_scale = s->scale;
    e->norm = checked ? stats->norm : nan;
    e->clip_coefficient = checked ? stats->clip_coefficient : nan;
    e->culprits = s->culprits;
    e->culprit_call = culprit ? (int)(s->first_culprit >> 32) : -1;
    e->culprit = culprit ? (int)(u32)s->first_culprit : -1;
    e->local = s->found != 0 ? 1 : 0;
    e->agreed = overflow ? 1 : 0;
    e->action = action;
    const bool reported = s->reported_epoch == s->epoch;
    e->amax = reported ? s->report_amax : nan;
    e->zero_fraction = reported ? s->zero_fraction : nan;
    e->subnormal_fraction = reported ? s->subnormal_fraction : nan;
    e->amax_call = reported ? s->report_call : -1;
    e->amax_position = reported ? s->report_position : -1;
}

// Comparisons and products of the headroom rule, in float64 like the rest of the rule (no -ftz flushing).
__device__ __forceinline__ float times(float value, double factor, int count) {
    for (int i = 0; i < count; ++i) value = narrow(__dmul_rn(widen(value), factor));
    return value;
}

__device__ __forceinline__ bool below(float a, float b) {
    return widen(a) < widen(b);
}

__device__ __forceinline__ float lower(float a, float b) {
    return below(b, a) ? b : a;
}

__device__ __forceinline__ float upper(float a, float b) {
    return below(a, b) ? b : a;
}

// Zero tests in float64 too: a scale (and so this memory) may be a float32 subnormal, which -ftz would flush.
__device__ __forceinline__ bool is_zero(float f) {
    return widen(f) == 0.0;
}

__device__ __forceinline__ bool positive_finite(float f) {
    return widen(f) > 0.0 && widen(f) < widen(__int_as_float(0x7f800000));
}

constexpr int kClimb = 4, kMaxFactors = 64, kMaxDescent = 6;  // cupy_amp.rule.CLIMB, MAX_FACTORS, MAX_DESCENT

// cupy_amp.rule._factors_between: the fewest products by `factor` that take `low` to `high` or above.
__device__ int factors_between(float low, float high, double factor) {
    int count = 0;
    float value = low;
    while (count < kMaxFactors) {
        value = narrow(__dmul_rn(widen(value), factor));
        count += 1;
        if (!below(value, high)) break;
    }
    return count;
}

// cupy_amp.rule.headroom_state, operation for operation; returns the journal's action.
__device__ unsigned char headroom_rule(State* s, bool overflow, float norm) {
    const float old = s->scale;
    const float ceiling = narrow(s->max_scale < 3.5e38 ? s->max_scale : 3.4028234663852886e38);
    float scale = old;
    if (overflow) {
        const u64 in_row = s->overflows_in_row == ~0ull ? ~0ull : s->overflows_in_row + 1;
        const float known = below(s->clean_scale, old) ? s->clean_scale : 0.0f;
        const float backed = upper(narrow(__dmul_rn(widen(old), s->backoff_factor)), narrow(s->floor));
        int gap = 0;
        if (is_zero(known)) {
            double factor = s->backoff_factor;
            const int squarings = (int)(in_row < (u64)kMaxDescent ? in_row : (u64)kMaxDescent) - 1;
            for (int i = 0; i < squarings; ++i) factor = __dmul_rn(factor, factor);
            scale = upper(narrow(__dmul_rn(widen(old), factor)), narrow(s->floor));
        } else if ((gap = factors_between(known, old, s->growth_factor)) >= 2) {
            scale = upper(lower(times(known, s->growth_factor, gap / 2), backed), narrow(s->floor));
        } else {
            scale = backed;
        }
        s->consecutive_good_steps = 0;
        s->skipped_steps += 1;
        if (s->found == 0) s->remote_skipped_steps += 1;
        if (bits_of(scale) != bits_of(old)) s->backoffs += 1;
        s->overflow_scale = old;
        s->overflow_norm = s->clean_norm;
        s->clean_scale = known;
        s->overflows_in_row = in_row;
        s->scale = scale;
        return bits_of(scale) != bits_of(old) ? kBackedOff : kAtFloor;
    }
    if (positive_finite(norm)) s->clean_norm = norm;
    u64 good = 0;
    if (is_zero(s->overflow_scale)) {
        s->clean_scale = upper(s->clean_scale, old);  // below whatever overflows first
        const float grown = times(old, s->growth_factor, kClimb);
        scale = positive_finite(grown) ? lower(grown, ceiling) : old;
    } else {
        if (below(old, s->overflow_scale)) s->clean_scale = upper(s->clean_scale, old);
        const int gap =
            !is_zero(s->clean_scale) ? factors_between(s->clean_scale, s->overflow_scale, s->growth_factor) : 1;
        if (gap >= 2) {  // never below the clean step's own scale
            scale = lower(upper(times(s->clean_scale, s->growth_factor, gap / 2), old), ceiling);
        } else {
            good = s->consecutive_good_steps + 1;
            if (good >= s->growth_interval) {
                const float grown = narrow(__dmul_rn(widen(old), s->growth_factor));
                if ((bits_of(grown) & 0x7f800000u) != 0x7f800000u) scale = lower(grown, ceiling);
                good = 0;
            }
            if (widen(s->overflow_norm) > 0.0 && positive_finite(norm)) {
                const double estimate =
                    __ddiv_rn(__dmul_rn(widen(s->overflow_scale), widen(s->overflow_norm)), widen(norm));
                int products = 0;
                float value = scale;
                while (products < kMaxFactors) {
                    const float grown = narrow(__dmul_rn(widen(value), s->growth_factor));
                    if (!(widen(grown) <= estimate)) break;
                    value = grown;
                    products += 1;
                }
                if (products >= 2) {
                    scale = lower(times(scale, s->growth_factor, products - 1), ceiling);
                    good = 0;
                }
            }
        }
    }
    s->consecutive_good_steps = good;
    s->overflows_in_row = 0;
    if (bits_of(scale) != bits_of(old)) s->growths += 1;
    s->scale = scale;
    return bits_of(scale) != bits_of(old) ? kGrew : (bits_of(old) == bits_of(ceiling) ? kAtCeiling : kKept);
}

// cupy_amp.rule.next_state, operation for operation: products in float64, rounded to float32;
// comparisons in float64 (exact for float32 values, and free of -ftz's flushing of subnormals).
__device__ void update_state(State* s) {
    reinterpret_cast<Stats*>(s->stats)->skip = 1;  // the step closes: no optimizer may apply its record again
    if (s->updated_epoch == s->epoch) return;      // a retried update (after an interrupt) applies the rule once
    if (s->poisoned != 0) return;                  // the ranks may disagree (a replayed graph): decide nothing more
    s->updated_epoch = s->epoch;
    const bool overflow = s->found != 0 || s->agreed != 0;  // not `finite`, which users can write
    const float old = s->scale;
    float scale = old;
    unsigned char action = kKept;
    s->steps += 1;
    if (s->rule == kHeadroom) {
        const float norm = s->checked_epoch == s->epoch ? s->checked_norm : __int_as_float(0x7fc00000);
        action = headroom_rule(s, overflow, norm);
        if (s->journal_capacity != 0) write_journal(s, old, overflow, action);
        return;
    }
    if (overflow) {
        const u64 tracker = s->hysteresis_tracker == 0 ? 0 : s->hysteresis_tracker - 1;
        action = kHeld;
        if (tracker == 0) {
            const double backed = widen(narrow(__dmul_rn(widen(old), s->backoff_factor)));
            scale = narrow(backed > s->floor ? backed : s->floor);
            action = bits_of(scale) != bits_of(old) ? kBackedOff : kAtFloor;
        }
        s->consecutive_good_steps = 0;
        s->hysteresis_tracker = tracker;
        s->skipped_steps += 1;
        if (s->found == 0) s->remote_skipped_steps += 1;
        if (bits_of(scale) != bits_of(old)) s->backoffs += 1;
    } else {
        u64 good = s->consecutive_good_steps + 1;
        if (good >= s->growth_interval) {
            const float grown = narrow(__dmul_rn(widen(old), s->growth_factor));
            if ((bits_of(grown) & 0x7f800000u) != 0x7f800000u) {
                scale = widen(grown) < s->max_scale ? grown : narrow(s->max_scale);
            }
            good = 0;
            s->hysteresis_tracker = s->hysteresis;
            action = bits_of(scale) != bits_of(old) ? kGrew : kAtCeiling;
        }
        s->consecutive_good_steps = good;
        if (bits_of(scale) != bits_of(old)) s->growths += 1;
    }
    s->scale = scale;
    if (s->journal_capacity != 0) write_journal(s, old, overflow, action);
}

// A step's first gradient call: a new epoch, flags that say "finite" until a kernel finds otherwise, and a
// statistics record that says "skip" until this step's check() completes.
__device__ void begin_step(State* s) {
    s->epoch = next_epoch(s->epoch);
    s->found = 0;
    s->agreed = 0;
    s->finite = 1;
    s->culprits = 0;
    s->first_culprit = ~0ull;
    reinterpret_cast<Stats*>(s->stats)->skip = 1;
}

}  // namespace cupy_amp

#define CUPY_AMP_ONE_THREAD(NAME, ARGS) extern "C" __global__ void __launch_bounds__(1) NAME(const cupy_amp::ARGS args)

CUPY_AMP_ONE_THREAD(cupy_amp_begin_step, StateArgs) {
    cupy_amp::begin_step(reinterpret_cast<cupy_amp::State*>(args.state));
}

// Before unscale_and_check's all-reduce: this rank's pair, (its 0/1 overflow flag, 0).
CUPY_AMP_ONE_THREAD(cupy_amp_cast_vote, StateArgs) {
    cupy_amp::State* s = reinterpret_cast<cupy_amp::State*>(args.state);
    s->vote_count = s->found != 0 ? 1.0 : 0.0;
    s->vote_sum = 0.0;
}

// After the all-reduce (cupy_amp.distributed.count_verdict): the step overflowed if any rank's gradients did,
// this rank's included whatever the answer. A poisoned count poisons the state for good; a count that is no
// whole number of ranks, at least this rank's own, is counted once per step (and is an overflow). Running
// twice (a call finished again after an interrupt) gives the same state.
CUPY_AMP_ONE_THREAD(cupy_amp_combine_vote, StateArgs) {
    cupy_amp::State* s = reinterpret_cast<cupy_amp::State*>(args.state);
    cupy_amp::take_count(s, s->vote_count);
}

// A call that failed after it may have written gradients: the step counts as this rank's overflow.
CUPY_AMP_ONE_THREAD(cupy_amp_mark_overflow, StateArgs) {
    cupy_amp::State* s = reinterpret_cast<cupy_amp::State*>(args.state);
    s->found = 1;
    s->finite = 0;
}

CUPY_AMP_ONE_THREAD(cupy_amp_update_state, StateArgs) {
    cupy_amp::update_state(reinterpret_cast<cupy_amp::State*>(args.state));
}

// The synchronous face's update(): the rule, then the next step's begin, in one launch, so that step's first
// gradient call launches nothing. Once per host step number: the begin moves the epoch, so a retry after an
// interrupt is told apart by the number, which a restore() clears (it writes the host mirror's state back).
// The number changes every step, so this launch is never captured: GradScaler.update() refuses a capture.
CUPY_AMP_ONE_THREAD(cupy_amp_update_and_begin, UpdateArgs) {
    cupy_amp::State* s = reinterpret_cast<cupy_amp::State*>(args.state);
    if (s->folded_step == args.step) return;
    cupy_amp::update_state(s);
    cupy_amp::begin_step(s);
    s->folded_step = args.step;
}
