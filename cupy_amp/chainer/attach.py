"""Attach a :class:`~cupy_amp.GradScaler` to a Chainer 7.8 ``GradientMethod``, through Chainer's own seams.

Chainer's ``GradientMethod.update(lossfun)`` makes the loss, clears the
gradients, calls ``loss.backward(loss_scale=self._loss_scale)`` (which stamps
``param._loss_scale`` on every parameter it reaches), then
``check_nan_in_grads()``, the optimizer's 'pre' hooks, ``is_safe_to_update()``,
``param.update()`` for each parameter (its ``UpdateRule``), the 'post' hooks
and ``update_loss_scale()``. :func:`attach` sets these names on the optimizer
object itself (no subclass), so Chainer's ``update`` runs unchanged around them:

- ``update``: the one call wrapped. It hands Chainer's ``update`` a loss
  function that seeds its loss (Chainer has no seam between the loss and its
  backward pass): ``scale_loss`` opens the step on a float32 seed of ones,
  which becomes the scale; it goes to ``loss.grad`` in the loss's dtype, so
  Chainer's backward starts from it. A float16 loss whose seed float16 cannot
  hold is refused before the step opens. After an exception inside the step,
  the float16 parameters are put back (see below), the scaler's step is ended
  (dropped before its check) and every gradient is cleared.
- ``_loss_scale``: the scale, so the backward stamps it on the parameters
  (which shows the backward was seeded with this step's scale) and a manual
  loop may seed with ``loss.backward(loss_scale=optimizer._loss_scale)``.
- ``check_nan_in_grads``: one ``unscale_and_check`` over every gradient, by
  ``namedparams()`` name (one host read per step; the culprits are those
  names), then the stamps are cleared, so no hook (``WeightDecay``) or update
  rule corrects for a scale that is gone.
- ``is_safe_to_update``: that check's verdict; ``update_loss_scale``:
  ``scaler.update()``, the next scale into ``_loss_scale``, the float16
  parameters put back.
- ``loss_scaling`` and ``set_loss_scale``: refuse (two scalers would scale twice).

The unscale of a float16 parameter with an fp32 master (``use_fp32_update()``)
is the delicate part. Chainer converts ``param.grad`` to float32 inside
``UpdateRule.update``, after the optimizer's hooks, so a hook sees float16
gradients; unscaling them in float16 flushes the small ones to zero. Here the
check unscales a float32 copy of the gradient, and until the end of the step
the parameter *is* its master (``UpdateRule._fp32_param``, created as Chainer
creates it when missing): its array is the master's float32 array and its
gradient the unscaled float32 copy. The hooks (``GradientClipping``,
``WeightDecay``) see float32 unscaled gradients and master weights; the update
rule takes its plain float32 path on the master; at the end the parameter
becomes the master rounded to float16 (after a skipped step: its old array,
untouched) with its gradient rounded to float16. Other gradients are unscaled
in place: float32, and float16 without a master (whose update runs in float16
anyway).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from cupy_amp.chainer.extension import LossScaleExtension
from cupy_amp.errors import ArgumentTypeError, GradientTypeError, GradientValueError, ScalerProtocolError
from cupy_amp.rule import inverse_scale
from cupy_amp.scaler import GradScaler
from cupy_amp.statistics import expect_max_norm

__all__ = ["Attachment", "attach"]

logger = logging.getLogger(__name__)

_MARK = "_cupy_amp_attachment"  # the optimizer's attribute that holds its Attachment
# The optimizer each scaler is attached to (both weak: the optimizer holds the scaler), for one scaler per optimizer.
_ATTACHED: weakref.WeakKeyDictionary[GradScaler, weakref.ref[Any]] = weakref.WeakKeyDictionary()
_SEAMS = ("update", "check_nan_in_grads", "is_safe_to_update", "update_loss_scale", "loss_scaling", "set_loss_scale")
_FLOAT16_MAX = float(np.finfo(np.float16).max)


def _chainer() -> Any:
    try:
        import chainer
    except ImportError as exc:
        raise ImportError(
            "cupy_amp.chainer needs Chainer 7.8.1, which builds only with old setuptools: pip install "
            '"setuptools<70" wheel "numpy<2", then pip install --no-build-isolation chainer==7.8.1 (on NumPy 2, '
            f"call cupy_amp.chainer.chainer_on_numpy2() before importing it): {exc}"
        ) from exc
    return chainer


class _StandIn:
    """A float16 parameter that is its fp32 master for the rest of the step."""

    __slots__ = ("array", "grad", "master", "param")

    def __init__(self, param: Any, master: Any, grad: Any) -> None:
        self.param, self.master = param, master  # master: the rule's _fp32_param
        self.array = param.array  # its own float16 array, put back after a skipped step
        self.grad = grad  # the float32 gradient it carries (what the hooks left is read back at the end)


def attach(optimizer: Any, scaler: GradScaler, *, max_norm: float | None = None) -> Attachment:
    """Make ``scaler`` the loss scaler of a Chainer ``GradientMethod``; return the attachment.

    After this, ``optimizer.update(lossfun, *args)`` (what Chainer's
    ``StandardUpdater`` calls) seeds the backward pass with the scale, checks
    and unscales every gradient in one pass, skips the step on inf/nan and
    adapts the scale. A manual loop seeds with ``attachment.backward(loss)``
    and then calls ``optimizer.update()``. Use ``GradScaler.guard()`` for
    float32 training that only needs the skip. Synchronizes the device once per
    step (the check); attaching does not.

    With ``max_norm``, the unscaled gradients are also clipped to that global
    L2 norm, with the norm the scaler's check reads in its one pass over them
    (``check(gradients, max_norm=)``), then one pass multiplies each gradient
    by the step's factor (inverse scale times clip coefficient): Chainer's
    ``GradientClipping`` hook reads every gradient again and writes it again,
    and is not to be added as well.

    Raises:
        ArgumentTypeError: ``optimizer`` is not a ``chainer.optimizer.GradientMethod``, or
            ``scaler`` is not a ``GradScaler``.
        ScalerProtocolError: The optimizer already has a cupy-amp scaler, or Chainer's own
            loss scaling (``loss_scaling()``, ``set_loss_scale()``) is on.
        ConfigError: ``max_norm`` is not None or a finite number > 0.
        ImportError: Chainer is not installed.
    """
    limit = expect_max_norm(max_norm)
    chainer = _chainer()
    if not isinstance(optimizer, chainer.optimizer.GradientMethod):
        raise ArgumentTypeError(
            f"attach() takes a chainer.optimizer.GradientMethod (SGD, MomentumSGD, Adam, ...); got "
            f"{type(optimizer).__name__}."
        )
    if not isinstance(scaler, GradScaler):
        raise ArgumentTypeError(
            f"attach() takes a cupy_amp.GradScaler (or GradScaler.guard()); got {type(scaler).__name__}. Chainer "
            "asks is_safe_to_update() for a Python bool every step, so a sync-free scaler would gain nothing."
        )
    if optimizer.__dict__.get(_MARK) is not None:
        raise ScalerProtocolError(
            "This optimizer already has a cupy-amp scaler attached: two scalers would scale the loss twice and "
            "each unscale once. Call detach() on the first attachment before attaching another scaler."
        )
    if scaler in _ATTACHED and _ATTACHED[scaler]() is not None:
        gc.collect()  # an optimizer and its attachment hold each other: a dropped one waits for the collector
    holder = _ATTACHED[scaler]() if scaler in _ATTACHED else None
    if holder is not None:
        raise ScalerProtocolError(
            f"This GradScaler is already attached to another optimizer ({type(holder).__name__}): each "
            "optimizer's update() is a whole step of its scaler, so one scaler on two optimizers would count two "
            "steps per iteration. Use one GradScaler per optimizer (a GAN's generator and discriminator each get "
            "their own), or detach() the first attachment."
        )
    if optimizer._loss_scaling_is_dynamic or optimizer._loss_scale is not None:
        raise ScalerProtocolError(
            f"This optimizer has Chainer's own loss scaling on (loss_scale={optimizer._loss_scale!r}, from "
            "loss_scaling() or set_loss_scale()): two scalers would scale the gradients twice. Build the optimizer "
            "without calling loss_scaling(), then attach the cupy-amp scaler."
        )
    return Attachment(optimizer, scaler, chainer, limit)


class Attachment:
    """A scaler attached to a Chainer optimizer: the seams it set, and the state of the open step.

    Build it with :func:`attach`.
    """

    def __init__(self, optimizer: Any, scaler: GradScaler, chainer: Any, max_norm: float = 0.0) -> None:
        self._chainer = chainer
        self._max_norm = max_norm  # 0.0: no clipping
        self._optimizer = optimizer
        self._scaler = scaler
        self._chainer_update: Callable[..., Any] = optimizer.update
        self._seeded = False  # this step's loss was seeded through _seed (scale_loss was called)
        self._checked = False  # the gradients were checked; update() of the scaler is due
        self._finite = True
        self._masters: list[_StandIn] = []  # float16 parameters standing as their masters until the step ends
        self._clear_at_end = False  # Chainer's own seed opened the step: the gradients are cleared when it ends
        self._attached_at = optimizer.t  # the optimizer's step count when attached
        # Each parameter's gradient variable as the last step left it (unscaled): still there at the next step,
        # unless cleargrads() dropped it. Weak, so a cleared gradient's memory is freed. At first, those made
        # before attaching (another attachment's last step, before a detach()): a backward would add to them.
        self._left: list[tuple[Any, weakref.ref[Any]]] = []
        self._leave()
        if optimizer.target is not None:
            for param in optimizer.target.params():
                param._loss_scale = None  # stamps of backward passes made before attaching
        seams: dict[str, Any] = {
            "update": self._update,
            "check_nan_in_grads": self._check,
            "is_safe_to_update": self._is_safe,
            "update_loss_scale": self._end_step,
            "loss_scaling": self._refuse_loss_scaling,
            "set_loss_scale": self._refuse_loss_scaling,
        }
        for name, seam in seams.items():
            setattr(optimizer, name, seam)
        optimizer._loss_scale = scaler.scale_factor()
        setattr(optimizer, _MARK, self)
        _ATTACHED[scaler] = weakref.ref(optimizer)

    @property
    def scaler(self) -> GradScaler:
        """The attached scaler."""
        return self._scaler

    @property
    def optimizer(self) -> Any:
        """The Chainer optimizer it is attached to."""
        return self._optimizer

    @property
    def attached_at(self) -> int:
        """The optimizer's step count (``optimizer.t``) when the scaler was attached."""
        return int(self._attached_at)

    def backward(self, loss: Any, **kwargs: Any) -> None:
        """Run ``loss.backward(**kwargs)`` seeded with the scale: the manual loop's backward pass.

        ``cleargrads(); attachment.backward(loss); optimizer.update()``. Call it
        once per loss (several times per step to accumulate gradients). Never
        synchronizes the device.

        Raises:
            GradientTypeError: ``loss`` is not a Chainer variable on NumPy or CuPy.
            GradientValueError: ``loss`` is not a scalar, already has a gradient, or is
                float16 and float16 cannot hold the scale (compute the loss in float32).
            ArgumentTypeError: ``loss_scale`` was passed (the scaler chooses it).
        """
        if "loss_scale" in kwargs:
            raise ArgumentTypeError("backward() takes no loss_scale: the attached scaler seeds the backward pass.")
        self._notice_dropped_step()
        if not self._seeded:  # the step's first backward: last step's gradients must be gone
            self._refuse_stale_gradients(checking=False)
        self._expect_loss(loss)  # before anything changes: a refused loss leaves the step as it was
        try:  # from the seed on, whatever stops this call drops the step
            self._seed(loss)
            loss.backward(loss_scale=self._optimizer._loss_scale, **kwargs)
        except BaseException:
            self._abandon()  # the step is dropped, its partial gradients cleared
            raise

    def abandon_step(self) -> None:
        """Drop the open step: for an exception or a Ctrl-C between its seeded backward passes.

        ``attachment.backward`` and ``optimizer.update`` drop their step
        themselves when they fail; an interrupt in a manual loop's own code
        (the forward pass of a later micro-batch) leaves it open. This ends
        it as they would: the scaler's step uncounted (``checkpoint()``
        works again; a step whose gradients were already checked is ended by
        ``update()``), the float16 parameters back, and every gradient
        cleared, so nothing of the step is added to the next or applied. Safe
        to call again after an interrupt inside it; does nothing between steps.
        """
        if self._seeded or self._checked or self._masters or self._scaler.is_step_open():
            self._abandon()

    def extension(self) -> LossScaleExtension:
        """Return a Trainer extension that reports the scale and serializes the scaler."""
        return LossScaleExtension(self)

    def masters(self) -> Iterator[tuple[str, Any]]:
        """Yield (name, fp32 master ``Parameter``) of every float16 parameter updated in fp32, creating missing ones.

        A master is created as Chainer creates it (the parameter cast to float32). A parameter whose update
        rule is disabled (a frozen layer) is left out.
        """
        for name, param in self.master_slots():
            rule = param.update_rule
            if not rule.enabled:
                continue
            if rule._fp32_param is None:
                if param.dtype != np.float16:
                    continue
                rule._fp32_param = self._chainer.Parameter(param.array.astype(np.float32), name=param.name)
            yield name, rule._fp32_param

    def master_slots(self) -> Iterator[tuple[str, Any]]:
        """Yield (name, parameter) of every parameter updated in fp32 (frozen ones too), each once: those that
        have, or may get, a master. A snapshot keeps the masters they have."""
        target = self._optimizer.target
        seen: set[int] = set()
        for name, param in target.namedparams() if target is not None else ():
            rule = getattr(param, "update_rule", None)
            if id(param) in seen or rule is None or not rule._use_fp32_update or param.array is None:
                continue  # a link registered twice (shared weights) has one master
            seen.add(id(param))
            yield name, param

    def load_checkpoint(self, checkpoint: Any) -> None:
        """Load a scaler checkpoint between steps and seed the next backward pass with its scale.

        Raises:
            As ``GradScaler.load_checkpoint``.
        """
        self._scaler.load_checkpoint(checkpoint)
        self._optimizer._loss_scale = self._scaler.scale_factor()

    def detach(self) -> None:
        """Give the optimizer back its own methods (between steps); its loss scaling is then off.

        Raises:
            ScalerProtocolError: A step is open (``backward`` was called and ``update()`` was not).
        """
        self._notice_dropped_step()
        if self._seeded or self._checked:
            raise ScalerProtocolError(
                "detach() in the middle of a step: the gradients are scaled with this scaler's scale. Call "
                "optimizer.update() first (or abandon_step() to drop the step)."
            )
        for name in _SEAMS:
            self._optimizer.__dict__.pop(name, None)
        self._optimizer.__dict__.pop(_MARK, None)
        self._optimizer._loss_scale = None
        self._left = []
        if self._scaler in _ATTACHED and _ATTACHED[self._scaler]() is self._optimizer:
            del _ATTACHED[self._scaler]

    # The seams.

    def _expect_loss(self, loss: Any) -> None:
        """Refuse a loss the step cannot be seeded through (before anything changes)."""
        chainer = self._chainer
        if not isinstance(loss, chainer.Variable) or loss.xp is chainer.backend.chainerx:
            raise GradientTypeError(
                f"The loss must be a chainer.Variable holding a NumPy or CuPy array; got {type(loss).__name__}"
                + (" on ChainerX" if isinstance(loss, chainer.Variable) else "")
                + "."
            )
        array = loss.array
        if array.size != 1:
            raise GradientValueError(
                f"The loss must be a scalar (its backward pass is seeded with the scale); got shape {array.shape}. "
                "Reduce it first (chainer.functions.sum or mean)."
            )
        if loss.grad_var is not None:
            raise GradientValueError(
                "The loss already has a gradient (loss.grad is set): the scaler seeds the backward pass with the "
                "scale itself. Leave loss.grad unset."
            )
        scale, dtype = self._scaler.scale_factor(), np.dtype(array.dtype)
        if dtype == np.float16 and float(np.float16(scale)) != scale:
            if scale > _FLOAT16_MAX:
                problem = f"its seed would be inf: float16 holds at most {_FLOAT16_MAX:g}"
            else:
                problem = "float16 cannot hold it exactly, so the gradients would not be scaled by the scale"
            raise GradientValueError(
                f"The loss is float16 and the loss scale is {scale:g}: {problem}. Compute the loss in float32 (cast "
                "the logits with chainer.functions.cast(x, 'float32') before the loss function), or keep the scale "
                "a power of two below 65536 (GradScaler(init_scale=2.0**15, max_scale=2.0**15))."
            )

    def _seed(self, loss: Any) -> None:
        """Open the step on a float32 seed that becomes the scale, and make it the gradient of ``loss``.

        Its caller drops the step if this or the backward pass after it fails.
        """
        scale, dtype = self._scaler.scale_factor(), np.dtype(loss.array.dtype)
        with self._chainer.using_device(loss.device):
            seed = loss.xp.ones(loss.array.shape, dtype=np.float32)
            self._scaler.scale_loss(seed)  # opens the step: the seed is now the scale
            self._optimizer._loss_scale = scale  # stamped on the parameters by the backward pass
            loss.grad = seed if dtype == np.float32 else seed.astype(dtype)
        self._seeded = True

    def _update(self, lossfun: Any = None, *args: Any, **kwds: Any) -> Any:
        """Chainer's own ``update``, with a loss function that seeds its loss; a failed step is ended."""
        seeded = None if lossfun is None else functools.partial(self._seeded_loss, lossfun)
        target = self._optimizer.target
        if lossfun is None and target is not None and all(param.grad_var is None for param in target.params()):
            # Chainer's update() would fill them with zeros (reallocate_cleared_grads) and apply a step of nothing.
            why = (
                " (chainer.config.enable_backprop is False: an interrupt inside a `with chainer.no_backprop_mode()` "
                "block can leave it so)"
                if not self._chainer.config.enable_backprop
                else ""
            )
            raise ScalerProtocolError(
                f"optimizer.update() found no gradient: no backward pass ran since the gradients were cleared{why}. "
                "Call attachment.backward(loss) before optimizer.update(), or optimizer.update(lossfun, *args)."
            )
        try:
            return self._chainer_update(seeded, *args, **kwds)
        except BaseException:
            self._abandon()
            raise

    def _seeded_loss(self, lossfun: Callable[..., Any], *args: Any, **kwds: Any) -> Any:
        loss = lossfun(*args, **kwds)
        self._expect_loss(loss)
        self._seed(loss)  # inside _update's try: a failure from here on drops the step
        return loss

    def _check(self) -> None:
        """Check and unscale every gradient in one call; stand float16 parameters in for their masters."""
        optimizer, scaler = self._optimizer, self._scaler
        if optimizer._loss_scaling_is_dynamic:
            raise ScalerProtocolError(
                "Chainer's own dynamic loss scaling was switched on after attaching a cupy-amp scaler: two scalers "
                "would scale the gradients twice. Leave _loss_scaling_is_dynamic off."
            )
        if self._notice_dropped_step():  # the gradients found here may hold the dropped step's: none is applied
            raise ScalerProtocolError(
                "The step this backward pass belongs to was dropped by the scaler's abandon_step(), and the "
                "gradients found here cannot be told from the dropped step's (or their sum), so they were cleared "
                "and nothing was applied. Run the step again; in a handler, attachment.abandon_step() drops the "
                "step and clears its gradients at once."
            )
        self._refuse_stale_gradients(checking=True)
        scale = scaler.scale_factor()
        params = _unique(optimizer.target.namedparams())
        self._require_seed(scale, {p._loss_scale for _, p in params} - {None}, params)
        masters = dict(self.masters())
        gradients: dict[str, Any] = {}
        standing: list[_StandIn] = []
        for name, param in params:
            master = masters.get(name)
            if master is not None and param.dtype == np.float16:
                standing.append(_StandIn(param, master, param.grad.astype(np.float32)))  # unscaled below
                gradients[name] = standing[-1].grad
            else:
                gradients[name] = param.grad
        self._seeded, self._checked = False, True
        if self._max_norm:
            stats = scaler.check(gradients, max_norm=self._max_norm)  # the step's one host read
            finite = bool(stats.finite)
            # Unscaled and clipped in one pass; a skipped step's only unscaled, as unscale_and_check leaves it.
            _multiply(gradients.values(), stats.factor if finite else inverse_scale(scale))
        else:
            finite = scaler.unscale_and_check(gradients)  # the step's one host read
        self._finite = finite
        for _, param in params:
            param._loss_scale = None  # the gradients are unscaled: nothing downstream may divide again
        for stand_in in standing:
            self._masters.append(stand_in)  # first: an interrupt while it is swapped in still puts it back
            stand_in.param.array = stand_in.master.array
            stand_in.param.grad = stand_in.grad
        if not finite:
            logger.warning(
                "cupy-amp: skipping step %d: inf/nan in the gradients of %s (loss scale %g)",
                scaler.stats().steps + 1,
                ", ".join(map(str, scaler.nonfinite_gradients())),
                scale,
            )

    def _require_seed(self, scale: float, stamps: set[Any], params: list[tuple[str, Any]]) -> None:
        """Refuse gradients seeded with another scale; open the step if Chainer's own backward path seeded them."""
        if self._seeded:
            if stamps - {scale}:
                raise ScalerProtocolError(
                    f"The backward pass was seeded with loss_scale {sorted(stamps)} but the scale is {scale:g}: "
                    "the gradients would be unscaled by the wrong factor. Seed it with attachment.backward(loss) or "
                    "optimizer.update(lossfun)."
                )
            return
        seed = next(iter(stamps)) if len(stamps) == 1 else (1.0 if not stamps else None)
        if seed != scale:
            how = (
                "a plain loss.backward(), or no backward pass since the last step"
                if seed == 1.0
                else f"loss_scale values {sorted(stamps)}"
            )
            raise ScalerProtocolError(
                f"The gradients were not seeded with the loss scale {scale:g} ({how}): they would be unscaled by "
                "the wrong factor. Use optimizer.update(lossfun, *args), or in a manual loop "
                "attachment.backward(loss) in place of loss.backward()."
            )
        # loss.backward(loss_scale=optimizer._loss_scale) (or scale 1): open the step on the seed it used.
        chainer = self._chainer
        device = params[0][1].device if params else chainer.get_device("@numpy")
        with chainer.using_device(device):
            self._scaler.scale_loss(device.xp.ones((), dtype=np.float32))
        # Its backward has run before this check sees the gradients, so a forgotten cleargrads() could not be
        # seen at the next step: the gradients are cleared when this one ends.
        self._clear_at_end = True

    def _refuse_stale_gradients(self, checking: bool) -> None:
        """Refuse gradients that are still the last step's, already unscaled (``cleargrads()`` was forgotten).

        A backward pass adds to them, and the sum, unscaled as a whole, would be
        ``g1 / scale + g2``. ``zerograds()`` (the arrays kept, filled with zeros)
        leaves nothing to add: one host read tells it apart. At the check
        (``checking``), every gradient being the last step's means no backward
        pass ran since: ``update()`` was called twice.
        """
        stale = [param.grad for param, left in self._left if param.grad_var is not None and param.grad_var is left()]
        if not stale:
            return
        xp = self._chainer.backend.get_array_module(stale[0])
        if not int(sum(xp.count_nonzero(grad) for grad in stale)):
            return
        target = self._optimizer.target
        if checking and len(stale) == sum(1 for param in target.params() if param.grad_var is not None):
            raise ScalerProtocolError(
                "optimizer.update() was called again with no backward pass since the last step: every gradient is "
                "the last step's, already applied. Each step is model.cleargrads(), attachment.backward(loss), "
                "then one optimizer.update() (or optimizer.update(lossfun, *args), which does all three)."
            )
        raise ScalerProtocolError(
            f"{len(stale)} parameter(s) still hold the last step's gradient, already unscaled: a backward pass adds "
            "to it, and the sum would be unscaled again (g1 / scale + g2). Call model.cleargrads() before each "
            "step's backward pass, as optimizer.update(lossfun) does."
        )

    def _leave(self) -> None:
        """Note each parameter's gradient as this step leaves it (see :meth:`_refuse_stale_gradients`)."""
        target = self._optimizer.target
        params = target.params() if target is not None else ()
        self._left = [(param, weakref.ref(param.grad_var)) for param in params if param.grad_var is not None]

    def _notice_dropped_step(self) -> bool:
        """Drop here too, its gradients cleared, a step the scaler's own ``abandon_step()`` dropped (in a user's
        handler); return whether there was one."""
        dropped = self._seeded and not self._scaler.is_step_open()
        if dropped:
            self._abandon()
        return dropped

    def _is_safe(self) -> bool:
        return self._finite

    def _end_step(self) -> None:
        """End the step: the scaler adapts, the next backward gets the new scale, float16 parameters come back.

        Each part can be run again after an interrupt (by :meth:`_abandon`): the scaler's step is marked
        ended only once ``update()`` returned, and the parameters are put back one by one.
        """
        self._scaler.update()
        self._checked = False
        self._optimizer._loss_scale = self._scaler.scale_factor()
        self._finish_parameters()

    def _finish_parameters(self) -> None:
        """Put the standing parameters back, clear the gradients of a step Chainer seeded, note what is left."""
        self._put_back(updated=self._finite)
        if self._clear_at_end:
            target = self._optimizer.target
            for param in target.params() if target is not None else ():
                param.cleargrad()
            self._clear_at_end = False
        self._leave()

    def _put_back(self, updated: bool) -> None:
        """Make each standing parameter float16 again: its master rounded (after an update) or its old array.

        One at a time, each removed once it is back, and each part safe to run again: an interrupt leaves
        the rest for the next call.
        """
        while self._masters:
            stand_in = self._masters[-1]
            param, master = stand_in.param, stand_in.master
            if param.array is not None and param.array.dtype != stand_in.array.dtype:  # still the master's float32
                if param.grad is not None:
                    stand_in.grad = param.grad  # as the hooks and the rule left it
                param.grad = None
                if updated:
                    master.array = param.array  # the rule may have replaced the array rather than written it
                param.array = master.array.astype(np.float16) if updated else stand_in.array
            elif param.array is not None:
                param.array = param.array  # set again: an interrupt inside Chainer's setter leaves its node float32
            if param.grad is None and stand_in.grad is not None:
                param.grad = stand_in.grad.astype(np.float16)
            self._masters.pop()

    def _abandon(self) -> None:
        """Drop the step (after an exception in a seeded backward pass or inside ``update()``, or for
        :meth:`abandon_step`): end the scaler's step (dropped before its check, ended by ``update()`` after
        it), put the parameters back and clear every gradient, so that nothing of the step is added to the
        next one or applied. Each part can run again after an interrupt: the step's flags clear last."""
        if self._checked:
            with contextlib.suppress(ScalerProtocolError):  # a check refused before it counted, or ended already
                self._scaler.update()
        with contextlib.suppress(ScalerProtocolError):  # raised only where a counted call left update() to do
            self._scaler.abandon_step()  # a scaled loss and no counted gradient call: dropped, nothing counted
        self._optimizer._loss_scale = self._scaler.scale_factor()  # the next seed, whatever was interrupted
        self._put_back(updated=self._finite)
        target = self._optimizer.target
        for param in target.params() if target is not None else ():
            param.cleargrad()
        self._left, self._clear_at_end = [], False
        self._checked = self._seeded = False

    def _refuse_loss_scaling(self, *args: Any, **kwargs: Any) -> None:
        raise ScalerProtocolError(
            "This optimizer's loss scaling is done by an attached cupy-amp scaler; Chainer's loss_scaling() / "
            "set_loss_scale() (which StandardUpdater(..., loss_scale=...) calls) would scale the gradients a "
            "second time. Drop the loss_scale argument and configure the GradScaler instead, or detach() it first."
        )


def _unique(named: Iterator[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The parameters with an array and a gradient, each once (a link registered twice shares its parameters)."""
    seen: set[int] = set()
    params = []
    for name, param in named:
        if param.array is not None and param.grad is not None and id(param) not in seen:
            seen.add(id(param))
            params.append((name, param))
    return params


def _multiply(gradients: Iterable[Any], factor: Any) -> None:
    """Multiply each gradient by ``factor`` (a 0-d float32 array) in place: in float32 and rounded to the gradient's
    dtype, as the fused optimizers apply it; float64 in float64. Spelled out, since 0-d arrays promote
    differently in NumPy 1, NumPy 2 and CuPy."""
    for grad in gradients:
        if grad.dtype == np.float32:
            grad *= factor
        elif grad.dtype == np.float64:
            grad *= factor.astype(np.float64)
        else:
            grad[...] = (grad.astype(np.float32) * factor).astype(grad.dtype)
