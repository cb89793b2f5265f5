"""cupy_amp.chainer with Chainer 7.8.1: attaching, skipping, resuming, clipping, host reads.

Here on NumPy arrays (the ``device`` fixture, "@numpy"); tests/gpu/test_chainer_gpu.py runs every test of this
file again on CuPy arrays ("@cupy:0"). Skipped where Chainer is not importable (it needs NumPy < 2, or
``chainer_on_numpy2()``; .ci/run has a pass for it).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import linecache
import logging
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from interrupts import interrupted

from cupy_amp.chainer import chainer_on_numpy2

if importlib.util.find_spec("chainer") is not None:  # NumPy is changed only where Chainer will import
    chainer_on_numpy2()  # Chainer 7.8.1 on NumPy 2 (the GPU machine's CuPy 14); nothing on NumPy 1
try:
    with warnings.catch_warnings():  # its import warns about numpy.distutils and msvccompiler: not ours to fix
        warnings.simplefilter("ignore", DeprecationWarning)
        import chainer
except ImportError as error:  # not installed, or installed but broken (a newer setuptools drops distutils parts)
    missing = error.name == "chainer"
    why = "is not installed" if missing else f"is installed but does not import ({error!r})"
    pytest.skip(f"Chainer 7.8.1 (which needs NumPy < 2) {why}", allow_module_level=True)
F = chainer.functions
L = chainer.links

from cupy_amp import GradientValueError, GradScaler, ScalerProtocolError  # noqa: E402
from cupy_amp.chainer import attach  # noqa: E402
from cupy_amp.demo.model import load_dataset  # noqa: E402
from cupy_amp.twins.step_state import HostState  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ON: Any = None  # the Chainer device of the running test (set by on_device)


@pytest.fixture
def device() -> str:
    """The Chainer device these tests run on; tests/gpu/test_chainer_gpu.py overrides it with "@cupy:0"."""
    return "@numpy"


@pytest.fixture(autouse=True)
def on_device(device: str) -> Iterator[Any]:
    """Build models and data on ``device`` (the helpers read ``ON``) and make it Chainer's current device."""
    global ON
    ON = chainer.get_device(device)
    with chainer.using_device(ON):
        yield ON
    ON = None


def host(array: Any) -> np.ndarray:
    """A NumPy copy of a NumPy or CuPy array, to compare on the host."""
    return np.array(chainer.backend.CpuDevice().send(array))


