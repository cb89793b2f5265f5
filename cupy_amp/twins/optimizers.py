"""The fused optimizers' numerics in NumPy: the CPU path, and the reference the GPU kernels match bit for bit.

An optimizer's scalar state is one record (:data:`ADAMW_STATE`, :data:`SGD_STATE`:
its struct in ``kernels/common.cuh``, mirrored in :mod:`cupy_amp.kernel_interface`;
the CuPy path keeps it in device memory). :func:`begin_adamw` / :func:`begin_sgd`
open a step on it: take the step's factor and skip flag, advance the step
counter unless skipped, and derive the float32 constants in float64, rounded once. :func:`adamw_update` /
:func:`sgd_update` then apply one step to float32 arrays in place, one
correctly rounded float32 operation at a time, in the kernels' order (NumPy
neither fuses nor flushes subnormals; the kernels use explicit PTX for both).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cupy_amp.kernel_interface import ADAMW_STATE, SGD_STATE

# The record dtypes are named here too: a record and the functions that step it go together.
__all__ = ["ADAMW_STATE", "SGD_STATE", "adamw_update", "begin_adamw", "begin_sgd", "sgd_update"]

_f32 = np.float32
_ONE = np.uint64(1)  # the step counter's increment: uint64 with uint64 is uint64 on every NumPy


def fma32(a: Any, b: Any, c: Any) -> np.ndarray:
    """Return ``a * b + c`` for float32 operands, rounded once to float32 (a fused multiply-add, as PTX's fma.rn.f32).

    The product is exact in float64; the sum is rounded to float64 "to odd"
    (to the neighbour with an odd last bit when inexact, using the exact error
    from TwoSum), which makes the final rounding to float32 the correct one.
    """
    a64, b64, c64 = (np.asarray(x, dtype=np.float32).astype(np.float64) for x in (a, b, c))
    product = a64 * b64
    total = product + c64
    virtual = total - product
    error = (product - (total - virtual)) + (c64 - virtual)
    even = (total.view(np.int64) & 1) == 0
    toward = np.where(error > 0, np.inf, -np.inf)
    return np.where((error != 0) & even, np.nextafter(total, toward), total).astype(np.float32)


def _begin(record: np.ndarray, skip: bool, factor: np.float32) -> bool:
    record["skip"] = skip
    record["factor"] = factor
    return not skip


def begin_adamw(record: np.ndarray, skip: bool, factor: np.float32) -> None:
    """Open a step on an AdamW record (a 0-d :data:`ADAMW_STATE` array), as ``cupy_amp_adamw_begin`` does."""
    if not _begin(record, skip, factor):
        return
    record["step"] = record["step"] + _ONE  # a NumPy 1.x uint64 += int would be float64
    lr, beta1, beta2 = float(record["lr"]), float(record["beta1"]), float(record["beta2"])
    record["beta1_power"] = float(record["beta1_power"]) * beta1
    record["beta2_power"] = float(record["beta2_power"]) * beta2
    record["decay"] = _f32(1.0 - lr * float(record["weight_decay"]))
    record["neg_step_size"] = _f32(-(lr / (1.0 - float(record["beta1_power"]))))
    record["bias_correction2_sqrt"] = _f32(math.sqrt(1.0 - float(record["beta2_power"])))
    record["lerp_weight"] = _f32(1.0 - beta1)
    record["beta2_f"] = _f32(beta2)
    record["one_minus_beta2"] = _f32(1.0 - beta2)
    record["eps_f"] = _f32(record["eps"])


def begin_sgd(record: np.ndarray, skip: bool, factor: np.float32) -> None:
    """Open a step on an SGD record (a 0-d :data:`SGD_STATE` array), as ``cupy_amp_sgd_begin`` does."""
    if not _begin(record, skip, factor):
        return
    record["first"] = record["step"] == np.uint64(0)
    record["step"] = record["step"] + _ONE
    record["neg_lr"] = _f32(-float(record["lr"]))
    record["momentum_f"] = _f32(record["momentum"])
    record["one_minus_dampening"] = _f32(1.0 - float(record["dampening"]))
    record["weight_decay_f"] = _f32(record["weight_decay"])


def adamw_update(record: np.ndarray, grad: np.ndarray, weights: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
    """Apply an opened AdamW step to float32 ``weights``, ``m`` and ``v`` in place; ``grad`` is only read.

    The operations of ``torch.optim.AdamW``'s single-tensor update on the CPU: a
    fused multiply-add where it fuses (lerp, addcmul), plain operations elsewhere.
    """
    if record["skip"]:
        return
    with np.errstate(all="ignore"):
        g = grad.astype(np.float32) * record["factor"]
        np.multiply(weights, record["decay"], out=weights)
        weight = record["lerp_weight"]
        if weight < 0.5:  # torch's lerp: from the start for a small weight, from the end for a large one
            m[...] = fma32(weight, g - m, m)
        else:
            m[...] = fma32(np.float32(weight - np.float32(1.0)), g - m, g)
        v[...] = fma32(record["one_minus_beta2"] * g, g, v * record["beta2_f"])
        denom = np.sqrt(v) / record["bias_correction2_sqrt"] + record["eps_f"]
        np.add(weights, (record["neg_step_size"] * m) / denom, out=weights)


def sgd_update(record: np.ndarray, grad: np.ndarray, weights: np.ndarray, buffer: np.ndarray | None) -> None:
    """Apply an opened SGD step to float32 ``weights`` (and momentum ``buffer``) in place; ``grad`` is only read.

    The operations of ``torch.optim.SGD``'s single-tensor update on the CPU (each
    ``add(x, alpha=a)`` a fused multiply-add).
    """
    if record["skip"]:
        return
    with np.errstate(all="ignore"):
        g = grad.astype(np.float32) * record["factor"]
        if float(record["weight_decay"]) != 0.0:
            g = fma32(weights, record["weight_decay_f"], g)
        if buffer is not None:
            if record["first"]:
                buffer[...] = g
            else:
                buffer[...] = fma32(g, record["one_minus_dampening"], buffer * record["momentum_f"])
            g = fma32(buffer, record["momentum_f"], g) if record["nesterov"] else buffer.copy()
        weights[...] = fma32(g, record["neg_lr"], weights)
