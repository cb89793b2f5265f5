"""Agreement between ranks on whether a step overflowed.

With several processes (data parallel with sharded gradients, model
parallelism), each rank sees only its own gradients. Ranks that disagree on
skipping a step drift apart or hang in their next collective, so the scaler
combines every rank's local overflow flag with a MAX all-reduce before it reads
the verdict back: every rank then returns the same bool and makes the same
``update()``.

The rules, whatever fails: every rank votes exactly once per
``unscale_and_check`` call; a call that fails anywhere (bad arguments, a device
error, an interrupt) votes "overflow" if it had not voted yet; the answer is
checked (a garbage answer is a :class:`~cupy_amp.errors.CommunicatorError`);
and a rank whose own gradients held inf/nan never reports a finite step.

A vote is any object with the two methods of :class:`OverflowVote`; NCCL
communicators from CuPy are wrapped by :func:`overflow_vote_for`.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Protocol

import numpy as np

from cupy_amp.errors import ArgumentTypeError, CommunicatorError, ConfigError

__all__ = [
    "NcclVote",
    "OverflowVote",
    "cast_host_vote",
    "device_answer",
    "host_answer",
    "host_sums",
    "host_verdict",
    "overflow_count_verdict",
    "overflow_vote_for",
    "refuse_impossible_sum",
    "require_sums",
    "sums_after_failure",
    "vote_after_failure",
]

logger = logging.getLogger(__name__)


class OverflowVote(Protocol):
    """Combines the ranks' overflow flags with MAX."""

    def reduce_max(self, flags: Any, stream: Any) -> None:
        """In ``stream`` order, set ``flags[1]`` to the maximum over all ranks of ``flags[0]``.

        ``flags`` is a contiguous int32 array of two elements in the vote's
        memory (device memory for NCCL). Must not synchronize.
        """
        ...

    def host_vote(self, local_overflow: bool) -> bool:
        """Take part with a host-side flag and return the agreed verdict (synchronizes).

        Used by calls whose flag is on the host (NumPy gradients, no gradients
        at all, a call that failed before its vote), so every rank joins every vote.
        """
        ...


class NcclVote:
    """An :class:`OverflowVote` over a CuPy NCCL communicator.

    Accepts ``cupyx.distributed.NCCLBackend`` (from
    ``cupyx.distributed.init_process_group``) or a raw
    ``cupy.cuda.nccl.NcclCommunicator``. The all-reduce runs on the stream it
    is given, which is the current stream of the gradients' device.
    """

    def __init__(self, comm: Any) -> None:
        self._comm = comm
        self._raw = not hasattr(comm, "all_reduce")  # NcclCommunicator spells it allReduce

    def reduce_max(self, flags: Any, stream: Any) -> None:
        if self._raw:
            from cupy.cuda import nccl

            self._comm.allReduce(flags.data.ptr, flags.data.ptr + 4, 1, nccl.NCCL_INT32, nccl.NCCL_MAX, stream.ptr)
        else:
            self._comm.all_reduce(flags[0:1], flags[1:2], op="max", stream=stream)

    def reduce_sum(self, values: Any, stream: Any) -> None:
        """Sum a float64 pair over the ranks in place: on ``stream`` for a CuPy array; a NumPy one waits."""
        import cupy

        if isinstance(values, np.ndarray):
            on_device = cupy.asarray(values)
            current = cupy.cuda.get_current_stream()
            self.reduce_sum(on_device, current)
            values[...] = on_device.get(stream=current)
            return
        if self._raw:
            from cupy.cuda import nccl

            ptr = values.data.ptr
            self._comm.allReduce(ptr, ptr, 2, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, stream.ptr)
        else:
            self._comm.all_reduce(values, values, op="sum", stream=stream)

    def host_vote(self, local_overflow: bool) -> bool:
        import cupy

        stream = cupy.cuda.get_current_stream()
        flags = cupy.asarray(np.array([int(local_overflow), 0], dtype=np.int32))
        self.reduce_max(flags, stream)
        return bool(flags[1:2].get(stream=stream)[0])


def overflow_vote_for(comm: Any) -> OverflowVote | None:
    """Return the vote for ``comm``: None for None, a wrapper for NCCL, ``comm`` itself for a vote.

    Raises:
        ArgumentTypeError: ``comm`` is none of these.
    """
    if comm is None:
        return None
    if hasattr(comm, "reduce_max") and hasattr(comm, "host_vote"):
        vote: OverflowVote = comm  # already a vote (a custom transport, or a test stand-in)
        return vote
    if hasattr(comm, "allReduce") or (hasattr(comm, "all_reduce") and hasattr(comm, "rank")):
        return NcclVote(comm)
    raise ArgumentTypeError(
        f"Invalid 'comm': expected a cupyx.distributed.NCCLBackend, a cupy.cuda.nccl.NcclCommunicator "
        f"or an object with reduce_max() and host_vote() methods, got {type(comm).__name__}."
    )


def cast_host_vote(vote: OverflowVote, local_overflow: bool) -> object:
    """Take part in a vote with a host flag and return the communicator's raw answer (synchronizes).

    Raises:
        CommunicatorError: The communicator raised; this rank then took no part in the vote.
    """
    try:
        return vote.host_vote(local_overflow)
    except Exception as exc:
        raise CommunicatorError(f"The overflow vote failed: {type(exc).__name__}: {exc}") from exc


def host_verdict(answer: object, local_overflow: bool) -> bool:
    """Return the verdict of a host vote's answer, which counts this rank's own overflow whatever it says.

    Raises:
        CommunicatorError: The answer is not a bool.
    """
    if not isinstance(answer, (bool, np.bool_)):
        raise CommunicatorError(
            f"The overflow vote answered {answer!r} ({type(answer).__name__}); expected a bool. "
            f"The step counts as an overflow."
        )
    return bool(answer) or local_overflow


