"""Several ranks agreeing on overflow: a scaler with ``comm=`` an in-process stand-in communicator.

Each rank is a thread with its own scaler and NumPy gradients; the votes go
through :mod:`fake_comm` (a barrier with a timeout, so a rank that skips a
vote fails the test quickly instead of hanging it). A scripted run is compared
step by step, every field, with the plain reference model of the update rule,
on both faces; what a disabled scaler does with its votes is GradScaler's only.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from fake_comm import FakeVote, FakeWorld, run_ranks
from helpers import Face, open_step
from reference_model import RefConfig, RefScaler

from cupy_amp import (
    ArgumentTypeError,
    CommunicatorError,
    GradientSet,
    GradScaler,
    GradScalerCheckpoint,
    GradScalerStats,
    SyncFreeGradScaler,
)
from cupy_amp.distributed import communicator_for
from cupy_amp.gpu.nccl import NcclAllReduce

CONFIG: dict[str, Any] = {
    "init_scale": 1024.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 3,
    "min_scale": 256.0,
    "max_scale": 4096.0,
    "hysteresis": 2,
}

# The first non-finite value written into a poisoned gradient, by dtype.
POISON = {np.dtype(np.float16): np.inf, np.dtype(np.float32): np.nan, np.dtype(np.float64): -np.inf}


@dataclass(frozen=True)
class Grad:
    """One gradient array: dtype, length, and the value every element has after unscaling."""

    dtype: type
    size: int
    value: float


@dataclass(frozen=True)
class Layout:
    """One ``unscale_and_check`` argument: "list", "dict" or "set" (a GradientSet of a list).

    ``entries`` pairs each label (the position for "list"/"set", the key for
    "dict") with its gradient, or None for a parameter without a gradient.
    """

    kind: str
    entries: tuple[tuple[Hashable, Grad | None], ...] = ()


# A step is one dict per unscale_and_check call: rank -> labels of that rank's gradients holding inf/nan.
Call = dict[int, tuple[Hashable, ...]]
Step = tuple[Call, ...]


@dataclass(frozen=True)
class StepRecord:
    """What one rank observed in one step."""

    results: tuple[bool, ...]
    had_overflow: bool
    culprits: tuple[Hashable, ...]
    stats: GradScalerStats


class CallGradients:
    """The persistent arrays of one call on one rank, and the argument passed every step (the same object)."""

    def __init__(self, layout: Layout) -> None:
        self.grads = {label: grad for label, grad in layout.entries if grad is not None}
        self.arrays: dict[Hashable, np.ndarray] = {
            label: np.zeros(grad.size, grad.dtype) for label, grad in self.grads.items()
        }
        values = [self.arrays.get(label) for label, _ in layout.entries]
        if layout.kind == "list":
            self.argument: Any = values
        elif layout.kind == "dict":
            self.argument = dict(zip([label for label, _ in layout.entries], values, strict=True))
        elif layout.kind == "set":
            self.argument = GradientSet(values)
        else:
            raise ValueError(f"unknown layout kind {layout.kind!r}")

    def fill(self, scale: float, poisoned: tuple[Hashable, ...]) -> None:
        """Write every gradient as its value times ``scale`` (exact: scales are powers of two)."""
        for label, array in self.arrays.items():
            array[...] = self.grads[label].value * scale
            if label in poisoned:
                array[0] = POISON[array.dtype]

    def assert_unscaled(self, poisoned: tuple[Hashable, ...]) -> None:
        """Check that every gradient was unscaled, overflow or not (locally or remotely)."""
        for label, array in self.arrays.items():
            first = 1 if label in poisoned else 0
            assert np.all(array[first:] == self.grads[label].value), (label, array)
            if first:
                assert not np.isfinite(array[0]), (label, array)


def one_call(*calls: Call) -> list[Step]:
    """Return one single-call step per dict."""
    return [(call,) for call in calls]


# 32 single-call steps on three ranks. With hysteresis 2 the second overflow in a row backs off;
# step 15 hits min_scale, step 30 max_scale (neither counts as a backoff/growth).
SCRIPT: list[Step] = one_call(
    {}, {}, {},  # 1-3: grow to 2048
    {0: (0,)},  # 4: rank 0's float16 inf; hysteresis 2 -> 1
    {1: ("b",)},  # 5: back off to 1024
    {2: (1,)},  # 6: 512
    {}, {}, {},  # 7-9: grow to 1024, hysteresis refilled
    {0: (0, 2), 1: ("w",)},  # 10: two ranks at once
    {}, {},  # 11-12
    {2: (1,)},  # 13: 512
    {1: ("w", "b")},  # 14: 256
    {0: (1,)},  # 15: 128 clamped to min_scale 256
    *[{}] * 15,  # 16-30: 512, 1024, 2048, 4096, then 8192 clamped to max_scale 4096
    {0: (2,)},  # 31: hysteresis 2 -> 1
    {1: ("b",)},  # 32: 2048
)  # fmt: skip

SCALES = [1024, 1024, 2048, 2048, 1024, 512, 512, 512, 1024, 1024, 1024, 1024, 512, 256, 256, 256]
SCALES += [256, 512, 512, 512, 1024, 1024, 1024, 2048, 2048, 2048, 4096, 4096, 4096, 4096, 4096, 2048]

LAYOUTS: list[tuple[Layout, ...]] = [
    (Layout("list", ((0, Grad(np.float16, 4, 0.75)), (1, Grad(np.float32, 3, -2.5)), (2, Grad(np.float64, 2, 1e-3)))),),
    (Layout("dict", (("w", Grad(np.float32, 6, 1.5)), ("b", Grad(np.float16, 3, 3.0)))),),
    (Layout("list", ((0, None), (1, Grad(np.float32, 5, -0.5)), (2, None))),),
]


def train(
    face: Face, scaler: Any, rank: int, calls: Sequence[CallGradients], steps: Sequence[Step]
) -> list[StepRecord]:
    """Run ``steps`` on one rank: scale_loss, fill, unscale_and_check per call, update; record what the rank saw."""
    records = []
    for step in steps:
        scale = scaler.scale_factor()
        results = []
        open_step(scaler)
        for poison, call in zip(step, calls, strict=True):
            mine = poison.get(rank, ())
            call.fill(scale, mine)
            results.append(face.ok(scaler.unscale_and_check(call.argument)))
            call.assert_unscaled(mine)
        had_overflow, culprits = scaler.had_overflow(), tuple(scaler.nonfinite_gradients())
        scaler.update()
        records.append(StepRecord(tuple(results), had_overflow, culprits, scaler.stats()))
    return records


def run_scenario(
    face: Face, layouts: Sequence[Sequence[Layout]], script: Sequence[Step]
) -> tuple[list[list[StepRecord]], FakeWorld, list[list[bytes]]]:
    """Train every rank through ``script``; return the records, the world (votes) and the final gradient bytes."""
    world = FakeWorld(len(layouts))

    def body(world: FakeWorld, rank: int) -> tuple[list[StepRecord], list[bytes]]:
        scaler = face(comm=FakeVote(world, rank), **CONFIG)
        calls = [CallGradients(layout) for layout in layouts[rank]]
        records = train(face, scaler, rank, calls, script)
        return records, [array.tobytes() for call in calls for array in call.arrays.values()]

    outcome = run_ranks(world, body)
    return [records for records, _ in outcome], world, [arrays for _, arrays in outcome]


def expected_records(layouts: Sequence[Sequence[Layout]], script: Sequence[Step]) -> list[list[StepRecord]]:
    """What every rank should see, from the reference model: the verdict is the OR over calls and ranks."""
    reference = RefScaler(RefConfig(**CONFIG))
    remote = [0] * len(layouts)
    expected: list[list[StepRecord]] = [[] for _ in layouts]
    for step in script:
        call_overflow = [any(labels for labels in call.values()) for call in step]
        overflow = any(call_overflow)
        reference.step(overflow)
        for rank, rank_layouts in enumerate(layouts):
            local = any(call.get(rank) for call in step)
            remote[rank] += overflow and not local
            culprits = tuple(
                label
                for call, layout in zip(step, rank_layouts, strict=True)
                for label, _ in layout.entries
                if label in call.get(rank, ())
            )
            where = ("local" if local else "remote") if overflow else "none"
            # The reference model is single-process: its per-rank fields are replaced by this rank's.
            fields = {**reference.stats_dict(), "remote_skipped_steps": remote[rank], "last_overflow": where}
            stats = GradScalerStats(**fields)
            # Each call answers for the step so far: every call from the first overflowing one on says "skip".
            so_far = tuple(not any(call_overflow[: number + 1]) for number in range(len(step)))
            expected[rank].append(StepRecord(so_far, overflow, culprits, stats))
    return expected


def assert_records(actual: list[list[StepRecord]], expected: list[list[StepRecord]]) -> None:
    """Compare every field of every step of every rank, and the fields all ranks must share."""
    assert len(actual) == len(expected)
    for rank, (got, want) in enumerate(zip(actual, expected, strict=True)):
        assert len(got) == len(want)
        for step, (record, reference) in enumerate(zip(got, want, strict=True), start=1):
            assert record == reference, f"rank {rank}, step {step}"
    for step, per_rank in enumerate(zip(*actual, strict=True), start=1):
        shared = {dataclasses.replace(record.stats, remote_skipped_steps=0, last_overflow="") for record in per_rank}
        assert len(shared) == 1, f"ranks disagree at step {step}: {shared}"
        assert len({(record.results, record.had_overflow) for record in per_rank}) == 1, f"step {step}"


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(face: Face) -> None:
    records, world, _ = run_scenario(face, LAYOUTS, SCRIPT)

    assert_records(records, expected_records(LAYOUTS, SCRIPT))
    for rank in range(3):
        assert [record.stats.scale for record in records[rank]] == SCALES
    # Step 4: an inf in rank 0's float16 gradient only.
    assert [records[rank][3].results for rank in range(3)] == [(False,)] * 3
    assert [records[rank][3].stats.last_overflow for rank in range(3)] == ["local", "remote", "remote"]
    assert [records[rank][3].culprits for rank in range(3)] == [(0,), (), ()]
    assert [records[rank][9].culprits for rank in range(3)] == [(0, 2), ("w",), ()]
    final = [records[rank][-1].stats for rank in range(3)]
    assert {(s.scale, s.steps, s.skipped_steps, s.growths, s.backoffs, s.hysteresis_tracker) for s in final} == {
        (2048.0, 32, 9, 6, 5, 0)
    }
    assert [s.remote_skipped_steps for s in final] == [5, 5, 7]
    assert [s.last_overflow for s in final] == ["remote", "local", "remote"]
    # One vote per call on every rank, and every rank read the same verdicts.
    assert [world.vote_count(rank) for rank in range(3)] == [32, 32, 32]
    verdicts = [[int(count > 0) for _, count in world.votes[rank]] for rank in range(3)]
    assert verdicts[0] == verdicts[1] == verdicts[2] == [int(record.had_overflow) for record in records[0]]
    assert sum(verdicts[0]) == 9


@pytest.mark.parametrize(
    "empty",
    [Layout("list"), Layout("list", ((0, None), (1, None))), Layout("dict"), Layout("set", ((0, None),))],
    ids=["empty-list", "list-of-None", "empty-dict", "empty-GradientSet"],
)
def test_a_rank_without_gradients_still_votes_and_follows(face: Face, empty: Layout) -> None:
    layouts = [*LAYOUTS, (empty,)]

    records, world, _ = run_scenario(face, layouts, SCRIPT)

    assert_records(records, expected_records(layouts, SCRIPT))
    lonely = records[3]
    assert [record.stats.scale for record in lonely] == SCALES
    assert all(record.culprits == () for record in lonely)
    assert [record.stats.last_overflow for record in lonely[3:6]] == ["remote"] * 3
    assert lonely[-1].stats.skipped_steps == lonely[-1].stats.remote_skipped_steps == 9
    assert world.vote_count(3) == 32
    assert {local for local, _ in world.votes[3]} == {0}
    assert [count for _, count in world.votes[3]] == [count for _, count in world.votes[0]]


GAN_LAYOUTS: list[tuple[Layout, ...]] = [
    (Layout("list", ((0, Grad(np.float32, 4, 0.5)),)), Layout("dict", (("d.w", Grad(np.float16, 2, -1.0)),))),
    (
        Layout("set", ((0, Grad(np.float32, 3, 2.0)), (1, None), (2, Grad(np.float64, 2, 0.25)))),
        Layout("list", ((0, Grad(np.float16, 5, 0.5)),)),
    ),
    (Layout("list"), Layout("dict", (("d.b", Grad(np.float32, 1, 4.0)),))),  # no generator gradients here
]

GAN_SCRIPT: list[Step] = [
    ({}, {}),
    ({1: (0,)}, {}),  # the first call overflowed on rank 1: the step is skipped everywhere
    ({}, {0: ("d.w",)}),  # only the second call, on rank 0
    ({1: (2,)}, {0: ("d.w",)}),  # two ranks, in different calls
    ({}, {}),
    ({}, {2: ("d.b",)}),
    ({}, {}),
    ({}, {}),
    ({}, {}),
    ({0: (0,)}, {1: (0,)}),
    ({}, {}),
]


def test_two_calls_per_step_vote_each_and_any_overflow_skips_the_step(face: Face) -> None:
    records, world, _ = run_scenario(face, GAN_LAYOUTS, GAN_SCRIPT)

    assert_records(records, expected_records(GAN_LAYOUTS, GAN_SCRIPT))
    assert [records[rank][1].results for rank in range(3)] == [(False, False)] * 3  # the step's verdict so far
    assert [records[rank][2].results for rank in range(3)] == [(True, False)] * 3
    assert all(records[rank][step].had_overflow for rank in range(3) for step in (1, 2, 3, 5, 9))
    assert [records[rank][3].stats.last_overflow for rank in range(3)] == ["local", "local", "remote"]
    assert [records[rank][3].culprits for rank in range(3)] == [("d.w",), (2,), ()]
    assert [records[rank][-1].stats.skipped_steps for rank in range(3)] == [5, 5, 5]
    assert [records[rank][-1].stats.remote_skipped_steps for rank in range(3)] == [2, 2, 4]
    assert [records[rank][-1].stats.scale for rank in range(3)] == [512.0] * 3
    assert [world.vote_count(rank) for rank in range(3)] == [22, 22, 22]


def test_checkpoint_saved_by_rank_0_resumes_every_rank(face: Face, tmp_path: Any) -> None:
    path = tmp_path / "scaler.ckpt"
    cut = 15  # right after step 15, whose overflow was rank 0's only

    def body(world: FakeWorld, rank: int) -> tuple[GradScalerCheckpoint, GradScalerStats, list[StepRecord]]:
        calls = [CallGradients(layout) for layout in LAYOUTS[rank]]
        scaler = face(comm=FakeVote(world, rank), **CONFIG)
        train(face, scaler, rank, calls, SCRIPT[:cut])
        if rank == 0:
            scaler.checkpoint().save(path)
        world.sync()
        loaded = GradScalerCheckpoint.load(path)
        resumed = face(comm=FakeVote(world, rank))  # default config: the checkpoint must replace it
        resumed.load_checkpoint(loaded)
        assert resumed.checkpoint() == loaded
        return loaded, resumed.stats(), train(face, resumed, rank, calls, SCRIPT[cut:])

    world = FakeWorld(3)
    outcome = run_ranks(world, body)

    expected = expected_records(LAYOUTS, SCRIPT)
    saved = expected[0][cut - 1].stats
    assert (saved.scale, saved.remote_skipped_steps, saved.last_overflow) == (256.0, 4, "local")
    for rank, (loaded, stats_after_load, after) in enumerate(outcome):
        assert loaded == outcome[0][0]
        # Rank 0's state on every rank, its per-rank fields included: the remote-skip counter,
        # and "local" for the last overflow (found_overflow_local), although it was rank 0's.
        assert stats_after_load == saved
        # Training continues as in an uninterrupted run; the remote-skip counter continues from rank 0's.
        offset = saved.remote_skipped_steps - expected[rank][cut - 1].stats.remote_skipped_steps
        uninterrupted = [
            dataclasses.replace(
                record,
                stats=dataclasses.replace(
                    record.stats, remote_skipped_steps=record.stats.remote_skipped_steps + offset
                ),
            )
            for record in expected[rank][cut:]
        ]
        assert after == uninterrupted, f"rank {rank}"
    assert [after[-1].stats.remote_skipped_steps for _, _, after in outcome] == [5, 5, 6]
    assert [after[-1].stats.scale for _, _, after in outcome] == [2048.0] * 3
    assert [world.vote_count(rank) for rank in range(3)] == [32, 32, 32]


def test_checkpoint_file_does_not_depend_on_the_world_size(face: Face, tmp_path: Any) -> None:
    # Rank 0 overflows at steps 2 and 7 in both runs; the other overflows fall on other ranks,
    # spread differently over 2 and 4 ranks. Rank 0's state, hence its file, is the same.
    layout = (Layout("list", ((0, Grad(np.float32, 3, 1.0)), (1, Grad(np.float16, 2, -4.0)))),)
    rank0_steps: Call = {2: (0,), 7: (1,)}
    elsewhere_2: dict[int, Call] = {4: {1: (0,)}, 5: {1: (0, 1)}, 9: {1: (1,)}, 12: {1: (0,)}}
    elsewhere_4: dict[int, Call] = {4: {3: (0,)}, 5: {1: (0,), 2: (1,)}, 9: {2: (1,)}, 12: {1: (0,), 3: (0, 1)}}

    def script(elsewhere: dict[int, Call]) -> list[Step]:
        steps: list[Step] = []
        for number in range(1, 13):
            call = dict(elsewhere.get(number, {}))
            if number in rank0_steps:
                call[0] = rank0_steps[number]
            steps.append((call,))
        return steps

    def saved_bytes(size: int, elsewhere: dict[int, Call]) -> tuple[bytes, list[GradScalerCheckpoint]]:
        path = tmp_path / f"world{size}.ckpt"

        def body(world: FakeWorld, rank: int) -> GradScalerCheckpoint:
            scaler = face(comm=FakeVote(world, rank), **CONFIG)
            train(face, scaler, rank, [CallGradients(layout[0])], script(elsewhere))
            if rank == 0:
                scaler.checkpoint().save(path)
            return scaler.checkpoint()

        checkpoints = run_ranks(FakeWorld(size), body)
        return path.read_bytes(), checkpoints

    two, two_ranks = saved_bytes(2, elsewhere_2)
    four, four_ranks = saved_bytes(4, elsewhere_4)

    assert two == four
    loaded = GradScalerCheckpoint.load(tmp_path / "world2.ckpt")
    assert (loaded.steps, loaded.skipped_steps, loaded.remote_skipped_steps) == (12, 6, 4)
    assert (loaded.found_overflow, loaded.found_overflow_local) == (True, False)
    assert loaded == two_ranks[0] == four_ranks[0]
    # The file is per rank, though: rank 1 of the 2-rank run had other local overflows.
    assert two_ranks[1].remote_skipped_steps == 2
    assert two_ranks[1].to_bytes() != two


def test_communicator_for_none_is_none() -> None:
    assert communicator_for(None) is None


def test_communicator_for_returns_a_communicator_as_is() -> None:
    vote = FakeVote(FakeWorld(1), 0)
    assert communicator_for(vote) is vote


class RawNcclStandIn:
    """Looks like cupy.cuda.nccl.NcclCommunicator (never called here: that needs NCCL)."""

    def allReduce(self, *args: Any) -> None:  # NCCL's spelling
        raise AssertionError("not expected to be called")


class BackendStandIn:
    """Looks like cupyx.distributed.NCCLBackend for one rank: a SUM over one rank copies the input."""

    rank = 0

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def all_reduce(self, in_array: Any, out_array: Any, op: str = "sum", stream: Any = None) -> None:
        self.calls.append((op, stream))
        out_array[...] = in_array


class DevicePairStandIn:
    """A float64 pair that the wrapper takes for a device array (not a NumPy one), on device 3."""

    def __init__(self, values: list[float]) -> None:
        self.values = values
        self.device = SimpleNamespace(id=3)

    def __setitem__(self, key: Any, other: DevicePairStandIn) -> None:
        self.values = list(other.values)


def test_communicator_for_wraps_nccl_communicators() -> None:
    assert isinstance(communicator_for(RawNcclStandIn()), NcclAllReduce)
    backend = BackendStandIn()
    communicator = communicator_for(backend)
    assert isinstance(communicator, NcclAllReduce)
    pair = DevicePairStandIn([1.0, 2.5])
    communicator.reduce_sum(pair, "the-stream")
    assert pair.values == [1.0, 2.5]  # one rank's sum is its own pair
    assert backend.calls == [("sum", "the-stream")]
    assert communicator._device == 3  # a host pair (the poisoned vote's) goes through this device


@pytest.mark.parametrize("comm", [42, "nccl", object()], ids=["int", "str", "object"])
def test_communicator_for_refuses_anything_else(comm: Any) -> None:
    with pytest.raises(ArgumentTypeError, match="Invalid 'comm'") as caught:
        communicator_for(comm)
    assert isinstance(caught.value, TypeError)
    assert type(comm).__name__ in str(caught.value)
    for scaler_class in (GradScaler, SyncFreeGradScaler):
        with pytest.raises(ArgumentTypeError, match="Invalid 'comm'"):
            scaler_class(comm=comm)


def test_fake_vote_follows_the_protocol() -> None:
    # The stand-in itself: a SUM of float64 pairs over the ranks, the same answer for every rank.
    def body(world: FakeWorld, rank: int) -> list[float]:
        values = np.array([float(rank == 2), 0.5 * rank])
        FakeVote(world, rank).reduce_sum(values, None)
        return values.tolist()

    world = FakeWorld(3)
    assert run_ranks(world, body) == [[1.0, 1.5]] * 3
    assert [world.vote_count(rank) for rank in range(3)] == [1, 1, 1]


def test_a_disabled_scaler_does_not_vote() -> None:
    # Every rank must agree on `enabled` (and on set_enabled() switches): a disabled rank
    # takes no part in votes. Here both ranks are disabled, so nobody waits for anybody.
    def body(world: FakeWorld, rank: int) -> tuple[bool, bytes, GradScalerStats]:
        scaler = GradScaler(enabled=False, comm=FakeVote(world, rank), **CONFIG)
        gradient = np.array([np.inf, 3.0], np.float32) if rank == 0 else np.array([5.0, 6.0], np.float32)
        result = scaler.unscale_and_check([gradient])
        scaler.update()
        return result, gradient.tobytes(), scaler.stats()

    world = FakeWorld(2)
    outcome = run_ranks(world, body)

    assert [result for result, _, _ in outcome] == [True, True]
    assert [raw for _, raw, _ in outcome] == [
        np.array([np.inf, 3.0], np.float32).tobytes(),
        np.array([5.0, 6.0], np.float32).tobytes(),
    ]
    assert [(stats.steps, stats.scale, stats.last_overflow) for _, _, stats in outcome] == [(0, 1024.0, "none")] * 2
    assert [world.vote_count(rank) for rank in range(2)] == [0, 0]


def test_ranks_disagreeing_on_enabled_fail_fast_instead_of_hanging() -> None:
    # What the rule above prevents: the enabled rank waits in a vote the disabled rank never joins.
    def body(world: FakeWorld, rank: int) -> bool:
        scaler = GradScaler(enabled=rank == 0, comm=FakeVote(world, rank), **CONFIG)
        open_step(scaler)
        return scaler.unscale_and_check([np.ones(2, np.float32)])

    start = time.monotonic()
    with pytest.raises(CommunicatorError) as info:
        run_ranks(FakeWorld(2, timeout=0.3), body)
    assert isinstance(info.value.__cause__, threading.BrokenBarrierError)
    assert time.monotonic() - start < 5.0


def test_the_scripted_run_is_deterministic(face: Face) -> None:
    first = run_scenario(face, LAYOUTS, SCRIPT)
    second = run_scenario(face, LAYOUTS, SCRIPT)

    assert first[0] == second[0]
    assert first[1].votes == second[1].votes
    assert first[2] == second[2]
    assert len(first[1].votes[0]) == 32
