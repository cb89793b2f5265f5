"""The door to CuPy: the only package of the library that imports it (the demo, an application, has its own).

- :mod:`~cupy_amp.gpu.backend`: what the scalers ask of CuPy arrays (validation, placement, capture);
- :mod:`~cupy_amp.gpu.device_state`: the scalers' state in device memory (``DeviceState``) and the launches
  that step it (loss scale, unscale, vote, rule);
- :mod:`~cupy_amp.gpu.stats`: the statistics record of ``check()`` and its launches;
- :mod:`~cupy_amp.gpu.tables`: the multi-tensor tables of gradients and parameters;
- :mod:`~cupy_amp.gpu.launch`: compiling the kernels of ``kernels/`` once per device, launching them, stream
  order;
- :mod:`~cupy_amp.gpu.optimizer_launches`: the fused optimizers' launches;
- :mod:`~cupy_amp.gpu.nccl`: NCCL communicators as the vote's transport.

Importing this package imports nothing; each module but ``nccl`` imports CuPy, and is imported only once a
CuPy array shows up (``tests/test_layout.py`` holds every other module to that).
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["loaded_cupy"]


def loaded_cupy() -> Any:
    """Return CuPy if it was imported already, else None, never importing it: a CuPy array exists only then."""
    return sys.modules.get("cupy")
