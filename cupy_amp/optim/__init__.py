"""Fused optimizers that unscale, clip and skip inside their update: :class:`AdamW` and :class:`SGD`."""

from cupy_amp.optim.adamw import AdamW
from cupy_amp.optim.sgd import SGD

__all__ = ["SGD", "AdamW"]
