"""GradScaler: the loss scaler a training loop talks to, and GradScalerStats, its snapshot."""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator
from typing import Any, NamedTuple

import numpy as np

from cupy_amp import journal as step_journal
from cupy_amp.checkpoint import GradScalerCheckpoint, expect_checkpoint
from cupy_amp.distributed import OTHERS, Communicator, communicator_for, impossible_answers, poisoned_error
from cupy_amp.errors import ConfigError, ScalerProtocolError
from cupy_amp.face import Face
from cupy_amp.gradient_call import GradientScope, unscale_call
from cupy_amp.gradients import CallCache, parse_gradients
from cupy_amp.rule import (
    PYTORCH,
    GradScalerStats,
    ScalerConfig,
    ScalerState,
    initial_state,
    next_state,
)
from cupy_amp.state import Call, Snapshot, State
from cupy_amp.state_set import GuardSet, StateSet
from cupy_amp.step import OPEN, UNSCALED, Step
from cupy_amp.validation import expect_bool

__all__ = ["GradScaler"]


class _Mirror(NamedTuple):
    """The host's copy of the scaler: replaced whole, so a reader without the lock sees one consistent value."""

    config: ScalerConfig
    state: ScalerState
    enabled: bool
    step: int = 0  # the step (Step.number) whose update() made this state


_ONE_DEVICE = "With a communicator, every gradient of a call must be on one device (the communicator's)"

# A disabled scaler's guard: scale 1 that never moves, and steps that count for nothing.
_GUARD = ScalerConfig(min_scale=1.0, max_scale=1.0)


