"""GradScaler: the loss scaler a training loop talks to."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import numpy as np

from cupy_amp.array_backend import OverflowCheck, UnscalePlan
from cupy_amp.checkpoint import GradScalerCheckpoint
from cupy_amp.config import DEFAULT_INIT_SCALE, ScalerConfig, validate_scale_in_clamps
from cupy_amp.distributed import overflow_vote_for
from cupy_amp.errors import ArgumentTypeError, ConfigError, ScalerProtocolError
from cupy_amp.gradient_cache import PreparedCallCache
from cupy_amp.gradients import GradientBatch, GradientSet, check_disjoint, collect_gradients, collect_loss
from cupy_amp.stats import GradScalerStats
from cupy_amp.update_rule import ScalerState, inverse_scale, next_state
from cupy_amp.validation import expect_bool, expect_float32

__all__ = ["GradScaler"]


class _CheckedCall(NamedTuple):
    """One ``unscale_and_check`` call of a step, kept to answer ``nonfinite_gradients``."""

    labels: tuple[Hashable, ...]
    check: OverflowCheck | None
    local_overflow: bool


class GradScaler:
    """Dynamic loss scaler with PyTorch-exact numerics for NumPy and CuPy arrays.

    A step is: ``scale_loss(loss)``, the backward pass, one or more
    ``unscale_and_check(gradients)`` calls (on disjoint gradient sets), the
    optimizer step if they all returned True, then ``update()``.

    The update rule (``scale`` is float32; products are rounded to float32)::

        on overflow:  growth_tracker = 0
                      hysteresis_tracker = max(hysteresis_tracker - 1, 0)
                      if hysteresis_tracker == 0: scale = max(scale * backoff_factor, min_scale)
        clean step:   growth_tracker += 1
                      if growth_tracker >= growth_interval:
                          scale = min(scale * growth_factor, max_scale)   # kept only if finite
                          growth_tracker = 0; hysteresis_tracker = hysteresis

    With ``min_scale=None``, ``max_scale=None`` and ``hysteresis=1`` the scale
    follows ``torch.amp.GradScaler`` exactly.

    Args:
        init_scale: Starting scale, finite and > 0, rounded to float32, inside the clamps.
        growth_factor: Finite, > 1.
        backoff_factor: Strictly between 0 and 1.
        growth_interval: Clean steps in a row before growing, an int >= 1.
        enabled: When False every call is a no-op and ``scale_factor()`` is 1.0.
        min_scale: Floor after a backoff (float32, > 0), or None for none.
        max_scale: Ceiling after a growth (float32, >= min_scale), or None for none.
        hysteresis: Overflowing steps before a backoff, an int >= 1 (refilled on growth).
        comm: For multi-process training: a CuPy NCCL communicator
            (``cupyx.distributed.NCCLBackend`` or ``cupy.cuda.nccl.NcclCommunicator``)
            or any :class:`~cupy_amp.distributed.OverflowVote`. Every
            ``unscale_and_check`` then all-reduces the overflow flag (MAX) before
            reading it, so all ranks skip and adapt together. Every rank must make
            the same calls and agree on ``enabled`` (a rank without gradients
            passes an empty list); a call rejected on one rank still votes
            "overflow", so the other ranks skip that step instead of hanging.

    Raises:
        ConfigError: A ``ValueError`` naming the parameter, what was expected and what was given.
    """

    def __init__(
        self,
        init_scale: float = DEFAULT_INIT_SCALE,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        min_scale: float | None = 1.0,
        max_scale: float | None = 2.0**24,
        hysteresis: int = 1,
        comm: Any = None,
    ) -> None:
        config = ScalerConfig(
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            min_scale=min_scale,
            max_scale=max_scale,
            hysteresis=hysteresis,
        )
        scale = expect_float32(ConfigError, "init_scale", init_scale)
        validate_scale_in_clamps(config, scale, "init_scale")
        self._config = config
        self._state = ScalerState(scale=scale, growth_tracker=0, hysteresis_tracker=config.hysteresis)
        self._enabled = expect_bool(ConfigError, "enabled", enabled)
        self._vote = overflow_vote_for(comm)
        self._found_overflow = False
        self._found_overflow_local = False
        self._step_open = False
        # The current step's calls, or the last step's once update() closed it.
        self._calls: list[_CheckedCall] = []
        # The open step's gradient batches, to refuse unscaling any memory twice in a step.
        self._step_batches: list[GradientBatch] = []
        # Gradient arguments seen before, so a repeated list skips validation and setup.
        self._prepared = PreparedCallCache()
        # The state a clean update() moves to, computed when the step opens (while the kernels run).
        self._clean_successor: ScalerState | None = None
        # Both factors are needed on every step: cached with the scale they were made from.
        self._factors_of: float | None = None
        self._scale32: np.float32 = np.float32(1.0)
        self._inverse: np.float32 = inverse_scale(1.0)

    @classmethod
    def with_params(
        cls, init_scale: float, growth_factor: float, backoff_factor: float, growth_interval: int
    ) -> GradScaler:
        """Build a scaler from the four classic parameters; the rest keep their defaults."""
        return cls(
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
        )

    @property
    def config(self) -> ScalerConfig:
        """The immutable configuration (never synchronizes)."""
        return self._config

    def scale_factor(self) -> float:
        """Return the factor ``scale_loss`` applies now: the scale, or 1.0 while disabled.

        Never synchronizes the device.
        """
        return self._state.scale if self._enabled else 1.0

    def scale_loss(self, loss: Any) -> None:
        """Multiply ``loss`` by the scale in place, allocating no new array.

        float16/float32 losses are multiplied in float32 and rounded back (an
        fp16 loss can become inf: the step will then show an overflow);
        float64 losses in float64. The argument is validated even while
        disabled; disabled, nothing else happens. Never synchronizes the device.

        Raises:
            GradientTypeError: ``loss`` is not a NumPy/CuPy float16/32/64 array.
            GradientValueError: ``loss`` is read-only.
        """
        backend, array = collect_loss(loss)
        if self._enabled:
            backend.scale_in_place(array, self._factors()[0])

    def unscale_and_check(self, gradients: Any) -> bool:
        """Unscale every gradient in place and return True if all were finite.

        ``gradients`` is an iterable of arrays (``None`` entries skipped, as
        parameters without a gradient) or a mapping name -> array. Every
        gradient is unscaled, overflow or not; overflow means an inf/nan in
        a gradient *before* unscaling. All validation happens before any
        array is touched. Several calls per step are allowed on disjoint
        gradients; the step overflowed if any call found inf/nan.

        With CuPy arrays: one fused kernel launch per (device, dtype) on the
        current stream, then one synchronizing read of a single overflow flag.
        With NumPy arrays nothing is asynchronous. Disabled: returns True and
        touches nothing. If waiting for the verdict fails (a device error, an
        interrupt), the exception propagates and the call still counts, as an
        overflow: its gradients may already be unscaled, so passing them again
        in this step is refused, and ``update()`` backs off.

        Raises:
            GradientTypeError: Not an iterable/mapping of supported float arrays,
                or NumPy and CuPy arrays mixed.
            GradientValueError: A read-only array.
            DuplicateGradientError: Two gradients share memory, or one was
                already unscaled in this step (also a ``RuntimeError``).
        """
        if not self._enabled:
            return True
        try:
            batch, plan = self._validated(gradients)
        except Exception:
            if self._vote is not None:
                # The other ranks are waiting in this call's vote: vote "overflow" so they
                # skip this step instead of hanging, then report the error here.
                self._vote.host_vote(True)
            raise

        check = plan.run(batch.arrays, self._factors()[1], self._vote) if plan is not None else None

        # With CuPy the kernels are running now: do what does not depend on their verdict before waiting,
        # including the state a clean update() moves to (the usual outcome).
        if not self._step_open:
            self._step_open = True
            self._found_overflow = False
            self._found_overflow_local = False
            self._calls = []
            self._step_batches = []
            self._clean_successor = next_state(self._config, self._state, False, False)
        self._step_batches.append(batch)
        try:
            if check is not None:
                overflowed, local = check.found_overflow(), check.local_overflow()
            else:  # nothing to check here; with a communicator this rank still votes
                overflowed, local = (self._vote.host_vote(False) if self._vote is not None else False), False
        except BaseException:
            # No verdict (a device error, an interrupt), but the kernels may have run: the call counts,
            # as an overflow, so its gradients are refused if passed again and update() backs off.
            self._calls.append(_CheckedCall(batch.labels, None, True))
            self._found_overflow = self._found_overflow_local = True
            raise
        self._calls.append(_CheckedCall(batch.labels, check, local))
        self._found_overflow = self._found_overflow or overflowed
        self._found_overflow_local = self._found_overflow_local or local
        return not overflowed

    def _factors(self) -> tuple[np.float32, np.float32]:
        """Return (scale, inverse scale) as float32, recomputed only when the scale changed."""
        scale = self._state.scale
        if self._factors_of != scale:
            self._factors_of, self._scale32, self._inverse = scale, np.float32(scale), inverse_scale(scale)
        return self._scale32, self._inverse

    def _validated(self, gradients: Any) -> tuple[GradientBatch, UnscalePlan | None]:
        """Return the validated batch and the backend's plan for it (reused when seen before)."""
        known = self._prepared.lookup(gradients)
        if known is not None:
            prepared, arrays = known
            batch = GradientBatch(prepared.labels, arrays, prepared.backend)
            plan: UnscalePlan | None = prepared.plan
        else:
            # A set's members may have changed in place (made read-only, say) since it was
            # built: validate again on a miss; its disjointness cannot have changed.
            batch = collect_gradients(gradients)
            if not isinstance(gradients, GradientSet):
                check_disjoint([batch])
            plan = batch.backend.prepare(batch.arrays) if batch.backend is not None and batch.arrays else None
            if plan is not None:
                self._prepared.store(gradients, batch, plan)
        if self._step_open:
            check_disjoint([*self._step_batches, batch])
        return batch, plan

    def update(self) -> None:
        """End the step: back off after an overflow, grow after enough clean steps.

        Never synchronizes the device. Disabled: no-op.

        Raises:
            ScalerProtocolError: No ``unscale_and_check`` since the previous ``update()``.
        """
        if not self._enabled:
            return
        if not self._step_open:
            raise ScalerProtocolError(
                "update() was called without an unscale_and_check() since the previous update(). Each optimizer "
                "step is: scale_loss(loss), backward, unscale_and_check(gradients), optimizer step if it returned "
                "True, update(). With gradient accumulation, call unscale_and_check() and update() once per "
                "optimizer step, after the last micro-batch, not once per micro-batch."
            )
        # The state and config cannot change while a step is open, so the successor computed when it
        # opened still holds.
        if self._found_overflow or self._clean_successor is None:
            self._state = next_state(self._config, self._state, self._found_overflow, self._found_overflow_local)
        else:
            self._state = self._clean_successor
        self._clean_successor = None
        self._step_open = False
        self._step_batches = []

    def had_overflow(self) -> bool:
        """Return True if the current step (or, after ``update()``, the last step) overflowed.

        Stays valid after ``update()`` until the next step's first
        ``unscale_and_check``, so a learning-rate schedule can skip with the
        optimizer. Never synchronizes the device.
        """
        return self._found_overflow

    def nonfinite_gradients(self) -> list[Hashable]:
        """Return which gradients held inf/nan in the current (or last) step.

        For each ``unscale_and_check`` call of the step, in call order, the
        positions of the offending gradients within that call's argument
        (``None`` entries count) or their names when a mapping was passed.
        Empty when the step was clean. With CuPy arrays, reads the
        per-gradient flags from the device (a synchronization) only for calls
        that overflowed.
        """
        culprits: list[Hashable] = []
        for call in self._calls:
            if call.local_overflow and call.check is not None:
                culprits.extend(call.labels[position] for position in call.check.nonfinite_positions())
        return culprits

    def set_enabled(self, enabled: bool) -> None:
        """Turn scaling on or off between steps.

        Raises:
            ConfigError: ``enabled`` is not a bool.
            ScalerProtocolError: Switching while a step is open (after
                ``unscale_and_check``, before ``update()``).
        """
        flag = expect_bool(ConfigError, "enabled", enabled)
        if flag != self._enabled and self._step_open:
            raise ScalerProtocolError(
                "set_enabled() cannot switch the scaler while a step is open (unscale_and_check() was called and "
                "update() was not yet); call update() first."
            )
        self._enabled = flag

    def is_enabled(self) -> bool:
        """Return whether scaling is on."""
        return self._enabled

    def stats(self) -> GradScalerStats:
        """Return a snapshot of the scale and counters (never synchronizes)."""
        state = self._state
        return GradScalerStats(
            scale=state.scale,
            consecutive_good_steps=state.growth_tracker,
            hysteresis_tracker=state.hysteresis_tracker,
            enabled=self._enabled,
            steps=state.steps,
            skipped_steps=state.skipped_steps,
            growths=state.growths,
            backoffs=state.backoffs,
            remote_skipped_steps=state.remote_skipped_steps,
            last_overflow=("local" if self._found_overflow_local else "remote") if self._found_overflow else "none",
        )

    def checkpoint(self) -> GradScalerCheckpoint:
        """Return the complete state, to resume bit for bit (never synchronizes).

        Raises:
            ScalerProtocolError: A step is open; take checkpoints after ``update()``.
        """
        if self._step_open:
            raise ScalerProtocolError(
                "checkpoint() was called in the middle of a step (after unscale_and_check(), before update()); "
                "such a state cannot be resumed exactly. Call update() first."
            )
        return GradScalerCheckpoint.capture(
            self._config,
            self._state,
            enabled=self._enabled,
            found_overflow=self._found_overflow,
            found_overflow_local=self._found_overflow_local,
        )

    def load_checkpoint(self, checkpoint: GradScalerCheckpoint) -> None:
        """Replace the whole state and configuration with a checkpoint's.

        Raises:
            ArgumentTypeError: ``checkpoint`` is not a GradScalerCheckpoint.
            ScalerProtocolError: A step is open.
        """
        if not isinstance(checkpoint, GradScalerCheckpoint):
            raise ArgumentTypeError(
                f"load_checkpoint expected a GradScalerCheckpoint, got {type(checkpoint).__name__}; "
                f"read files with GradScalerCheckpoint.load(path)."
            )
        if self._step_open:
            raise ScalerProtocolError(
                "load_checkpoint() was called in the middle of a step (after unscale_and_check(), before update()); "
                "call update() first, or load before the step starts."
            )
        self._config = checkpoint.config()
        self._state = checkpoint.state()
        self._enabled = checkpoint.enabled
        self._found_overflow = checkpoint.found_overflow
        self._found_overflow_local = checkpoint.found_overflow_local
        self._calls = []
        self._step_batches = []

    def __repr__(self) -> str:
        config = self._config
        return (
            f"GradScaler(scale={self._state.scale:g}, growth_factor={config.growth_factor!r}, "
            f"backoff_factor={config.backoff_factor!r}, growth_interval={config.growth_interval}, "
            f"enabled={self._enabled}, min_scale={config.min_scale!r}, max_scale={config.max_scale!r}, "
            f"hysteresis={config.hysteresis})"
        )
