"""A deliberately plain reference of the loss scaler, written from the spec (issue 2).

Nothing here imports cupy_amp: the update rule is spelled out branch by branch
and the numerics are computed one element at a time with NumPy scalars, so a
shared mistake between this model and the library is unlikely.
"""

from __future__ import annotations

import math
import struct
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

FLOAT32_MAX = float(np.finfo(np.float32).max)
# The smallest float32 whose float32 inverse is finite: below it, unscaling would make finite gradients inf.
SMALLEST_SCALE = float.fromhex("0x1.000008p-128")


def f32(value: float) -> float:
    """Round a Python float to float32 (overflow gives inf, underflow 0), as a Python float."""
    with np.errstate(over="ignore", under="ignore"):
        return float(np.float32(value))


@dataclass(frozen=True)
class RefConfig:
    """The scaler's constructor arguments (all of them except ``enabled``)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float | None = 1.0
    max_scale: float | None = 2.0**24
    hysteresis: int = 1

    def kwargs(self) -> dict[str, Any]:
        """Return the fields as keyword arguments for ``GradScaler``."""
        return asdict(self)


@dataclass
class RefScaler:
    """The update rule of the spec, one step at a time, in a single process.

    A single process has no other ranks, so every overflow is local:
    ``found_overflow_local`` equals ``found_overflow`` and
    ``remote_skipped_steps`` stays 0 (it is tracked all the same, so a rule
    that counted a local skip as remote would show).
    """

    config: RefConfig
    enabled: bool = True
    scale: float = field(init=False)
    consecutive_good_steps: int = field(init=False, default=0)
    hysteresis_tracker: int = field(init=False)
    steps: int = field(init=False, default=0)
    skipped_steps: int = field(init=False, default=0)
    growths: int = field(init=False, default=0)
    backoffs: int = field(init=False, default=0)
    remote_skipped_steps: int = field(init=False, default=0)
    found_overflow: bool = field(init=False, default=False)
    # The step journal as a checkpoint holds it: one entry per enabled step, packed here with the struct
    # module from the spec's field list (step, scale, next scale, norm, clip coefficient, culprits, the
    # first culprit's call and position, local, agreed, action, one zero byte of padding).
    journal: list[bytes] = field(init=False, default_factory=list)
    journal_names: tuple[tuple[str, ...], ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        self.scale = f32(self.config.init_scale)
        self.hysteresis_tracker = self.config.hysteresis

    @property
    def min_scale(self) -> float | None:
        return None if self.config.min_scale is None else f32(self.config.min_scale)

    @property
    def max_scale(self) -> float | None:
        return None if self.config.max_scale is None else f32(self.config.max_scale)

    @property
    def found_overflow_local(self) -> bool:
        return self.found_overflow

    @property
    def last_overflow(self) -> str:
        return "local" if self.found_overflow_local else "none"

    def scale_factor(self) -> float:
        return self.scale if self.enabled else 1.0

    def step(
        self,
        overflow: bool,
        culprits: int = 0,
        first: tuple[int, int] = (-1, -1),
        names: tuple[tuple[str, ...], ...] = (),
    ) -> None:
        """Apply ``update()`` after a step that did (or did not) overflow, and journal it: ``culprits`` gradients
        held inf/nan, the first at ``first`` (call, position); ``names`` are the step's gradients, call by call."""
        if not self.enabled:
            return
        old, tracker = self.scale, self.hysteresis_tracker
        self._rule(overflow)
        if overflow:
            action = 3 if max(tracker - 1, 0) > 0 else (2 if self.scale != old else 4)
        elif self.consecutive_good_steps == 0:  # the growth interval ran out
            action = 1 if self.scale != old else 5
        else:
            action = 0
        nan = float("nan")
        entry = struct.pack(  # no check(): no norm, no report
            "<QffffiiiBBBxfffiixxxx", self.steps, old, self.scale, nan, nan, culprits, *first, overflow, overflow,
            action, nan, nan, nan, -1, -1,
        )  # fmt: skip
        self.journal.append(entry)
        self.journal_names = names

    def _rule(self, overflow: bool) -> None:
        self.steps += 1
        self.found_overflow = overflow
        old = self.scale
        if overflow:
            self.skipped_steps += 1
            if not self.found_overflow_local:
                self.remote_skipped_steps += 1
            self.consecutive_good_steps = 0
            if self.hysteresis_tracker > 0:
                self.hysteresis_tracker -= 1
            if self.hysteresis_tracker == 0:
                new = f32(old * self.config.backoff_factor)
                floor = SMALLEST_SCALE if self.min_scale is None else self.min_scale
                if new < floor:
                    new = floor
                self.scale = new
                if new != old:
                    self.backoffs += 1
            return
        self.consecutive_good_steps += 1
        if self.consecutive_good_steps < self.config.growth_interval:
            return
        new = f32(old * self.config.growth_factor)
        if math.isfinite(new):
            if self.max_scale is not None and new > self.max_scale:
                new = self.max_scale
            self.scale = new
            if new != old:
                self.growths += 1
        self.consecutive_good_steps = 0
        self.hysteresis_tracker = self.config.hysteresis

    def stats_dict(self) -> dict[str, Any]:
        """Return what ``GradScaler.stats().to_dict()`` should return."""
        return {
            "scale": self.scale,
            "consecutive_good_steps": self.consecutive_good_steps,
            "hysteresis_tracker": self.hysteresis_tracker,
            "enabled": self.enabled,
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "growths": self.growths,
            "backoffs": self.backoffs,
            "remote_skipped_steps": self.remote_skipped_steps,
            "last_overflow": self.last_overflow,
        }

    def checkpoint_dict(self) -> dict[str, Any]:
        """Return what ``GradScaler.checkpoint().to_dict()`` should return."""
        return {
            "scale": self.scale,
            "growth_factor": self.config.growth_factor,
            "backoff_factor": self.config.backoff_factor,
            "growth_interval": self.config.growth_interval,
            "consecutive_good_steps": self.consecutive_good_steps,
            "found_overflow": self.found_overflow,
            "found_overflow_local": self.found_overflow_local,
            "enabled": self.enabled,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "hysteresis": self.config.hysteresis,
            "hysteresis_tracker": self.hysteresis_tracker,
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "growths": self.growths,
            "backoffs": self.backoffs,
            "remote_skipped_steps": self.remote_skipped_steps,
            **PYTORCH_RULE_FIELDS,
            "journal": b"".join(self.journal),
            "journal_names": self.journal_names,
        }


