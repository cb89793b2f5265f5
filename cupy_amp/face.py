"""What both scaler faces offer in the same words: the guard scaler and the one-call optimizer step."""

from __future__ import annotations

from typing import Any, TypeVar

from cupy_amp.statistics import GradientStats

__all__ = ["Face"]

F = TypeVar("F", bound="Face")


class Face:
    """The calls :class:`~cupy_amp.GradScaler` and :class:`~cupy_amp.SyncFreeGradScaler` share word for word."""

    def __init__(self, init_scale: float, *, min_scale: float | None, max_scale: float | None) -> None:
        raise NotImplementedError  # each face has its own; declared for guard()

    @classmethod
    def guard(cls: type[F]) -> F:
        """Return a scaler whose scale stays 1: the inf/nan check, skip and clipping of ``check()`` without scaling.

        For bfloat16 (or float32) training, which needs no loss scaling but must
        still skip a step whose gradients hold inf/nan. Skipped steps are counted as usual.
        Its steps need no ``scale_loss``: every scaler whose ``min_scale`` and
        ``max_scale`` are both 1 (so its scale is 1 for good) is exempt from that rule.
        """
        return cls(init_scale=1.0, min_scale=1.0, max_scale=1.0)

    def check(self, gradients: Any, *, max_norm: float | None = None) -> GradientStats:
        raise NotImplementedError

    def step(self, optimizer: Any, gradients: Any, *, max_norm: float | None = None) -> GradientStats:
        """Check ``gradients`` and apply ``optimizer``'s fused update from this check, in one call.

        ``check(gradients, max_norm=max_norm)`` followed by
        ``optimizer.step(gradients, stats)``: the update unscales and clips
        inside its pass and does nothing at all after an overflow. Call
        ``update()`` after it. ``optimizer`` is a :mod:`cupy_amp.optim`
        optimizer (``AdamW``, ``SGD``); ``gradients`` are its gradients, in its
        parameters' order (a ``GradientSet`` too). Returns the step's
        statistics (``norm``, ``clip_coefficient``, ``finite``). Synchronizes as
        ``check()`` does.

        Raises:
            As ``check()`` and the optimizer's ``step()``; the optimizer is not
            called when the check raises.
        """
        stats = self.check(gradients, max_norm=max_norm)
        optimizer.step(gradients, stats)
        return stats
