"""What both scaler faces do in the same words: scale the loss, check, checkpoint, the report, the guard, step()."""

from __future__ import annotations

import functools
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np

from cupy_amp import journal as step_journal
from cupy_amp.checkpoint import GradScalerCheckpoint
from cupy_amp.distributed import Communicator
from cupy_amp.errors import ArgumentTypeError, ConfigError, ScalerProtocolError
from cupy_amp.gradient_call import check_call
from cupy_amp.gradients import CallCache, parse_gradients, parse_loss
from cupy_amp.record import GradientStats
from cupy_amp.rule import ScalerConfig, ScalerState
from cupy_amp.state import Call, State
from cupy_amp.state_set import StateSet
from cupy_amp.statistics import GradientNumerics, expect_max_norm
from cupy_amp.step import IDLE, INSPECTED, Step
from cupy_amp.validation import expect_bool

__all__ = ["Face", "NumericsSource"]

F = TypeVar("F", bound="Face")

# PyTorch's GradScaler calls a user brings across, and what does their job here.
_TORCH_NAMES = {
    "scale": "scale_loss(loss), which scales a float32 array in place (PyTorch's scale(loss) returns a new tensor)",
    "get_scale": "scale_factor()",
    "unscale_": "unscale_and_check(gradients) (or check(gradients) with the optimizers of cupy_amp.optim)",
    "state_dict": "checkpoint(), the whole state (checkpoint().to_torch_state_dict() gives PyTorch's five keys, "
    "without the clamps, hysteresis and counters a resume needs)",
    "load_state_dict": "load_checkpoint(checkpoint) (from PyTorch: GradScalerCheckpoint.from_torch_state_dict(sd))",
    "get_growth_factor": "config.growth_factor",
    "get_backoff_factor": "config.backoff_factor",
    "get_growth_interval": "config.growth_interval",
}
_ONE_DEVICE = "check() takes the gradients of one device (its norm is summed on that device): use one scaler per device"


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
    """The calls :class:`~cupy_amp.GradScaler` and :class:`~cupy_amp.SyncFreeGradScaler` share word for word.

    Each face sets ``_step``, ``_communicator``, ``_cache`` and ``_scaling`` (the states whose records, verdict
    and journal the scaler reports) and supplies the hooks below; what differs
    between them is where the verdict is read (the synchronous face reads it after each call) and what the
    host keeps.
    """

    _numerics_source: NumericsSource | None = None  # the last check(report=True), replaced in one assignment
    _loaded_names: tuple[tuple[str, ...], ...] = ()  # what a loaded checkpoint's journal names, until a step runs
    _step: Step
    _communicator: Communicator | None
    _cache: CallCache
    _scaling: StateSet

    def __init__(self, init_scale: float, *, min_scale: float | None, max_scale: float | None) -> None:
        raise NotImplementedError  # each face has its own; declared for guard()

    @property
    def _lane(self) -> StateSet:
        """The states the calls use now."""
        raise NotImplementedError

    def _place(self, lane: StateSet, backend: Any, device: int) -> State:
        """Return ``lane``'s state for arrays of ``backend`` on ``device``, placing one there on first use."""
        raise NotImplementedError

    def _settle(
        self, lane: StateSet, state: State, call: Call, culprits: tuple[int, ...] | None
    ) -> tuple[int, ...] | None:
        """What follows a queued gradient call: the synchronous face reads the verdict; this one, nothing."""
        return culprits

    def _host_finite(self, lane: StateSet) -> Any:
        """The verdict array ``check()`` hands out, when the host keeps it (else the record's own)."""
        return None

    def _resumable(self) -> tuple[ScalerConfig, ScalerState, bool, bool, bool]:
        """(configuration, state, enabled, the last step's overflow, this rank's own), for ``checkpoint()``."""
        raise NotImplementedError

    def _journaled(self) -> StateSet:
        """The states whose journal is the scaler's (set right first, where a change of them may have stopped)."""
        raise NotImplementedError

    def journal(self) -> np.ndarray:
        """Return the step journal: what the last steps did and why, oldest first (reads the state: on the GPU,
        synchronizes).

        A NumPy structured array of :data:`cupy_amp.journal.ENTRY`, one entry
        per step the rule closed, up to the scaler's ``journal`` steps: the
        step's number, the scale it used and the one it left, this rank's
        verdict and the agreed one (``agreed``: the step was skipped), what the
        rule did (``action``, named in :data:`cupy_amp.journal.ACTIONS`), how
        many gradients held inf/nan here and the first of them
        (``culprit_call``, ``culprit``: see :meth:`journal_names`), and
        ``check()``'s norm and clip coefficient (NaN without ``check()``).
        Written on the device by the rule's own launch: keeping it costs no
        synchronization and is captured with a CUDA graph. Saved in
        ``checkpoint()``.
        """
        with self._step.lock.turn, self._step.admit():
            return self._journaled().journal()

    def journal_names(self) -> tuple[tuple[str, ...], ...]:
        """Return the names the journal's culprits refer to: for each gradient call of the latest step, in
        order, its gradients' positions or keys as strings (``journal_names()[culprit_call][culprit]``).

        Empty when that step passed more than :data:`cupy_amp.journal.MAX_NAMES`
        gradients; each name is cut to :data:`cupy_amp.journal.MAX_NAME_LENGTH` characters. After
        ``load_checkpoint``, the checkpoint's until the next step. Never synchronizes.
        """
        with self._step.lock.turn, self._step.admit():
            return self._names()

    def _names(self) -> tuple[tuple[str, ...], ...]:
        records = self._scaling.records
        return step_journal.names(record.labels for record in records) if records else self._loaded_names

    if not TYPE_CHECKING:  # hidden from type checkers, which would otherwise accept any attribute name

        def __getattr__(self, name: str) -> Any:
            """Name the cupy-amp call doing a PyTorch GradScaler method's job (only missing names get here)."""
            if name in _TORCH_NAMES:
                raise AttributeError(
                    f"{type(self).__name__} has no {name}() (PyTorch's GradScaler name): use {_TORCH_NAMES[name]}.",
                    name=name,
                    obj=self,
                )
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self)

    @classmethod
    def guard(cls: type[F]) -> F:
        """Return a scaler whose scale stays 1: the inf/nan check, skip and clipping of ``check()`` without scaling.

        For bfloat16 (or float32) training, which needs no loss scaling but must
        still skip a step whose gradients hold inf/nan. Skipped steps are counted as usual.
        Its steps need no ``scale_loss``: every scaler whose ``min_scale`` and
        ``max_scale`` are both 1 (so its scale is 1 for good) is exempt from that rule.
        """
        return cls(init_scale=1.0, min_scale=1.0, max_scale=1.0)

    def scale_loss(self, loss: Any) -> None:
        """Multiply ``loss`` by the scale in place, allocating no new array; this opens a step.

        Call it before the backward pass, which must start from the scaled
        loss: the gradient calls of a step refuse to run without it (unless
        the scale is fixed at 1: a guard, or a disabled ``GradScaler``).
        float32 losses are multiplied in float32, float64 losses in float64; a
        float16 loss is refused (times the scale it would be inf in float16;
        compute the loss in float32, as PyTorch's ``scale()`` promotes it), on
        every scaler, guards and disabled ones too, so that a loop does not
        break when scaling is turned on. Call it once per loss (several times
        per step with gradient accumulation). The argument is validated even
        while disabled; disabled, nothing else happens. Never synchronizes the
        device: on the GPU the kernel reads the scale where the state is.

        Raises:
            GradientTypeError: ``loss`` is not a NumPy/CuPy float32/64 array
                (float16 and bfloat16 losses are refused), or (sync-free) not
                of the kind of array the scaler's state is beside.
            GradientValueError: ``loss`` is read-only, misaligned or repeats elements, or
                (sync-free) on a device other than the state's.
            ScalerProtocolError: The previous step's gradients were unscaled but
                ``update()`` was not called.
        """
        backend, array = parse_loss(loss)
        with self._step.lock.turn, self._step.admit():
            self._step.refuse_scale_loss()
            lane = self._lane
            state = lane.loss_state(functools.partial(self._place, lane, backend, backend.location(array)[1]))
            self._step.scaled()  # also while disabled: enabling now would unscale a loss that was not scaled
            state.scale_loss(array)

    def abandon_step(self) -> None:
        """End a step whose backward pass failed: after ``scale_loss``, before any gradient call.

        For an exception or a Ctrl-C in the backward pass: the scale, the
        counters and the statistics records stay as they were before
        ``scale_loss`` (no step is counted), and ``checkpoint()`` works again.
        The step's scaled loss and whatever gradients its backward pass made
        must be thrown away (zero or clear them). Does nothing between steps.
        Never synchronizes the device.

        Raises:
            ScalerProtocolError: A gradient call of the step ran (the gradients were
                unscaled or checked, or such a call failed): call ``update()``, which
                ends the step (a failed call already counts it as an overflow).
        """
        with self._step.lock.turn, self._step.admit():
            self._step.abandon()

    def is_step_open(self) -> bool:
        """Return whether a step is open: ``scale_loss`` or a gradient call ran, and neither ``update()`` nor
        ``abandon_step()`` has ended it. Never synchronizes the device."""
        self._step.refuse_if_broken()
        return self._step.phase != IDLE

    def check(self, gradients: Any, *, max_norm: float | None = None, report: bool = False) -> GradientStats:
        """Read every gradient once, without writing it: the verdict, the culprits, the norm and the clip coefficient.

        The read-only alternative to ``unscale_and_check`` for the fused
        optimizers of :mod:`cupy_amp.optim`, which unscale, clip and skip inside
        their update from the returned record. It must be the step's only
        gradient call, on one device; bfloat16 gradients are accepted. With CuPy
        arrays: one fused kernel launch per dtype, then one small launch that
        sums the blocks' sums in a fixed order and computes, on the device, the
        L2 norm of the unscaled gradients and ``min(1, max_norm / (norm +
        1e-6))``. ``norm`` and ``clip_coefficient`` stay on the device (reading
        one waits). ``GradScaler`` then reads the verdict (one synchronizing
        read, as ``unscale_and_check`` reads its flag) and ``finite`` is a host
        bool array; ``SyncFreeGradScaler`` never synchronizes, and ``finite`` is
        its flag on the device.

        With a communicator, one SUM all-reduce carries the pair (ranks with
        inf/nan, sum of squares): every rank gets the global norm (of sharded
        gradients too) and the same verdict, and a rank's own overflow always
        counts. Every rank must call ``check()`` in the same steps; a call that
        fails anywhere still joins the all-reduce, as an overflowed rank. An
        impossible answer counts as an overflow and raises ``CommunicatorError``
        (``SyncFreeGradScaler``: at the next call that reads the state). A
        disabled ``GradScaler`` computes the statistics (all-reduce included)
        with no scale (inverse 1) and records nothing. A call that fails leaves
        every statistics record of the scaler saying "skip".

        With ``report=True`` the same read also takes a numerics report of
        this rank's gradients (the largest finite magnitude, the zeros and the
        subnormals of each), for :meth:`gradient_numerics`; the norm and the
        verdict are the same bits as without it.

        Raises:
            ConfigError: ``max_norm`` is not None or a positive float32 number, ``report`` is not
                a bool, or the communicator cannot sum (no ``reduce_sum``).
            ScalerProtocolError: No ``scale_loss`` in this step (scale not fixed at 1), or
                gradients were already checked or unscaled in this step; nothing is touched.
            GradientValueError: Gradients on several devices.
            CommunicatorError: The all-reduce failed or (``GradScaler``) answered an impossible count.
            As ``unscale_and_check`` for other bad gradients.
        """
        limit = expect_max_norm(max_norm)
        reporting = expect_bool(ConfigError, "report", report)
        with self._step.lock.turn, self._step.admit(), self._step.accounting():
            return self._check(gradients, limit, reporting)

    def _check(self, gradients: Any, limit: float, reporting: bool) -> GradientStats:
        """Run ``check()`` inside a call that holds the scaler (``check()``'s own, or ``step()``'s)."""
        lane = self._lane
        with self._step.gradient_call(INSPECTED, lane, self._communicator) as scope:
            scope.max_norm = limit
            call = parse_gradients(gradients, self._cache, one_device=_ONE_DEVICE, in_place=False)
            state = self._place(lane, call.backend, call.devices[0] if call.devices else -1)
            self._step.open_call(scope, call, state)
            culprits = self._settle(lane, state, call, check_call(call, state, scope, reporting))
            self._step.record_call(scope, culprits)
        number = self._step.number
        if reporting:  # with the culprits where the host knows them (a disabled GradScaler's records keep none)
            nonfinite = None if culprits is None else tuple(call.labels[position] for position in culprits)
            self._numerics_source = NumericsSource(number, call.labels, call.plan, state, nonfinite)
        stats = state.stats
        stats.record.completed(number)  # the record may be applied now: once by each optimizer
        finite = self._host_finite(lane)
        return GradientStats(
            stats.norm, stats.clip_coefficient, stats.factor, state.finite if finite is None else finite,
            stats.record, number,
        )  # fmt: skip

    def checkpoint(self) -> GradScalerCheckpoint:
        """Return the complete state, to resume bit for bit; either scaler loads it.

        It holds the step journal (:meth:`journal`), which it reads: on the GPU it
        synchronizes (``GradScaler`` with ``journal=0`` never does). ``SyncFreeGradScaler``'s
        also reads its state.

        Raises:
            ScalerProtocolError: A step is open; take checkpoints after ``update()``.
        """
        with self._step.lock.turn, self._step.admit():
            self._step.require_idle("checkpoint() cannot capture a resumable state")
            journaled = self._journaled()
            config, state, enabled, overflow, local = self._resumable()
            return GradScalerCheckpoint.capture(
                config, state, enabled=enabled, found_overflow=overflow, found_overflow_local=local,
                entries=journaled.journal() if journaled.capacity else None, names=self._names(),
            )  # fmt: skip

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
        # Under the scaler's lock: a check() of the next step in another thread cannot replace the
        # state's report between the test below and the read (rows of one step under another's labels).
        with self._step.lock.turn, self._step.admit():
            source, number = self._numerics_source, self._step.number
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

    def step(
        self, optimizer: Any, gradients: Any = None, *, max_norm: float | None = None, report: bool = False
    ) -> GradientStats:
        """Check ``gradients`` and apply ``optimizer``'s fused update from this check, in one call.

        ``check(gradients, max_norm=max_norm)`` followed by
        ``optimizer.step(gradients, stats)``: the update unscales and clips
        inside its pass and does nothing at all after an overflow. Call
        ``update()`` after it. ``optimizer`` is a :mod:`cupy_amp.optim`
        optimizer (``AdamW``, ``SGD``); ``gradients`` are its gradients, in its
        parameters' order (a ``GradientSet``, a mapping or any iterable too).
        Several optimizers in one step (a GAN, a multi-task model): pass a list
        of optimizers and a list of their gradients, one entry each; one
        ``check()`` reads them all (one norm over all of them, culprits named
        ``(optimizer's index, position or key)``), then each optimizer applies
        it to its own. Returns the step's statistics (``norm``,
        ``clip_coefficient``, ``factor``, ``finite``). Synchronizes as
        ``check()`` does. It is one call of the scaler: another thread's
        ``update()`` waits until every optimizer has applied the step. With a
        communicator, a failure after the check answered "apply" poisons the
        scaler (this rank's weights may differ from the others').

        With ``report``, the check also takes the numerics report
        (:meth:`gradient_numerics`).

        Raises:
            ArgumentTypeError: No gradients, or a list of optimizers without a list of as many gradient lists.
            As ``check()`` and the optimizers' ``step()``; gradients that do
            not fit an optimizer are refused before the check (the step stays
            open), and no optimizer is called when the check raises.
        """
        if gradients is None:
            raise ArgumentTypeError(
                f"{type(self).__name__}.step(optimizer, gradients) needs the gradients: cupy-amp's optimizers take "
                "them as an argument, in their parameters' order (PyTorch's find .grad on their parameters): "
                "scaler.step(optimizer, grads)."
            )
        limit = expect_max_norm(max_norm)
        reporting = expect_bool(ConfigError, "report", report)
        if not isinstance(optimizer, (list, tuple)):
            share = list(gradients) if isinstance(gradients, Iterator) else gradients  # read once, for both
            # One call: no other thread's update() between the check and the optimizer.
            with self._step.lock.turn, self._step.admit(), self._step.accounting():
                _expect_fits([optimizer], [share])  # after admit(): a poisoned scaler refuses first
                stats = self._check(share, limit, reporting)
                optimizer.step(_ordered(share), stats)
            return stats
        shares = [list(g) if isinstance(g, Iterator) else g for g in _shares(gradients, len(optimizer))]
        if len({id(each) for each in optimizer}) != len(optimizer):
            raise ArgumentTypeError(
                "step() got the same optimizer twice in its list: each optimizer applies a step once. Pass each "
                "optimizer once, with all of its gradients."
            )
        labelled: dict[Hashable, Any] = {}
        for index, share in enumerate(shares):
            entries = share.items() if isinstance(share, Mapping) else enumerate(share)
            labelled.update(((index, key), array) for key, array in entries)
        with self._step.lock.turn, self._step.admit(), self._step.accounting():
            _expect_fits(optimizer, shares)
            stats = self._check(labelled, limit, reporting)
            for each, share in zip(optimizer, shares):
                each.step(_ordered(share), stats)
        return stats


def _ordered(share: Any) -> Any:
    """An optimizer's gradients in its parameters' order (a mapping's values)."""
    return list(share.values()) if isinstance(share, Mapping) else share


def _expect_fits(optimizers: Sequence[Any], shares: list[Any]) -> None:
    """Ask every optimizer whether its gradients fit it, before the check (an optimizer of another kind may not
    say: it is then asked by its own step)."""
    for each, share in zip(optimizers, shares):
        expect = getattr(each, "expect_gradients", None)
        if expect is not None:
            expect(_ordered(share))


def _shares(gradients: Any, count: int) -> list[Any]:
    """Return the gradient lists of ``count`` optimizers, one entry each.

    Raises:
        ArgumentTypeError: ``gradients`` is not a list or tuple of ``count`` entries.
    """
    if not isinstance(gradients, (list, tuple)) or len(gradients) != count:
        got = f"{len(gradients)} entries" if isinstance(gradients, (list, tuple)) else type(gradients).__name__
        raise ArgumentTypeError(
            f"step() with a list of {count} optimizers takes a list of {count} gradient lists, one per optimizer "
            f"in the same order; got {got}."
        )
    return list(gradients)
