"""What both scaler faces offer in the same words: the guard scaler and the one-call optimizer step."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple, TypeVar

from cupy_amp.errors import ScalerProtocolError
from cupy_amp.statistics import GradientNumerics, GradientStats

__all__ = ["Face", "NumericsSource"]

F = TypeVar("F", bound="Face")


class NumericsSource(NamedTuple):
    """Where the numerics report of a step's ``check(report=True)`` is: no arrays, only their tables."""

    number: int  # the step's number (Step.number)
    labels: tuple[Hashable, ...]
    plan: Any
    state: Any  # the State that ran the check
    # The labels of the gradients that held inf/nan, where the check knew them on the host (GradScaler: its
    # own records keep no culprits while disabled); None: read them from nonfinite_gradients().
    nonfinite: tuple[Hashable, ...] | None = None


class Face:
    """The calls :class:`~cupy_amp.GradScaler` and :class:`~cupy_amp.SyncFreeGradScaler` share word for word."""

    _numerics_source: NumericsSource | None = None  # the last check(report=True), replaced in one assignment

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

    def check(self, gradients: Any, *, max_norm: float | None = None, report: bool = False) -> GradientStats:
        raise NotImplementedError

    def nonfinite_gradients(self) -> list[Hashable]:
        raise NotImplementedError

    def gradient_numerics(self) -> list[GradientNumerics]:
        """Return the numerics report of this step's ``check(gradients, report=True)``, one entry per gradient.

        After ``update()``, the last step's. For each gradient, in the
        argument's order: its largest finite magnitude, its count of zeros and
        of subnormals (of the values as given, still scaled), and whether it
        held inf/nan. Taken in the same read as the norm; reading it
        synchronizes on the GPU.

        Raises:
            ScalerProtocolError: This (or the last) step had no ``check(..., report=True)``, or a
                checkpoint was loaded since.
        """

        def read() -> list[GradientNumerics]:
            # Under the scaler's lock: a check() of the next step in another thread cannot replace the
            # state's report between the test below and the read (rows of one step under another's labels).
            source, number = self._numerics_source, self._step.number  # type: ignore[attr-defined]
            if source is None or source.number != number:
                raise ScalerProtocolError(
                    "gradient_numerics() reads the report of this step's check(gradients, report=True) (after "
                    "update(), the last step's); this step's gradients were not checked with report=True."
                )
            nonfinite = set(self.nonfinite_gradients() if source.nonfinite is None else source.nonfinite)
            rows = source.state.numerics(source.plan)
            labels = [source.labels[row.position] for row in rows]
            return [
                GradientNumerics(label, row.dtype, row.size, row.amax, row.zeros, row.subnormals, label in nonfinite)
                for label, row in zip(labels, rows)
            ]

        return self._step.run(read)  # type: ignore[attr-defined,no-any-return]

    def step(
        self, optimizer: Any, gradients: Any, *, max_norm: float | None = None, report: bool = False
    ) -> GradientStats:
        """Check ``gradients`` and apply ``optimizer``'s fused update from this check, in one call.

        ``check(gradients, max_norm=max_norm)`` followed by
        ``optimizer.step(gradients, stats)``: the update unscales and clips
        inside its pass and does nothing at all after an overflow. Call
        ``update()`` after it. ``optimizer`` is a :mod:`cupy_amp.optim`
        optimizer (``AdamW``, ``SGD``); ``gradients`` are its gradients, in its
        parameters' order (a ``GradientSet`` too). Returns the step's
        statistics (``norm``, ``clip_coefficient``, ``finite``). Synchronizes as
        ``check()`` does.

        With ``report``, the check also takes the numerics report
        (:meth:`gradient_numerics`).

        Raises:
            As ``check()`` and the optimizer's ``step()``; the optimizer is not
            called when the check raises.
        """
        stats = self.check(gradients, max_norm=max_norm, report=report)
        optimizer.step(gradients, stats)
        return stats
