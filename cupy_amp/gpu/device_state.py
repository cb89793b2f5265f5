"""A scaler's state in device memory (:class:`DeviceState`) and the launches that step it, bit for bit as its twins.

Gradients are grouped by (device, dtype); each group is one launch of the
multi-tensor kernel over device tables (:mod:`cupy_amp.gpu.tables`: one
chunk record per block of work, cached for the common case where the same
memory comes back every step). Every
launch reads the scale, the step's epoch and its flags from a :class:`DeviceState`
in device memory; only the synchronous face reads the verdict back, with one
small copy per call (and, only after an overflow, of the per-gradient flags).

Kernels are compiled and launched through :mod:`cupy_amp.gpu.launch`,
each with one struct argument laid out as :mod:`cupy_amp.kernel_interface`
mirrors it; the fused optimizers' launches are in :mod:`cupy_amp.gpu.optimizer_launches`.
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from dataclasses import asdict
from typing import Any

import cupy
import numpy as np

from cupy_amp import journal
from cupy_amp.dtypes import dtype_name
from cupy_amp.gpu.launch import MAX_GRID, StreamOrder, _on_device, capturing, launcher, refuse_capture
from cupy_amp.gpu.stats import DeviceStatsRecord
from cupy_amp.gpu.tables import GradientGroup, dense_base, layout_words
from cupy_amp.kernel_interface import CHUNK_BYTES, ENTRIES, STATE, UNSCALE_DTYPE_NAMES
from cupy_amp.rule import RULES, ScalerConfig, ScalerState
from cupy_amp.state import Verdict
from cupy_amp.twins.grad_stats import Numerics

__all__ = ["DeviceState"]

_VOTE_OFFSET = STATE.fields["vote_count"][1]  # type: ignore[index]  # the pair unscale_and_check sums
_FINITE_OFFSET = STATE.fields["finite"][1]  # type: ignore[index]
_FIRST_CULPRIT_OFFSET = STATE.fields["first_culprit"][1]  # type: ignore[index]
_CULPRITS_OFFSET = STATE.fields["culprits"][1]  # type: ignore[index]


def _scale_loss(loss: cupy.ndarray, state: int) -> None:
    """Multiply ``loss`` in place by the scale of ``state`` (a State's address).

    Queued on the current stream; never synchronizes.
    """
    if loss.size == 0:
        return
    with _on_device(loss.data.device_id):
        base, layout = dense_base(loss), None
        if base is None:
            refuse_capture("a loss with gaps between its elements needs its layout copied to the device")
            base = loss.data.ptr
            layout = cupy.asarray(np.array(layout_words(loss), dtype=np.int64))  # freed in stream order
        chunk = CHUNK_BYTES // loss.itemsize
        launcher("scale_loss.cu", f"cupy_amp_scale_loss_{dtype_name(loss.dtype)}")(
            min(-(-loss.size // chunk), MAX_GRID),
            cupy.cuda.get_current_stream().ptr,
            base=base,
            numel=loss.size,
            layout=0 if layout is None else layout.data.ptr,
            chunk_size=chunk,
            state=state,
        )


# Sync-free scalers: their state in device memory (the State struct), stepped by one-thread kernels.

_owners = itertools.count(1)  # each DeviceState's number, the high 32 bits of its epochs
_OTHER_STREAM = (
    "The scaler's last work (or the optimizer step that read its statistics) was queued on another stream than "
    "the one being captured: run the eager steps on the capturing stream, or synchronize before capturing."
)
_owners_lock = threading.Lock()


# What a finished check() leaves in the State for the step's rule and journal entry (kernels/grad_stats.cu).
_CHECKED_FIELDS = (
    "checked_epoch", "checked_norm", "reported_epoch", "report_amax", "zero_fraction", "subnormal_fraction",
    "report_call", "report_position",
)  # fmt: skip


def _python(value: np.generic) -> int | float:
    """A State field as the Python number ScalerState holds (float32 fields as floats, counters as ints)."""
    return float(value) if value.dtype.kind == "f" else int(value)


def _next_epoch(epoch: int) -> int:
    """The epoch a step's begin moves ``epoch`` to (kernels/step_state.cu next_epoch): the count in the low 32 bits
    goes up, skipping 0."""
    count = (epoch + 1) & 0xFFFFFFFF
    return (epoch & ~0xFFFFFFFF) | (count or 1)


class DeviceState:
    """A sync-free scaler's State (configuration included) in device memory, and the launches that step it.

    Every method queues work on the device's current stream and returns
    without waiting, except :meth:`snapshot`, :meth:`restore` and
    :meth:`culprits`, which wait for the whole device (the steps may have been
    queued on any stream, or replayed in a graph). Work queued on another
    stream than the state's previous work first waits for it (an event), so
    the scale a loss is multiplied by is always the one the last update left.
    Launch arguments never change from step to step (only this state's
    address), so every launch can be captured in a CUDA graph and replayed,
    and :meth:`restore` (a loaded checkpoint) reaches graphs captured before it.
    """

    def __init__(
        self, device: int, config: ScalerConfig, state: ScalerState, overflow: bool, local: bool, epoch: int,
        capacity: int = 0,
    ) -> None:  # fmt: skip
        self.device = device
        with _on_device(device):
            self._memory = cupy.zeros(STATE.itemsize, dtype=np.uint8)
            self._journal = cupy.zeros(capacity * journal.ENTRY.itemsize, dtype=np.uint8)  # the rule's ring
            # No culprit yet (all ones): restore() keeps the open step's culprits, as it keeps its epoch.
            self._memory[_FIRST_CULPRIT_OFFSET : _FIRST_CULPRIT_OFFSET + 8].fill(0xFF)
            # Loaded now, not at a first call that may come inside a CUDA graph capture (which cannot load modules).
            for entry in ENTRIES["step_state.cu"]:
                launcher("step_state.cu", entry, threads=1)
            for name in UNSCALE_DTYPE_NAMES:
                launcher("scale_loss.cu", f"cupy_amp_scale_loss_{name}")
        with _owners_lock:
            self._owner = (next(_owners) % 2**32) << 32
        self.address = int(self._memory.data.ptr)
        # Where read() copies the State: pinned, so the copy is one DMA and the wait is the stream's.
        self._pinned = cupy.cuda.alloc_pinned_memory(STATE.itemsize)
        self._host = np.frombuffer(self._pinned, dtype=STATE, count=1)
        self.finite = self._memory[_FINITE_OFFSET : _FINITE_OFFSET + 1].view(np.bool_).reshape(())
        self._vote_pair = self._memory[_VOTE_OFFSET : _VOTE_OFFSET + 16].view(np.float64)
        self.order = StreamOrder(_OTHER_STREAM)  # every stream that writes the state, or reads its record
        self.stats = DeviceStatsRecord(device, self.order)
        # This state's culprit flags, per gradient table (by its memory's id, dropped when the table dies): a
        # u64 per tensor, the epoch of this state's last launch that saw inf/nan in it. Tables are shared by
        # every scaler over the same memory; flags kept there would be another scaler's to overwrite.
        self._culprit_flags: dict[int, tuple[weakref.ref[cupy.ndarray], cupy.ndarray]] = {}
        self._reported = 0  # how many of the device's impossible all-reduce answers new_bad_votes() handed out
        self._begun = False  # the open step was begun by the last update()'s own launch (the synchronous face)
        self.restore(config, state, overflow, local, epoch)

    def follow(self) -> Any:
        """Return the device's current stream, made to wait for the state's last work and every read of its
        record since, where those went to other streams (:class:`~cupy_amp.gpu.launch.StreamOrder`).

        Raises:
            ScalerProtocolError: The current stream is capturing a CUDA graph and that work
                went to another stream (a capture cannot wait for work outside it).
        """
        with _on_device(self.device):
            stream = cupy.cuda.get_current_stream()
            self.order.write(stream)
        return stream

    def capturing(self) -> bool:
        """Return whether the current stream of the state's device is capturing a CUDA graph."""
        with _on_device(self.device):
            return capturing()

    def _launch(self, entry: str) -> None:
        with _on_device(self.device):
            launcher("step_state.cu", entry, threads=1)(1, self.follow().ptr, state=self.address)

    def read(self) -> Verdict:
        """Wait for the state's last work and return the step's verdict (synchronizes that stream only).

        One small copy of the State to pinned memory on the stream of the last
        work, then a wait for that stream: the synchronous face's one read per call.
        """
        with _on_device(self.device):
            stream = self.follow()
            cupy.cuda.runtime.memcpyAsync(
                self._host.ctypes.data, self.address, STATE.itemsize, cupy.cuda.runtime.memcpyDeviceToHost,
                stream.ptr,
            )  # fmt: skip
            stream.synchronize()
        (record,) = self._host
        found = record["found"] != 0
        overflow = bool(found or record["agreed"] != 0)
        epoch, poisoned = int(record["epoch"]) & 0xFFFFFFFF, bool(record["poisoned"])
        norm = float(record["checked_norm"]) if record["checked_epoch"] == record["epoch"] else math.nan
        return Verdict(overflow, bool(found), epoch, int(record["bad_votes"]), poisoned, norm)

    def new_bad_votes(self, counted: int) -> int:
        """Return how many of the ``counted`` impossible answers (a read's count) were not handed out yet.

        The count and what was handed out of it live here together, and a
        :meth:`restore` keeps both (a face that kept its own tally missed new
        answers after a restore zeroed the count).
        """
        new, self._reported = max(counted - self._reported, 0), max(counted, self._reported)
        return new

    def snapshot(self) -> tuple[ScalerState, bool, bool, int, int, bool]:
        """Wait for the whole device; return (state, the step's verdict, this rank's own overflow, epoch, bad
        votes, poisoned).

        The verdict is read from the flags the rule uses, not from ``finite``, which callers can write.
        """
        with _on_device(self.device):
            cupy.cuda.runtime.deviceSynchronize()
            (record,) = self._memory.get().view(STATE)
        self.order.settled()
        state = ScalerState(
            **{name: _python(record[name]) for name in ScalerState.__dataclass_fields__}  # type: ignore[arg-type]
        )
        overflow = bool(record["found"] != 0 or record["agreed"] != 0)
        epoch = int(record["epoch"]) & 0xFFFFFFFF
        return state, overflow, bool(record["found"]), epoch, int(record["bad_votes"]), bool(record["poisoned"])

    def restore(
        self, config: ScalerConfig, state: ScalerState, overflow: bool, local: bool, epoch: int, reopen: bool = False
    ) -> None:
        """Replace the State in place (synchronizes); epochs keep this state's own number in their high bits.

        ``reopen``: the open step is retried (its update() was interrupted before the host kept the rule's
        result). If the folded update already ran here and began the next step, that step's epoch is put
        back, so the retried rule sees the step as it was (its check()'s norm, its culprits' epoch).
        """
        record = np.zeros((), dtype=STATE)
        for name, value in asdict(state).items():
            record[name] = value
        record["growth_factor"] = config.growth_factor
        record["backoff_factor"] = config.backoff_factor
        record["floor"] = config.floor
        record["max_scale"] = np.inf if config.max_scale is None else config.max_scale
        record["growth_interval"] = config.growth_interval
        record["hysteresis"] = config.hysteresis
        record["rule"] = RULES.index(config.rule)
        record["epoch"] = self._owner | (epoch & 0xFFFFFFFF)
        record["updated_epoch"] = 2**64 - 1  # no epoch: the open step's rule is not applied yet
        record["folded_step"] = 2**64 - 1  # nor by a folded update(): the retry of one applies the rule here
        record["found"] = local
        record["agreed"] = overflow
        record["finite"] = not overflow
        record["stats"] = self.stats.address
        record["journal"] = self._journal.data.ptr
        record["journal_capacity"] = self._journal.size // journal.ENTRY.itemsize
        self.stats.record.closed()
        self._begun = False  # first: after an interrupt before the write, the next step only begins again
        with _on_device(self.device):
            cupy.cuda.runtime.deviceSynchronize()  # no queued step still uses the state
            # The count of impossible answers stays: it is the communicator's history, not the scaler's state,
            # and what new_bad_votes() handed out of it stays true at every line here.
            (current,) = self._memory.get().view(STATE)
            record["bad_votes"] = current["bad_votes"]
            # The open step's culprits stay with its epoch: a repair mid-step keeps them for the journal's entry.
            record["culprits"], record["first_culprit"] = current["culprits"], current["first_culprit"]
            # And what its finished check() left: the norm (which the headroom rule reads) and the report's numbers.
            for name in _CHECKED_FIELDS:
                record[name] = current[name]
            began = int(current["updated_epoch"])  # the epoch the rule last closed here
            if reopen and began != 2**64 - 1 and _next_epoch(began) == int(current["epoch"]):
                record["epoch"] = began  # the folded update's begin of the next step is undone
            self._memory.set(np.frombuffer(record.tobytes(), dtype=np.uint8))
            self.stats.skip.fill(1)  # a restored state's record says "skip" until a check() completes
            cupy.cuda.runtime.deviceSynchronize()  # the host record is a temporary
        self.order.settled()

    def scale_loss(self, loss: cupy.ndarray) -> None:
        self.follow()
        _scale_loss(loss, self.address)

    def keep_culprits(self, count: int, first: tuple[int, int] | None) -> None:
        """Set the open step's culprits for its journal entry (what the host read of them, after a repair;
        synchronizes)."""
        packed = 2**64 - 1 if first is None else first[0] << 32 | first[1]
        with _on_device(self.device):
            cupy.cuda.runtime.deviceSynchronize()
            self._memory[_CULPRITS_OFFSET : _CULPRITS_OFFSET + 4].set(np.array([count], np.int32).view(np.uint8))
            self._memory[_FIRST_CULPRIT_OFFSET : _FIRST_CULPRIT_OFFSET + 8].set(
                np.array([packed], np.uint64).view(np.uint8)
            )
            cupy.cuda.runtime.deviceSynchronize()  # the host values are temporaries
        self.order.settled()

    def begin_step(self) -> None:
        self.stats.record.closed()  # until this step's check() completes (the kernel writes "skip")
        if self._begun:  # the last update()'s launch began this step (a second begin would only cost a launch)
            self._begun = False
        else:
            self._launch("cupy_amp_begin_step")

    def _flags(self, group: GradientGroup) -> int:
        """Return the address of this state's culprit flags for ``group``'s table, made (zeroed) on first use.

        Raises:
            ScalerProtocolError: They must be made inside a CUDA graph capture.
        """
        flags = self._known_flags(group)
        if flags is None:
            refuse_capture("the scaler's culprit flags for these gradients must first be made")
            with _on_device(self.device):
                flags = cupy.zeros(len(group.table.sizes), dtype=np.uint64)  # on the stream the launch uses
            key, known = id(group.table.memory), self._culprit_flags  # the callback holds the dict, not the state

            def forget(_: object, key: int = key) -> None:
                known.pop(key, None)

            self._culprit_flags[key] = (weakref.ref(group.table.memory, forget), flags)
        return int(flags.data.ptr)

    def _known_flags(self, group: GradientGroup) -> cupy.ndarray | None:
        """Return this state's culprit flags for ``group``'s table, or None if it never launched over that table.

        Keyed by the table's address, and checked against the table itself: a
        new table at a freed one's address is a table these flags never saw.
        """
        entry = self._culprit_flags.get(id(group.table.memory))
        return entry[1] if entry is not None and entry[0]() is group.table.memory else None

    def unscale(self, call: Any, number: int = 0) -> None:
        """Queue the unscale of a parsed call (its arrays on this device), reading factor and epoch from the State.

        ``number``: the call's number in the step, for the journal's first culprit. Returns None: the culprits
        are read later, by :meth:`culprits`.
        """
        with _on_device(self.device):
            stream = self.follow()
            for group in call.plan:
                if group.table.launch is not None:
                    grid = min(group.table.chunk_count, MAX_GRID)
                    found = self._flags(group)
                    group.table.launch(grid, stream.ptr, state=self.address, tensor_found=found, call=number)

    def prepare(self, call: Any) -> None:
        """Get everything a captured step with ``call``'s arrays needs (the statistics buffer, the culprit flags)."""
        self.stats.reserve(call.plan)
        for group in call.plan or ():
            if group.table.stats is not None:
                self._flags(group)

    def check(self, call: Any, max_norm: float, voting: bool, report: bool = False, number: int = 0) -> None:
        """Queue the statistics pass of a parsed call (its arrays on this device), reading the State.

        With ``voting``, only this rank's sums are taken (:meth:`vote_sums`, then
        :meth:`finish_vote`); with ``report``, the same read fills the numerics
        report (:meth:`numerics`). Returns None: the culprits are read later, by :meth:`culprits`.
        """
        with _on_device(self.device):
            self.stats.gather(call.plan, self.follow(), self.address, self._flags, max_norm, voting, report, number)

    def numerics(self, plan: Any) -> list[Numerics]:
        """Return the numerics report that the last ``check(report=True)`` over ``plan`` filled (synchronizes)."""
        rows = []
        with _on_device(self.device):
            cupy.cuda.runtime.deviceSynchronize()
            self.order.settled()
            report, first = self.stats.report_counts(plan).reshape(-1, 3), 0
            for group in plan or ():
                table = group.table
                counts, first = report[first : first + len(group.positions)], first + len(group.positions)
                unsigned = np.dtype(f"<u{table.dtype.itemsize}")
                amax = counts[:, 0].astype(unsigned).view(table.dtype).astype(np.float64)
                for index, position in enumerate(group.positions):
                    entry = counts[index]
                    rows.append(
                        Numerics(
                            position, table.dtype, table.sizes[index], float(amax[index]), int(entry[1]), int(entry[2])
                        )
                    )
        return sorted(rows, key=lambda row: row.position)

    def vote(self, ballot: Any) -> None:
        """Queue ``unscale_and_check``'s SUM all-reduce of (this rank's flag, 0) (never synchronizes).

        The pair is set from the state's flag on the device, then summed there by the communicator.
        """
        self._launch("cupy_amp_cast_vote")
        with _on_device(self.device):
            ballot.sum(self._vote_pair, self.follow())

    def vote_sums(self, ballot: Any) -> None:
        """Queue ``check()``'s SUM all-reduce of (overflowed, sum of squares) (never synchronizes)."""
        with _on_device(self.device):
            ballot.sum(self.stats.values, self.follow())

    def finish_vote(self, inspected: bool, max_norm: float) -> None:
        """Queue the verdict from the all-reduced pair (after a ``check()``, the record's finish too).

        On the device: a poisoned count poisons the state, an impossible one is counted (once per step); running
        it twice gives the same state.
        """
        if not inspected:
            self._launch("cupy_amp_combine_vote")
            return
        with _on_device(self.device):
            self.stats.finish(self.follow(), self.address, max_norm)

    def mark_overflow(self) -> None:
        """Count the open step as this rank's overflow; its statistics record too says skip."""
        self._launch("cupy_amp_mark_overflow")
        self.skip_statistics()

    def skip_statistics(self) -> None:
        """Make the statistics record say "skip", after the state's last work (an optimizer may still read it)."""
        with _on_device(self.device), self.follow():
            self.stats.skip.fill(1)

    def update(self, step: int | None = None) -> None:
        """Queue the step's close (its record says "skip") and the rule, applied once per step: a retry after an
        interrupted ``update()`` changes nothing more.

        With ``step`` (the synchronous face's number of the step, which a
        capture would freeze), the next step begins in the same launch, once
        per number: its first gradient call then launches nothing.
        """
        self.stats.record.closed()
        if step is None:
            self._launch("cupy_amp_update_state")
            return
        self._begun = False  # first: after an interrupt past the launch, the next step begins again (harmless)
        with _on_device(self.device):
            launcher("step_state.cu", "cupy_amp_update_and_begin", threads=1)(
                1, self.follow().ptr, state=self.address, step=step
            )
        self._begun = True

    def journal(self) -> np.ndarray:
        """Return the journal's entries, oldest first (waits for the whole device)."""
        with _on_device(self.device):
            cupy.cuda.runtime.deviceSynchronize()
            (record,) = self._memory.get().view(STATE)
            ring = self._journal.get().view(journal.ENTRY)
        self.order.settled()
        return journal.entries(ring, int(record["steps"]))

    def load_journal(self, chosen: np.ndarray) -> None:
        """Replace the journal by ``chosen`` (entries sorted by step; the newest that fit are kept; synchronizes)."""
        ring = journal.place(self._journal.size // journal.ENTRY.itemsize, chosen)
        with _on_device(self.device):
            cupy.cuda.runtime.deviceSynchronize()  # no queued step still writes the ring
            self._journal.set(ring.view(np.uint8))
            cupy.cuda.runtime.deviceSynchronize()  # the host ring is a temporary
        self.order.settled()

    def culprits(self, plan: Any, epoch: int) -> tuple[int, ...]:
        """Return the positions of a call's arrays (``plan``: its tables) flagged in step ``epoch`` (synchronizes)."""
        epoch = self._owner | epoch
        positions: list[int] = []
        with _on_device(self.device):
            cupy.cuda.runtime.deviceSynchronize()
            self.order.settled()
            for group in plan or ():
                flags = self._known_flags(group)
                if flags is None:
                    continue  # this state never launched over the table: nothing of it was flagged here
                seen = flags.get()
                positions += [group.positions[i] for i in np.flatnonzero(seen == epoch)]
        return tuple(sorted(positions))
