"""Agreement between ranks: one SUM all-reduce per gradient call, joined at most once, its outcome never guessed.

With several processes each rank sees only its own gradients. Ranks that
disagree on skipping a step drift apart or hang in their next collective. So
every gradient call of a scaler with a communicator (``unscale_and_check`` and
``check`` alike) joins exactly one collective: a SUM all-reduce of a float64
pair, this rank's 0/1 overflow flag and its sum of squares (0 for
``unscale_and_check``). The step overflowed if the summed count is positive,
or if this rank's own flag is set, whatever the answer says.

The rules, whatever fails:

- a call that fails before it joined joins as an overflowed rank, so no rank
  waits for it;
- an answer that no ranks can produce (a count that is no whole number of
  ranks, or below this rank's own; a sum of squares below this rank's share)
  counts as an overflow and raises :class:`~cupy_amp.errors.CommunicatorError`:
  every rank got the same answer, so every rank agrees;
- a call interrupted inside the collective cannot know whether it took part,
  nor what the others decided. Guessing would let the ranks diverge without
  a word (NCCL's rule for a communicator that failed mid-collective is the
  same: it is aborted, not reused). That rank sends the poisoned vote
  (:data:`POISON` ranks) once, and every later call of its scaler refuses with
  :class:`~cupy_amp.errors.RanksMayDisagreeError`; every other rank gets the
  poisoned count from the collective it was waiting in or its next one, and
  refuses likewise from then on.

A communicator is any object with ``reduce_sum`` (:class:`Communicator`);
CuPy's NCCL communicators are wrapped by :func:`communicator_for`.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any, Protocol

import numpy as np

from cupy_amp.errors import ArgumentTypeError, CommunicatorError, RanksMayDisagreeError
from cupy_amp.gpu.nccl import NcclAllReduce

__all__ = [
    "AFTER",
    "INSIDE",
    "OTHERS",
    "POISON",
    "POISONED_BELOW",
    "Communicator",
    "communicator_for",
    "count_verdict",
    "holds_poison",
    "impossible_answers",
    "log_failed_join",
    "poisoned_error",
    "refuse_impossible_sum",
    "send_poison",
]

logger = logging.getLogger(__name__)

POISON = 2.0**40  # a count of overflowed ranks no world reaches: the vote of a rank that cannot know the outcome
POISONED_BELOW = POISON * 2.0**20  # several ranks may poison one collective: up to 2**20 poisoned votes are read


def _poisoned(count: float) -> bool:
    """Whether an all-reduced count holds poisoned votes: POISON times some ranks plus a count of ranks (a
    collective in which several ranks poisoned, too), not garbage like inf."""
    return POISON <= count < POISONED_BELOW


class Communicator(Protocol):
    """Sums a float64 pair over the ranks: the one collective of a gradient call."""

    def reduce_sum(self, values: Any, stream: Any) -> None:
        """Replace ``values``, a contiguous float64 pair, by its elementwise sum over all ranks.

        A CuPy array is summed in ``stream`` order, without synchronizing; a
        NumPy array (``stream`` None) is summed before the call returns. A call
        that raises took no part in the collective.
        """
        ...


def communicator_for(comm: Any) -> Communicator | None:
    """Return the communicator for ``comm``: None for None, a wrapper for NCCL, ``comm`` itself otherwise.

    Raises:
        ArgumentTypeError: ``comm`` is none of these.
    """
    if comm is None:
        return None
    if hasattr(comm, "allReduce") or (hasattr(comm, "all_reduce") and hasattr(comm, "rank")):
        return NcclAllReduce(comm)
    if callable(getattr(comm, "reduce_sum", None)):
        communicator: Communicator = comm  # a custom transport, or a test stand-in
        return communicator
    raise ArgumentTypeError(
        f"Invalid 'comm': expected a cupyx.distributed.NCCLBackend, a cupy.cuda.nccl.NcclCommunicator or an "
        f"object with a reduce_sum(values, stream) method, got {type(comm).__name__}."
    )


# Why a scaler was poisoned: its own call was interrupted inside the all-reduce; its own call failed after the
# all-reduce answered, where the other ranks may apply the step; another rank's poisoned vote arrived.
INSIDE, AFTER, OTHERS = "inside", "after", "others"

_POISON_CAUSES = {
    INSIDE: "A gradient call on this rank was interrupted inside its all-reduce (or the communicator failed there)",
    AFTER: (
        "A call on this rank failed after its all-reduce answered: the other ranks may apply a step that this "
        "one did not (its caller never got the go-ahead, its optimizers were stopped part way, or it could not "
        "finish the step from the answer)"
    ),
    OTHERS: "Another rank's gradient call failed where the ranks may disagree (its poisoned vote arrived here)",
}


def poisoned_error(cause: str) -> RanksMayDisagreeError:
    """The one error every later call of a poisoned scaler raises; ``cause`` is INSIDE, AFTER or OTHERS."""
    error = RanksMayDisagreeError(
        f"{_POISON_CAUSES[cause]}: the ranks' scales, verdicts or weights may differ. This scaler refuses every "
        "call from now on, on every rank. Restore every rank from the last checkpoint (the scaler's and the "
        "optimizer's), with new scalers and a new communicator."
    )
    error.own = cause != OTHERS
    return error


def holds_poison(count: float) -> bool:
    """Whether an all-reduced count holds one or more poisoned votes."""
    return _poisoned(count)


def send_poison(communicator: Communicator) -> threading.Thread:
    """Send this rank's poisoned vote from a thread of its own, and return that thread.

    The vote completes the collective the other ranks wait in, or their next
    one. The failing call does not wait for it: the others may first wait for
    this rank in a collective of the user's (a gradient all-reduce), or never
    reach another of the scaler's, and a rank blocked here would hang with them.
    """
    thread = threading.Thread(target=_send_poison, args=(communicator,), name="cupy-amp poisoned vote", daemon=True)
    thread.start()
    return thread


def _send_poison(communicator: Communicator) -> None:
    try:
        communicator.reduce_sum(np.array([POISON, 0.0], dtype=np.float64), None)
    except BaseException as error:  # nobody to raise to: the call that poisoned has returned
        logger.error("cupy-amp: sending the poisoned vote failed, so the other ranks may wait for it: %s", error)


def count_verdict(count: float, local_overflow: bool) -> bool:
    """Return the step's verdict from the all-reduced count of overflowed ranks (this rank's always counts).

    Raises:
        RanksMayDisagreeError: The count holds a poisoned vote.
        CommunicatorError: The count is not a whole number of ranks at least this rank's own flag.
    """
    if _poisoned(count):
        raise poisoned_error(OTHERS)
    if not ((1.0 if local_overflow else 0.0) <= count < POISON and count == math.floor(count)):
        raise CommunicatorError(
            f"The all-reduce answered {count!r} ranks with inf/nan (this rank: {int(local_overflow)}), which is no "
            "such count: the communicator did not sum float64 values. The step counts as an overflow."
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
            f"The all-reduce answered a sum of squares of {total!r} (this rank's share: {own!r}), which no sum over "
            "the ranks can be: the communicator did not sum float64 values. The step counts as an overflow."
        )


def log_failed_join(error: BaseException, join_error: BaseException) -> None:
    """Keep a failure of the join after ``error`` without replacing ``error``: logged, and attached as a note."""
    logger.error(
        "cupy-amp: joining the all-reduce as an overflowed rank after a failed call failed too: %s", join_error
    )
    add_note = getattr(error, "add_note", None)
    if add_note is not None:
        add_note(f"cupy-amp: joining the all-reduce after this failure failed as well: {join_error}")


def impossible_answers(count: int) -> CommunicatorError:
    """The error for ``count`` steps whose all-reduce answer a state counted as impossible (each was skipped)."""
    return CommunicatorError(
        f"{count} all-reduce answer(s) were impossible: no count of the ranks with inf/nan, or no sum of the ranks' "
        "sums of squares. The communicator did not sum float64 values; those steps counted as overflows."
    )