class GradScaler(Face):
    """Dynamic loss scaler with PyTorch-exact numerics for NumPy and CuPy arrays.

    A step is: ``scale_loss(loss)`` (once per loss; a step opens at the
    first call, and a gradient call without one is refused), the backward
    pass, one or more ``unscale_and_check(gradients)`` calls on disjoint
    gradients, the optimizer step if they all returned True, then
    ``update()``. Calls on one scaler from several threads are serialized.

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
            and ``scale_factor()`` is 1.0; a step then needs no ``scale_loss``.
        min_scale: Floor after a backoff (float32, >= SMALLEST_SCALE), or None for none.
        max_scale: Ceiling after a growth (float32, >= min_scale), or None for none.
        hysteresis: Overflowing steps before a backoff, an int >= 1 (refilled on growth).
        comm: For multi-process training: a CuPy NCCL communicator
            (``cupyx.distributed.NCCLBackend`` or ``cupy.cuda.nccl.NcclCommunicator``)
            or any :class:`~cupy_amp.distributed.Communicator`. Every gradient
            call then joins one SUM all-reduce of (overflowed ranks, sum of
            squares) before its verdict is read, so all ranks skip and adapt
            together. Every rank must make the same calls (``scale_loss``
            included) and agree on ``enabled`` (a rank without gradients passes
            an empty list); a call whose arguments fail on one rank, whatever the
            reason, still joins as an overflowed rank, so every rank skips that
            step. A call the call order refuses (no ``scale_loss`` in the step) is
            refused alike on every rank and joins nothing. A call interrupted
            inside its all-reduce poisons the scaler on every rank
            (:mod:`cupy_amp.distributed`).
        journal: Steps the step journal keeps (:meth:`journal`), an int from 0 (none) to
            :data:`cupy_amp.journal.MAX_CAPACITY`. Once this scaler has states in several places
            (arrays on several devices of one process, or NumPy and CuPy arrays), its steps are left
            out of the journal: each state saw only its own arrays.
        rule: ``"pytorch"`` (the default: PyTorch's rule, bit for bit) or ``"headroom"``,
            which moves the scale from where overflows happened and how ``check()``'s norm
            moved since (:func:`cupy_amp.rule.headroom_state` gives its exact formula):
            from a start far too low or too high it finds the scale in a few steps, and it
            climbs back as the norm falls. It needs ``hysteresis=1``.

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
        journal: int = step_journal.DEFAULT_CAPACITY,
        rule: str = PYTORCH,
    ) -> None:
        config = ScalerConfig(growth_factor, backoff_factor, growth_interval, min_scale, max_scale, hysteresis, rule)
        state = initial_state(config, init_scale)
        self._mirror = _Mirror(config, state, expect_bool(ConfigError, "enabled", enabled))
        self._communicator: Communicator | None = communicator_for(comm)
        self._step = Step()
        self._cache = CallCache()  # gradient arguments seen before, so a repeated list skips validation
        capacity = step_journal.expect_capacity(journal)
        self._scaling = StateSet(config, state, one_device=False, journal=capacity)
        self._guard = GuardSet(_GUARD, initial_state(_GUARD, 1.0), one_device=False)  # the null lane, while disabled
        # (mirror, verdict, journals) from before a change of the scaling states that has not been seen through:
        # the next use of the states sets them from the mirror first (_repair); a load's journals (the old, the
        # new) go with the mirror that was kept.
        self._unsure: tuple[_Mirror, tuple[bool, bool], tuple[np.ndarray, np.ndarray] | None] | None = None

    @classmethod
    def with_params(
        cls, init_scale: float, growth_factor: float, backoff_factor: float, growth_interval: int
    ) -> GradScaler:
        """Build a scaler from the four classic parameters; the rest keep their defaults."""
        return cls(init_scale, growth_factor, backoff_factor, growth_interval)

    @property
    def config(self) -> ScalerConfig:
        """The immutable configuration (never synchronizes)."""
        return self._mirror.config

    @property
    def _lane(self) -> StateSet:
        """The states the calls use: the scaling ones, or the guard's while disabled."""
        return self._scaling if self._mirror.enabled else self._guard

    def _place(self, lane: StateSet, backend: Any, device: int) -> State:
        """Return ``lane``'s state for arrays of ``backend`` on ``device``, placed from the mirror on first use."""
        if lane is self._scaling:
            self._repair()

        def current() -> Snapshot:
            state = self._mirror.state if lane is self._scaling else lane.all()[0].snapshot()[0]
            return Snapshot(state, *lane.verdict, 0)

        return lane.place(backend, device, current, self._step.phase in OPEN)

    def scale_factor(self) -> float:
        """Return the factor ``scale_loss`` applies now: the scale, or 1.0 while disabled.

        Never synchronizes the device.
        """
        mirror = self._mirror
        self._step.refuse_if_broken()
        return mirror.state.scale if mirror.enabled else 1.0

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
        touches nothing and returns True (False once a call of the same step
        failed part way, which counts as an overflow). If the call fails once arrays may have
        been written (a device error, an interrupt, a communicator error), the
        exception propagates and the call still counts, as an overflow: its
        gradients are refused if passed again in this step, and ``update()``
        backs off.

        Raises:
            ScalerProtocolError: No ``scale_loss`` in this step (scale not fixed at 1),
                or ``check()`` already read this step's gradients; nothing is touched.
            GradientTypeError: Not an iterable/mapping of supported float arrays,
                or NumPy and CuPy arrays mixed.
            GradientValueError: A read-only, misaligned or self-overlapping array;
                with a communicator, arrays on several devices.
            DuplicateGradientError: Two gradients share memory, or one was
                already unscaled in this step (also a ``RuntimeError``).
            CommunicatorError: The communicator failed or answered garbage.
        """

        with self._step.lock.turn, self._step.admit(), self._step.accounting():
            lane = self._lane  # under the lock: a set_enabled() served first is the one this call sees
            communicator = lane.unscale_collective(self._communicator)
            with self._step.gradient_call(UNSCALED, lane, communicator) as scope:
                call = parse_gradients(gradients, self._cache, one_device=_ONE_DEVICE if communicator else None)
                devices = lane.unscale_devices(call)
                state = self._place(lane, call.backend, devices[0])
                for device in devices[1:]:
                    self._place(lane, call.backend, device)  # each device's kernels read the scale from a state there
                self._step.open_call(scope, call, state)
                if len(devices) > 1:
                    culprits = self._unscale_on_each_device(lane, call, scope)
                else:
                    culprits = self._settle(lane, state, call, unscale_call(call, state, scope))
                self._step.record_call(scope, culprits)
            return not lane.verdict[0]

    def _unscale_on_each_device(self, lane: StateSet, call: Call, scope: GradientScope) -> tuple[int, ...]:
        """Unscale a call whose gradients are on several devices (never with a communicator), then read each verdict.

        Each device's groups are launched on that device, with the state placed
        there (the kernels read the scale and the epoch from it); every launch
        is queued before the first verdict is read. Returns the positions of
        the gradients that held inf/nan, over the whole call.
        """
        queued = []
        for device in call.devices:
            part, state = call._replace(plan=tuple(g for g in call.plan if g.device == device)), lane.states[device]
            queued.append((part, state, unscale_call(part, state, scope)))
        return tuple(sorted(p for part, state, culprits in queued for p in self._settle(lane, state, part, culprits)))

    def _settle(self, lane: StateSet, state: State, call: Call, culprits: tuple[int, ...] | None) -> tuple[int, ...]:
        """Wait for a call's verdict; return the positions of its gradients that held inf/nan.

        Raises:
            RanksMayDisagreeError: An all-reduce answered a poisoned vote (the scaler refuses from now on).
            CommunicatorError: The state counted an impossible all-reduce answer (the step is an overflow).
        """
        verdict = state.read()
        lane.found(verdict.overflow, verdict.local, verdict.norm)
        if verdict.poisoned:
            raise poisoned_error(OTHERS)
        new_bad_votes = state.new_bad_votes(verdict.bad_votes)
        if new_bad_votes:
            raise impossible_answers(new_bad_votes)
        if culprits is None:
            culprits = state.culprits(call.plan, verdict.epoch) if verdict.local else ()
        return culprits

    def _host_finite(self, lane: StateSet) -> Any:
        return lane.finite  # the verdict as the host read it

    def update(self) -> None:
        """End the step: back off after an overflow, grow after enough clean steps.

        Never synchronizes the device. On the GPU the next step begins in the
        same launch. Disabled: no-op.

        Raises:
            ScalerProtocolError: No ``unscale_and_check`` since the previous ``update()``, or the
                current stream is capturing a CUDA graph (nothing is changed).
        """

        with self._step.lock.turn, self._step.admit():
            lane = self._lane
            if lane.capturing():  # a replay would apply the rule where the host mirror never sees it
                raise ScalerProtocolError(
                    "GradScaler.update() cannot be captured in a CUDA graph: this scaler keeps its state on the "
                    "host too, which a replay would leave behind. Capture the step with a SyncFreeGradScaler."
                )
            if self._mirror.enabled:  # disabled, update() ends the step on the null lane, without the rule
                self._step.require_gradients()
                self._step.updating()
                self._repair()
                mirror = self._mirror
                if mirror.step != self._step.number:  # not applied yet (a retry after an interrupt may find it was)
                    state = next_state(mirror.config, mirror.state, *lane.verdict, lane.norm)
                    with self._states_follow_the_mirror():
                        lane.update(state, self._step.number)
                        self._mirror = mirror._replace(state=state, step=self._step.number)
            else:
                lane.update(self._mirror.state, self._step.number)  # GuardSet: its records say "skip" again
            self._step.close()

    def had_overflow(self) -> bool:
        """Return True if the current step (or, after ``update()``, the last step) overflowed.

        Stays valid after ``update()`` until the next step's first
        ``unscale_and_check``, so a learning-rate schedule can skip with the
        optimizer. While disabled, a step records nothing: this keeps the
        answer of the last enabled step (a disabled ``check()``'s ``finite``
        says whether the optimizer skipped). Never synchronizes the device.
        """
        self._step.refuse_if_broken()
        return self._scaling.verdict[0]

    def nonfinite_gradients(self) -> list[Hashable]:
        """Return which gradients held inf/nan in the current (or last) step.

        For each ``unscale_and_check`` call of the step, in call order, the
        positions of the offending gradients within that call's argument
        (``None`` entries count) or their names when a mapping was passed.
        Empty when the step was clean. Never synchronizes the device.
        """
        self._step.refuse_if_broken()
        return self._scaling.culprit_labels(lambda record: record.culprits or ())

    def set_enabled(self, enabled: bool) -> None:
        """Turn scaling on or off between steps.

        Raises:
            ConfigError: ``enabled`` is not a bool.
            ScalerProtocolError: Switching while a step is open (from ``scale_loss``
                or ``unscale_and_check`` to ``update()``).
        """
        flag = expect_bool(ConfigError, "enabled", enabled)
        with self._step.lock.turn, self._step.admit():
            if flag != self._mirror.enabled:
                self._step.require_idle("set_enabled() cannot switch the scaler")
            self._mirror = self._mirror._replace(enabled=flag)

    def is_enabled(self) -> bool:
        """Return whether scaling is on."""
        self._step.refuse_if_broken()
        return self._mirror.enabled

    def stats(self) -> GradScalerStats:
        """Return a snapshot of the scale and counters (never synchronizes)."""
        self._step.refuse_if_broken()
        # The state is immutable: a consistent read without the lock, even from a signal handler.
        mirror = self._mirror
        return GradScalerStats.of(mirror.state, mirror.enabled, *self._scaling.verdict)

    def _resumable(self) -> tuple[ScalerConfig, ScalerState, bool, bool, bool]:
        mirror = self._mirror
        return mirror.config, mirror.state, mirror.enabled, *self._scaling.verdict

    def _journaled(self) -> StateSet:
        self._repair()
        return self._scaling

    def load_checkpoint(self, checkpoint: GradScalerCheckpoint) -> None:
        """Replace the whole state and configuration with a checkpoint's.

        Raises:
            ArgumentTypeError: ``checkpoint`` is not a GradScalerCheckpoint.
            ScalerProtocolError: A step is open (the loss was scaled with the old scale).
        """
        expect_checkpoint(checkpoint)
        with self._step.lock.turn, self._step.admit():
            self._step.require_idle("load_checkpoint() cannot replace the state")
            mirror = _Mirror(checkpoint.config(), checkpoint.state(), checkpoint.enabled, self._step.number)
            journals = (self._journaled().journal(), checkpoint.journal_entries()) if self._scaling.capacity else None
            with self._states_follow_the_mirror(journals):
                overflow, local = checkpoint.found_overflow, checkpoint.found_overflow_local
                self._scaling.restore(mirror.config, mirror.state, overflow, local)
                if journals is not None:
                    self._scaling.load_journal(journals[1])
                self._mirror, self._scaling.records, self._numerics_source, self._loaded_names = (
                    mirror, (), None, checkpoint.journal_names,
                )  # fmt: skip

    @contextlib.contextmanager
    def _states_follow_the_mirror(self, journals: tuple[np.ndarray, np.ndarray] | None = None) -> Iterator[None]:
        """Run a change of the scaling states and the mirror; if it fails part way, set the states from the mirror.

        The mirror changes in one assignment, last: after an interrupt the
        states hold what the mirror says (the old state, or the new one if the
        mirror was replaced), with the step's verdict as it was. Until they
        are known to, every use of the states repairs them first
        (:meth:`_repair`): a second interrupt inside the repair cannot leave
        a device state ahead of the mirror for a later call to use.
        """
        self._unsure = (self._mirror, self._scaling.verdict, journals)  # first
        try:
            yield
        except BaseException:
            self._repair()
            raise
        self._unsure = None

    def _repair(self) -> None:
        """Set the scaling states from the mirror if a change of them may have stopped part way (synchronizes)."""
        if self._unsure is None:
            return
        before, verdict, journals = self._unsure
        mirror = self._mirror  # replaced last: if it was, the states were already changed whole
        if mirror is before:  # the rule may run again (a retried update()) on the step as it was
            self._scaling.restore(mirror.config, mirror.state, *verdict, reopen=True)
            # Its journal entry needs the culprits, which the device's folded begin may have cleared.
            self._scaling.keep_culprits(*self._scaling.culprit_summary())
        else:
            self._scaling.restore(mirror.config, mirror.state, *self._scaling.verdict)
        if journals is not None:
            self._scaling.load_journal(journals[0] if mirror is before else journals[1])
        self._unsure = None

    def __repr__(self) -> str:
        mirror = self._mirror
        config = mirror.config
        return (
            f"GradScaler(scale={mirror.state.scale:g}, growth_factor={config.growth_factor!r}, "
            f"backoff_factor={config.backoff_factor!r}, growth_interval={config.growth_interval}, "
            f"enabled={mirror.enabled}, min_scale={config.min_scale!r}, max_scale={config.max_scale!r}, "
            f"hysteresis={config.hysteresis}"
            f"{'' if config.rule == PYTORCH else f', rule={config.rule!r}'})"
        )
