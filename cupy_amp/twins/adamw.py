"""The NumPy twin of ``kernels/adamw.cu``: the fused AdamW's step on a record and float32 arrays."""

from __future__ import annotations

import math

import numpy as np

from cupy_amp.kernel_interface import ADAMW_STATE
from cupy_amp.twins.optimizer import ONE, fma32, open_step

# The record's dtype is named here too: a record and the functions that step it go together.
__all__ = ["ADAMW_STATE", "begin", "update"]

_f32 = np.float32


def begin(record: np.ndarray, skip: bool, factor: np.float32) -> None:
    """Open a step on an AdamW record (a 0-d :data:`ADAMW_STATE` array), as ``cupy_amp_adamw_begin`` does."""
    if not open_step(record, skip, factor):
        return
    record["step"] = record["step"] + ONE  # a NumPy 1.x uint64 += int would be float64
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


def update(record: np.ndarray, grad: np.ndarray, weights: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
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
