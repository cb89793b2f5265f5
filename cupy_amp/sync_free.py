"""SyncFreeGradScaler: a loss scaler whose step never waits for the GPU, and can be captured in a CUDA graph."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import numpy as np

from cupy_amp import numpy_backend
from cupy_amp.checkpoint import GradScalerCheckpoint, expect_checkpoint
from cupy_amp.distributed import (
    OverflowVote,
    overflow_vote_for,
    require_sums,
    sums_after_failure,
    vote_after_failure,
)
from cupy_amp.errors import (
    ArgumentTypeError,
    CommunicatorError,
    ConfigError,
    GradientTypeError,
    GradientValueError,
    ScalerProtocolError,
)
from cupy_amp.gradients import Call, CallCache, GradientSet, StepClaims, parse_gradients, parse_loss
from cupy_amp.rule import ScalerConfig, ScalerState, initial_state
from cupy_amp.scaler import GradScalerStats
from cupy_amp.statistics import GradientStats, expect_max_norm
from cupy_amp.step_order import CHECKED, IDLE, StepOrder, refuse_after_check, refuse_second_check

__all__ = ["SyncFreeGradScaler"]


class _Record(NamedTuple):
    """One ``unscale_and_check`` call of a step, kept to answer ``nonfinite_gradients``."""

    call: Call | None  # None for a call that failed before its arrays were known
    culprits: tuple[int, ...] | None  # known at once on the host; None: read from the device when asked


class SyncFreeGradScaler:
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
    ) -> None:
        config = ScalerConfig(growth_factor, backoff_factor, growth_interval, min_scale, max_scale, hysteresis)
        self._config = config
        state = initial_state(config, init_scale)
        # Host state until the first array shows where the state belongs (_state_for).
        self._state: Any = numpy_backend.HostState(config, state, False, False, 0)
        self._bound: types.ModuleType | None = None  # the backend the state belongs to, once known
        self._vote: OverflowVote | None = overflow_vote_for(comm)
        self._order = StepOrder()
        self._claims: StepClaims | None = None
        self._records: list[_Record] = []
        self._cache = CallCache()
        self._bad_votes_reported = 0
        self._checked_read_only = False  # this step's gradients went through check(), not unscale_and_check()

    @classmethod
    def guard(cls) -> SyncFreeGradScaler:
        """Return a scaler whose scale stays 1: the inf/nan check, skip and clipping of ``check()`` without scaling.

        For bfloat16 (or float32) training, which needs no loss scaling but must
        still skip a step whose gradients hold inf/nan. Skipped steps are counted as usual.
        """
        return cls(init_scale=1.0, min_scale=1.0, max_scale=1.0)

    @property
    def config(self) -> ScalerConfig:
        """The immutable configuration (never synchronizes)."""
        return self._config

    def prepare(self, gradients: Any) -> GradientSet:
        """Place the state beside ``gradients``, load every kernel, and return them as a :class:`GradientSet`.

        Call it before capturing a step in a CUDA graph (a capture can neither
        allocate the state nor build the gradients' device tables): pass the
        returned set to ``unscale_and_check`` inside the capture.

        Raises:
            As ``unscale_and_check`` does for bad gradients.
        """
        gradient_set = gradients if type(gradients) is GradientSet else GradientSet(gradients)
        with self._order:
            call = parse_gradients(gradient_set, one_device=True, in_place=False)  # for check() too
            if call.backend is not None:
                self._state_for(call.backend, call.footprints[0].device).prepare(call)
        return gradient_set

    def _state_for(self, backend: types.ModuleType, device: int) -> Any:
        """Return the state for arrays of ``backend`` on ``device``, moving it there if it has met no array yet."""
        if self._bound is None:
            if backend is not numpy_backend:
                if self._order.phase == CHECKED:
                    raise ScalerProtocolError(
                        "This step's first unscale_and_check() had no arrays, so its verdict lives on the host; the "
                        "state cannot move to the GPU in the middle of the step. Pass the GPU arrays (or call "
                        "prepare(gradients)) before the step's first unscale_and_check()."
                    )
                backend.refuse_capture("the scaler's state is first placed on the GPU")
                self._state = backend.DeviceState(device, self._config, *self._state.snapshot()[:4])
            self._bound = backend
        elif backend is not self._bound:
            raise GradientTypeError(
                f"This scaler's state is {_where(self._state.device)}, so it takes {self._bound.NAME} arrays; "
                f"got {backend.NAME} arrays. Use one scaler per kind of array."
            )
        elif device != self._state.device:
            raise GradientValueError(
                f"This scaler's state is {_where(self._state.device)}; got arrays on device {device}. A sync-free "
                f"scaler works on one device (one scaler per device, with a communicator across them)."
            )
        return self._state

    def _snapshot(self) -> tuple[ScalerState, bool, bool, int]:
        """Read the state (synchronizes); raise if an all-reduce answered garbage since the last read.

        Raises:
            CommunicatorError: Some vote's answer was no maximum of the ranks' flags (those steps were skipped).
        """
        state, overflow, local, epoch, bad_votes = self._state.snapshot()
        if bad_votes > self._bad_votes_reported:
            count, self._bad_votes_reported = bad_votes - self._bad_votes_reported, bad_votes
            raise CommunicatorError(
                f"{count} all-reduce(s) answered something impossible (no maximum of the ranks' 0/1 flags for "
                "unscale_and_check, no count of ranks with inf/nan for check): the communicator did not run the "
                "expected reduction. Those steps counted as overflows."
            )
        return state, overflow, local, epoch

    def scale_factor(self) -> float:
        """Return the current scale (synchronizes: it lives on the device)."""
        return float(self._snapshot()[0].scale)

    def scale_loss(self, loss: Any) -> None:
        """Multiply ``loss`` in place by the scale, read on the device; this opens a step. Never synchronizes.

        Raises:
            GradientTypeError, GradientValueError: As :meth:`GradScaler.scale_loss`, or
                a loss not where the scaler's state is.
            ScalerProtocolError: The previous step's gradients were unscaled but ``update()`` was not called.
        """
        backend, array = parse_loss(loss)
        with self._order:
            self._order.check_scale_loss()
            state = self._state_for(backend, backend.location(array)[1])
            self._order.scale_loss()
            state.scale_loss(array)

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
            As :meth:`GradScaler.unscale_and_check`; also GradientValueError for
            arrays on a device other than the state's, and ScalerProtocolError for
            gradients not yet prepared while a CUDA graph is being captured.
        """
        with self._order:
            refuse_after_check(self._checked_read_only)
            vote = self._vote
            try:
                call = parse_gradients(gradients, self._cache, one_device=True)
                state = (
                    self._state if call.backend is None else self._state_for(call.backend, call.footprints[0].device)
                )
                claims = self._claims if self._claims is not None else StepClaims()
                claims.claim(call)
            except BaseException as error:
                if vote is not None:
                    # The other ranks wait in this call's vote: vote "overflow", so every rank skips this step.
                    self._fail_call(None, vote, error)
                raise
            return self._run(state, call, claims, vote)

    def check(self, gradients: Any, *, max_norm: float | None = None) -> GradientStats:
        """Read every gradient once, without writing it: the verdict, the culprits, the norm and the clip coefficient.

        The read-only alternative to ``unscale_and_check`` for the fused
        optimizers of :mod:`cupy_amp.optim`, which unscale, clip and skip inside
        their update from the returned record. One fused kernel launch per
        dtype, then one small launch that sums the blocks' sums in a fixed
        order and computes the L2 norm of the unscaled gradients and
        ``min(1, max_norm / (norm + 1e-6))`` on the device. Never synchronizes;
        the returned arrays live in the scaler's record (reading one waits).
        It must be the step's only gradient call; bfloat16 gradients are accepted.

        With a communicator, one SUM all-reduce, queued on the stream, carries
        the pair (ranks with inf/nan, sum of squares) between the two launches:
        the norm is global and the verdict the same on every rank (a rank's own
        overflow always counts; an impossible count is an overflow, raised as
        ``CommunicatorError`` at the next call that reads the state). A call that
        fails anywhere still joins the all-reduce, as an overflowed rank.

        Raises:
            ConfigError: ``max_norm`` is not None or a positive float32 number, or the
                communicator cannot sum (no ``reduce_sum``).
            ScalerProtocolError: Gradients were already checked or unscaled in this step.
            As ``unscale_and_check`` for bad gradients.
        """
        limit = expect_max_norm(max_norm)
        with self._order:
            refuse_second_check(self._claims is not None)
            vote = self._vote
            try:
                if vote is not None:
                    require_sums(vote)
                call = parse_gradients(gradients, self._cache, one_device=True, in_place=False)
                state = (
                    self._state if call.backend is None else self._state_for(call.backend, call.footprints[0].device)
                )
            except ConfigError:
                raise  # every rank refuses alike: nobody votes
            except BaseException as error:
                if vote is not None:
                    self._checked_read_only = True
                    self._fail_call(None, vote, error, sums_after_failure)
                raise
            self._checked_read_only = True
            voted = False
            try:
                self._open_checks(StepClaims())
                culprits = state.check(call, limit, vote is not None)
                if vote is not None:
                    state.vote_sums(vote)  # a vote that raises took no part: _fail_call joins for this rank
                    voted = True
                    state.finish_check(limit)
            except BaseException as error:
                self._fail_call(call, None if voted else vote, error, sums_after_failure)
                raise
            self._records.append(_Record(call, culprits))
            return state.stats.result  # type: ignore[no-any-return]

    def _open_checks(self, claims: StepClaims) -> None:
        """Begin the checks of a step: the host's bookkeeping first, then the state's flags."""
        self._order.phase = CHECKED
        self._records = []
        self._claims = claims
        self._state.begin_step()

    def _fail_call(
        self,
        call: Call | None,
        vote: OverflowVote | None,
        error: BaseException,
        join: Callable[[OverflowVote, BaseException], None] = vote_after_failure,
    ) -> None:
        """Count a failed call as an overflow of the step and, if ``vote`` was not cast yet, ``join`` it as one."""
        try:
            if self._order.phase != CHECKED:
                self._open_checks(StepClaims())
            self._records.append(_Record(call, ()))
            self._state.mark_overflow()
        finally:
            if vote is not None:
                join(vote, error)

    def _run(self, state: Any, call: Call, claims: StepClaims, vote: OverflowVote | None) -> Any:
        """Unscale a claimed call and queue its vote; any failure counts as an overflow of the step."""
        voted = False
        try:
            if self._claims is None:  # the step's first call
                self._open_checks(claims)
            culprits = state.unscale(call) if call.backend is not None else ()
            if vote is not None:
                state.vote(vote)  # a vote that raises took no part: _fail_call votes
                voted = True
                state.combine()
        except BaseException as error:
            self._fail_call(call, None if voted else vote, error)
            raise
        self._records.append(_Record(call, culprits))
        return state.finite

    def apply_if_finite(self, targets: Any, updates: Any) -> None:
        """Copy each of ``updates`` into the matching array of ``targets``, only if the step's gradients were finite.

        One elementwise kernel per pair, gated by the verdict on the device:
        after an overflow nothing is written. Never synchronizes.

        Raises:
            ArgumentTypeError: ``targets`` and ``updates`` differ in length.
        """
        targets, updates = list(targets), list(updates)
        if len(targets) != len(updates):
            raise ArgumentTypeError(
                f"apply_if_finite expected as many updates as targets, got {len(updates)} and {len(targets)}."
            )
        state = self._state
        copyto = np.copyto if isinstance(state.finite, np.ndarray) else sys.modules["cupy"].copyto
        state.follow()  # after the state's last work, whichever stream that was on
        for target, update in zip(targets, updates):
            copyto(target, update, where=state.finite)

    def update(self) -> None:
        """End the step on the device: back off after an overflow, grow after enough clean steps. Never synchronizes.

        Raises:
            ScalerProtocolError: No ``unscale_and_check`` since the previous ``update()``.
        """
        with self._order:
            self._order.require_checked()
            self._state.update()
            self._order.phase = IDLE
            self._claims = None
            self._checked_read_only = False

    def had_overflow(self) -> bool:
        """Return True if the current step (or, after ``update()``, the last step) overflowed (synchronizes)."""
        return bool(self._snapshot()[1])

    def nonfinite_gradients(self) -> list[Hashable]:
        """Return which gradients held inf/nan in the current (or last) step, as GradScaler does (synchronizes)."""
        state, records = self._state, self._records  # records are replaced, never changed, by a new step
        epoch = self._snapshot()[3]
        found: list[Hashable] = []
        for record in records:
            if record.call is None:
                continue
            culprits = record.culprits if record.culprits is not None else state.culprits(record.call, epoch)
            found += [record.call.labels[position] for position in culprits]
        return found

    def stats(self) -> GradScalerStats:
        """Return a snapshot of the scale and counters (synchronizes)."""
        state, overflow, local, _ = self._snapshot()
        return GradScalerStats.of(state, True, overflow, local)

    def checkpoint(self) -> GradScalerCheckpoint:
        """Return the complete state, to resume bit for bit (synchronizes); loadable by either scaler.

        Raises:
            ScalerProtocolError: A step is open; take checkpoints after ``update()``.
        """
        with self._order:
            self._order.require_no_step("checkpoint() cannot capture a resumable state")
            state, overflow, local, _ = self._snapshot()
            return GradScalerCheckpoint.capture(
                self._config, state, enabled=True, found_overflow=overflow, found_overflow_local=local
            )

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
        with self._order:
            self._order.require_no_step("load_checkpoint() cannot replace the state")
            epoch = self._state.snapshot()[3]
            self._bad_votes_reported = 0  # restore() clears the state's count
            config = checkpoint.config()
            self._state.restore(
                config, checkpoint.state(), checkpoint.found_overflow, checkpoint.found_overflow_local, epoch
            )
            self._config = config
            self._records = []

    def __repr__(self) -> str:
        config = self._config
        return (
            f"SyncFreeGradScaler(state {_where(self._state.device)}, growth_factor={config.growth_factor!r}, "
            f"backoff_factor={config.backoff_factor!r}, growth_interval={config.growth_interval}, "
            f"min_scale={config.min_scale!r}, max_scale={config.max_scale!r}, hysteresis={config.hysteresis})"
        )


def _where(device: int) -> str:
    return "on the host" if device < 0 else f"on device {device}"
