"""AdamW, fused: the update of ``torch.optim.AdamW`` over the shared parts of :mod:`cupy_amp.optim.base`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from cupy_amp.errors import ConfigError
from cupy_amp.kernel_interface import ADAMW_STATE
from cupy_amp.optim.base import FusedOptimizer, hyperparameter
from cupy_amp.optim.state_file import Layout
from cupy_amp.twins import adamw as numpy_twin

__all__ = ["AdamW"]


class AdamW(FusedOptimizer):
    """AdamW (decoupled weight decay, bias correction), fused; the update of ``torch.optim.AdamW``.

    Args:
        params: NumPy or CuPy arrays (float16, bfloat16 or float32, C-contiguous, one
            device). float16/bfloat16 parameters get float32 master weights.
        lr, betas, eps, weight_decay: As for ``torch.optim.AdamW`` (same defaults).

    Raises:
        ConfigError: A hyperparameter out of range (the message names it).
    """

    layout = Layout(
        "adamw",
        ADAMW_STATE,
        ("exp_avg", "exp_avg_sq"),
        ("beta1", "beta2", "eps", "weight_decay"),
        ("step", "lr", "beta1", "beta2", "eps", "weight_decay", "beta1_power", "beta2_power"),
        (("beta1_power", "beta1"), ("beta2_power", "beta2")),
    )

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ConfigError(f"Invalid 'betas': expected two numbers, got {betas!r}.")
        super().__init__(
            params,
            {
                "lr": hyperparameter("lr", lr, "lr"),
                "beta1": hyperparameter("betas[0]", betas[0], "beta1"),
                "beta2": hyperparameter("betas[1]", betas[1], "beta2"),
                "eps": hyperparameter("eps", eps, "eps"),
                "weight_decay": hyperparameter("weight_decay", weight_decay, "weight_decay"),
            },
        )

    def _begin(self, record: np.ndarray, skip: bool, factor: np.float32) -> None:
        numpy_twin.begin(record, skip, factor)

    def _update(self, record: np.ndarray, grad: np.ndarray, weights: np.ndarray, *moments: Any) -> None:
        numpy_twin.update(record, grad, weights, *moments)