# What a checkpoint of PyTorch's rule holds of the headroom rule's fields: the rule's name, and no memory.
PYTORCH_RULE_FIELDS = {
    "rule": "pytorch",
    "overflow_scale": 0.0,
    "overflow_norm": 0.0,
    "clean_scale": 0.0,
    "clean_norm": 0.0,
    "overflows_in_row": 0,
}


def inv_scale(scale: float) -> np.float32:
    """Return float32(1 / float64(scale)): inf for a scale of 0."""
    if scale == 0.0:
        return np.float32(np.inf)
    with np.errstate(over="ignore"):
        return np.float32(1.0 / float(scale))


def _elementwise(array: np.ndarray, factor: float | np.float32, name: str) -> np.ndarray:
    """Return a new C-ordered array: every element multiplied by ``factor`` the spec's way."""
    dtype = array.dtype
    flat = np.array(array, copy=True).reshape(-1)
    out = np.empty(flat.shape, dtype=dtype)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        for i in range(flat.size):
            if dtype == np.float64:
                out[i] = float(flat[i]) * float(factor)
            elif dtype in (np.float16, np.float32):
                product = np.float32(flat[i]) * np.float32(factor)
                out[i] = product.astype(dtype)
            else:
                raise TypeError(f"{name}: unsupported dtype {dtype}")
    return out.reshape(array.shape)


def is_overflowing(array: np.ndarray) -> bool:
    """Return True if any element is inf or nan (checked before unscaling)."""
    return any(not math.isfinite(float(value)) for value in np.array(array, copy=True).reshape(-1))


def unscaled(array: np.ndarray, scale: float) -> np.ndarray:
    """Return what ``unscale_and_check`` leaves in ``array`` for the given stored scale."""
    return _elementwise(array, inv_scale(scale), "unscale")


def scaled_loss(loss: np.ndarray, scale: float) -> np.ndarray:
    """Return what ``scale_loss`` leaves in ``loss`` for the given factor."""
    return _elementwise(loss, np.float32(scale), "scale_loss")


_BITS = {np.dtype(np.float16): np.uint16, np.dtype(np.float32): np.uint32, np.dtype(np.float64): np.uint64}


def same_bits(actual: np.ndarray, expected: np.ndarray) -> bool:
    """Return True if the arrays match bit for bit, NaNs matching any NaN.

    Finite values and infinities must have identical bits (so -0.0 differs
    from 0.0); a NaN must stay a NaN, whatever its payload, which IEEE leaves
    to the hardware.
    """
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return False
    a = np.ascontiguousarray(actual).reshape(-1)
    e = np.ascontiguousarray(expected).reshape(-1)
    a_nan, e_nan = np.isnan(a), np.isnan(e)
    if not np.array_equal(a_nan, e_nan):
        return False
    bits = _BITS[a.dtype]
    return bool(np.array_equal(a[~a_nan].view(bits), e[~e_nan].view(bits)))


def identical(actual: np.ndarray, expected: np.ndarray) -> bool:
    """Return True if the arrays hold exactly the same bytes (NaN payloads included)."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return False
    a = np.ascontiguousarray(actual).reshape(-1)
    e = np.ascontiguousarray(expected).reshape(-1)
    return a.tobytes() == e.tobytes()
