"""The statistics pass on the GPU: a scaler's Stats record, the blocks' sums and report, and their launches.

``check()`` queues one statistics launch per dtype over the gradient tables
(:mod:`cupy_amp.gpu.tables`), then one block that finishes the step's
statistics (:data:`cupy_amp.kernel_interface.STATS`); each warp walks chunks of
its own (``kernels/grad_stats.cu``). The NumPy reference is
:mod:`cupy_amp.statistics`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cupy
import numpy as np

from cupy_amp.gpu.launch import _Launcher, _on_device, launcher, refuse_capture
from cupy_amp.gpu.tables import GradientGroup
from cupy_amp.kernel_interface import STATS, THREADS
from cupy_amp.record import StatsRecord

__all__ = ["DeviceStatsRecord"]


_STATS_FIELDS = {name: STATS.fields[name][1] for name in STATS.names or ()}  # type: ignore[index]
_SUM_AND_FINISH, _SUM_ONLY, _FINISH_ONLY = 0, 1, 2  # FinishArgs::stage (kernels/common.cuh)
_HEADER = 3  # the report's whole-call numbers before the per-gradient ones (kernels/common.cuh: kReportHeader)
# kMinBlocks of kernels/common.cuh: every block resident at once, each warp walking chunks of its own.
_STATS_BLOCKS_PER_SM = 2
_WARPS_PER_BLOCK = THREADS // 32


@cupy.memoize(for_each_device=True)  # type: ignore[untyped-decorator]
def _stats_grid() -> int:
    """Return the most blocks of a statistics launch on the current device: fixed, so the sums' order is too."""
    return int(_STATS_BLOCKS_PER_SM * cupy.cuda.Device().attributes["MultiProcessorCount"])