def subprocess_env() -> dict[str, str]:
    """This environment with the checkout first on PYTHONPATH (kept: it may name where Chainer is)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(autouse=True)
def _quiet_fp16() -> Any:
    """Overflow in float16 is expected in these tests; Chainer's own scaler warns once per bad parameter."""
    with np.errstate(over="ignore", invalid="ignore", under="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class MLP(chainer.Chain):
    """A 2-32-32-5 MLP in the configured dtype; its loss is computed in float32 and multiplied by ``weight``."""

    def __init__(self, weight: float = 1.0, classes: int = 5) -> None:
        super().__init__()
        self.weight = weight
        with self.init_scope():
            self.l1 = L.Linear(2, 32)
            self.l2 = L.Linear(32, 32)
            self.l3 = L.Linear(32, classes)

    def logits(self, x: Any) -> Any:
        return F.cast(self.l3(F.relu(self.l2(F.relu(self.l1(x))))), "float32")

    def __call__(self, x: Any, t: Any) -> Any:
        return F.softmax_cross_entropy(self.logits(x), t) * self.weight


def spirals(count: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """The demo's five spirals (generated, nothing downloaded): float32 points, int32 labels."""
    data = load_dataset("spirals", 0)
    return ON.send(data.x_train[:count]), ON.send(data.y_train[:count].astype(np.int32))


def build(dtype: Any = np.float16, weight: float = 1.0, optimizer: Any = None) -> tuple[Any, Any]:
    """A freshly initialized MLP (seeded) in ``dtype`` with ``optimizer`` (Adam) set up, fp32 update on."""
    with chainer.using_config("dtype", np.dtype(dtype)):
        np.random.seed(0)
        model = MLP(weight)  # initialized on the host: the same weights on every device
    model.to_device(ON)
    optimizer = optimizer if optimizer is not None else chainer.optimizers.Adam(alpha=1e-2)
    optimizer.setup(model)
    optimizer.use_fp32_update()
    return model, optimizer


def arrays(model: Any) -> dict[str, np.ndarray]:
    return {name: host(param.array) for name, param in model.namedparams()}


def assert_same_bits(left: dict[str, np.ndarray], right: dict[str, np.ndarray]) -> None:
    assert left.keys() == right.keys()
    for name in left:
        assert left[name].dtype == right[name].dtype, name
        np.testing.assert_array_equal(left[name].view(np.uint8), right[name].view(np.uint8), err_msg=name)


# The comparison: tiny gradients in float16.

# A loss weighted by 2**-24 with Adam's eps weighted alike is, in exact arithmetic, the unweighted problem: a
# stand-in for a loss averaged over ~16M tokens. In float16 its gradients underflow: unscaled they are all 0;
# Chainer's loss_scaling() stops at 65504 (it seeds in the loss's dtype), which leaves many of them subnormal.
TINY = 2.0**-24


def train_spirals(mode: str, steps: int = 150, dtype: Any = np.float16) -> tuple[float, float]:
    """Train with ``optimizer.update(model, x, t)``; return (accuracy, unweighted loss) on the training points."""
    model, optimizer = build(dtype, TINY, chainer.optimizers.Adam(alpha=1e-2, eps=1e-8 * TINY))
    if mode == "cupy-amp":
        attach(optimizer, GradScaler(init_scale=2.0**16, growth_interval=20))
    elif mode == "chainer":
        optimizer.loss_scaling()
    x, t = spirals()
    x = x.astype(dtype)
    for _ in range(steps):
        optimizer.update(model, x, t)
    with chainer.using_config("train", False), chainer.no_backprop_mode():
        logits = model.logits(x).array
    return float((logits.argmax(axis=1) == t).mean()), float(F.softmax_cross_entropy(logits, t).array)


@pytest.mark.slow
def test_fp16_mlp_learns_tiny_gradients_where_chainer_lags_and_unscaled_fp16_fails() -> None:
    # (accuracy, loss) after 150 steps, NumPy 1.26 on a CPU: ours (0.914, 0.412), Chainer's (0.766, 0.712),
    # unscaled (0.109, 1.651: the untrained model's), float32 (0.902, 0.433); README.md has the H200's. After
    # 300 steps Chainer's catches up.
    ours = train_spirals("cupy-amp")
    chainers = train_spirals("chainer")
    unscaled = train_spirals("none")
    fp32 = train_spirals("none", dtype=np.float32)
    untrained = train_spirals("none", steps=0)
    seen = f"ours {ours}, Chainer's {chainers}, float32 {fp32}"
    assert ours[0] >= fp32[0] - 0.05 and ours[1] <= 1.2 * fp32[1], seen  # as good as float32
    assert chainers[0] <= ours[0] - 0.05 and chainers[1] >= 1.2 * ours[1], seen  # Chainer's ceiling costs it
    assert unscaled == untrained  # nothing learned: every gradient was 0


class BatchNormMLP(chainer.Chain):
    """Linear, BatchNormalization, ReLU, Linear: under ``mixed16`` the linear layers hold float16 parameters
    and the normalization float32 ones (it computes in float32)."""

    def __init__(self) -> None:
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(2, 32)
            self.bn = L.BatchNormalization(32)
            self.l2 = L.Linear(32, 5)

    def __call__(self, x: Any, t: Any) -> Any:
        return F.softmax_cross_entropy(F.cast(self.l2(F.relu(self.bn(self.l1(x)))), "float32"), t)


def train_batch_norm_mlp(dtype: Any, steps: int = 80) -> tuple[list[float], Any]:
    """Train a BatchNormMLP built under ``chainer.config.dtype = dtype``; return its losses and attachment
    (a GradScaler on fp32 masters for mixed16, none for float32)."""
    with chainer.using_config("dtype", dtype):
        np.random.seed(0)
        model = BatchNormMLP()
        model.to_device(ON)
        x, t = spirals(128)
        x = x.astype(np.float16 if dtype is chainer.mixed16 else np.float32)  # mixed16's inputs are float16
        optimizer = chainer.optimizers.Adam(alpha=1e-2)
        optimizer.setup(model)
        attachment = None
        if dtype is chainer.mixed16:
            optimizer.use_fp32_update()
            attachment = attach(optimizer, GradScaler(init_scale=2.0**16, growth_interval=5))
        losses = []
        for _ in range(steps):
            losses.append(float(model(x, t).array))
            optimizer.update(model, x, t)
    return losses, attachment


def test_a_mixed16_model_with_batch_normalization_trains_as_float32_does() -> None:
    # The README's recipe for a float16 model: chainer.mixed16 (float16 linear layers, float32 normalization),
    # fp32 masters, the loss in float32.
    losses, attachment = train_batch_norm_mlp(chainer.mixed16)
    model = attachment.optimizer.target
    dtypes = {name: param.dtype for name, param in model.namedparams()}
    assert dtypes["/l1/W"] == np.float16 and dtypes["/bn/gamma"] == np.float32  # float16 again after each step
    masters = dict(attachment.masters())
    assert set(masters) == {name for name, dtype in dtypes.items() if dtype == np.float16}
    assert all(master.dtype == np.float32 for master in masters.values())
    assert attachment.scaler.stats().steps == 80
    reference, _ = train_batch_norm_mlp(np.float32)
    assert losses[-1] < 0.85 * losses[0] and reference[-1] < 0.85 * reference[0], (losses, reference)  # both learn
    assert losses[-1] == pytest.approx(reference[-1], rel=0.03), (losses[-1], reference[-1])  # alike


# Skipping.


def test_injected_inf_skips_the_step_keeps_the_parameters_and_names_the_culprit(caplog: Any) -> None:
    model, optimizer = build()
    attachment = attach(optimizer, GradScaler(init_scale=2.0**10))
    x, t = spirals(64)
    x = x.astype(np.float16)
    optimizer.update(model, x, t)  # one clean step: the masters and Adam's moments exist
    before, masters = arrays(model), {name: host(m.array) for name, m in attachment.masters()}
    moments = {name: {k: host(v) for k, v in p.update_rule.state.items()} for name, p in model.namedparams()}
    model.cleargrads()
    attachment.backward(model(x, t))
    model.l2.W.grad[3, 4] = np.inf
    with caplog.at_level(logging.WARNING, logger="cupy_amp.chainer.attach"):
        optimizer.update()
    assert_same_bits(arrays(model), before)
    assert_same_bits({name: host(m.array) for name, m in attachment.masters()}, masters)
    for name, param in model.namedparams():
        assert_same_bits({k: host(v) for k, v in param.update_rule.state.items()}, moments[name])
    stats = attachment.scaler.stats()
    assert stats.scale == 2.0**9 and stats.skipped_steps == 1 and stats.steps == 2
    assert attachment.scaler.nonfinite_gradients() == ["/l2/W"]
    assert "/l2/W" in caplog.text and "skipping step 2" in caplog.text
    optimizer.update(model, x, t)  # and training goes on
    assert not attachment.scaler.had_overflow()
    assert all(np.isfinite(host(param.array)).all() for param in model.params())


def test_optimizer_t_counts_every_step_and_the_rules_count_the_updates_applied() -> None:
    # Chainer adds 1 to optimizer.t before asking is_safe_to_update(): t counts the iterations (what schedules
    # keyed on it expect), and Adam's lr stays defined even when the first step is skipped (observe_lr reads it
    # every iteration). The update rules' own t move only on an applied update, so Adam's update is right.
    model, optimizer = build()
    attachment = attach(optimizer, GradScaler(init_scale=2.0**10))
    x, t = spirals(32)
    x = x.astype(np.float16)
    for step in range(5):
        model.cleargrads()
        attachment.backward(model(x, t))
        if step in (0, 3):
            model.l1.b.grad[0] = np.nan
        optimizer.update()
        assert optimizer.lr > 0  # defined from the first step on, skipped or not
    assert attachment.scaler.stats().skipped_steps == 2
    assert optimizer.t == 5
    assert {param.update_rule.t for param in model.params()} == {3}


def test_guard_scaler_skips_float32_steps_with_a_plain_backward() -> None:
    model, optimizer = build(np.float32)
    attachment = attach(optimizer, GradScaler.guard())
    x, t = spirals(64)
    before = arrays(model)
    model.cleargrads()
    model(x, t).backward()  # scale 1: Chainer's own unseeded backward is the right seed
    model.l1.b.grad[0] = np.nan
    optimizer.update()
    assert_same_bits(arrays(model), before)
    assert attachment.scaler.nonfinite_gradients() == ["/l1/b"]
    assert attachment.scaler.stats().scale == 1.0


def test_manual_loop_and_update_with_a_loss_function_take_the_same_steps() -> None:
    x, t = spirals(64)
    x = x.astype(np.float16)
    runs = []
    for loop in ("lossfun", "manual", "chainer idiom"):
        model, optimizer = build()
        attachment = attach(optimizer, GradScaler(init_scale=2.0**20, growth_interval=2))
        for _ in range(6):
            if loop == "lossfun":
                optimizer.update(model, x, t)
                continue
            model.cleargrads()
            if loop == "manual":
                attachment.backward(model(x, t))
            else:
                model(x, t).backward(loss_scale=optimizer._loss_scale)
            optimizer.update()
        runs.append((arrays(model), attachment.scaler.checkpoint()))
    for params, checkpoint in runs[1:]:
        assert_same_bits(params, runs[0][0])
        assert checkpoint == runs[0][1]
    assert runs[0][1].growths >= 1 and runs[0][1].backoffs >= 1  # the scale moved both ways


def test_an_exception_inside_the_step_puts_float16_parameters_back_and_ends_the_step() -> None:
    model, optimizer = build()
    attachment = attach(optimizer, GradScaler(init_scale=2.0**10))
    x, t = spirals(16)
    x = x.astype(np.float16)

    def failing_hook(optimizer: Any) -> None:
        raise KeyboardInterrupt

    optimizer.add_hook(failing_hook, name="fails", timing="post")
    with pytest.raises(KeyboardInterrupt):
        optimizer.update(model, x, t)
    assert all(param.dtype == np.float16 and param.grad is None for param in model.params())  # a failed step's
    assert all(param.node.dtype == np.float16 for param in model.params())  # gradients are cleared with it
    assert_same_bits(arrays(model), {name: host(m.array).astype(np.float16) for name, m in attachment.masters()})
    assert attachment.scaler.checkpoint().steps == 1  # the step was ended: a checkpoint can be taken
    optimizer.remove_hook("fails")
    optimizer.update(model, x, t)
    assert attachment.scaler.stats().steps == 2


class InterruptingBackward(chainer.Function):
    """The identity whose backward raises KeyboardInterrupt: a Ctrl-C in the middle of the backward pass."""

    def forward(self, inputs: Any) -> Any:
        return inputs

    def backward(self, inputs: Any, grads: Any) -> Any:
        raise KeyboardInterrupt


def trains_as_if_never_interrupted(loop: str, interruption: Any) -> None:
    """After one step, ``interruption(model, attachment, x, t)`` (and then three steps) leaves a run that is bit
    for bit the one without it. The interruption returns how many whole steps it trained itself (None: 0)."""
    x, t = spirals(32)
    x = x.astype(np.float16)
    runs, extra = [], 0
    for interrupt in (True, False):
        model, optimizer = build()
        attachment = attach(optimizer, GradScaler(init_scale=2.0**10, growth_interval=2))
        optimizer.update(model, x, t)
        if interrupt:
            extra = interruption(model, attachment, x, t) or 0
        for _ in range(3 if interrupt else 3 + extra):
            train_one_step(loop, attachment, x, t)
        runs.append((arrays(model), attachment.scaler.checkpoint()))
    assert_same_bits(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]


@pytest.mark.parametrize("loop", ["lossfun", "manual"])
def test_a_ctrl_c_in_the_backward_pass_drops_the_step_and_the_save_in_the_handler_works(loop: str) -> None:
    # The backward pass is where a Ctrl-C usually lands. The step is dropped before its check: nothing was
    # counted, the checkpoint in the except clause is taken, and the run goes on as if the step never was.
    def interruption(model: Any, attachment: Any, x: Any, t: Any) -> None:
        before = attachment.scaler.checkpoint()
        with pytest.raises(KeyboardInterrupt):
            if loop == "lossfun":
                attachment.optimizer.update(lambda: InterruptingBackward()(model(x, t)))
            else:
                model.cleargrads()
                attachment.backward(InterruptingBackward()(model(x, t)))
        assert attachment.scaler.checkpoint() == before  # the handler's save: nothing of the step counted
        if loop == "manual":
            with pytest.raises(ScalerProtocolError, match=r"found no gradient"):
                attachment.optimizer.update()  # the interrupt came before any parameter's gradient

    trains_as_if_never_interrupted(loop, interruption)


@pytest.mark.slow
@pytest.mark.parametrize("micro_batch", [1, 2])
def test_an_interrupt_at_any_line_of_a_seeded_backward_drops_the_step(micro_batch: int) -> None:
    # attachment.backward(loss) of the step's first or second micro-batch, interrupted at its k-th line inside
    # cupy_amp for every k (the seed too: after scale_loss, before the loss has its gradient): the step is
    # dropped whole (by the call itself from the seed on; a handler's abandon_step() covers an interrupt that
    # lands between micro-batches), the save in the handler holds nothing of it, and after cleargrads() the
    # run takes the same steps as one never interrupted.
    x, t = spirals(32)
    x = x.astype(np.float16)

    def started() -> tuple[Any, Any, Any]:
        model, optimizer = build()
        attachment = attach(optimizer, GradScaler(init_scale=2.0**10, growth_interval=2))
        optimizer.update(model, x, t)
        before = attachment.scaler.checkpoint()
        model.cleargrads()
        for _ in range(micro_batch - 1):
            attachment.backward(model(x[:16], t[:16]))
        return model, attachment, before

    def finish(model: Any, attachment: Any) -> tuple[dict[str, np.ndarray], Any]:
        for _ in range(2):
            train_one_step("manual", attachment, x, t)
        return arrays(model), attachment.scaler.checkpoint()

    model, attachment, _ = started()
    expected = finish(model, attachment)
    k = 1
    while True:
        model, attachment, before = started()
        second = functools.partial(attachment.backward, model(x[16:], t[16:]))  # the forward pass runs here
        if not interrupted(second, k):
            break
        where = f"interrupted at line {k}"
        if micro_batch > 1:  # an interrupt before the seed is one between micro-batches: the handler drops the step
            attachment.abandon_step()
        assert attachment.scaler.checkpoint() == before, where  # the handler's save: nothing of the step
        assert not attachment.scaler.is_step_open(), where
        got = finish(model, attachment)
        assert_same_bits(got[0], expected[0])
        assert got[1] == expected[1], where
        k += 1
    assert k > 20  # the sweep reached the seed and the backward pass


@pytest.mark.parametrize("loop", ["manual", "chainer seed"])
@pytest.mark.parametrize("handler", ["attachment", "scaler"])
def test_an_interrupt_between_micro_batches_drops_the_step_and_its_gradients(handler: str, loop: str) -> None:
    # The forward pass of a second micro-batch is the user's own code: nothing of ours sees a Ctrl-C there.
    # The handler drops the step (attachment.abandon_step(), or the scaler's own). Its gradients are cleared
    # with it, so the next step, even without cleargrads(), neither adds nor applies them. After the scaler's
    # own call the attachment notices at the next backward it seeds; the Chainer idiom's update() cannot tell
    # the dropped gradients from new ones, so it is refused once, with the gradients cleared.
    def interruption(model: Any, attachment: Any, x: Any, t: Any) -> int:
        optimizer = attachment.optimizer
        model.cleargrads()
        attachment.backward(model(x[:16], t[:16]))
        with pytest.raises(ScalerProtocolError, match=r"abandon_step\(\)"):
            attachment.scaler.checkpoint()  # the handler must drop the step first
        (attachment if handler == "attachment" else attachment.scaler).abandon_step()
        before = attachment.scaler.checkpoint()
        if handler == "attachment":
            attachment.abandon_step()  # between steps: nothing to do
            assert attachment.scaler.checkpoint() == before
        if loop == "manual":  # the next step, without cleargrads()
            attachment.backward(model(x, t))
        else:
            model(x, t).backward(loss_scale=optimizer._loss_scale)
            if handler == "scaler":
                with pytest.raises(ScalerProtocolError, match=r"dropped by the scaler's abandon_step\(\)"):
                    optimizer.update()
                assert all(param.grad is None for param in model.params())
                assert attachment.scaler.checkpoint() == before
                model(x, t).backward(loss_scale=optimizer._loss_scale)  # the step again
        optimizer.update()
        return 1

    trains_as_if_never_interrupted(loop, interruption)


@pytest.mark.slow
def test_an_abandon_step_interrupted_at_any_line_and_called_again_drops_the_step() -> None:
    # A second Ctrl-C inside the handler's attachment.abandon_step(): the handler's retry finishes the job.
    k = 1
    while True:
        reached = False

        def interruption(model: Any, attachment: Any, x: Any, t: Any, k: int = k) -> None:
            nonlocal reached
            model.cleargrads()
            before = attachment.scaler.checkpoint()
            attachment.backward(model(x[:16], t[:16]))
            reached = interrupted(attachment.abandon_step, k)
            attachment.abandon_step()
            assert attachment.scaler.checkpoint() == before, f"line {k}"
            assert all(param.grad is None and param.dtype == np.float16 for param in model.params()), f"line {k}"
            attachment.backward(model(x, t))  # no cleargrads(): nothing of the dropped step is left to add

        trains_as_if_never_interrupted("manual", interruption)
        if not reached:
            break
        k += 1
    assert k > 10


def test_an_interrupt_inside_chainers_array_setter_leaves_no_float32_node() -> None:
    # Chainer's Variable.array setter updates the node's dtype, then the array: a Ctrl-C between the two, as
    # the check stands a float16 parameter in for its master, left the node float32, and every later
    # backward pass failed (a dtype mismatch). Putting the parameters back sets each array again.
    x, t = spirals(32)
    x = x.astype(np.float16)
    model, optimizer = build()
    attachment = attach(optimizer, GradScaler(init_scale=2.0**10))
    optimizer.update(model, x, t)
    swaps = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal swaps
        if frame.f_code.co_name != "_set_array" or frame.f_back.f_back.f_code.co_name != "_check":
            return None
        swaps += 1
        if swaps != 2:
            return None

        def line(frame: Any, event: str, arg: Any) -> Any:
            if event == "line" and "self._data[0] = d" in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
                sys.settrace(None)
                raise KeyboardInterrupt
            return line

        return line

    model.cleargrads()
    attachment.backward(model(x, t))
    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            optimizer.update()
    finally:
        sys.settrace(None)
    assert swaps == 2  # the interrupt landed in the second parameter's swap
    attachment.abandon_step()
    assert all(param.node.dtype == np.float16 == param.array.dtype for param in model.params())
    for _ in range(2):
        train_one_step("manual", attachment, x, t)
    assert attachment.scaler.stats().steps == 4  # the interrupted step was checked: update() ended it


def train_one_step(loop: str, attachment: Any, x: Any, t: Any) -> None:
    """One training step: Chainer's update(lossfun), or cleargrads, the seeded backward and update()."""
    optimizer = attachment.optimizer
    model = optimizer.target
    if loop == "lossfun":
        optimizer.update(model, x, t)
    elif loop == "chainer seed":
        model.cleargrads()
        model(x, t).backward(loss_scale=optimizer._loss_scale)
        optimizer.update()
    else:
        model.cleargrads()
        attachment.backward(model(x, t))
        optimizer.update()


# Chainer's own code that a step runs between ours: its update loop and hooks, Adam's rule, Parameter.update
# and the array and gradient setters.
CHAINER_STEP_FILES = ("optimizer.py", "optimizers/adam.py", "link.py", "variable.py")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("loop", "lines"),
    [(loop, "ours") for loop in ("lossfun", "manual", "chainer seed")]
    # update(lossfun) adds the forward and backward passes, thousands of Chainer lines that are not its step
    + [(loop, "ours and chainer's") for loop in ("manual", "chainer seed")],
)
def test_an_interrupt_at_any_line_of_a_step_leaves_float16_parameters_and_a_scaler_that_goes_on(
    loop: str, lines: str
) -> None:
    # A KeyboardInterrupt at the k-th line inside cupy_amp (and Chainer's step code) during optimizer.update,
    # for every k; then the handler's attachment.abandon_step() and save. The save works, the parameters are
    # float16 again (their nodes too) and equal their masters rounded, no step is left open, and the next
    # steps run. Chainer's lines found a Ctrl-C inside its array setter that left a float32 node.
    also: tuple[str, ...] = ()
    if lines != "ours":
        if ON.xp is not np:
            pytest.skip("Chainer's step code is the same Python on either device: swept on NumPy only")
        root = Path(chainer.__file__).parent
        also = tuple(str(root / name) for name in CHAINER_STEP_FILES)
    x, t = spirals(32)
    x = x.astype(np.float16)
    k = 1
    while True:
        model, optimizer = build()
        attachment = attach(optimizer, GradScaler(init_scale=2.0**10, growth_interval=1))
        optimizer.update(model, x, t)  # the masters and Adam's state exist
        model.cleargrads()
        if loop == "manual":
            attachment.backward(model(x, t))
        elif loop == "chainer seed":
            model(x, t).backward(loss_scale=optimizer._loss_scale)
        update = functools.partial(optimizer.update, model, x, t) if loop == "lossfun" else optimizer.update
        if not interrupted(update, k, also=also):
            break
        where = f"interrupted at line {k}"
        attachment.abandon_step()  # the handler
        attachment.scaler.checkpoint()  # its save
        assert not attachment.scaler.is_step_open(), where
        assert all(param.array.dtype == param.node.dtype == np.float16 for param in model.params()), where
        params = dict(model.namedparams())
        for name, master in attachment.masters():
            rounded = host(master.array).astype(np.float16)
            np.testing.assert_array_equal(rounded, host(params[name].array), err_msg=where)
        for _ in range(2):
            train_one_step(loop, attachment, x, t)
        k += 1
    assert k > (100 if lines == "ours" else 400)  # the sweep reached the whole step


# Resuming from a trainer snapshot.


def make_trainer(out: Path, stop: int, register: bool = True) -> tuple[Any, Any]:
    """A Trainer over the spirals (in order: no shuffling state to restore) with the extension (``register``);
    step 4 overflows."""
    model, optimizer = build()
    attachment = attach(optimizer, GradScaler(init_scale=2.0**12, growth_interval=2))
    x, t = spirals(128)
    dataset = chainer.datasets.TupleDataset(x.astype(np.float16), t)
    iterator = chainer.iterators.SerialIterator(dataset, 32, shuffle=False)
    poison = ON.xp.zeros((), np.float16)

    def loss(x: Any, t: Any) -> Any:
        poison[()] = np.inf if updater.iteration == 3 else 0
        return model(x, t) + F.sum(F.cast(model.l3.b * poison, "float32"))

    updater = chainer.training.updaters.StandardUpdater(iterator, optimizer, loss_func=loss)
    trainer = chainer.training.Trainer(updater, (stop, "iteration"), out=str(out))
    if register:
        trainer.extend(attachment.extension())
    return trainer, attachment


def test_trainer_snapshot_resumes_scale_counters_and_parameters_bit_for_bit(tmp_path: Path) -> None:
    whole, whole_attachment = make_trainer(tmp_path / "whole", 12)
    whole.run()
    first, _ = make_trainer(tmp_path / "first", 6)
    first.extend(chainer.training.extensions.snapshot(filename="snap"), trigger=(6, "iteration"))
    first.run()
    resumed, attachment = make_trainer(tmp_path / "resumed", 12)
    chainer.serializers.load_npz(str(tmp_path / "first" / "snap"), resumed)
    assert attachment.optimizer._loss_scale == attachment.scaler.scale_factor()
    resumed.run()
    stats = whole_attachment.scaler.stats()
    assert stats.skipped_steps == 1 and stats.growths >= 3  # the scale moved both ways
    assert attachment.scaler.checkpoint() == whole_attachment.scaler.checkpoint()
    assert_same_bits(arrays(attachment.optimizer.target), arrays(whole_attachment.optimizer.target))
    assert_same_bits(
        {name: host(master.array) for name, master in attachment.masters()},
        {name: host(master.array) for name, master in whole_attachment.masters()},
    )


def test_a_layer_frozen_at_the_snapshot_resumes_with_its_fp32_master(tmp_path: Path) -> None:
    # l1 trains, is frozen after iteration 2 and trains again after 5; the snapshot is taken at 4, while it is
    # frozen. Its master must be in the snapshot: rebuilt from the float16 weights, the resumed run drifts.
    def freezing(trainer: Any, attachment: Any) -> None:
        def schedule(trainer: Any) -> None:
            if trainer.updater.iteration == 2:
                attachment.optimizer.target.l1.disable_update()
            if trainer.updater.iteration == 5:
                attachment.optimizer.target.l1.enable_update()

        trainer.extend(schedule, trigger=(1, "iteration"), name="freeze")

    whole, whole_attachment = make_trainer(tmp_path / "whole", 8)
    freezing(whole, whole_attachment)
    whole.run()
    first, first_attachment = make_trainer(tmp_path / "first", 4)
    freezing(first, first_attachment)
    first.extend(chainer.training.extensions.snapshot(filename="snap"), trigger=(4, "iteration"))
    first.run()
    resumed, attachment = make_trainer(tmp_path / "resumed", 8)
    freezing(resumed, attachment)
    attachment.optimizer.target.l1.disable_update()  # as it was at the snapshot (Chainer does not save it)
    chainer.serializers.load_npz(str(tmp_path / "first" / "snap"), resumed)
    resumed.run()
    assert attachment.scaler.checkpoint() == whole_attachment.scaler.checkpoint()
    assert_same_bits(arrays(attachment.optimizer.target), arrays(whole_attachment.optimizer.target))
    assert_same_bits(
        {name: host(master.array) for name, master in attachment.masters()},
        {name: host(master.array) for name, master in whole_attachment.masters()},
    )


def test_an_extension_registered_after_the_snapshot_was_loaded_is_refused(tmp_path: Path) -> None:
    # load_npz before trainer.extend(...) leaves the scaler at its initial scale and the masters rebuilt from
    # the float16 weights, silently. The extension sees a trainer resumed without it, and refuses to run.
    first, _ = make_trainer(tmp_path / "first", 6)
    first.extend(chainer.training.extensions.snapshot(filename="snap"), trigger=(6, "iteration"))
    first.run()
    resumed, attachment = make_trainer(tmp_path / "resumed", 12, register=False)
    chainer.serializers.load_npz(str(tmp_path / "first" / "snap"), resumed)
    resumed.extend(attachment.extension())
    with pytest.raises(ScalerProtocolError, match=r"before chainer.serializers.load_npz"):
        resumed.run()
    assert attachment.scaler.stats().steps == 0  # refused before the first step


def test_a_snapshot_loaded_before_the_scaler_was_attached_is_refused(tmp_path: Path) -> None:
    # load_npz, then attach() and the extension: the masters would be rebuilt from float16 weights.
    first, _ = make_trainer(tmp_path / "first", 6)
    first.extend(chainer.training.extensions.snapshot(filename="snap"), trigger=(6, "iteration"))
    first.run()
    resumed, attachment = make_trainer(tmp_path / "resumed", 12, register=False)
    attachment.detach()
    chainer.serializers.load_npz(str(tmp_path / "first" / "snap"), resumed)
    again = attach(attachment.optimizer, GradScaler(init_scale=2.0**12, growth_interval=2))
    resumed.extend(again.extension())
    with pytest.raises(ScalerProtocolError, match=r"before chainer.serializers.load_npz"):
        resumed.run()


def test_a_scaler_added_to_a_trainer_that_already_ran_in_this_process_is_not_refused(tmp_path: Path) -> None:
    # No snapshot involved: the guard joins an optimizer that trained two iterations; a new Trainer goes on.
    model, optimizer = build(np.float32)
    x, t = spirals(64)
    iterator = chainer.iterators.SerialIterator(chainer.datasets.TupleDataset(x, t), 16, shuffle=False)
    updater = chainer.training.updaters.StandardUpdater(iterator, optimizer, loss_func=model)
    chainer.training.Trainer(updater, (2, "iteration"), out=str(tmp_path / "before")).run()
    attachment = attach(optimizer, GradScaler.guard())
    trainer = chainer.training.Trainer(updater, (4, "iteration"), out=str(tmp_path / "after"))
    trainer.extend(attachment.extension())
    trainer.run()
    assert attachment.scaler.stats().steps == 2


def test_a_snapshot_without_the_extensions_state_starts_the_scaler_afresh_with_a_warning(
    tmp_path: Path, caplog: Any
) -> None:
    # Mixed precision added to a run that had none: the snapshot holds no scaler and no masters. Loaded with
    # the extension registered first, the scaler starts at its initial scale and the masters are the loaded
    # float16 weights (not the new model's own), instead of Chainer's bare KeyError.
    first, _ = make_trainer(tmp_path / "first", 3, register=False)
    first.extend(chainer.training.extensions.snapshot(filename="snap"), trigger=(3, "iteration"))
    first.run()
    resumed, attachment = make_trainer(tmp_path / "resumed", 5)
    dict(attachment.masters())  # masters made from the new model's weights, before the load
    with caplog.at_level(logging.WARNING, logger="cupy_amp.chainer.extension"):
        chainer.serializers.load_npz(str(tmp_path / "first" / "snap"), resumed)
    assert "holds no cupy-amp loss-scale state" in caplog.text
    params = dict(attachment.optimizer.target.namedparams())
    for name, master in attachment.masters():
        np.testing.assert_array_equal(host(master.array), host(params[name].array).astype(np.float32), err_msg=name)
    assert attachment.scaler.scale_factor() == 2.0**12
    resumed.run()
    assert attachment.scaler.stats().steps == 2


def test_extension_reports_the_scale_and_skipped_steps(tmp_path: Path) -> None:
    trainer, attachment = make_trainer(tmp_path, 5)
    seen: list[dict[str, float]] = []
    trainer.extend(lambda trainer: seen.append(dict(trainer.observation)), name="spy", trigger=(1, "iteration"))
    trainer.run()
    assert [row["skipped_steps"] for row in seen] == [0, 0, 0, 1, 1]
    assert [row["loss_scale"] for row in seen] == [2.0**12, 2.0**13, 2.0**13, 2.0**12, 2.0**12]


# Hooks see unscaled gradients.


def one_step(scale: float | None, hook: Any, chainer_scale: float | None = None) -> dict[str, np.ndarray]:
    """One SGD step of the fp16 MLP with ``hook``; return how far each fp32 master moved."""
    model, optimizer = build(optimizer=chainer.optimizers.SGD(lr=0.1))
    optimizer.add_hook(hook)
    if scale is not None:
        attach(optimizer, GradScaler(init_scale=scale))
    if chainer_scale is not None:
        optimizer.set_loss_scale(chainer_scale)
    start = {name: host(param.array).astype(np.float32) for name, param in model.namedparams()}
    x, t = spirals(64)
    optimizer.update(model, x.astype(np.float16), t)
    return {name: host(param.update_rule._fp32_param.array) - start[name] for name, param in model.namedparams()}


def norm(arrays: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.sum(a.astype(np.float64) ** 2)) for a in arrays.values())))


