"""The step journal: what the last steps of a scaler did and why, kept where its state is.

The rule writes one entry per step it closes (``kernels/step_state.cu``:
``write_journal``; on the host, :class:`cupy_amp.twins.step_state.HostState`),
into a ring of ``capacity`` entries beside the state: no extra pass over the
gradients, no synchronization, and nothing a CUDA graph could not replay. The
step of number ``n`` (the scaler's ``steps`` count, that step included) sits at
slot ``(n - 1) % capacity``, so a state restored to an earlier count writes
over the steps it rolled back, and :func:`entries` keeps only the slots that
hold the steps the state has made.

An entry (:data:`ENTRY`, a NumPy structured dtype) holds:

- ``step``: the step's number; ``scale``: the scale it used; ``next_scale``: the one the rule left;
- ``local``: this rank's gradients held inf/nan; ``agreed``: the step overflowed on some rank, so it was skipped;
- ``action``: what the rule did (:data:`ACTIONS`);
- ``culprits``: how many of this rank's gradients held inf/nan; ``culprit_call`` and ``culprit``: the first
  of them, by its call's number in the step and its position in that call (-1 without one);
- ``norm`` and ``clip_coefficient``: ``check()``'s, NaN in a step without ``check()``;
- with ``check(report=True)`` (NaN and -1 without): ``amax``, the largest finite magnitude of the checked
  gradients as they are (scaled), in float32 (a float64 one rounded, at most float32's largest);
  ``amax_call`` and ``amax_position``, which gradient holds it (the lowest position among equals; -1 when
  no element is above 0); ``zero_fraction`` and ``subnormal_fraction``, the fractions of the checked
  elements that are 0, and subnormal in their own dtype.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from cupy_amp.errors import CheckpointFieldError, ConfigError
from cupy_amp.kernel_interface import JOURNAL_ENTRY
from cupy_amp.rule import FLOAT32_MAX, HEADROOM, ScalerConfig, ScalerState

__all__ = [
    "ACTIONS",
    "AT_CEILING",
    "AT_FLOOR",
    "BACKED_OFF",
    "DEFAULT_CAPACITY",
    "ENTRY",
    "GREW",
    "HELD",
    "KEPT",
    "MAX_CAPACITY",
    "MAX_NAMES",
    "MAX_NAMES_BYTES",
    "MAX_NAME_LENGTH",
    "action_of",
    "entries",
    "expect_capacity",
    "expect_names",
    "from_bytes",
    "names",
    "place",
    "report_of",
    "to_bytes",
]

ENTRY = JOURNAL_ENTRY
DEFAULT_CAPACITY = 1024
MAX_CAPACITY = 8192  # 512 KiB in a checkpoint, under its 1 MiB cap

# What the rule did to the scale (kernels/common.cuh: kKept...).
KEPT, GREW, BACKED_OFF, HELD, AT_FLOOR, AT_CEILING = range(6)
ACTIONS = {
    KEPT: "kept",  # a clean step before the growth interval ran out
    GREW: "grew",
    BACKED_OFF: "backed off",
    HELD: "held by hysteresis",  # an overflow that the hysteresis tracker absorbed
    AT_FLOOR: "at the floor",  # a backoff that min_scale (or the smallest scale) stopped
    AT_CEILING: "at the ceiling",  # a growth that max_scale (or float32's range) stopped
}


def expect_capacity(value: Any) -> int:
    """Return ``value`` as a journal capacity: an int from 0 (no journal) to :data:`MAX_CAPACITY`.

    Raises:
        ConfigError: Anything else.
    """
    try:
        count = operator.index(value) if not isinstance(value, (bool, np.bool_)) else None
    except TypeError:
        count = None
    if count is None or not 0 <= count <= MAX_CAPACITY:
        raise ConfigError(
            f"journal: expected the number of steps to keep, an int from 0 (no journal) to {MAX_CAPACITY}; "
            f"got {value!r}."
        )
    return int(count)


def action_of(config: ScalerConfig, before: ScalerState, after: ScalerState, overflow: bool) -> int:
    """Return what the rule did in a step that took ``before`` to ``after`` (as ``write_journal`` tells it)."""
    changed = np.float32(after.scale).tobytes() != np.float32(before.scale).tobytes()
    if config.rule == HEADROOM:  # no hysteresis; a clean step's scale stays only below its next move or at the ceiling
        if overflow:
            return BACKED_OFF if changed else AT_FLOOR
        return GREW if changed else AT_CEILING if before.scale == config.ceiling else KEPT
    if overflow:
        if max(before.hysteresis_tracker - 1, 0) != 0:
            return HELD
        return BACKED_OFF if changed else AT_FLOOR
    if before.consecutive_good_steps + 1 >= config.growth_interval:
        return GREW if changed else AT_CEILING
    return KEPT


def report_of(numerics: Any, call: int) -> tuple[float, float, float, int, int]:
    """Return a check's numerics report (:class:`cupy_amp.twins.grad_stats.Numerics`, one per gradient) as the
    journal keeps it: (amax, zero fraction, subnormal fraction, amax's call, amax's position), as the device's
    statistics pass and its finish compute them (kernels/grad_stats.cu)."""
    best: tuple[int, int] | None = None  # (float32 bits of the largest, -position): the largest, lowest position
    zeros = subnormals = elements = 0
    for row in numerics:
        zeros, subnormals, elements = zeros + row.zeros, subnormals + row.subnormals, elements + row.size
        if row.amax != 0.0:
            with np.errstate(over="ignore"):
                largest = min(np.float32(row.amax), np.float32(FLOAT32_MAX))  # beyond float32: its largest
            key = (int(np.float32(largest).view(np.uint32)), -row.position)
            best = key if best is None or key > best else best
    amax = float(np.uint32(best[0]).view(np.float32)) if best is not None else 0.0
    where = (call, -best[1]) if best is not None else (-1, -1)
    zero_fraction = float(np.float32(zeros / elements)) if elements else np.nan
    subnormal_fraction = float(np.float32(subnormals / elements)) if elements else np.nan
    return amax, zero_fraction, subnormal_fraction, *where


def _copy(chosen: np.ndarray) -> np.ndarray:
    """Return a copy of entries field by field over zeros: NumPy's copies of a record leave its padding
    undefined, and a checkpoint's bytes must not depend on it."""
    copy = np.zeros(len(chosen), dtype=ENTRY)
    for name in ENTRY.names or ():
        copy[name] = chosen[name]
    return copy


