"""The NumPy twin of ``kernels/sgd.cu``: the fused SGD's step on a record and float32 arrays."""

from __future__ import annotations

import numpy as np

from cupy_amp.kernel_interface import SGD_STATE
from cupy_amp.twins.optimizer import ONE, fma32, open_step

# The record's dtype is named here too: a record and the functions that step it go together.
__all__ = ["SGD_STATE", "begin", "update"]

_f32 = np.float32


def begin(record: np.ndarray, skip: bool, factor: np.float32) -> None:
    """Open a step on an SGD record (a 0-d :data:`SGD_STATE` array), as ``cupy_amp_sgd_begin`` does."""
    if not open_step(record, skip, factor):
        return
    record["first"] = record["step"] == np.uint64(0)
    record["step"] = record["step"] + ONE
    record["neg_lr"] = _f32(-float(record["lr"]))
    record["momentum_f"] = _f32(record["momentum"])
    record["one_minus_dampening"] = _f32(1.0 - float(record["dampening"]))
    record["weight_decay_f"] = _f32(record["weight_decay"])


def update(record: np.ndarray, grad: np.ndarray, weights: np.ndarray, buffer: np.ndarray | None) -> None:
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
