"""The fused optimizers' shared parts: one pass that unscales, clips, skips and updates, without writing the
gradients. Each optimizer is a file of its own (:mod:`cupy_amp.optim.adamw`, :mod:`cupy_amp.optim.sgd`) that
names its state file layout, its hyperparameters and its NumPy reference.

Each optimizer owns its float32 state: master weights for float16/bfloat16
parameters (written back rounded in the same pass), moments, and a small
record (hyperparameters, step counter, this step's constants) that lives on the
device for CuPy parameters. ``step(gradients, stats)`` reads the gradient
factor (``inv_scale * clip_coefficient``) and the skip flag from the record a
scaler's ``check()`` returned, so a step needs no value from the host: it can
run ahead of the GPU and be captured in a CUDA graph. On the host (NumPy) the
same operations run in each optimizer's twin (:mod:`cupy_amp.twins.adamw`...), bit for bit.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import numpy as np

from cupy_amp.call_lock import CallLock
from cupy_amp.dtypes import dtype_name
from cupy_amp.errors import (
    ArgumentTypeError,
    ConfigError,
    ScalerProtocolError,
)
from cupy_amp.optim import arguments, state_file
from cupy_amp.record import GradientStats, StatsRecord

__all__ = ["FusedOptimizer", "hyperparameter"]


class _Missing:
    """The default of an argument that must be given: its absence gets an error that says what to pass."""


_MISSING = _Missing()


def hyperparameter(name: str, value: object, field: str) -> float:
    """Return ``value`` as a float if it lies in the state files' range for ``field``; ``name`` is the argument's."""
    ok = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, (bool, np.bool_))
    number = float(value) if ok and state_file.finite(value) else math.nan  # type: ignore[arg-type]
    allowed = state_file.RANGES[field]
    if not (math.isfinite(number) and allowed.admits(number)):
        raise ConfigError(f"Invalid {name!r}: expected {allowed.describe()}, got {value!r}.")
    return number


class FusedOptimizer:
    """What AdamW and SGD share: parameters, buffers, the record, tables, the step and state files.

    A step, a save and a load each happen whole or not at all, even when
    interrupted (KeyboardInterrupt) or failing half-way: everything that can
    fail runs before the first write, and a call interrupted while it writes
    (the parameters, the buffers, the device's launches) leaves the optimizer
    torn: ``step`` and ``save``/``state_dict`` then raise ScalerProtocolError
    until a ``load``/``load_state_dict`` succeeds. Calls from several threads
    take turns; a call made while another runs on the same thread (a signal
    handler's save during a step) raises ScalerProtocolError instead of
    waiting for itself forever.
    """

    layout: ClassVar[state_file.Layout]  # what it keeps: its record's fields and its buffers (its state files')

    def __init__(self, params: Iterable[Any], hyperparameters: dict[str, float]) -> None:
        self._params = list(params)
        if not self._params:
            raise ArgumentTypeError(f"{type(self).__name__} expected a non-empty list of parameters, got none.")
        self._xp, self._device = arguments.expect_params(self._params)
        xp = self._xp
        with self._on_device():  # the buffers live beside the parameters, whichever device is current
            self._masters = [xp.array(p, dtype=np.float32) if p.dtype != np.float32 else None for p in self._params]
            self._buffers = {
                name: [xp.zeros(p.shape, dtype=np.float32) if self._has(name) else None for p in self._params]
                for name in self.layout.moments
            }
        self._lock = CallLock()
        self._torn: str | None = None  # what was interrupted while writing, until a load succeeds
        self._record = np.zeros((), dtype=self.layout.record_dtype)  # the host's copy (the NumPy path's only one)
        for name, value in hyperparameters.items():
            self._record[name] = value
        for power, _ in self.layout.powers:
            self._record[power] = 1.0
        self._device_record: Any = None
        self._tables: Any = None
        self._table_key: tuple[int, ...] | None = None
        self._captured: list[Any] = []  # every table list a CUDA graph capture used, kept while graphs may replay
        self._stream: Any = None  # where the last step was queued: a step on another stream waits for it
        self._last_applied: StatsRecord | None = None  # a load lets this optimizer apply its record again
        if self._device >= 0:
            from cupy_amp.gpu import optimizer_launches as launches

            self._backend = launches
            launches.load_optimizer(self.layout.kind, self._device)
            with xp.cuda.Device(self._device):
                self._device_record = xp.zeros(self.layout.record_dtype.itemsize, dtype=np.uint8)
            self._push_record()

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        """Make the parameters' device current (nothing to do on the host)."""
        if self._device < 0:
            return contextlib.nullcontext()
        device: contextlib.AbstractContextManager[Any] = self._xp.cuda.Device(self._device)
        return device

    def _begin(self, record: np.ndarray, skip: bool, factor: np.float32) -> None:
        """Open a step on the host record (the reference's begin function)."""
        raise NotImplementedError

    def _update(self, record: np.ndarray, grad: np.ndarray, weights: np.ndarray, *moments: Any) -> None:
        """Apply an opened step to one parameter's float32 weights and moments (the reference's update)."""
        raise NotImplementedError

    def _has(self, buffer: str) -> bool:
        return True

    # Hyperparameters: the host copy and the device record agree after every change.

    def _push_record(self) -> None:
        """Copy the host record to the device (stream-ordered: steps queued before keep the old values)."""
        if self._device_record is not None:
            with self._xp.cuda.Device(self._device):
                self._device_record.set(np.frombuffer(self._record.tobytes(), dtype=np.uint8))

    def _pull_record(self) -> np.ndarray:
        """Return the current record (synchronizes on the GPU: the device owns the counters)."""
        if self._device_record is None:
            return self._record
        with self._xp.cuda.Device(self._device) as device:
            device.synchronize()  # steps may be queued on any stream
            return np.frombuffer(self._device_record.get().tobytes(), dtype=self.layout.record_dtype).reshape(())

    @property
    def lr(self) -> float:
        """The learning rate (never synchronizes). Setting it takes effect from the next step, also in CUDA graphs."""
        return float(self._record["lr"])

    @lr.setter
    def lr(self, value: float) -> None:
        lr = hyperparameter("lr", value, "lr")
        with self._lock.turn:
            self._refuse_reentry("lr")
            with self._lock.busy:
                self._set_lr(lr)

    def _set_lr(self, lr: float) -> None:
        if self._device_record is not None:
            self._backend.refuse_capture("a new learning rate is copied from the host")
            offset = self.layout.record_dtype.fields["lr"][1]  # type: ignore[index]
            target = self._device_record[offset : offset + 8]
            # After the steps queued so far (which keep the old value), whichever stream they are on.
            self._stream = self._backend.write_after(self._device, self._stream, target, np.array([lr], dtype="<f8"))
        self._record["lr"] = lr  # after the device's copy

    @property
    def step_count(self) -> int:
        """Updates applied so far; skipped steps do not count (synchronizes on the GPU)."""
        return int(self._pull_record()["step"])

    @property
    def params(self) -> list[Any]:
        """The parameters, in the order given."""
        return list(self._params)

    # One call at a time.

    def _refuse_reentry(self, name: str) -> None:
        """Refuse the call ``name`` from inside another call of this optimizer on the same thread."""
        self._lock.refuse_reentry(
            f"{type(self).__name__}.{name} was called while another call of this optimizer runs on the same "
            "thread (from a signal handler or a callback?); it would wait for that call forever. Call it after "
            "the running call returns (for a save on Ctrl-C: in an `except KeyboardInterrupt:` clause)."
        )

    def _refuse_torn(self, name: str) -> None:
        if self._torn is not None:
            raise ScalerProtocolError(
                f"{type(self).__name__}.{name} refused: {self._torn}, so the parameters and the optimizer's state "
                "may hold a partial update. Load a saved state with load() or load_state_dict() first (and, for "
                "float32 parameters, which the state does not hold, their values saved with it)."
            )

    # The step.

    def step(self, gradients: Sequence[Any], stats: GradientStats | _Missing | None = _MISSING) -> None:
        """Update every parameter from its gradient; do nothing at all if ``stats`` says the step overflowed.

        Each gradient is multiplied by ``stats``' factor (inverse scale times clip
        coefficient) inside the update and is only read. ``stats`` must be the
        result of this step's ``check()``: between it and the scaler's
        ``update()``, applied once by this optimizer. ``None``, passed
        explicitly, is for gradients no scaler touched: the factor is 1 and no
        step is skipped. ``scaler.step(optimizer, gradients)`` does the check
        and this step in one call. With CuPy arrays: a one-thread launch,
        then one launch per dtype, on the current stream; never synchronizes
        (the first step with new gradient buffers builds device tables and
        waits for their copy; in a CUDA graph capture, pass the same buffers as
        before the capture).

        Raises:
            ArgumentTypeError: ``gradients`` does not match the parameters, or
                ``stats`` is not the GradientStats of a check() on the same kind of array.
            GradientTypeError, GradientValueError: A gradient of another shape,
                dtype, device or layout than its parameter, or sharing memory with the optimizer's state.
            ScalerProtocolError: ``stats`` are of a step that ``update()`` closed, or
                this optimizer applied them already; an earlier step or load was
                interrupted while writing (until a load succeeds); or this thread is
                inside another call of this optimizer.
        """
        if isinstance(stats, _Missing):
            raise ArgumentTypeError(
                f"{type(self).__name__}.step(gradients, stats) needs stats: the GradientStats that this step's "
                "scaler.check(gradients) returned (scaler.step(optimizer, gradients) does both). Pass None only for "
                "gradients that no scaler scaled: nothing is then unscaled, clipped or skipped."
            )
        grads = list(gradients)
        arguments.expect_stats(stats, self._device)
        with self._lock.turn:
            self._refuse_reentry("step()")
            with self._lock.busy:
                self._step(grads, stats)

    def expect_gradients(self, gradients: Sequence[Any]) -> None:
        """Raise what :meth:`step` raises for ``gradients`` that do not fit the parameters; change nothing.

        ``scaler.step`` asks every optimizer before its check, so that gradients that do not fit one
        optimizer never leave the step applied by the others.

        Raises:
            ArgumentTypeError, GradientTypeError, GradientValueError: As :meth:`step`.
            ScalerProtocolError: An earlier step or load was interrupted while writing (until a load succeeds).
        """
        self._refuse_torn("step()")
        grads = list(gradients)
        arguments.expect_gradients(grads, self._params, self._device)
        if self._device < 0 or tuple(int(g.data.ptr) for g in grads) != self._table_key:  # as _tables_for does
            arguments.refuse_shared(grads, self._params, (self._masters, *self._buffers.values()))

    def _step(self, grads: list[Any], stats: GradientStats | None) -> None:
        self._refuse_torn("step()")
        arguments.expect_gradients(grads, self._params, self._device)
        if stats is None:
            self._apply(grads, None, None)
            return
        stream = None if self._device < 0 else self._backend.current_stream(self._device)
        # The record admits each optimizer once per check(), and holds off the scaler's next writes (another
        # thread's update() and check(), or kernels on another stream) until this step has read it.
        record = stats.record
        with record.lock:
            source = record.admit(self, stats.step, stream)
            self._apply(grads, source, stream, record)
            record.queued(stream)

    def _apply(
        self, grads: list[Any], source: np.ndarray | int | None, stream: Any, stats: StatsRecord | None = None
    ) -> None:
        """Apply the step: ``source`` is the statistics record (host array or device address), None for none.

        ``stats``, the record's owner, notes this optimizer as its reader once the optimizer is marked torn,
        before the first write: an interrupt anywhere leaves it untouched and unnoted, or torn (refusing
        until a load), and never lets it apply the record twice.
        """
        if self._device_record is None:
            self._host_step(grads, source if isinstance(source, np.ndarray) else None, stats)
            return
        tables = self._tables_for(grads)
        if self._backend.capturing(self._device) and not any(kept is tables for kept in self._captured):
            self._captured.append(tables)  # a graph replays them for as long as it lives: never freed
        hyper = int(self._device_record.data.ptr)
        address = 0 if source is None else int(source)
        self._torn = "a step was interrupted (or failed) between its launches"
        self._note_applying(stats)
        try:
            stream = self._backend.optimizer_step(self.layout.kind, self._device, tables, hyper, address, self._stream)
        except ScalerProtocolError:
            if stats is not None:
                stats.refused(self)  # its one refusal comes before the first launch: nothing changed
            self._torn = None
            raise
        self._torn, self._stream = None, stream

    def _note_applying(self, stats: StatsRecord | None) -> None:
        """Note this optimizer as ``stats``' reader (once it is marked torn, before its first write)."""
        if stats is not None:
            stats.applied_by(self)
            self._last_applied = stats

    def _host_step(self, grads: list[np.ndarray], source: np.ndarray | None, stats: StatsRecord | None) -> None:
        """Compute the step into new arrays, then write the parameters and swap the new state in."""
        skip = bool(source["skip"]) if source is not None else False
        factor = np.float32(source["factor"]) if source is not None else np.float32(1.0)
        arguments.refuse_shared(grads, self._params, (self._masters, *self._buffers.values()))
        record = self._record.copy()
        self._begin(record, skip, factor)
        if skip:  # only the per-step fields change: nothing an interrupt could tear
            self._note_applying(stats)
            self._record = record
            return
        masters = list(self._masters)
        buffers = {name: list(arrays) for name, arrays in self._buffers.items()}
        values = []
        for index, (g, p) in enumerate(zip(grads, self._params)):
            master = self._masters[index]
            weights = (p if master is None else master).copy()
            moments = [
                None if b is None else b.copy() for b in (self._buffers[name][index] for name in self.layout.moments)
            ]
            self._update(record, g, weights, *moments)
            if master is not None:
                masters[index] = weights
            for name, moment in zip(self.layout.moments, moments):
                buffers[name][index] = moment
            values.append(weights if master is None else weights.astype(p.dtype))
        self._torn = "a step was interrupted while it wrote the parameters"
        self._note_applying(stats)
        for p, value in zip(self._params, values):
            p[...] = value
        self._record, self._masters, self._buffers, self._torn = record, masters, buffers, None

    def _tables_for(self, grads: list[Any]) -> Any:
        """Return the device tables for these gradient buffers, built when their addresses change."""
        key = tuple(int(g.data.ptr) for g in grads)
        if key != self._table_key:
            arguments.refuse_shared(grads, self._params, (self._masters, *self._buffers.values()))
            groups: dict[str, list[tuple[int, ...]]] = {}
            counts: dict[str, list[int]] = {}
            for index, (g, p) in enumerate(zip(grads, self._params)):
                name = str(dtype_name(p.dtype))  # one of arguments.PARAM_DTYPES: checked at construction
                master = self._masters[index]
                moments = [self._buffers[m][index] for m in self.layout.moments] + [None] * (
                    2 - len(self.layout.moments)
                )
                buffers = (master, *moments)
                addresses = (int(g.data.ptr), int(p.data.ptr), *(0 if b is None else int(b.data.ptr) for b in buffers))
                groups.setdefault(name, []).append(addresses)
                counts.setdefault(name, []).append(p.size)
            with self._xp.cuda.Device(self._device):
                self._tables = self._backend.param_tables(self.layout.kind, groups, counts)
            self._table_key = key
        return self._tables

    # State files.

    def state_dict(self) -> dict[str, Any]:
        """Return the whole state (hyperparameters, counters, float32 buffers as bytes); synchronizes on the GPU.

        Raises:
            ScalerProtocolError: A step or load was interrupted while writing
                (until a load succeeds), or this thread is inside another call of this optimizer.
        """
        with self._lock.turn:
            self._refuse_reentry("state_dict()")
            with self._lock.busy:
                return self._state_dict("state_dict()")

    def _state_dict(self, name: str) -> dict[str, Any]:
        self._refuse_torn(name)
        record = self._pull_record()
        buffers = {"master": self._masters, **self._buffers}
        return {
            "format": state_file.STATE_FORMAT,
            "version": state_file.STATE_VERSION,
            "kind": self.layout.kind,
            "record": {name: record[name].item() for name in self.layout.persistent},
            "buffers": {
                name: [None if b is None else _host_bytes(b) for b in arrays] for name, arrays in buffers.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the whole state with one from :meth:`state_dict` of an optimizer like this one (synchronizes).

        Everything is checked before anything changes; a load that succeeds
        also ends the refusals after an interrupted step or load.

        Raises:
            CheckpointFieldError: A field is missing, unknown, or does not fit these
                parameters, or holds a value no sequence of steps produces.
            ScalerProtocolError: This thread is inside another call of this optimizer.
        """
        record, buffers = self._validated(state)
        with self._lock.turn:
            self._refuse_reentry("load_state_dict()")
            with self._lock.busy, self._on_device():
                self._write(record, buffers)

    def _write(self, record: np.ndarray, buffers: dict[str, list[bytes | None]]) -> None:
        if self._device_record is not None:
            self._xp.cuda.Device(self._device).synchronize()  # no queued step still uses the buffers
        self._torn = "a load was interrupted (or failed) while it wrote the state"
        for name, arrays in buffers.items():
            targets = self._masters if name == "master" else self._buffers[name]
            for target, data in zip(targets, arrays):
                if target is not None and data is not None:
                    target[...] = self._xp.asarray(np.frombuffer(data, dtype=np.float32).reshape(target.shape))
        for index, master in enumerate(self._masters):
            if master is not None:
                self._params[index][...] = master.astype(self._params[index].dtype)
        self._record = record
        self._push_record()
        if self._device_record is not None:
            self._xp.cuda.Device(self._device).synchronize()  # steps on any stream see the loaded state
        last = self._last_applied
        if last is not None:  # the loaded state is not the one that applied it: it may apply once more
            with last.lock:
                last.refused(self)
        self._torn = None

    def _validated(self, state: Any) -> tuple[np.ndarray, dict[str, list[bytes | None]]]:
        """Return the record and buffers of ``state`` if this optimizer's own steps could have produced them.

        Raises:
            CheckpointFieldError: The first field that could not be (see :func:`state_file.validated`), or
                one that does not fit this optimizer (its kind, hyperparameters and parameters).
        """
        _, record, buffers = state_file.validated(state, {self.layout.kind: self.layout})
        for name in self.layout.hyperparameters:
            if record[name] != self._record[name]:
                ours = f"{self._record[name].item()!r} (this optimizer's)"
                raise state_file.invalid(f"record.{name}", ours, repr(state["record"][name]))
        for name, arrays in {"master": self._masters, **self._buffers}.items():
            given = buffers[name]
            if len(given) != len(arrays):
                expected = f"a list of {len(arrays)} entries (one per parameter)"
                raise state_file.invalid(f"buffers.{name}", expected, f"{len(given)} entries")
            for index, (data, target) in enumerate(zip(given, arrays)):
                field = f"buffers.{name}[{index}]"
                if target is None and data is not None:
                    raise state_file.invalid(field, "None (this parameter has no such buffer)", type(data).__name__)
                if target is not None and (data is None or len(data) != target.nbytes):
                    got = "None" if data is None else f"{len(data)} bytes"
                    raise state_file.invalid(field, f"{target.nbytes} bytes (float32 of its parameter's shape)", got)
        return record, buffers

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`state_dict` to ``path`` atomically (msgpack with a CRC-32), as scaler checkpoints are.

        ``path`` then holds the old file or the new one, never a mix, even if the save is interrupted.

        Raises:
            ScalerProtocolError: As :meth:`state_dict` (an interrupted step or load, or a call from inside
                another call of this optimizer on the same thread); nothing is written.
            OSError: The file cannot be written (``path`` keeps its old content).
        """
        with self._lock.turn:
            self._refuse_reentry("save()")
            with self._lock.busy:
                state = self._state_dict("save()")
        state_file.write(path, state)

    def load(self, path: str | os.PathLike[str]) -> None:
        """Read a file written by :meth:`save` into this optimizer; nothing changes unless it is intact and fits.

        Raises:
            CheckpointCorruptError: Not a regular file, too large for these parameters, or not intact.
            CheckpointFieldError: Intact, but not the state of an optimizer like this one, or
                holding a value that no sequence of steps produces (the message names the field).
            ScalerProtocolError: This thread is inside another call of this optimizer.
        """
        buffers = sum(4 * p.size for p in self._params) * (1 + len(self.layout.moments))
        self.load_state_dict(state_file.read(path, buffers + (1 << 16) + 64 * len(self._params)))


def _host_bytes(array: Any) -> bytes:
    return (array if isinstance(array, np.ndarray) else array.get()).tobytes()
