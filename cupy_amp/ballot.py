"""One gradient call's part in the collective: joined at most once, its stage always known.

The step machine (:mod:`cupy_amp.step`) gives each gradient call a :class:`Ballot`
and reads its stage when the call fails: not joined (join now, as an overflowed
rank), joining (this rank cannot know the outcome: poison), joined (the answer
is in hand).
"""

from __future__ import annotations

from typing import Any

from cupy_amp.distributed import Communicator
from cupy_amp.errors import CommunicatorError, ScalerProtocolError

__all__ = ["JOINED", "JOINING", "NOT_JOINED", "Ballot"]

# Where a call stands with the collective: not joined yet; inside the communicator; it returned.
NOT_JOINED, JOINING, JOINED = "not joined", "joining", "joined"


class Ballot:
    """One gradient call's part in the collective: joined at most once, and its outcome never guessed.

    The stage is stored before the communicator is called and after it
    returns, so no exception, wherever it arrives, can lead the call to join a
    second collective. A call that fails while JOINING (an interrupt, or the
    communicator raising: NCCL's rule is that a communicator that failed inside
    a collective is not reused) cannot know whether it took part nor what the
    others decided: the step machine then poisons the scaler (:meth:`Step.poison`).
    """

    __slots__ = ("communicator", "stage")

    def __init__(self, communicator: Communicator | None) -> None:
        self.communicator = communicator
        self.stage = NOT_JOINED

    def sum(self, values: Any, stream: Any) -> None:
        """Join the call's one collective: sum ``values`` over the ranks (a device pair in ``stream`` order)."""
        communicator = self.communicator
        if communicator is None or self.stage != NOT_JOINED:
            raise ScalerProtocolError("A gradient call tried to join a second collective.")  # an internal rule
        self.stage = JOINING
        try:
            communicator.reduce_sum(values, stream)
        except Exception as error:
            raise CommunicatorError(f"The all-reduce failed: {type(error).__name__}: {error}") from error
        self.stage = JOINED