def entries(ring: np.ndarray, steps: int) -> np.ndarray:
    """Return the steps a ring holds of a state that has made ``steps`` steps, oldest first.

    A slot counts only if it holds the step whose number maps to it, up to ``steps``: slots never
    written (step 0) and steps rolled back by a restore are left out.
    """
    capacity = len(ring)
    if capacity == 0:
        return np.zeros(0, dtype=ENTRY)
    numbers = ring["step"]  # uint64: steps up to 2**64 - 1 compare as they are
    held = (numbers >= 1) & (numbers <= np.uint64(steps))
    if steps >= capacity:
        held &= numbers > np.uint64(steps - capacity)
    held &= (numbers - np.uint64(1)) % np.uint64(capacity) == np.arange(capacity, dtype=np.uint64)
    chosen = ring[held]
    return _copy(chosen[np.argsort(chosen["step"], kind="stable")])


def _padding() -> np.ndarray:
    """The entry's byte offsets that no field covers (zero in every entry cupy-amp writes)."""
    covered = np.zeros(ENTRY.itemsize, dtype=bool)
    for name in ENTRY.names or ():
        dtype, offset = ENTRY.fields[name][:2]  # type: ignore[index]
        covered[offset : offset + dtype.itemsize] = True
    return np.flatnonzero(~covered)


_PADDING = _padding()


def place(capacity: int, chosen: np.ndarray) -> np.ndarray:
    """Return a ring of ``capacity`` slots holding the newest of ``chosen`` (sorted by step) at their slots."""
    ring = np.zeros(capacity, dtype=ENTRY)
    if capacity:
        kept = chosen[len(chosen) - capacity :] if len(chosen) > capacity else chosen
        ring[((kept["step"] - np.uint64(1)) % np.uint64(capacity)).astype(np.int64)] = kept
    return ring


def to_bytes(chosen: np.ndarray) -> bytes:
    """Return journal entries as a checkpoint stores them: the entries' little-endian bytes, oldest first."""
    return _copy(chosen).tobytes()


