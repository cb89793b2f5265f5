"""SGD with momentum, fused: the update of ``torch.optim.SGD`` over the shared parts of :mod:`cupy_amp.optim.base`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from cupy_amp.errors import ConfigError
from cupy_amp.kernel_interface import SGD_STATE
from cupy_amp.optim import state_file
from cupy_amp.optim.base import FusedOptimizer, hyperparameter
from cupy_amp.optim.state_file import Layout
from cupy_amp.twins import sgd as numpy_twin

__all__ = ["SGD"]


class SGD(FusedOptimizer):
    """SGD with momentum, dampening, Nesterov and weight decay, fused; the update of ``torch.optim.SGD``.

    Args:
        params: As for :class:`AdamW`.
        lr, momentum, dampening, weight_decay, nesterov: As for ``torch.optim.SGD``
            (Nesterov needs momentum > 0 and no dampening).

    Raises:
        ConfigError: A hyperparameter out of range (the message names it).
    """

    layout = Layout(
        "sgd",
        SGD_STATE,
        ("momentum_buffer",),
        ("momentum", "dampening", "weight_decay", "nesterov"),
        ("step", "lr", "momentum", "dampening", "weight_decay", "nesterov"),
    )

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        if not isinstance(nesterov, (bool, np.bool_)):
            raise ConfigError(f"Invalid 'nesterov': expected a bool, got {nesterov!r}.")
        hyper = {
            "lr": hyperparameter("lr", lr, "lr"),
            "momentum": hyperparameter("momentum", momentum, "momentum"),
            "dampening": hyperparameter("dampening", dampening, "dampening"),
            "weight_decay": hyperparameter("weight_decay", weight_decay, "weight_decay"),
            "nesterov": float(bool(nesterov)),
        }
        problem = state_file.nesterov_problem(hyper["momentum"], hyper["dampening"]) if nesterov else None
        if problem is not None:
            raise ConfigError(f"Invalid 'nesterov': expected False unless {problem}, got True.")
        self._with_momentum = hyper["momentum"] != 0.0
        super().__init__(params, hyper)

    def _has(self, buffer: str) -> bool:
        return self._with_momentum

    def _begin(self, record: np.ndarray, skip: bool, factor: np.float32) -> None:
        numpy_twin.begin(record, skip, factor)

    def _update(self, record: np.ndarray, grad: np.ndarray, weights: np.ndarray, *moments: Any) -> None:
        numpy_twin.update(record, grad, weights, *moments)
