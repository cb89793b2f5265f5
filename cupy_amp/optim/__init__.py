"""Fused optimizers that unscale, clip and skip inside their update: :class:`AdamW` and :class:`SGD`."""

from cupy_amp.optim.optimizers import SGD, AdamW

__all__ = ["SGD", "AdamW"]
