"""A read-only snapshot of the scaler's counters, for logs and dashboards."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["GradScalerStats"]


@dataclass(frozen=True)
class GradScalerStats:
    """The scaler's state at the moment :meth:`GradScaler.stats` was called.

    Attributes:
        scale: The stored loss scale (also while the scaler is disabled).
        consecutive_good_steps: Clean steps in a row since the last growth or overflow.
        hysteresis_tracker: Overflows still tolerated before the next backoff.
        enabled: Whether scaling is on.
        steps: ``update()`` calls made while enabled, skipped or not.
        skipped_steps: Of those, the steps whose gradients overflowed.
        growths: Times the scale grew.
        backoffs: Times the scale shrank.
        remote_skipped_steps: Skipped steps whose overflow was on another rank only
            (this process's gradients were finite); always 0 without a communicator.
        last_overflow: Where the current (or last) step's overflow was: "none",
            "local" (this process's gradients) or "remote" (another rank's only).
    """

    scale: float
    consecutive_good_steps: int
    hysteresis_tracker: int
    enabled: bool
    steps: int
    skipped_steps: int
    growths: int
    backoffs: int
    remote_skipped_steps: int
    last_overflow: str

    def to_dict(self) -> dict[str, float | int | bool | str]:
        """Return the fields as a plain dict (for loggers such as TensorBoard or W&B)."""
        return asdict(self)

    def __str__(self) -> str:
        state = "enabled" if self.enabled else "disabled"
        # Nine significant digits name every float32 exactly (":g" printed 2**24 as 1.67772e+07).
        return (
            f"scale={self.scale:.9g} ({state}) good_steps={self.consecutive_good_steps} "
            f"steps={self.steps} skipped={self.skipped_steps} "
            f"growths={self.growths} backoffs={self.backoffs} hysteresis_left={self.hysteresis_tracker} "
            f"remote_skips={self.remote_skipped_steps} last_overflow={self.last_overflow}"
        )