def _stats_blocks(chunks: int, grid: int) -> int:
    """Return the blocks of a statistics launch over ``chunks``: the warps walk equal numbers of chunks.

    The fewest rounds the grid allows, and just enough warps for them, so that in each round at most one
    block's spare warps have no chunk: a last round that only some warps walk would leave too few loads in
    flight (5000 chunks on 4224 warps: 776 would walk a second chunk alone). A function of the chunk count
    and the grid only, so the sums' order is fixed too.
    """
    if chunks == 0:
        return 0
    rounds = -(-chunks // (grid * _WARPS_PER_BLOCK))  # chunks per warp
    warps = -(-chunks // rounds)
    return -(-warps // _WARPS_PER_BLOCK)


class DeviceStatsRecord:
    """A scaler's Stats record and the statistics blocks' sums of squares, on one device.

    The record is reused step after step (so a captured step keeps reading it):
    its views hold the latest ``check()``'s values.
    """

    def __init__(self, device: int, order: Any) -> None:
        self.device = device
        with _on_device(device):
            self._finish = launcher("grad_stats.cu", "cupy_amp_finish_stats")  # loaded now, not inside a capture
            self._grid = _stats_grid()
            self._memory = cupy.zeros(STATS.itemsize, dtype=np.uint8)
            self._partials = cupy.zeros(0, dtype=np.float64)  # one sum per block; grows outside captures
            # The numerics report: 3 counts per gradient (this state's own, never another scaler's); grows likewise.
            self._report = cupy.zeros(0, dtype=np.uint64)
            self._filled: cupy.ndarray | None = None  # the report buffer the last check(report=True) wrote
            self._reported = (0, 0, 0)  # the last gather's report: (its address, its elements, the call's number)
            self._retired: list[cupy.ndarray] = []  # smaller ones they replaced, which captured graphs may still use
        self.address = int(self._memory.data.ptr)
        self.found = self._field("found", np.int32)
        self.skip = self._field("skip", np.int32)
        self.skip.fill(1)  # no check() has completed: nothing to apply
        # [overflowed, sum_of_squares]: the pair a communicator sums over the ranks, in one all-reduce.
        self.values = self._memory[: 2 * 8].view(np.float64)
        self.norm, self.clip_coefficient = self._field("norm", np.float32), self._field("clip_coefficient", np.float32)
        self.factor = self._field("factor", np.float32)
        self.record = StatsRecord(self.address, device, order)

    def _field(self, name: str, dtype: type) -> cupy.ndarray:
        offset = _STATS_FIELDS[name]
        return self._memory[offset : offset + np.dtype(dtype).itemsize].view(dtype).reshape(())

    def _launches(
        self, plan: tuple[GradientGroup, ...] | None, report: bool = False
    ) -> list[tuple[GradientGroup, _Launcher | None, int]]:
        """Return each group with its statistics launch and blocks (None and 0 for a group without elements).

        The report's launches have the same grids, so the sums, their order and their bits are the same.
        """
        launches = []
        for group in plan or ():
            launch = group.table.report_stats if report else group.table.stats
            blocks = 0 if launch is None else _stats_blocks(group.table.chunk_count, self._grid)
            launches.append((group, launch, blocks))
        return launches

    def read(self, stream: Any) -> np.void:
        """Return the record as written by the work queued on ``stream`` (waits for it)."""
        record: np.void = np.frombuffer(self._memory.get(stream=stream).tobytes(), dtype=STATS)[0]
        return record

    def reserve(self, plan: tuple[GradientGroup, ...] | None) -> None:
        """Make room for one sum per block of ``plan``'s launches and for its report (refused inside a capture)."""
        blocks = sum(grid for _, _, grid in self._launches(plan))
        counts = _HEADER + 3 * sum(len(group.positions) for group in plan or ())
        if blocks > self._partials.size or counts > self._report.size:
            refuse_capture("the statistics buffers must first grow to these gradients' size")
            self._retired += [self._partials, self._report]  # a graph captured before still writes them: never freed
            with _on_device(self.device):
                self._partials = cupy.zeros(max(blocks, self._partials.size), dtype=np.float64)
                self._report = cupy.zeros(max(counts, self._report.size), dtype=np.uint64)

    def report_counts(self, plan: tuple[GradientGroup, ...] | None) -> np.ndarray:
        """Return the report of ``plan``'s last ``gather(report=True)``: 3 counts per gradient, group after group.

        Read from the buffer that gather wrote, which a graph captured then keeps writing, even after the
        buffer grew for other gradients (the record then points at a new one, and graphs at the old).
        """
        counts = 3 * sum(len(group.positions) for group in plan or ())
        if self._filled is None or counts == 0:
            return np.zeros(counts, dtype=np.uint64)
        return np.asarray(self._filled[_HEADER : _HEADER + counts].get())

    def gather(
        self, plan: tuple[GradientGroup, ...], stream: Any, state: int, flags: Callable[[GradientGroup], int],
        max_norm: float, voting: bool, report: bool = False, number: int = 0,
    ) -> None:  # fmt: skip
        """Queue the statistics of one device's groups (at most one per dtype), then their finish; never waits.

        The kernels read the epoch and the scale from ``state`` (a State's
        address) and set its flags on inf/nan, and each group's culprit flags
        at ``flags(group)``. With ``voting``, only this rank's
        sums are taken: :attr:`values` is then to be all-reduced, and
        :meth:`finish` called. With ``report``, the same read also fills this
        record's numerics report (zeroed first, on the stream), 3 counts per
        gradient, the groups' gradients one after the other. ``number``: the call's number in the step (the
        journal's first culprit).
        """
        self.reserve(plan)
        if report:
            self._filled = self._report
            if self._report.size:
                cupy.cuda.runtime.memsetAsync(self._report.data.ptr, 0, self._report.nbytes, stream.ptr)
        partials, written, reported = int(self._partials.data.ptr), 0, 0
        whole = int(self._report.data.ptr) if report else 0  # the call's own numbers, then each gradient's
        self._reported = (whole, sum(sum(group.table.sizes) for group in plan or ()) if report else 0, number)
        for group, launch, grid in self._launches(plan, report):  # each launch's sums, and report, after the last
            if launch is not None:
                entries = {"report": whole + 8 * _HEADER + 24 * reported, "step_report": whole} if report else {}
                found = flags(group)
                launch(
                    grid,
                    stream.ptr,
                    partials=partials + 8 * written,
                    state=state,
                    tensor_found=found,
                    call=number,
                    **entries,
                )
                written += grid
            reported += len(group.positions)
        self._finish(
            1, stream.ptr, stats=self.address, partials=partials, partial_count=written, state=state,
            max_norm=np.float32(max_norm), stage=_SUM_ONLY if voting else _SUM_AND_FINISH, **self._report_args(),
        )  # fmt: skip

    def _report_args(self) -> dict[str, int]:
        """The finish's arguments for the last gather's report (the journal's share of it)."""
        whole, elements, number = self._reported
        return {"step_report": whole, "elements": elements, "call": number}

    def finish(self, stream: Any, state: int, max_norm: float) -> None:
        """Queue the finish from the all-reduced :attr:`values` (checked on the device); never waits."""
        self._finish(
            1, stream.ptr, stats=self.address, partials=0, partial_count=0, state=state,
            max_norm=np.float32(max_norm), stage=_FINISH_ONLY, **self._report_args(),
        )  # fmt: skip
