"""A scaler state's statistics record, and the one owner of who may read it, when, and in what order.

``check()`` fills a state's record (:data:`cupy_amp.kernel_interface.STATS`);
the fused optimizers read the factor and the skip flag from it inside their
update. :class:`StatsRecord` owns, for any number of optimizers on any number
of streams or threads:

- **currency**: the step whose completed ``check()`` the record holds. From a
  step's opening to the completion of its check, and from the step's close
  (``update()``), it holds none, and the record's memory says "skip": so a
  check that is refused or fails, for whatever reason, leaves nothing to apply,
  and a CUDA graph replaying an optimizer step alone applies nothing;
- **applied once**: each optimizer applies a step's record once;
- **order**: on the GPU, every read is queued after the record's last write,
  and the next write (any of the scaler's kernels) after every read, whatever
  their streams (:class:`cupy_amp.gpu.launch.StreamOrder`). On the host, the
  record's lock keeps a reader and the scaler's next writes apart.

:class:`GradientStats`, what ``check()`` returns, is a frozen value: views of
the record's fields, the record, and the step they belong to.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from cupy_amp.errors import ScalerProtocolError

__all__ = ["GradientStats", "StatsRecord"]


class StatsRecord:
    """The record a state's ``check()`` writes and optimizers read: currency, readers and their order.

    Attributes:
        source: The record itself, a 0-d STATS array on the host, or its address on the device.
        device: Where it is (-1: the host).
        order: The state's :class:`~cupy_amp.gpu.launch.StreamOrder` on the GPU; None on the host.
    """

    def __init__(self, source: np.ndarray | int, device: int, order: Any = None) -> None:
        self.source, self.device, self.order = source, device, order
        # Held by a reader for its whole read (see admit), and by the scaler to close or rewrite the record.
        self.lock = threading.Lock()
        self._step: int | None = None  # the step whose completed check() the record holds; None: "skip"
        self._readers: set[int] = set()  # the optimizers (by id) that applied it in that step

    def completed(self, step: int) -> None:
        """Note that step ``step``'s ``check()`` completed: its record may now be applied, once per optimizer."""
        with self.lock:
            self._step, self._readers = step, set()

    def closed(self) -> None:
        """Note that the record holds no step's check any more (a step opened or closed, a state was loaded).

        Waits for a reader that is applying it (another thread's optimizer step) to finish.
        """
        with self.lock:
            self._step, self._readers = None, set()

    def admit(self, reader: object, step: int, stream: Any = None) -> np.ndarray | int:
        """Let ``reader`` read step ``step``'s record once, and return its source. Call it holding :attr:`lock`,
        for the whole read (``with record.lock:``, a lock entered and left in C: no interrupt leaves it held),
        then :meth:`queued` once the reads are queued.

        The reader notes itself (:meth:`applied_by`) before its first write, once it is marked torn: an
        interrupted read never lets it apply the record twice. On the GPU, ``stream`` (where the reads are
        queued) first waits for the record's last write.

        Raises:
            ScalerProtocolError: The record holds another step's check (``update()`` closed this one), or
                ``reader`` applied it already.
        """
        if self._step != step:
            raise ScalerProtocolError(
                "step(): these statistics are of a step that the scaler's update() already closed (or whose "
                "check() did not complete); each step is check() (or scaler.step(optimizer, gradients)), the "
                "optimizer step, then update(). Pass the statistics of this step's check()."
            )
        if id(reader) in self._readers:
            raise ScalerProtocolError(
                "step(): this optimizer already applied these statistics (one update per check()); run the "
                "next step's check() first."
            )
        if self.order is not None:
            self.order.read(stream)
        return self.source

    def applied_by(self, reader: object) -> None:
        """Note that ``reader`` applies the record (holding :attr:`lock`): it is not admitted again."""
        self._readers = {*self._readers, id(reader)}

    def refused(self, reader: object) -> None:
        """Forget :meth:`applied_by`: the read was refused before it wrote anything."""
        self._readers = self._readers - {id(reader)}

    def queued(self, stream: Any = None) -> None:
        """Note that reads are queued on ``stream``: the record's next write waits for them (on the GPU)."""
        if self.order is not None:
            self.order.read_done(stream)


@dataclass(frozen=True)
class GradientStats:
    """One step's statistics from ``check()``, in device memory for CuPy gradients (host memory for NumPy).

    The arrays are views of the scaler's record: they hold the values of the
    latest ``check()``, and reading one on the host synchronizes
    (``float(stats.norm)``).

    Attributes:
        norm: 0-d float32 array, the L2 norm of all the step's unscaled gradients
            (inf or nan after an overflow).
        clip_coefficient: 0-d float32 array, ``min(1, max_norm / (norm + 1e-6))``
            (1 without ``max_norm``).
        factor: 0-d float32 array, the inverse scale times ``clip_coefficient``
            (rounded to float32 once): what to multiply each still-scaled
            gradient by, as the fused optimizers do inside their update. An
            optimizer of your own applies it, and skips the step unless ``finite``.
        finite: 0-d bool array, the step's verdict (True: no rank overflowed).
        record: The record they are views of, which the fused optimizers read.
        step: The step of the ``check()`` that made them.
    """

    norm: Any
    clip_coefficient: Any
    factor: Any
    finite: Any
    record: StatsRecord
    step: int

    @property
    def device(self) -> int:
        """Where the record is (-1: the host)."""
        return self.record.device

    def __repr__(self) -> str:
        where = "on the host" if self.record.device < 0 else f"on device {self.record.device}"
        return f"GradientStats(step {self.step}, {where}; read .norm, .clip_coefficient, .factor, .finite)"