def from_bytes(data: bytes, steps: int) -> np.ndarray:
    """Read a checkpoint's journal entries, refusing any that a scaler of ``steps`` steps cannot have written.

    Raises:
        CheckpointFieldError: Not a whole number of entries, more than :data:`MAX_CAPACITY`, steps not
            increasing or beyond ``steps``, or a field out of its range.
    """
    if len(data) % ENTRY.itemsize or len(data) // ENTRY.itemsize > MAX_CAPACITY:
        raise CheckpointFieldError(
            f"Invalid 'journal': expected a whole number of {ENTRY.itemsize}-byte entries, at most {MAX_CAPACITY}; "
            f"got {len(data)} bytes."
        )
    raw = np.frombuffer(data, dtype=np.uint8).reshape(-1, ENTRY.itemsize)
    chosen = _copy(np.frombuffer(data, dtype=ENTRY))
    numbers = chosen["step"]  # uint64, compared as such: a cast to int64 would wrap steps from 2**63 on
    problems = []
    last = np.uint64(min(steps, 2**64 - 1))  # NumPy 1 compares uint64 with a Python int through float64
    if len(chosen) and (numbers[0] < np.uint64(1) or numbers[-1] > last or np.any(numbers[1:] <= numbers[:-1])):
        problems.append(f"steps must increase, from 1 to the scaler's {steps}")
    if np.any(chosen["action"] >= len(ACTIONS)) or np.any(chosen["local"] > 1) or np.any(chosen["agreed"] > 1):
        problems.append(f"action must be below {len(ACTIONS)}, local and agreed 0 or 1")
    calls, positions = chosen["culprit_call"], chosen["culprit"]
    if (
        np.any(chosen["culprits"] < 0)
        or np.any(calls < -1)
        or np.any(positions < -1)
        or np.any((calls < 0) != (positions < 0))
    ):
        problems.append("culprit counts must be >= 0, a culprit's call and position both -1 or both >= 0")
    scales = np.concatenate([chosen["scale"], chosen["next_scale"]])
    if np.any(~np.isfinite(scales) | (scales <= 0)):
        problems.append("scales must be finite and positive")
    reported = ~np.isnan(chosen["amax"])
    fractions = np.stack([chosen["zero_fraction"], chosen["subnormal_fraction"]])
    where = np.stack([chosen["amax_call"], chosen["amax_position"]])
    if (
        np.any(reported & ~((chosen["amax"] >= 0) & np.isfinite(chosen["amax"])))
        or np.any(~np.isnan(fractions[:, ~reported]))
        or np.any(fractions[:, reported] < 0)
        or np.any(fractions[:, reported] > 1)
        or np.any(where < -1)
        or np.any((where[0] < 0) != (where[1] < 0))
        or np.any((where[0] >= 0) & ~reported)
    ):
        problems.append(
            "a report's amax must be NaN (no report) or finite and >= 0, its fractions NaN without a report and "
            "else in [0, 1] (or NaN: no element), its gradient's call and position both -1 or both >= 0"
        )
    if np.any(raw[:, _PADDING]):
        problems.append("padding bytes must be zero")
    if problems:
        raise CheckpointFieldError(f"Invalid 'journal': {'; '.join(problems)}. The file was not written by cupy-amp.")
    return chosen


MAX_NAMES = 4096  # names kept in a checkpoint, over all calls
MAX_NAME_LENGTH = 128
MAX_NAMES_BYTES = 256 * 1024  # the names' UTF-8 bytes in all: with a full journal, a file stays under 1 MiB


def names(labels: Any) -> tuple[tuple[str, ...], ...]:
    """Return the names a checkpoint keeps of a step's gradient labels (call by call): each as a string cut
    to :data:`MAX_NAME_LENGTH` characters (what UTF-8 cannot encode escaped), or none at all when there are more
    than :data:`MAX_NAMES` or their UTF-8 bytes pass :data:`MAX_NAMES_BYTES`."""
    kept = tuple(
        tuple(str(label)[:MAX_NAME_LENGTH].encode("utf-8", "backslashreplace").decode("utf-8")[:MAX_NAME_LENGTH]
              for label in call)
        for call in labels
    )  # fmt: skip
    total = sum(len(name.encode("utf-8")) for call in kept for name in call)
    return kept if len(kept) <= MAX_NAMES and sum(map(len, kept)) <= MAX_NAMES and total <= MAX_NAMES_BYTES else ()


def expect_names(error: type[Exception], value: Any) -> tuple[tuple[str, ...], ...]:
    """Return a checkpoint's ``journal_names`` as tuples, or raise ``error`` naming what is wrong.

    What a checkpoint file can hold: at most :data:`MAX_NAMES` calls and :data:`MAX_NAMES` names in all, each a
    string of at most :data:`MAX_NAME_LENGTH` characters that UTF-8 can encode, :data:`MAX_NAMES_BYTES` bytes in all.
    """
    what = "Invalid 'journal_names'"
    if not isinstance(value, (list, tuple)):
        raise error(f"{what}: expected an array of arrays of strings, got {type(value).__name__}.")
    if len(value) > MAX_NAMES:
        raise error(f"{what}: expected at most {MAX_NAMES} calls, got {len(value)}.")
    for call in value:
        if not isinstance(call, (list, tuple)):
            raise error(
                f"{what}: expected an array of arrays of strings, got an array holding a {type(call).__name__}."
            )
    kept = tuple(tuple(call) for call in value)
    count = sum(len(call) for call in kept)
    if count > MAX_NAMES:
        raise error(f"{what}: expected at most {MAX_NAMES} names in all, got {count}.")
    for call in kept:
        for name in call:
            if type(name) is not str:
                raise error(f"{what}: expected strings, got a name of type {type(name).__name__}.")
            if len(name) > MAX_NAME_LENGTH:
                raise error(f"{what}: expected names of at most {MAX_NAME_LENGTH} characters, got one of {len(name)}.")
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                raise error(f"{what}: expected names UTF-8 can encode, got {name!a}.") from None
    total = sum(len(name.encode("utf-8")) for call in kept for name in call)
    if total > MAX_NAMES_BYTES:
        raise error(f"{what}: expected at most {MAX_NAMES_BYTES} bytes of names in UTF-8, got {total}.")
    return kept
