"""An in-process stand-in for a communicator: N ranks as N threads, all-reduces through a barrier.

:class:`FakeVote` implements :class:`cupy_amp.distributed.Communicator`: a SUM
all-reduce of float64 pairs. Every call is a collective: each rank deposits its
pair, waits for all the others, then reads the sum. The barrier has a timeout,
so a rank that does not join makes the others raise
``threading.BrokenBarrierError`` quickly instead of hanging the test run (as a
real NCCL all-reduce would).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

__all__ = ["FakeVote", "FakeWorld", "run_ranks"]

T = TypeVar("T")


class FakeWorld:
    """The shared side of the stand-in communicator: one slot per rank and a barrier.

    Attributes:
        size: The number of ranks.
        sums: For each rank, the pair it gave to every all-reduce it took part in, in order.
        votes: For each rank, (its own overflow flag, the summed count of overflowed ranks) of each of them.
    """

    def __init__(self, size: int, timeout: float = 5.0) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._slots: list[Any] = [0] * size
        self.votes: list[list[tuple[int, int]]] = [[] for _ in range(size)]
        self.sums: list[list[np.ndarray]] = [[] for _ in range(size)]

    def sum_over_ranks(self, rank: int, values: np.ndarray) -> np.ndarray:
        """Deposit ``values`` for ``rank``, wait for every rank, and return the elementwise sum (a collective)."""
        self._slots[rank] = values.copy()  # type: ignore[call-overload]
        self.sums[rank].append(values.copy())  # before waiting: whoever waits for this pair sees it kept
        self._barrier.wait()
        total = np.sum(np.stack(self._slots), axis=0)  # type: ignore[arg-type]
        self._barrier.wait()
        self.votes[rank].append((int(values[0]), int(total[0])))
        return total

    def sync(self) -> None:
        """Wait until every rank gets here (a plain barrier, not counted as a vote)."""
        self._barrier.wait()

    def abort(self) -> None:
        """Break the barrier, so ranks waiting in a vote fail at once."""
        self._barrier.abort()

    def vote_count(self, rank: int) -> int:
        """Return how many all-reduces ``rank`` took part in."""
        return len(self.votes[rank])


class FakeVote:
    """One rank's :class:`~cupy_amp.distributed.Communicator` over a :class:`FakeWorld`."""

    def __init__(self, world: FakeWorld, rank: int, interrupt_at: int = 0) -> None:
        self.world = world
        self.rank = rank
        self.interrupt_at = interrupt_at  # raise KeyboardInterrupt as this all-reduce (1, 2, ...) returns
        self.calls = 0

    def reduce_sum(self, values: Any, stream: Any) -> None:
        """Replace the float64 pair ``values`` by its sum over all ranks (``stream`` is ignored)."""
        if not isinstance(values, np.ndarray) or values.dtype != np.float64 or values.shape != (2,):
            raise TypeError(f"reduce_sum expected a NumPy float64 array of shape (2,), got {values!r}.")
        values[...] = self.world.sum_over_ranks(self.rank, values)
        self.calls += 1
        if self.calls == self.interrupt_at:
            raise KeyboardInterrupt  # a Ctrl-C delivered as the collective returns, where a rank waits longest


def run_ranks(world: FakeWorld, body: Callable[[FakeWorld, int], T], join_timeout: float = 30.0) -> list[T]:
    """Run ``body(world, rank)`` for every rank in its own thread and return the results by rank.

    When a rank raises, the barrier is broken so the others stop at their next
    vote; the first rank's own error is re-raised in preference to the
    ``BrokenBarrierError`` it caused elsewhere.
    """
    results: list[Any] = [None] * world.size
    errors: list[BaseException | None] = [None] * world.size

    def target(rank: int) -> None:
        try:
            results[rank] = body(world, rank)
        except BaseException as exc:
            errors[rank] = exc
            world.abort()

    threads = [threading.Thread(target=target, args=(rank,), daemon=True) for rank in range(world.size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(join_timeout)
    stuck = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    if stuck:
        world.abort()
        raise TimeoutError(f"ranks {stuck} did not finish within {join_timeout} s")
    raised = [error for error in errors if error is not None]
    if raised:
        causes = [error for error in raised if not isinstance(error, threading.BrokenBarrierError)]
        raise (causes or raised)[0]
    return results
