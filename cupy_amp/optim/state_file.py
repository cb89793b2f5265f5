"""Optimizer state files: the layout of each optimizer's state, the file format, and the checks that need no optimizer.

A state (what ``state_dict()`` returns and ``save()`` writes) is a map::

    {"format": "cupy-amp.optimizer", "version": 1, "kind": "adamw" | "sgd" | ...,
     "record": {field: number, ...}, "buffers": {"master": [...], moment: [...], ...}}

with one entry per parameter in each buffer list: float32 bytes, or None where the
parameter has no such buffer. A file is the state packed with msgpack, then the
CRC-32 of the packed bytes (4 bytes, big-endian). :func:`validated` refuses every
state no sequence of steps can produce, by field; whether a state fits a given
optimizer's parameters is the optimizer's own check.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import msgpack
import numpy as np

from cupy_amp._fileio import read_regular_file, write_file_atomic
from cupy_amp.errors import CheckpointCorruptError, CheckpointFieldError

__all__ = [
    "FILE_PREFIX",
    "RANGES",
    "STATE_FORMAT",
    "STATE_VERSION",
    "Layout",
    "Range",
    "nesterov_problem",
    "power_bounds",
    "read",
    "validated",
    "write",
]

STATE_FORMAT = "cupy-amp.optimizer"
STATE_VERSION = 1
# Every file starts with these bytes: a msgpack map of 5 entries whose first is "format": STATE_FORMAT.
FILE_PREFIX = b"\x85" + msgpack.packb("format") + msgpack.packb(STATE_FORMAT)
LAST_STEP = 2**64 - 2  # the largest step counter a state may hold: one more step must not wrap the uint64
REPLAY_LIMIT = 1 << 24  # the most products a power's check replays (0.4 s): no file costs more


class Range(NamedTuple):
    """The numbers a hyperparameter may be: from ``low`` up to ``high`` (below it when ``high_open``)."""

    low: float
    high: float = math.inf
    high_open: bool = False

    def admits(self, value: float) -> bool:
        """Whether the finite float ``value`` lies in the range."""
        return self.low <= value and (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        """The range in words, for an error message."""
        bound = f"< {self.high}" if self.high_open else (f"<= {self.high}" if math.isfinite(self.high) else "finite")
        return f"a number >= {self.low} and {bound}"


# The hyperparameters' ranges, for the optimizers' constructors and the state files alike.
RANGES = {
    "lr": Range(0.0),
    "beta1": Range(0.0, 1.0, high_open=True),
    "beta2": Range(0.0, 1.0, high_open=True),
    "eps": Range(0.0),
    "weight_decay": Range(0.0),
    "momentum": Range(0.0),
    "dampening": Range(0.0, 1.0),
    "beta1_power": Range(0.0, 1.0),  # a product of betas, 1.0 before the first step
    "beta2_power": Range(0.0, 1.0),
}
FLAGS = ("nesterov",)  # record fields that are a bool: True/False or 1/0 in a file


def nesterov_problem(momentum: float, dampening: float) -> str | None:
    """Say why Nesterov momentum cannot run with these values, or None when it can."""
    if momentum > 0.0 and dampening == 0.0:
        return None
    given = f"momentum {momentum!r}, dampening {dampening!r}"
    return f"momentum > 0 and dampening 0 (Nesterov momentum needs both; {given})"


class Layout(NamedTuple):
    """What one kind of optimizer keeps: its record's fields and its buffers."""

    kind: str
    record_dtype: np.dtype[Any]
    moments: tuple[str, ...]  # the float32 buffers beside the masters
    hyperparameters: tuple[str, ...]  # the record's fields a state must share with the optimizer loading it
    persistent: tuple[str, ...]  # the record's fields a state keeps (the rest is per step)
    powers: tuple[tuple[str, str], ...] = ()  # (power, beta): fields the steps multiply by a beta


