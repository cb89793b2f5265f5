"""GradScaler: the loss scaler a training loop talks to, and GradScalerStats, its snapshot."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np

from cupy_amp import numpy_backend
from cupy_amp.checkpoint import GradScalerCheckpoint, expect_checkpoint
from cupy_amp.distributed import (
    OverflowVote,
    cast_host_vote,
    host_verdict,
    overflow_count_verdict,
    overflow_vote_for,
    require_sums,
    sums_after_failure,
    vote_after_failure,
)
from cupy_amp.errors import ConfigError, GradientValueError
from cupy_amp.gradients import Call, CallCache, StepClaims, parse_gradients, parse_loss
from cupy_amp.rule import ScalerConfig, ScalerState, expect_bool, initial_state, inverse_scale, next_state
from cupy_amp.statistics import GradientStats, expect_max_norm
from cupy_amp.step_order import CHECKED, IDLE, StepOrder, refuse_after_check, refuse_second_check

__all__ = ["GradScaler", "GradScalerStats"]


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

    @classmethod
    def of(cls, state: ScalerState, enabled: bool, overflow: bool, local: bool) -> GradScalerStats:
        """Build the snapshot of ``state``, whose last step did (or did not) overflow, here or elsewhere."""
        return cls(
            scale=state.scale,
            consecutive_good_steps=state.consecutive_good_steps,
            hysteresis_tracker=state.hysteresis_tracker,
            enabled=enabled,
            steps=state.steps,
            skipped_steps=state.skipped_steps,
            growths=state.growths,
            backoffs=state.backoffs,
            remote_skipped_steps=state.remote_skipped_steps,
            last_overflow=("local" if local else "remote") if overflow else "none",
        )

    def to_dict(self) -> dict[str, float | int | bool | str]:
        """Return the fields as a plain dict (for loggers such as TensorBoard or W&B)."""
        return asdict(self)

    def __str__(self) -> str:
        # One line, field=value with the field names; nine significant digits name every float32 exactly.
        fields = " ".join(f"{name}={value}" for name, value in asdict(self).items() if name != "scale")
        return f"scale={self.scale:.9g} {fields}"


class _Record(NamedTuple):
    """One ``unscale_and_check`` call of a step, kept to answer ``nonfinite_gradients``."""

    labels: tuple[Hashable, ...]
    culprits: tuple[int, ...]  # positions in the call's arrays; empty when clean or when the call failed


class GradScaler:
    """Dynamic loss scaler with PyTorch-exact numerics for NumPy and CuPy arrays.

    A step is: ``scale_loss(loss)`` (once per loss; a step is open from the
    first call), the backward pass, one or more ``unscale_and_check(gradients)``
    calls on disjoint gradients, the optimizer step if they all returned True,
    then ``update()``. Calls on one scaler from several threads are serialized.

    The update rule (``scale`` is float32; products are rounded to float32)::

        on overflow:  consecutive_good_steps = 0
                      hysteresis_tracker = max(hysteresis_tracker - 1, 0)
                      if hysteresis_tracker == 0:
                          scale = max(scale * backoff_factor, min_scale or SMALLEST_SCALE)
        clean step:   consecutive_good_steps += 1
                      if consecutive_good_steps >= growth_interval:
                          scale = min(scale * growth_factor, max_scale)   # kept only if finite
                          consecutive_good_steps = 0; hysteresis_tracker = hysteresis

    With ``min_scale=None``, ``max_scale=None`` and ``hysteresis=1`` the scale
    follows ``torch.amp.GradScaler`` exactly, as long as PyTorch's stays at or
    above :data:`~cupy_amp.rule.SMALLEST_SCALE` (about 2**-128): below it the
    inverse scale overflows float32 and PyTorch's unscaled gradients become
    inf; this scaler's scale stops there instead.

    Args:
        init_scale: Starting scale, rounded to float32, from SMALLEST_SCALE to float32's
            maximum, inside the clamps.
        growth_factor: Finite, > 1.
        backoff_factor: Strictly between 0 and 1.
        growth_interval: Clean steps in a row before growing, an int >= 1.
        enabled: When False every call is a no-op (arguments are still validated)
            and ``scale_factor()`` is 1.0.
        min_scale: Floor after a backoff (float32, >= SMALLEST_SCALE), or None for none.
        max_scale: Ceiling after a growth (float32, >= min_scale), or None for none.
        hysteresis: Overflowing steps before a backoff, an int >= 1 (refilled on growth).
        comm: For multi-process training: a CuPy NCCL communicator
            (``cupyx.distributed.NCCLBackend`` or ``cupy.cuda.nccl.NcclCommunicator``)
            or any :class:`~cupy_amp.distributed.OverflowVote`. Every
            ``unscale_and_check`` then all-reduces the overflow flag (MAX) before
            reading it, so all ranks skip and adapt together. Every rank must make
            the same calls and agree on ``enabled`` (a rank without gradients
            passes an empty list); a call that fails on one rank, whatever the
            reason, still votes "overflow", so every rank skips that step.

    Raises:
        ConfigError: A ``ValueError`` naming the parameter, what was expected and what was given.
    """

    def __init__(
        self,
        init_scale: float = 65536.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        min_scale: float | None = 1.0,
        max_scale: float | None = 2.0**24,
        hysteresis: int = 1,
        comm: Any = None,
    ) -> None:
        config = ScalerConfig(growth_factor, backoff_factor, growth_interval, min_scale, max_scale, hysteresis)
        self._config = config
        self._state = initial_state(config, init_scale)
        self._enabled = expect_bool(ConfigError, "enabled", enabled)
        self._vote: OverflowVote | None = overflow_vote_for(comm)
        self._order = StepOrder()
        # The open step's claims on gradient memory (None outside the unscaling part of a step).
        self._claims: StepClaims | None = None
        # The current step's calls, or the last step's once update() closed it.
        self._records: list[_Record] = []
        self._found_overflow = False
        self._found_overflow_local = False
        # Gradient arguments seen before, so a repeated list skips validation and setup.
        self._cache = CallCache()
        self._checked_read_only = False  # this step's gradients went through check(), not unscale_and_check()
        self._stats: dict[int, Any] = {}  # check()'s records, by device (-1: the host)

    @classmethod
    def with_params(
        cls, init_scale: float, growth_factor: float, backoff_factor: float, growth_interval: int
    ) -> GradScaler:
        """Build a scaler from the four classic parameters; the rest keep their defaults."""
        return cls(init_scale, growth_factor, backoff_factor, growth_interval)

    @classmethod
    def guard(cls) -> GradScaler:
        """Return a scaler whose scale stays 1: the inf/nan check, skip and clipping of ``check()`` without scaling.

        For bfloat16 (or float32) training, which needs no loss scaling but must
        still skip a step whose gradients hold inf/nan. Skipped steps are counted as usual.
        """
        return cls(init_scale=1.0, min_scale=1.0, max_scale=1.0)

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
        """Multiply ``loss`` by the scale in place, allocating no new array; this opens a step.

        float16/float32 losses are multiplied in float32 and rounded back (an
        fp16 loss can become inf: the step will then show an overflow);
        float64 losses in float64. Call it once per loss (several times per
        step with gradient accumulation). The argument is validated even while
        disabled; disabled, nothing else happens. Never synchronizes the device.

        Raises:
            GradientTypeError: ``loss`` is not a NumPy/CuPy float16/32/64 array.
            GradientValueError: ``loss`` is read-only, misaligned or repeats elements.
            ScalerProtocolError: The previous step's gradients were unscaled but
                ``update()`` was not called.
        """
        backend, array = parse_loss(loss)
        with self._order:
            self._order.scale_loss()  # also while disabled: enabling now would unscale a loss that was not scaled
            if self._enabled:
                backend.scale_loss(array, np.float32(self._state.scale))

    def unscale_and_check(self, gradients: Any) -> bool:
        """Unscale every gradient in place and return True if all were finite.

        ``gradients`` is an iterable of arrays (``None`` entries skipped, as
        parameters without a gradient), a mapping name -> array, or a
        :class:`~cupy_amp.GradientSet`. Every gradient is unscaled, overflow or
        not; overflow means an inf/nan in a gradient *before* unscaling. All
        validation happens before any array is touched. Several calls per step
        are allowed on disjoint gradients; the step overflowed if any call
        found inf/nan.

        With CuPy arrays: one fused kernel launch per (device, dtype) on the
        current stream, then one synchronizing read of a single overflow flag
        per device (after an overflow, also of the per-gradient flags). With
        NumPy arrays nothing is asynchronous. Disabled: validates the argument,
        returns True and touches nothing. If the call fails once arrays may have
        been written (a device error, an interrupt, a communicator error), the
        exception propagates and the call still counts, as an overflow: its
        gradients are refused if passed again in this step, and ``update()``
        backs off.

        Raises:
            GradientTypeError: Not an iterable/mapping of supported float arrays,
                or NumPy and CuPy arrays mixed.
            GradientValueError: A read-only, misaligned or self-overlapping array;
                with a communicator, arrays on several devices.
            DuplicateGradientError: Two gradients share memory, or one was
                already unscaled in this step (also a ``RuntimeError``).
            CommunicatorError: The communicator failed or answered garbage.
        """
        with self._order:
            refuse_after_check(self._checked_read_only)
            if not self._enabled:
                parse_gradients(gradients)
                self._order.phase = CHECKED
                return True
            vote = self._vote
            try:
                call = parse_gradients(gradients, self._cache, one_device=vote is not None)
                claims = self._claims if self._claims is not None else StepClaims()
                claims.claim(call)
            except BaseException as error:
                if vote is not None:
                    # The other ranks wait in this call's vote: vote "overflow", so every rank skips this step.
                    self._record_failure(())
                    vote_after_failure(vote, error)
                raise
            if self._claims is None:  # the step's first call: forget the last step's verdict
                self._begin_checks()
                self._claims = claims
            return self._run(call, vote)

    def check(self, gradients: Any, *, max_norm: float | None = None) -> GradientStats:
        """Read every gradient once, without writing it: the verdict, the culprits, the norm and the clip coefficient.

        The read-only alternative to ``unscale_and_check`` for the fused
        optimizers of :mod:`cupy_amp.optim`, which unscale, clip and skip inside
        their update from the returned record. With CuPy arrays: one fused
        kernel launch per dtype, one small launch that sums the blocks' sums in
        a fixed order and computes, on the device, the L2 norm of the unscaled
        gradients and ``min(1, max_norm / (norm + 1e-6))``; then one
        synchronizing read of the record, as ``unscale_and_check`` reads its
        flag. ``norm`` and ``clip_coefficient`` stay on the device (reading one
        waits); ``finite`` is a host bool array. It must be the step's only
        gradient call, on one device; bfloat16 gradients are accepted.

        With a communicator, one SUM all-reduce carries the pair (ranks with
        inf/nan, sum of squares): every rank gets the global norm (of sharded
        gradients too) and the same verdict, and a rank's own overflow always
        counts. Every rank must call ``check()`` in the same steps; a call that
        fails anywhere still joins the all-reduce, as an overflowed rank.
        Disabled: the statistics (all-reduce included) are computed with no
        scale (inverse 1), and the scaler records nothing.

        Raises:
            ConfigError: ``max_norm`` is not None or a positive float32 number, or the
                communicator cannot sum (no ``reduce_sum``).
            ScalerProtocolError: Gradients were already checked or unscaled in this step.
            GradientValueError: Gradients on several devices.
            CommunicatorError: The all-reduce failed or answered an impossible count.
            As ``unscale_and_check`` for other bad gradients.
        """
        limit = expect_max_norm(max_norm)
        with self._order:
            refuse_second_check(self._order.phase == CHECKED)
            vote = self._vote
            try:
                if vote is not None:
                    require_sums(vote)
                call = parse_gradients(gradients, self._cache, in_place=False)
                if len(call.devices) > 1:
                    raise GradientValueError(
                        "check() takes the gradients of one device (its norm is summed on that device); got "
                        f"devices {list(call.devices)}. Use one scaler per device."
                    )
            except ConfigError:
                raise  # every rank refuses alike: nobody votes
            except BaseException as error:
                try:
                    self._fail_check((), counted=vote is not None)  # with a communicator, a rejected call counts
                finally:
                    if vote is not None:
                        sums_after_failure(vote, error)
                raise
            inverse = inverse_scale(self._state.scale) if self._enabled else np.float32(1.0)
            self._order.phase = CHECKED
            self._checked_read_only = True
            if self._enabled:
                self._begin_checks()
                self._claims = StepClaims()
            backend = call.backend if call.backend is not None else numpy_backend
            voted = False
            try:
                stats = self._stats_for(call)
                checked = backend.check(call.plan, call.arrays, stats, inverse, limit, vote is not None)
                if vote is not None:
                    checked.vote(vote)  # a vote that raises took no part: sums_after_failure joins below
                    voted = True
                local, count, culprits = checked.result()
                agreed = overflow_count_verdict(count, local) if count is not None else False
            except BaseException as error:
                try:
                    self._fail_check(call.labels, counted=True)
                finally:
                    if vote is not None and not voted:
                        sums_after_failure(vote, error)
                raise
            if self._enabled:
                self._records.append(_Record(call.labels, culprits))
                self._found_overflow = local or agreed
                self._found_overflow_local = local
            stats.result.finite[()] = not (local or agreed)
            return stats.result  # type: ignore[no-any-return]

    def _fail_check(self, labels: tuple[Hashable, ...], *, counted: bool) -> None:
        """Record a failed ``check()``: every statistics record says skip, so no optimizer applies the step.

        With ``counted`` the step counts as an overflow (an enabled scaler's update() backs off).
        """
        if counted:
            self._checked_read_only = True
            if self._enabled:
                self._record_failure(labels)
            else:
                self._order.phase = CHECKED
        for stats in self._stats.values():  # the device ones may raise (a broken device): the caller still votes
            stats.result.finite[()] = False
            stats.skip[...] = 1

    def _stats_for(self, call: Call) -> Any:
        """Return this scaler's statistics record for a call's device, made on first use."""
        device = call.devices[0] if call.devices else -1
        stats = self._stats.get(device)
        if stats is None:
            finite = np.ones((), dtype=np.bool_)
            backend = call.backend if call.backend is not None else numpy_backend
            stats = backend.HostStats(finite) if device < 0 else backend.DeviceStats(device, finite)
            self._stats[device] = stats
        return stats

    def _begin_checks(self) -> None:
        self._order.phase = CHECKED
        self._records = []
        self._found_overflow = self._found_overflow_local = False

    def _record_failure(self, labels: tuple[Hashable, ...]) -> None:
        if self._order.phase != CHECKED:
            self._begin_checks()
            self._claims = StepClaims()
        self._records.append(_Record(labels, ()))
        self._found_overflow = self._found_overflow_local = True

    def _run(self, call: Call, vote: OverflowVote | None) -> bool:
        """Unscale a claimed call, vote, and record the verdict; any failure counts as an overflow."""
        voted = False
        unscaled = None
        try:
            if call.backend is None:  # nothing to unscale; with a communicator this rank still votes
                local, agreed, culprits = False, None, ()
                if vote is not None:
                    answer = cast_host_vote(vote, False)
                    voted = True
                    agreed = host_verdict(answer, False)
            else:
                unscaled = call.backend.unscale(
                    call.plan, call.arrays, inverse_scale(self._state.scale), vote is not None
                )
                if vote is not None:
                    unscaled.vote(vote)  # a vote that raises took no part: vote_after_failure votes below
                    voted = True
                local, agreed, culprits = unscaled.result()
        except BaseException as error:
            if unscaled is not None:
                unscaled.abandon()
            self._record_failure(call.labels)
            if vote is not None and not voted:
                vote_after_failure(vote, error)
            raise
        overflow = local or bool(agreed)
        self._records.append(_Record(call.labels, culprits))
        self._found_overflow = self._found_overflow or overflow
        self._found_overflow_local = self._found_overflow_local or local
        return not overflow

    def update(self) -> None:
        """End the step: back off after an overflow, grow after enough clean steps.

        Never synchronizes the device. Disabled: no-op.

        Raises:
            ScalerProtocolError: No ``unscale_and_check`` since the previous ``update()``.
        """
        with self._order:
            self._checked_read_only = False
            if not self._enabled:
                self._order.phase = IDLE
                return
            self._order.require_checked()
            self._state = next_state(self._config, self._state, self._found_overflow, self._found_overflow_local)
            self._order.phase = IDLE
            self._claims = None
            self._checked_read_only = False

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
        Empty when the step was clean. Never synchronizes the device.
        """
        records = self._records  # replaced, never emptied in place, when a new step begins: a consistent read
        return [record.labels[position] for record in records for position in record.culprits]

    def set_enabled(self, enabled: bool) -> None:
        """Turn scaling on or off between steps.

        Raises:
            ConfigError: ``enabled`` is not a bool.
            ScalerProtocolError: Switching while a step is open (from ``scale_loss``
                or ``unscale_and_check`` to ``update()``).
        """
        flag = expect_bool(ConfigError, "enabled", enabled)
        with self._order:
            if flag != self._enabled:
                self._order.require_no_step("set_enabled() cannot switch the scaler")
            self._enabled = flag

    def is_enabled(self) -> bool:
        """Return whether scaling is on."""
        return self._enabled

    def stats(self) -> GradScalerStats:
        """Return a snapshot of the scale and counters (never synchronizes)."""
        # The state is immutable: a consistent read without the lock, even from a signal handler.
        return GradScalerStats.of(self._state, self._enabled, self._found_overflow, self._found_overflow_local)

    def checkpoint(self) -> GradScalerCheckpoint:
        """Return the complete state, to resume bit for bit (never synchronizes).

        Raises:
            ScalerProtocolError: A step is open; take checkpoints after ``update()``.
        """
        with self._order:
            self._order.require_no_step("checkpoint() cannot capture a resumable state")
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
            ScalerProtocolError: A step is open (the loss was scaled with the old scale).
        """
        expect_checkpoint(checkpoint)
        with self._order:
            self._order.require_no_step("load_checkpoint() cannot replace the state")
            self._config = checkpoint.config()
            self._state = checkpoint.state()
            self._enabled = checkpoint.enabled
            self._found_overflow = checkpoint.found_overflow
            self._found_overflow_local = checkpoint.found_overflow_local
            self._records = []

    def __repr__(self) -> str:
        config = self._config
        return (
            f"GradScaler(scale={self._state.scale:g}, growth_factor={config.growth_factor!r}, "
            f"backoff_factor={config.backoff_factor!r}, growth_interval={config.growth_interval}, "
            f"enabled={self._enabled}, min_scale={config.min_scale!r}, max_scale={config.max_scale!r}, "
            f"hysteresis={config.hysteresis})"
        )
