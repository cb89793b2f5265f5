"""Fused optimizers that unscale, clip and skip inside their update: :class:`AdamW` and :class:`SGD`.

Each is a file of its own here, over :mod:`cupy_amp.optim.base`, with its kernel ``kernels/<kind>.cu`` and
its NumPy twin :mod:`cupy_amp.twins.<kind>`. :data:`LAYOUTS` lists every kind a state file may hold.
"""

from cupy_amp.optim.adamw import AdamW
from cupy_amp.optim.sgd import SGD

__all__ = ["LAYOUTS", "SGD", "AdamW"]

LAYOUTS = {optimizer.layout.kind: optimizer.layout for optimizer in (AdamW, SGD)}