def host_answer(vote: OverflowVote, local_overflow: bool) -> bool:
    """Vote with a host flag and return the checked verdict (see :func:`cast_host_vote`, :func:`host_verdict`)."""
    return host_verdict(cast_host_vote(vote, local_overflow), local_overflow)


def device_answer(local_flag: int, agreed_flag: int) -> bool:
    """Return the verdict from this rank's flag and the all-reduced one, checking that it is a maximum.

    Raises:
        CommunicatorError: The reduced flag is smaller than this rank's own, so it is no MAX over the ranks.
    """
    if agreed_flag < local_flag or agreed_flag < 0:
        raise CommunicatorError(
            f"The overflow all-reduce answered {agreed_flag}, which is not a maximum over the ranks' flags "
            f"(this rank's is {local_flag}); the communicator did not run a MAX reduction of int32 flags. "
            f"The step counts as an overflow."
        )
    return agreed_flag != 0 or local_flag != 0


def vote_after_failure(vote: OverflowVote, error: BaseException) -> None:
    """Vote "overflow" for a call that ``error`` stopped before its vote, so the other ranks do not hang.

    A failure of this vote does not replace ``error``: it is logged, attached
    to ``error`` as its context and, where Python supports it, as a note.
    """
    try:
        host_answer(vote, True)
    except CommunicatorError as vote_error:
        logger.error("cupy-amp: the overflow vote after a failed call failed too: %s", vote_error)
        vote_error.__context__ = None  # it was raised while handling `error`; keep the chain acyclic
        error.__context__ = vote_error
        add_note = getattr(error, "add_note", None)
        if add_note is not None:
            add_note(f"cupy-amp: voting 'overflow' for this call failed as well: {vote_error}")


# check() with a communicator: one SUM all-reduce of [overflowed ranks, sum of squares] per step. The flag
# travels as its own element, so an inf/nan in a rank's sum of squares cannot hide it: the count is a
# whole number of ranks, at least this rank's own 0/1, whatever the sums beside it hold.


def require_sums(vote: OverflowVote) -> None:
    """Raise unless ``vote`` can sum a pair of floats over the ranks (what ``check()`` needs).

    Raises:
        ConfigError: It has no ``reduce_sum(values, stream)`` method.
    """
    if not callable(getattr(vote, "reduce_sum", None)):
        raise ConfigError(
            f"check() with a communicator needs a SUM all-reduce: {type(vote).__name__} has no reduce_sum(values, "
            "stream). Use a CuPy NCCL communicator, or unscale_and_check()."
        )


def host_sums(vote: OverflowVote, overflowed: bool, sum_of_squares: float) -> tuple[float, float]:
    """Sum (this rank's 0/1 overflow flag, its sum of squares) over the ranks from the host (synchronizes).

    Raises:
        CommunicatorError: The communicator raised; this rank then took no part.
    """
    values = np.array([1.0 if overflowed else 0.0, sum_of_squares], dtype=np.float64)
    try:
        vote.reduce_sum(values, None)  # type: ignore[attr-defined]
    except Exception as exc:
        raise CommunicatorError(f"The statistics all-reduce failed: {type(exc).__name__}: {exc}") from exc
    return float(values[0]), float(values[1])


def overflow_count_verdict(count: float, local_overflow: bool) -> bool:
    """Return the step's verdict from the all-reduced count of overflowed ranks (this rank's always counts).

    Raises:
        CommunicatorError: The count is not a whole number at least this rank's own flag.
    """
    if not ((1.0 if local_overflow else 0.0) <= count < 1e15 and count == math.floor(count)):
        raise CommunicatorError(
            f"The statistics all-reduce answered {count!r} ranks with inf/nan (this rank: {int(local_overflow)}), "
            "which is no such count: the communicator did not sum float64 values. The step counts as an overflow."
        )
    return count > 0 or local_overflow


def refuse_impossible_sum(total: float, own: float) -> None:
    """Refuse an all-reduced sum of squares that no sum of the ranks' shares can be.

    Every share is a sum of squares, so it is not negative: the total is at
    least this rank's own share, not NaN, and infinite only if the share is.

    Raises:
        CommunicatorError: It is NaN, below this rank's share, negative, or infinite over a finite share.
    """
    if math.isnan(total) or total < own or (math.isinf(total) and not math.isinf(own)):
        raise CommunicatorError(
            f"The statistics all-reduce answered a sum of squares of {total!r} (this rank's share: {own!r}), which "
            "no sum over the ranks can be: the communicator did not sum float64 values. The step counts as an "
            "overflow."
        )


def sums_after_failure(vote: OverflowVote, error: BaseException) -> None:
    """Join the statistics all-reduce as an overflowed rank for a ``check()`` that ``error`` stopped first."""
    try:
        host_sums(vote, True, 0.0)
    except CommunicatorError as vote_error:
        logger.error("cupy-amp: the statistics all-reduce after a failed check() failed too: %s", vote_error)
        vote_error.__context__ = None
        error.__context__ = vote_error


def impossible_answers(count: int) -> CommunicatorError:
    """The error for ``count`` all-reduce answers that a state counted as impossible (each step was skipped)."""
    return CommunicatorError(
        f"{count} all-reduce answer(s) were impossible: no maximum of the ranks' 0/1 flags (unscale_and_check), "
        "or no count of ranks with inf/nan, or no sum of the ranks' sums of squares (check). The communicator did "
        "not run the expected reduction; those steps counted as overflows."
    )