def write(path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically: the old file or the new one, never a mix."""
    body: bytes = msgpack.packb(state, use_bin_type=True, use_single_float=False)
    write_file_atomic(path, body + zlib.crc32(body).to_bytes(4, "big"))


def read(path: str | os.PathLike[str], limit: int) -> Any:
    """Return the unpacked state of a file of at most ``limit`` bytes (not yet :func:`validated`).

    Raises:
        CheckpointCorruptError: Not a regular file, larger than ``limit``, or not intact.
    """
    data = read_regular_file(path, limit, CheckpointCorruptError)
    body, crc = data[:-4], data[-4:]
    if len(data) < 4 or zlib.crc32(body).to_bytes(4, "big") != crc:
        raise CheckpointCorruptError(f"{os.fsdecode(path)}: not an intact optimizer state (CRC-32 mismatch).")
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as error:  # msgpack raises several unrelated types for malformed input
        raise CheckpointCorruptError(f"{os.fsdecode(path)}: not an optimizer state ({error}).") from None


def validated(state: Any, layouts: Mapping[str, Layout]) -> tuple[Layout, np.ndarray, dict[str, list[bytes | None]]]:
    """Return the layout, the record and the buffers of ``state`` if some sequence of steps can produce it.

    ``layouts``: the kinds of optimizer a state may be of (:data:`cupy_amp.optim.LAYOUTS`: every kind), by kind.

    Raises:
        CheckpointFieldError: The first field that could not be (named as ``record.<name>`` or
            ``buffers.<name>[<index>]``), with what was expected and what was given.
    """
    keys = {"format", "version", "kind", "record", "buffers"}
    if not isinstance(state, dict) or set(state) != keys:
        got = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise invalid("state", f"a dict with the keys {', '.join(sorted(keys))}", got)
    if state["format"] != STATE_FORMAT or state["version"] != STATE_VERSION:
        got = f"{state['format']!r} version {state['version']!r}"
        raise invalid("format", f"{STATE_FORMAT!r} version {STATE_VERSION}", got)
    layout = layouts.get(state["kind"]) if isinstance(state["kind"], str) else None
    if layout is None:
        kinds = ", ".join(map(repr, layouts))
        raise invalid("kind", kinds if len(layouts) == 1 else f"one of {kinds}", repr(state["kind"]))
    record = _checked_record(layout, state["record"])
    buffers = state["buffers"]
    names = ("master", *layout.moments)
    if not isinstance(buffers, dict) or set(buffers) != set(names):
        got = sorted(map(str, buffers)) if isinstance(buffers, dict) else type(buffers).__name__
        raise invalid("buffers", f"a dict with the keys {', '.join(names)}", got)
    fresh = int(record["step"]) == 0
    for name in names:
        given = buffers[name]
        if not isinstance(given, list) or (name != "master" and len(given) != len(buffers["master"])):
            got = f"{len(given)} entries" if isinstance(given, list) else type(given).__name__
            raise invalid(f"buffers.{name}", "a list with one entry per parameter", got)
        for index, data in enumerate(given):
            field = f"buffers.{name}[{index}]"
            if data is None:
                continue
            if not isinstance(data, bytes) or len(data) % 4:
                got = f"{len(data)} bytes" if isinstance(data, bytes) else type(data).__name__
                raise invalid(field, "None or float32 values (bytes, a multiple of 4)", got)
            problem = unreachable(np.frombuffer(data, dtype=np.float32), name, fresh)
            if problem is not None:
                raise invalid(field, *problem)
    return layout, record, buffers


def _checked_record(layout: Layout, fields: Any) -> np.ndarray:
    """Check the record field by field, the cheap checks first: kinds and ranges, then how the fields agree,
    then the powers, whose check costs at most REPLAY_LIMIT products."""
    names = layout.persistent
    if not isinstance(fields, dict) or set(fields) != set(names):
        got = sorted(map(str, fields)) if isinstance(fields, dict) else type(fields).__name__
        raise invalid("record", f"a dict with the fields {', '.join(names)}", got)
    record = np.zeros((), dtype=layout.record_dtype)
    for name in names:
        value, field = fields[name], f"record.{name}"
        if name == "step":
            # One more step must not wrap the uint64 counter (the kernel would go on from 0).
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= LAST_STEP:
                raise invalid(field, "an int from 0 to 2**64 - 2", repr(value))
        elif name in FLAGS:
            if not (isinstance(value, bool) or (type(value) is int and value in (0, 1))):
                raise invalid(field, "a bool (true or false, or 1 or 0)", repr(value))
            value = int(value)
        elif not isinstance(value, (int, float)) or isinstance(value, bool) or not finite(value):
            raise invalid(field, "a finite number", repr(value))
        elif not RANGES[name].admits(float(value)):
            raise invalid(field, RANGES[name].describe(), repr(value))
        record[name] = value
    if layout.kind == "sgd" and record["nesterov"]:
        problem = nesterov_problem(float(record["momentum"]), float(record["dampening"]))
        if problem is not None:
            raise invalid("record.nesterov", f"false unless {problem}", repr(fields["nesterov"]))
    for name, beta in layout.powers:
        # The powers are the products each step makes, replayed: the kernel can reach no other value.
        low, high = power_bounds(float(record[beta]), int(record["step"]))
        value = float(record[name])
        if low == high and value.hex() != low.hex():
            expected = f"{low!r} ({beta} multiplied {int(record['step'])} times into 1.0, as the steps do)"
            raise invalid(f"record.{name}", expected, repr(fields[name]))
        if not low <= value <= high:
            expected = (
                f"a number from {low!r} to {high!r} ({beta} multiplied {int(record['step'])} times into 1.0, "
                f"replayed for {REPLAY_LIMIT} steps and bounded for the rest)"
            )
            raise invalid(f"record.{name}", expected, repr(fields[name]))
    return record


def invalid(field: str, expected: str, got: object) -> CheckpointFieldError:
    return CheckpointFieldError(f"Invalid {field!r}: expected {expected}, got {got}.")


def finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int beyond float64
        return False


def power_bounds(beta: float, steps: int) -> tuple[float, float]:
    """Return the values 1.0 multiplied ``steps`` times by ``beta`` (0 <= beta < 1) can hold, as (low, high).

    The steps round each float64 product. The products are replayed, so
    ``low == high`` is the exact value, until they stop changing (a fixed
    point, reached after about 745 / (1 - beta) steps) or for REPLAY_LIMIT
    products at most. Past that limit each remaining product is within a
    rounding of beta times the last, so the value lies between the replayed
    one times beta**r * (1 -+ 2**-53)**r for the r steps left (widened by a
    little for the logarithms' own rounding; down to 0 where that reaches
    float64's subnormals). Either way the work is bounded, whatever the file.
    """
    power, done = 1.0, 0
    while done < min(steps, REPLAY_LIMIT):
        count = min(min(steps, REPLAY_LIMIT) - done, 1 << 16)
        value = power
        for _ in range(count >> 3):
            value = value * beta * beta * beta * beta * beta * beta * beta * beta
        for _ in range(count & 7):
            value *= beta
        if value == power:  # a fixed point: every later product gives it again
            return power, power
        power, done = value, done + count
    left = steps - done
    if left == 0 or power == 0.0:
        return power, power
    # log(value) = log(power) + left * log(beta) +- left * log1p(2**-53), each term to a few ulps
    centre = math.log(power) + left * math.log(beta) if beta > 0.0 else -math.inf
    spread = left * math.log1p(2.0**-53) + 1e-12 * (abs(centre) + 1.0)
    high = max(math.exp(min(centre + spread, 0.0)), 2.0**-1000)  # a subnormal's rounding is not relative
    low = math.exp(centre - spread)
    return (0.0 if low < 2.0**-1000 else low), min(high, power)


def unreachable(values: np.ndarray, name: str, fresh: bool) -> tuple[str, str] | None:
    """Return (expected, got) if no step could have left these float32 values in buffer ``name``, else None.

    Masters and moments are finite, a second moment is never negative (nor -0.0), and before the first
    step (``fresh``) every moment is +0.0.
    """
    bad = ~np.isfinite(values)
    expected = "finite float32 values"
    if name == "exp_avg_sq":
        bad |= np.signbit(values)
        expected = "finite float32 values >= +0.0 (a second moment)"
    if fresh and name != "master":
        bad |= values.view(np.uint32) != 0
        expected = "+0.0 everywhere (record.step is 0: no step has written a moment)"
    if not bad.any():
        return None
    index = int(np.flatnonzero(bad)[0])
    return expected, f"{float(values[index])!r} at index {index}"
