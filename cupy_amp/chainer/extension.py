"""LossScaleExtension: a ``chainer.training.Trainer`` extension that reports the scale and serializes the scaler."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_amp.checkpoint import GradScalerCheckpoint

if TYPE_CHECKING:
    from cupy_amp.chainer.attach import Attachment

__all__ = ["LossScaleExtension"]

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
    loading a snapshot. It is a plain object with the attributes Chainer reads
    (``trigger``, ``priority``, ``default_name``, ``serialize``), so this
    module imports without Chainer. Never synchronizes the device, except to
    copy the masters when saving or loading.
    """

    trigger = (1, "iteration")
    priority = _PRIORITY_WRITER
    default_name = "cupy_amp_loss_scale"

    def __init__(self, attachment: Attachment) -> None:
        self._attachment = attachment

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
        masters = serializer["fp32_masters"]
        for name, master in attachment.masters():
            masters(name.lstrip("/"), master.array)  # saved, or loaded into the array in place
        if isinstance(serializer, chainer.serializer.Serializer):
            data = attachment.scaler.checkpoint().to_bytes()
            serializer("scaler", np.frombuffer(data, dtype=np.uint8))
        else:
            stored = serializer("scaler", None)
            checkpoint = GradScalerCheckpoint.from_bytes(np.asarray(stored, dtype=np.uint8).tobytes())
            attachment.load_checkpoint(checkpoint)
