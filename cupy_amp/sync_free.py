"""SyncFreeGradScaler: a loss scaler whose step never waits for the GPU, and can be captured in a CUDA graph."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

from cupy_amp import journal as step_journal
from cupy_amp.checkpoint import GradScalerCheckpoint, expect_checkpoint
from cupy_amp.distributed import OTHERS, Communicator, communicator_for, impossible_answers, poisoned_error
from cupy_amp.errors import ArgumentTypeError, ConfigError
from cupy_amp.face import Face
from cupy_amp.gpu import loaded_cupy
from cupy_amp.gradient_call import unscale_call
from cupy_amp.gradients import CallCache, GradientSet, parse_gradients
from cupy_amp.rule import PYTORCH, GradScalerStats, ScalerConfig, ScalerState, initial_state
from cupy_amp.state import Snapshot, State
from cupy_amp.state_set import CallRecord, StateSet, where
from cupy_amp.step import OPEN, UNSCALED, Step

__all__ = ["SyncFreeGradScaler"]

_ONE_DEVICE = "A SyncFreeGradScaler works on one device (one scaler per device, with a communicator across them)"


class SyncFreeGradScaler(Face):
    """Dynamic loss scaler whose state and skip decision stay on the GPU: no step waits for the device.

    The same update rule, numerics and call order as :class:`~cupy_amp.GradScaler`
    (bit for bit), with the scale, the counters and the step's overflow flag kept
    in device memory and updated by kernels. ``unscale_and_check`` returns the
    step's verdict as a 0-d bool array on the device, to gate the optimizer's
    update without reading it (``xp.where(finite, new, old)``, or
    :meth:`apply_if_finite`); ``update()`` applies the rule on the device. A
    steady-state step (scale_loss, unscale_and_check, a gated update, update)
    synchronizes nothing and copies nothing to the host, so it can be captured in
    a CUDA graph and replayed.

    The state lives where the first array the scaler is given lives: on that
    GPU for CuPy arrays (from then on every array must be on it), or on the host
    for NumPy arrays, with the same semantics. Calls that read the state on the
    host synchronize: ``scale_factor``, ``had_overflow``, ``nonfinite_gradients``,
    ``stats``, ``checkpoint`` (and ``bool()`` of the verdict).

    Args:
        init_scale, growth_factor, backoff_factor, growth_interval, min_scale,
        max_scale, hysteresis: As for :class:`~cupy_amp.GradScaler`.
        comm: As for :class:`~cupy_amp.GradScaler`; the MAX all-reduce of the
            overflow flag is queued on the stream, so it is captured with the step.
        journal, rule: As for :class:`~cupy_amp.GradScaler`.

    Raises:
        ConfigError: A ``ValueError`` naming the parameter, what was expected and what was given.
    """

    def __init__(
        self,
        init_scale: float = 65536.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float | None = 1.0,
        max_scale: float | None = 2.0**24,
        hysteresis: int = 1,
        comm: Any = None,
        journal: int = step_journal.DEFAULT_CAPACITY,
        rule: str = PYTORCH,
    ) -> None:
        config = ScalerConfig(growth_factor, backoff_factor, growth_interval, min_scale, max_scale, hysteresis, rule)
        capacity = step_journal.expect_capacity(journal)
        self._scaling = StateSet(config, initial_state(config, init_scale), one_device=True, journal=capacity)
        self._communicator: Communicator | None = communicator_for(comm)
        self._step = Step()
        self._cache = CallCache()

    @property
    def config(self) -> ScalerConfig:
        """The immutable configuration (never synchronizes)."""
        return self._scaling.config

    def prepare(self, gradients: Any) -> GradientSet:
        """Place the state beside ``gradients``, load every kernel, and return them as a :class:`GradientSet`.

        Call it before capturing a step in a CUDA graph (a capture can neither
        allocate the state nor build the gradients' device tables): pass the
        returned set to ``unscale_and_check`` inside the capture.

        Raises:
            As ``unscale_and_check`` does for bad gradients.
        """
        gradient_set = gradients if type(gradients) is GradientSet else GradientSet(gradients)
        with self._step.lock.turn, self._step.admit():
            call = parse_gradients(gradient_set, one_device=_ONE_DEVICE, in_place=False)  # for check() too
            if call.backend is not None:
                self._place(self._scaling, call.backend, call.devices[0]).prepare(call)
        return gradient_set

    @property
    def _state(self) -> State:
        return self._scaling.all()[0]

    @property
    def _lane(self) -> StateSet:
        return self._scaling

    def _place(self, lane: StateSet, backend: Any, device: int) -> State:
        step_open = self._step.phase in OPEN
        return lane.place(backend, device, lambda: Snapshot(*self._state.snapshot()[:4]), step_open)

    def _snapshot(self) -> tuple[ScalerState, bool, bool, int]:
        """Read the state (synchronizes); raise if an all-reduce answered garbage since the last read.

        Raises:
            RanksMayDisagreeError: An all-reduce answered a poisoned vote (the scaler refuses from now on).
            CommunicatorError: Some all-reduce's answer was impossible (those steps were skipped).
        """
        self._step.refuse_if_broken()
        state, overflow, local, epoch, bad_votes, poisoned = self._state.snapshot()
        if poisoned:
            self._step.poison(poisoned_error(OTHERS))
            self._step.refuse_if_broken()
        new_bad_votes = self._state.new_bad_votes(bad_votes)
        if new_bad_votes:
            raise impossible_answers(new_bad_votes)
        return state, overflow, local, epoch

    def scale_factor(self) -> float:
        """Return the current scale (synchronizes: it lives on the device)."""
        return float(self._snapshot()[0].scale)

    def unscale_and_check(self, gradients: Any) -> Any:
        """Unscale every gradient in place; return the step's verdict as a 0-d bool array (True: all finite).

        The same arguments, validation and failure rules as
        :meth:`GradScaler.unscale_and_check`, and one fused kernel launch per
        dtype, but nothing is read back: the verdict is the scaler's flag in
        device memory (a NumPy array on the NumPy path), True until a call of
        this step finds inf/nan. It covers every call of the step so far, and
        stays valid after ``update()`` until the next step's first call. Gate the
        optimizer's update with it; ``bool(verdict)`` reads it (synchronizes).

        Raises:
            As :meth:`GradScaler.unscale_and_check` (ScalerProtocolError without a
                ``scale_loss`` in the step, unless a guard); also GradientValueError for
            arrays on a device other than the state's, and ScalerProtocolError for
            gradients not yet prepared while a CUDA graph is being captured.
        """

        with self._step.lock.turn, self._step.admit(), self._step.accounting():
            with self._step.gradient_call(UNSCALED, self._scaling, self._communicator) as scope:
                call = parse_gradients(gradients, self._cache, one_device=_ONE_DEVICE)
                state = self._place(self._scaling, call.backend, call.devices[0] if call.devices else -1)
                self._step.open_call(scope, call, state)
                self._step.record_call(scope, unscale_call(call, state, scope))
            return state.finite

    def apply_if_finite(self, targets: Any, updates: Any) -> None:
        """Copy each of ``updates`` into the matching array of ``targets``, only if the step's gradients were finite.

        One elementwise kernel per pair, gated by the verdict on the device:
        after an overflow nothing is written. Never synchronizes.

        Raises:
            ArgumentTypeError: ``targets`` and ``updates`` differ in length.
            RanksMayDisagreeError: The scaler is poisoned (see ``update``).
        """
        self._step.refuse_if_broken()
        targets, updates = list(targets), list(updates)
        if len(targets) != len(updates):
            raise ArgumentTypeError(
                f"apply_if_finite expected as many updates as targets, got {len(updates)} and {len(targets)}."
            )
        state = self._state
        copyto = np.copyto if isinstance(state.finite, np.ndarray) else loaded_cupy().copyto
        state.follow()  # after the state's last work, whichever stream that was on
        for target, update in zip(targets, updates):
            copyto(target, update, where=state.finite)

    def update(self) -> None:
        """End the step on the device: back off after an overflow, grow after enough clean steps. Never synchronizes.

        Raises:
            ScalerProtocolError: No ``unscale_and_check`` since the previous ``update()``.
        """

        with self._step.lock.turn, self._step.admit():
            self._step.require_gradients()
            self._step.updating()
            self._state.update()
            self._step.close()

    def had_overflow(self) -> bool:
        """Return True if the current step (or, after ``update()``, the last step) overflowed (synchronizes)."""
        return bool(self._snapshot()[1])

    def nonfinite_gradients(self) -> list[Hashable]:
        """Return which gradients held inf/nan in the current (or last) step, as GradScaler does (synchronizes)."""
        epoch = self._snapshot()[3]

        def read(record: CallRecord) -> tuple[int, ...]:
            if record.culprits is not None or record.state is None:
                return record.culprits or ()
            return record.state.culprits(record.plan, epoch)

        return self._scaling.culprit_labels(read)

    def stats(self) -> GradScalerStats:
        """Return a snapshot of the scale and counters (synchronizes)."""
        state, overflow, local, _ = self._snapshot()
        return GradScalerStats.of(state, True, overflow, local)

    def _resumable(self) -> tuple[ScalerConfig, ScalerState, bool, bool, bool]:
        state, overflow, local, _ = self._snapshot()
        return self.config, state, True, overflow, local

    def _journaled(self) -> StateSet:
        return self._scaling

    def load_checkpoint(self, checkpoint: GradScalerCheckpoint) -> None:
        """Replace the whole state and configuration with a checkpoint's, in place (synchronizes).

        The state keeps its memory, so CUDA graphs captured before go on with the loaded state.

        Raises:
            ArgumentTypeError: ``checkpoint`` is not a GradScalerCheckpoint.
            ConfigError: The checkpoint is of a disabled scaler (a sync-free scaler is always enabled).
            ScalerProtocolError: A step is open.
        """
        expect_checkpoint(checkpoint)
        if not checkpoint.enabled:
            raise ConfigError(
                "This checkpoint is of a disabled scaler; a SyncFreeGradScaler is always enabled. Load it into a "
                "GradScaler, or train without a scaler."
            )

        with self._step.lock.turn, self._step.admit():
            self._step.require_idle("load_checkpoint() cannot replace the state")
            config, (state, overflow, local, *_) = self.config, self._state.snapshot()
            entries, names = self._scaling.journal(), (self._scaling.records, self._numerics_source, self._loaded_names)
            try:
                self._scaling.restore(
                    checkpoint.config(), checkpoint.state(), checkpoint.found_overflow, checkpoint.found_overflow_local
                )
                self._scaling.load_journal(checkpoint.journal_entries())
                # The loaded state's last step is not the one reported; its names are the checkpoint's.
                self._scaling.records, self._numerics_source, self._loaded_names = (), None, checkpoint.journal_names
            except BaseException:  # a load that failed part way leaves the state it found
                self._scaling.restore(config, state, overflow, local)
                self._scaling.load_journal(entries)
                self._scaling.records, self._numerics_source, self._loaded_names = names
                raise

    def __repr__(self) -> str:
        config = self.config
        return (
            f"SyncFreeGradScaler(state {where(self._state.device)}, growth_factor={config.growth_factor!r}, "
            f"backoff_factor={config.backoff_factor!r}, growth_interval={config.growth_interval}, "
            f"min_scale={config.min_scale!r}, max_scale={config.max_scale!r}, hysteresis={config.hysteresis}"
            f"{'' if config.rule == PYTORCH else f', rule={config.rule!r}'})"
        )