@pytest.mark.parametrize(
    "hook", [chainer.optimizer_hooks.GradientClipping(1e-3), chainer.optimizer_hooks.WeightDecay(0.5)], ids=str
)
def test_optimizer_hooks_see_unscaled_gradients(hook: Any) -> None:
    unscaled = one_step(1.0, hook)  # scale 1: the hook's gradients are the true ones
    scaled = one_step(2.0**16, hook)
    for name in unscaled:
        np.testing.assert_allclose(scaled[name], unscaled[name], rtol=1e-3, atol=1e-9, err_msg=name)
    if isinstance(hook, chainer.optimizer_hooks.GradientClipping):
        assert norm(scaled) == pytest.approx(0.1 * 1e-3, rel=1e-3)  # lr * threshold: the clip was applied
        assert norm(one_step(None, hook, chainer_scale=2.0**10)) < norm(scaled) / 500  # Chainer's clips scaled ones


# Host reads.


def test_one_host_read_per_step_against_chainers_one_per_parameter(monkeypatch: Any) -> None:
    """Count host reads of the gradients' verdict.

    Ours: calls of the state's ``read`` (``HostState``'s on NumPy arrays,
    ``DeviceState``'s on CuPy arrays, which copies the verdict's flags to the
    host), the scaler's only read of a verdict. Chainer's:
    ``check_nan_in_grads`` turns ``xp.all(xp.isfinite(grad))`` into a Python
    bool once per parameter (a device-to-host copy each on the GPU); counted as
    its ``isfinite`` calls, with no cupy-amp code running.
    """
    if ON.xp is np:
        state = HostState
    else:
        from cupy_amp.gpu.device_state import DeviceState as state
    reads, isfinite = [0], [0]
    host_read, xp_isfinite = state.read, ON.xp.isfinite

    def counted_read(self: Any) -> Any:
        reads[0] += 1
        return host_read(self)

    def counted_isfinite(*args: Any, **kwargs: Any) -> Any:
        isfinite[0] += 1
        return xp_isfinite(*args, **kwargs)

    monkeypatch.setattr(state, "read", counted_read)
    x, t = spirals(64)
    x = x.astype(np.float16)
    model, optimizer = build()
    attach(optimizer, GradScaler(init_scale=2.0**10))
    for _ in range(3):
        optimizer.update(model, x, t)
    model, optimizer = build()
    optimizer.loss_scaling()
    monkeypatch.setattr(ON.xp, "isfinite", counted_isfinite)
    for _ in range(3):
        optimizer.update(model, x, t)
    monkeypatch.undo()
    assert reads[0] == 3
    assert isfinite[0] == 3 * len(list(model.params())) == 18


