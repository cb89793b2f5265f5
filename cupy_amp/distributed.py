"""Agreement between ranks on whether a step overflowed.

With several processes (data parallel with sharded gradients, model
parallelism), each rank sees only its own gradients. Ranks that disagree on
skipping a step drift apart or hang in their next collective, so the scaler
combines every rank's local overflow flag with a MAX all-reduce before it reads
the verdict back: every rank then returns the same bool and makes the same
``update()``.

A vote is any object with the two methods of :class:`OverflowVote`; NCCL
communicators from CuPy are wrapped by :func:`overflow_vote_for`.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from cupy_amp.errors import ArgumentTypeError

__all__ = ["NcclVote", "OverflowVote", "overflow_vote_for"]


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

        Used by ranks whose call had no gradients on the vote's device (an
        empty list, NumPy gradients), so that every rank joins every vote.
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
