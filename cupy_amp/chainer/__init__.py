"""Chainer 7.8 integration: a cupy-amp :class:`~cupy_amp.GradScaler` as the loss scaler of a Chainer optimizer.

``attachment = attach(optimizer, GradScaler())`` after ``optimizer.setup(model)``;
``trainer.extend(attachment.extension())`` with a Trainer. Importing this
package does not import Chainer (:func:`attach` does). How the scaler plugs
into Chainer's optimizer is described in :mod:`cupy_amp.chainer.attach`. On
NumPy 2 (CuPy 14), call :func:`chainer_on_numpy2` before ``import chainer``.
"""

from cupy_amp.chainer.attach import Attachment, attach
from cupy_amp.chainer.extension import LossScaleExtension
from cupy_amp.chainer.numpy2 import chainer_on_numpy2

__all__ = ["Attachment", "LossScaleExtension", "attach", "chainer_on_numpy2"]
