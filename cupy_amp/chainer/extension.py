"""LossScaleExtension: a ``chainer.training.Trainer`` extension that reports the scale and serializes the scaler."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from cupy_amp.checkpoint import GradScalerCheckpoint
from cupy_amp.errors import CheckpointFieldError, ScalerProtocolError
from cupy_amp.scaler import GradScaler

__all__ = ["LossScaleExtension"]


class Attached(Protocol):
    """What the extension reads of an attachment (:class:`cupy_amp.chainer.attach.Attachment`, which builds it)."""

    @property
    def scaler(self) -> GradScaler: ...
    @property
    def optimizer(self) -> Any: ...
    @property
    def attached_at(self) -> int: ...
    def master_slots(self) -> Iterator[tuple[str, Any]]: ...
    def load_checkpoint(self, checkpoint: Any) -> None: ...


logger = logging.getLogger(__name__)

_PRIORITY_WRITER = 300  # chainer.training.PRIORITY_WRITER: runs before the extensions that read the observation


class LossScaleExtension:
    """Report the loss scale and the skipped steps each iteration; save and load the scaler with the trainer.

    ``trainer.extend(attachment.extension())``. Each iteration it reports
    ``loss_scale`` and ``skipped_steps`` (steps skipped so far) to
    ``chainer.reporter``, so ``LogReport`` and ``PrintReport`` can show them.
    Serialized with the trainer (``extensions.snapshot()``,
    ``chainer.serializers.load_npz(path, trainer)``): the scaler's checkpoint
    (:meth:`GradScalerCheckpoint.to_bytes`, versioned and checksummed, under the
    key ``scaler``) and the fp32 masters of float16 parameters (under
    ``fp32_masters/``), which Chainer's own optimizer snapshot leaves out, so a
    resumed run continues bit for bit. Register it on the new trainer before
    loading a snapshot: a trainer that resumed without it is refused when it
    runs. A snapshot made without it (mixed precision added to a run) starts the
    scaler at its initial scale, with masters from the loaded float16 weights,
    and logs a warning. It is a plain object with the attributes Chainer reads
    (``trigger``, ``priority``, ``default_name``, ``serialize``), so this
    module imports without Chainer. Never synchronizes the device, except to
    copy the masters when saving or loading.
    """

    trigger = (1, "iteration")
    priority = _PRIORITY_WRITER
    default_name = "cupy_amp_loss_scale"

    def __init__(self, attachment: Attached) -> None:
        self._attachment = attachment
        self._loaded = False  # a snapshot was loaded through it (holding its state or not)

    def initialize(self, trainer: Any) -> None:
        """Refuse a trainer that resumed from a snapshot before this extension was registered.

        Raises:
            ScalerProtocolError: A snapshot was loaded without this extension (the optimizer's step count
                changed since the scaler was attached, or float16 parameters hold update steps but no fp32
                master), this scaler has taken no step, and no snapshot was loaded through it. (A scaler
                attached to an optimizer that trained in this process is not refused: its masters exist.)
        """
        iteration = trainer.updater.iteration
        attachment = self._attachment
        moved = attachment.optimizer.t != attachment.attached_at
        # Loaded before attach(): the update rules hold steps (from the file), and no master (Chainer's
        # snapshot has none; a run that trained in this process has them).
        masterless = any(
            param.update_rule.t > 0 and param.update_rule._fp32_param is None and param.dtype == np.float16
            for _, param in attachment.master_slots()
        )
        if iteration > 0 and (moved or masterless) and not self._loaded and attachment.scaler.stats().steps == 0:
            raise ScalerProtocolError(
                f"The trainer resumed at iteration {iteration}, but this loss-scale extension was not registered "
                "when the snapshot was loaded, so the scaler's state and the fp32 masters were not restored: the "
                "scale would restart at its initial value and the masters be rebuilt from float16 weights. Call "
                "trainer.extend(attachment.extension()) before chainer.serializers.load_npz(path, trainer)."
            )

    def __call__(self, trainer: Any) -> None:
        import chainer

        stats = self._attachment.scaler.stats()
        chainer.reporter.report({"loss_scale": stats.scale, "skipped_steps": stats.skipped_steps})

    def serialize(self, serializer: Any) -> None:
        """Save the scaler and the fp32 masters into ``serializer``, or load them from a deserializer.

        Raises:
            CheckpointError: The stored scaler checkpoint is damaged or of an unknown version.
            ScalerProtocolError: A step is open.
        """
        import chainer

        attachment = self._attachment
        if isinstance(serializer, chainer.serializer.Serializer):
            masters = serializer["fp32_masters"]
            for name, param in attachment.master_slots():
                if param.update_rule._fp32_param is not None:  # a frozen layer's too: it trains again later
                    masters(name.lstrip("/"), param.update_rule._fp32_param.array)
            data = attachment.scaler.checkpoint().to_bytes()
            serializer("scaler", np.frombuffer(data, dtype=np.uint8))
            return
        try:
            stored = serializer("scaler", None)
        except KeyError:  # Chainer's strict deserializers (a lenient one returns None)
            stored = None
        if stored is None:
            self._start_afresh()
            return
        checkpoint = GradScalerCheckpoint.from_bytes(np.asarray(stored, dtype=np.uint8).tobytes())
        masters = serializer["fp32_masters"]
        loaded = []
        for name, param in attachment.master_slots():
            try:
                array = masters(name.lstrip("/"), None)
            except KeyError:
                array = None
            loaded.append((param, None if array is None else _master_array(name, param, array)))
        for param, array in loaded:  # every master read and checked before any is set
            _set_master(chainer, param, array)
        attachment.load_checkpoint(checkpoint)
        self._loaded = True

    def _start_afresh(self) -> None:
        """Resume from a snapshot without this extension's state: the masters become the loaded weights."""
        import chainer

        attachment = self._attachment
        for _, param in attachment.master_slots():
            _set_master(chainer, param, None)
        self._loaded = True
        logger.warning(
            "cupy-amp: the snapshot holds no cupy-amp loss-scale state (made without the extension, or under "
            "another name): the scaler starts at scale %g, and the fp32 masters are the loaded float16 weights.",
            attachment.scaler.scale_factor(),
        )


def _master_array(name: str, param: Any, stored: Any) -> Any:
    """The stored master of ``param`` as a float32 array where the parameter is.

    Raises:
        CheckpointFieldError: It does not have the parameter's shape.
    """
    stored = np.asarray(stored)
    if stored.shape != param.shape:
        raise CheckpointFieldError(
            f"Invalid fp32 master of {name!r}: expected shape {param.shape} (its parameter's), got {stored.shape}."
        )
    return param.device.send(stored.astype(np.float32))


def _set_master(chainer: Any, param: Any, array: Any) -> None:
    """Make ``array`` the master of ``param``; None: the snapshot held none (none existed when it was saved).

    Without one, an existing master (made from the new model's own weights) becomes the loaded weights;
    a missing one is made from them at the next step, as Chainer makes it.
    """
    rule = param.update_rule
    if array is None:
        if rule._fp32_param is not None:
            rule._fp32_param.array[...] = param.array.astype(np.float32)
    elif rule._fp32_param is None:
        rule._fp32_param = chainer.Parameter(array, name=param.name)
    else:
        rule._fp32_param.array[...] = array