def clipped_step_deltas(max_norm: float, clip: str, scale: float = 2.0**10) -> dict[str, np.ndarray]:
    """One SGD step (lr 1) of the fp32 MLP, clipped to ``max_norm`` by the attachment's check ("fused") or by
    Chainer's GradientClipping hook ("hook"); return each parameter's change."""
    model, optimizer = build(np.float32, optimizer=chainer.optimizers.SGD(lr=1.0))
    if clip == "hook":
        optimizer.add_hook(chainer.optimizer_hooks.GradientClipping(max_norm))
        attach(optimizer, GradScaler(init_scale=scale))
    else:
        attach(optimizer, GradScaler(init_scale=scale), max_norm=max_norm)
    start = arrays(model)
    x, t = spirals(64)
    optimizer.update(model, x, t)
    return {name: host(param.array) - start[name] for name, param in model.namedparams()}


def test_max_norm_clips_with_the_checks_norm_as_chainers_hook_does() -> None:
    # The reference: the gradients of a plain float64 backward, clipped to the global norm by hand.
    model, _ = build(np.float32)
    x, t = spirals(64)
    model.cleargrads()
    model(x, t).backward()
    grads = {name: host(param.grad).astype(np.float64) for name, param in model.namedparams()}
    total = float(np.sqrt(sum(float(np.sum(g * g)) for g in grads.values())))
    max_norm = total / 4  # the clip bites: every gradient a quarter of its size
    fused, hook = clipped_step_deltas(max_norm, "fused"), clipped_step_deltas(max_norm, "hook")
    for name, g in grads.items():
        expected = -g * min(1.0, max_norm / (total + 1e-6))
        np.testing.assert_allclose(fused[name], expected, rtol=1e-4, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(fused[name], hook[name], rtol=1e-4, atol=1e-7, err_msg=name)
    assert norm(fused) == pytest.approx(max_norm, rel=1e-4)


def test_max_norm_on_a_skipped_step_leaves_the_gradients_unscaled_for_the_hooks() -> None:
    seen: list[float] = []

    def hook(optimizer: Any) -> None:  # a 'pre' hook runs on a skipped step too
        seen.append(float(optimizer.target.l1.W.grad[0, 0]))

    model, optimizer = build(np.float32, optimizer=chainer.optimizers.SGD(lr=1.0))
    optimizer.add_hook(hook, name="peek")
    attachment = attach(optimizer, GradScaler(init_scale=2.0**10), max_norm=1.0)
    x, t = spirals(16)
    model.cleargrads()
    model(x, t).backward()  # unscaled: the reference gradient
    reference = float(model.l1.W.grad[0, 0])
    model.cleargrads()
    attachment.backward(model(x, t))
    model.l2.b.grad[0] = np.inf
    before = arrays(model)
    optimizer.update()
    assert_same_bits(arrays(model), before)  # skipped
    assert seen[-1] == pytest.approx(reference, rel=1e-6)  # unscaled, not 1024 times as large


def test_max_norm_is_validated() -> None:
    from cupy_amp import ConfigError

    _, optimizer = build()
    for bad in (0.0, -1.0, float("inf"), "1"):
        with pytest.raises(ConfigError, match="Invalid 'max_norm'"):
            attach(optimizer, GradScaler(), max_norm=bad)  # type: ignore[arg-type]
    assert "update" not in optimizer.__dict__  # nothing was attached


# Errors.


def test_float16_loss_whose_seed_overflows_is_refused_before_the_step_opens() -> None:
    model, optimizer = build()
    scaler = GradScaler()  # 65536: float16's largest value is 65504
    attach(optimizer, scaler)
    x, t = spirals(16)
    with pytest.raises(
        GradientValueError, match=r"float16 and the loss scale is 65536: its seed would be inf.*in float32"
    ):
        optimizer.update(lambda: F.softmax_cross_entropy(model.l3(model.l2(model.l1(x.astype(np.float16)))), t))
    scaler.checkpoint()  # no step is open
    assert scaler.stats().steps == 0


def test_two_scalers_and_chainers_own_loss_scaling_are_refused() -> None:
    _, optimizer = build()
    attachment = attach(optimizer, GradScaler())
    with pytest.raises(ScalerProtocolError, match=r"already has a cupy-amp scaler attached.*detach\(\)"):
        attach(optimizer, GradScaler())
    with pytest.raises(ScalerProtocolError, match="would scale the gradients a second time"):
        optimizer.loss_scaling()
    attachment.detach()
    assert optimizer._loss_scale is None and optimizer.update.__func__ is chainer.optimizers.Adam.update
    optimizer.loss_scaling()
    with pytest.raises(ScalerProtocolError, match="has Chainer's own loss scaling on"):
        attach(optimizer, GradScaler())


def test_a_backward_not_seeded_with_the_scale_is_refused() -> None:
    model, optimizer = build()
    attach(optimizer, GradScaler(init_scale=2.0**10))
    x, t = spirals(16)
    model.cleargrads()
    model(x.astype(np.float16), t).backward()
    with pytest.raises(ScalerProtocolError, match=r"not seeded with the loss scale 1024 \(a plain loss.backward\(\)"):
        optimizer.update()
    model.cleargrads()
    model(x.astype(np.float16), t).backward(loss_scale=123.0)
    with pytest.raises(ScalerProtocolError, match=r"\(loss_scale values \[123\.0\]\)"):
        optimizer.update()  # the stamp it found is named


def test_update_twice_in_a_step_is_refused_as_such() -> None:
    model, optimizer = build()
    attachment = attach(optimizer, GradScaler(init_scale=2.0**10))
    x, t = spirals(16)
    model.cleargrads()
    attachment.backward(model(x.astype(np.float16), t))
    optimizer.update()
    before = arrays(model)
    with pytest.raises(ScalerProtocolError, match=r"update\(\) was called again with no backward pass"):
        optimizer.update()
    assert_same_bits(arrays(model), before)
    model.cleargrads()
    with pytest.raises(ScalerProtocolError, match=r"found no gradient: no backward pass ran since [^(]*\. Call"):
        optimizer.update()  # cleared, and still no backward
    with (
        chainer.using_config("enable_backprop", False),  # as an interrupted no_backprop_mode() leaves it
        pytest.raises(ScalerProtocolError, match=r"found no gradient: .*config\.enable_backprop is False"),
    ):
        optimizer.update()


def test_a_manual_step_without_cleargrads_is_refused_before_it_adds_last_steps_gradients() -> None:
    # Without cleargrads() the backward adds the new scaled gradient to last step's unscaled one, and the sum
    # unscaled as a whole is g1 / S + g2: a wrong update with no error. Refused, naming cleargrads().
    model, optimizer = build()
    attachment = attach(optimizer, GradScaler(init_scale=2.0**10))
    x, t = spirals(16)
    x = x.astype(np.float16)
    model.cleargrads()
    attachment.backward(model(x, t))
    optimizer.update()
    before = arrays(model)
    with pytest.raises(ScalerProtocolError, match=r"cleargrads\(\) before each step's backward"):
        attachment.backward(model(x, t))  # no cleargrads() since the last step
    assert_same_bits(arrays(model), before)
    assert attachment.scaler.stats().steps == 1  # refused before the step opened
    model.cleargrads()
    attachment.backward(model(x, t))
    optimizer.update()  # the loop goes on once the gradients are cleared
    assert attachment.scaler.stats().steps == 2


def test_chainers_own_seed_without_cleargrads_takes_the_same_steps_as_with_it() -> None:
    # loss.backward(loss_scale=optimizer._loss_scale) runs before the attachment sees the gradients, so a
    # forgotten cleargrads() could not be told from a cleared gradient there: a step that Chainer's own seed
    # opened clears the gradients when it ends, and the next backward starts from nothing either way.
    x, t = spirals(16)
    x = x.astype(np.float16)
    runs = []
    for clear in (True, False):
        model, optimizer = build()
        attach(optimizer, GradScaler(init_scale=2.0**10, growth_interval=2))
        model.cleargrads()  # Chainer starts every gradient as NaN
        for _ in range(4):
            if clear:
                model.cleargrads()
            model(x, t).backward(loss_scale=optimizer._loss_scale)
            optimizer.update()
        assert all(param.grad is None for param in model.params())  # cleared as the step ended
        runs.append(arrays(model))
    assert_same_bits(runs[1], runs[0])


def test_zerograds_and_a_parameter_the_backward_skips_are_not_stale_gradients() -> None:
    # zerograds() keeps each gradient array, filled with zeros: nothing of the last step is added.
    model, optimizer = build()
    attachment = attach(optimizer, GradScaler(init_scale=2.0**10))
    x, t = spirals(16)
    x = x.astype(np.float16)
    for _ in range(3):
        model.zerograds()
        attachment.backward(model(x, t))
        optimizer.update()
    assert attachment.scaler.stats().steps == 3


def test_one_scaler_attached_to_two_optimizers_is_refused_and_one_each_works() -> None:
    # Each optimizer's update() is a whole step of its scaler: one scaler on two optimizers would count two
    # steps per iteration (growth twice as fast, each overflow counted twice). A GAN's optimizers each get one.
    generator, generator_optimizer = build()
    discriminator, discriminator_optimizer = build()
    scaler = GradScaler(init_scale=2.0**10)
    first = attach(generator_optimizer, scaler)
    with pytest.raises(ScalerProtocolError, match=r"one GradScaler per optimizer"):
        attach(discriminator_optimizer, scaler)
    assert "update" not in discriminator_optimizer.__dict__  # nothing was set on the refused optimizer
    first.detach()
    attach(discriminator_optimizer, scaler)  # free again once detached
    x, t = spirals(16)
    x = x.astype(np.float16)
    attach(generator_optimizer, GradScaler(init_scale=2.0**10))
    for _ in range(2):
        generator_optimizer.update(generator, x, t)
        discriminator_optimizer.update(discriminator, x, t)
    assert scaler.stats().steps == 2  # one step per iteration


def test_gradients_left_before_attaching_are_refused_as_a_forgotten_cleargrads() -> None:
    # detach() and attach again (or attach after training without a scaler): the last step's gradients are
    # still on the parameters, and a backward without cleargrads() would add to them.
    model, optimizer = build()
    attachment = attach(optimizer, GradScaler(init_scale=2.0**10))
    x, t = spirals(16)
    x = x.astype(np.float16)
    train_one_step("manual", attachment, x, t)
    attachment.detach()
    attachment = attach(optimizer, GradScaler(init_scale=2.0**10))
    with pytest.raises(ScalerProtocolError, match=r"cleargrads\(\) before each step's backward"):
        attachment.backward(model(x, t))
    train_one_step("manual", attachment, x, t)  # cleared first: goes on
    assert attachment.scaler.stats().steps == 1


def test_a_scaler_whose_optimizer_was_dropped_attaches_again_without_waiting_for_the_collector() -> None:
    model, optimizer = build()
    scaler = GradScaler()
    attach(optimizer, scaler)
    del model, optimizer  # the optimizer and its attachment hold each other: only the collector frees them
    _, again = build()
    attach(again, scaler)


def test_a_standard_updater_with_loss_scale_is_refused_naming_its_argument() -> None:
    model, optimizer = build()
    attach(optimizer, GradScaler())
    iterator = chainer.iterators.SerialIterator(chainer.datasets.TupleDataset(*spirals(8)), 4)
    with pytest.raises(ScalerProtocolError, match=r"StandardUpdater\(\.\.\., loss_scale=\.\.\.\)"):
        chainer.training.updaters.StandardUpdater(iterator, optimizer, loss_scale=128)


def test_importing_cupy_amp_chainer_does_not_import_chainer() -> None:
    code = "import sys, cupy_amp, cupy_amp.chainer; sys.exit('chainer' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, check=False).returncode == 0


@pytest.mark.slow
def test_example_trains_with_the_extension(tmp_path: Path, device: str) -> None:
    script = REPO / "examples" / "chainer_train.py"
    done = subprocess.run(
        [sys.executable, str(script), "--epochs", "2", "--device", device, "--out", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=subprocess_env(),
    )
    assert done.returncode == 0, done.stderr
    assert "loss_scale" in done.stdout and "accuracy" in done.stdout
    steps = rf"^\d+ steps in [\d.]+ s: \d+ steps/s on {re.escape(device)}$"
    assert re.search(steps, done.stdout, re.MULTILINE), done.stdout


def test_an_attached_optimizer_and_its_scaler_are_freed_with_it() -> None:
    # The record of which optimizer holds a scaler keeps neither alive.
    import gc
    import weakref

    model, optimizer = build()
    scaler = GradScaler()
    attach(optimizer, scaler)
    gone = weakref.ref(scaler), weakref.ref(optimizer)
    del model, optimizer, scaler
    gc.collect()
    assert [ref() for ref in gone] == [None, None]


def test_the_chainer_benchmark_runs_and_counts_one_read_against_one_per_parameter(tmp_path: Path, device: str) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "bench_chainer.py"), "--layers", "3", "--width", "16", "--batch", "8",
         "--steps", "1", "--repeats", "1", "--device", device, "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False, env=subprocess_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = {row["setting"]: row for row in json.loads(out.read_text())["rows"]}
    assert {row["parameters"] for row in rows.values()} == {6}
    for setting, row in rows.items():
        assert row["verdict_reads_per_step"] == (1 if setting.startswith("cupy-amp") else 6), setting
        assert row["ms_per_update"] > 0
