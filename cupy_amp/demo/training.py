"""The training loop of the demo: one optimizer step at a time, the loss scaler around the backward pass.

Three modes share the loop: ``amp`` (fp16 weights and activations, fp32
master weights, loss scaling), ``fp16`` (the same with a disabled scaler:
nothing is scaled, and ``check()`` still skips steps whose gradients hold
inf/nan) and ``fp32`` (everything in float32, with a scaler whose scale stays 1).
The array module is NumPy on the CPU or CuPy on a GPU (imported only here,
only when asked).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from cupy_amp.demo.model import BatchOrder, Dataset, Forward, backward, cross_entropy, forward, init_params
from cupy_amp.demo.settings import DemoError, ScalerSettings, Settings
from cupy_amp.optim import AdamW
from cupy_amp.scaler import GradScaler
from cupy_amp.statistics import GradientNumerics

__all__ = [
    "MODES",
    "Device",
    "History",
    "RunState",
    "StepOutcome",
    "Trainer",
    "Underflow",
    "make_optimizer",
    "make_scaler",
    "new_state",
    "run_steps",
    "select_device",
    "small_matrix_threads",
]


@dataclass(frozen=True)
class Device:
    """The array module a run computes with.

    Attributes:
        xp: ``numpy`` or ``cupy``.
        kind: "cpu" or "gpu".
        description: One line for the user, e.g. "GPU 0: NVIDIA H200 (CuPy 14.2.0)".
    """

    xp: Any
    kind: str
    description: str

    def to_host(self, array: Any) -> np.ndarray:
        """Copy an array of this device to a NumPy array (synchronizes the GPU)."""
        return np.asarray(self.xp.asnumpy(array)) if self.kind == "gpu" else np.asarray(array)


def select_device(choice: str) -> tuple[Device, str | None]:
    """Return the device for ``--device`` and, under 'auto' on the CPU, why the GPU was not used.

    Raises:
        DemoError: ``choice`` is "gpu" and CuPy cannot run a kernel here.
    """
    cpu = Device(np, "cpu", f"CPU (NumPy {np.__version__})")
    if choice == "cpu":
        return cpu, None
    gpu, problem = _probe_gpu()
    if gpu is not None:
        return gpu, None
    if choice == "gpu":
        raise DemoError(f"--device gpu: no usable GPU: {problem}. Use --device cpu (or auto) to run on the CPU.")
    return cpu, problem


def _probe_gpu() -> tuple[Device | None, str]:
    """Import CuPy and run one small kernel; return the device, or None and the reason it failed."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken install raising anything at import
        return None, f"CuPy is not installed ({_short(exc)})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "CuPy sees no CUDA device"
        total = int(cupy.arange(4, dtype=cupy.float32).sum())  # compiles and runs a kernel: driver and NVRTC work
        if total != 6:
            return None, f"a test kernel returned {total} instead of 6"
        properties = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    except Exception as exc:  # CUDARuntimeError, CompileException, missing NVRTC library ...
        return None, f"CuPy cannot use a GPU ({_short(exc)})"
    name = properties["name"].decode(errors="replace") if isinstance(properties["name"], bytes) else properties["name"]
    return Device(cupy, "gpu", f"GPU {cupy.cuda.Device().id}: {name} (CuPy {cupy.__version__})"), ""


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text if len(text) <= 160 else text[:157] + "..."


def small_matrix_threads(device: Device) -> contextlib.AbstractContextManager[Any]:
    """Limit NumPy's BLAS to one thread while training on the CPU, unless the environment sets a thread count.

    The demo's matrices are small (512 x 64); a multithreaded BLAS spends more
    time synchronizing its threads than multiplying, several times more on a
    busy two-core machine. The results do not depend on the thread count
    (:mod:`cupy_amp.demo.host_math`), so ``OPENBLAS_NUM_THREADS`` (or
    ``OMP_NUM_THREADS``) is obeyed when set. Without threadpoolctl, nothing changes.
    """
    if device.kind != "cpu" or any(os.environ.get(name) for name in _THREAD_VARIABLES):
        return contextlib.nullcontext()
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    limits: contextlib.AbstractContextManager[Any] = threadpool_limits(limits=1, user_api="blas")
    return limits


_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


MODES = {"amp": "fp16 + loss scaling", "fp16": "fp16, no loss scaling", "fp32": "fp32"}
ADAM_EPS = 1e-8  # PyTorch's default, multiplied by the loss weight


@dataclass
class History:
    """Per-step records of a run, kept whole across resumes (index i is step i + 1)."""

    loss: list[float] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    scale: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)

    def append(self, outcome: StepOutcome) -> None:
        """Record one step."""
        self.loss.append(outcome.loss)
        self.accuracy.append(outcome.accuracy)
        self.scale.append(outcome.scale)
        self.skipped.append(outcome.skipped)

    def __len__(self) -> int:
        return len(self.loss)


@dataclass
class Underflow:
    """Gradient elements that were exactly 0 in fp16 while the fp32 backward pass had them nonzero."""

    zeroed: dict[str, int] = field(default_factory=dict)
    nonzero: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, zeroed: int, nonzero: int) -> None:
        """Count one tensor of one step."""
        self.zeroed[name] = self.zeroed.get(name, 0) + zeroed
        self.nonzero[name] = self.nonzero.get(name, 0) + nonzero

    def fraction(self, names: list[str] | None = None) -> float:
        """Return zeroed / nonzero over ``names`` (default: all tensors), 0.0 when nothing was counted."""
        keys = list(self.nonzero) if names is None else [name for name in names if name in self.nonzero]
        total = sum(self.nonzero[name] for name in keys)
        return sum(self.zeroed[name] for name in keys) / total if total else 0.0


@dataclass
class RunState:
    """Everything besides the scaler that a resumed run needs: masters, the optimizer, step, history.

    The optimizer updates the masters (its parameters) in place.
    """

    step: int
    masters: dict[str, Any]
    optimizer: AdamW
    history: History


def make_optimizer(settings: Settings, masters: dict[str, Any]) -> AdamW:
    """Return the fused AdamW over the fp32 masters (no weight decay: Adam), epsilon scaled by the loss weight."""
    return AdamW(list(masters.values()), lr=settings.lr, eps=ADAM_EPS * settings.loss_weight, weight_decay=0.0)


@dataclass(frozen=True)
class StepOutcome:
    """What one step did, for the progress display and the event log.

    Attributes:
        step: The step's number, from 1.
        loss: Mean cross-entropy of the batch (not multiplied by the loss weight or scale).
        accuracy: Fraction of the batch classified right.
        scale: The loss scale the step used (1.0 without scaling).
        skipped: The gradients overflowed and the optimizer step was skipped.
        nonfinite: Names of the gradients that held inf/nan.
        backoff: (scale before, after) when ``update()`` backed off.
        growth: (scale before, after) when ``update()`` grew the scale.
        skipped_total: Steps skipped so far in the whole run.
        numerics: The step's numerics report (``scaler.gradient_numerics()``), on a backoff step.
    """

    step: int
    loss: float
    accuracy: float
    scale: float
    skipped: bool
    nonfinite: tuple[str, ...] = ()
    backoff: tuple[float, float] | None = None
    growth: tuple[float, float] | None = None
    skipped_total: int = 0
    numerics: tuple[GradientNumerics, ...] = ()


def make_scaler(mode: str, scaler: ScalerSettings) -> GradScaler | None:
    """Return the run's scaler: configured for ``amp``, disabled for ``fp16``, none for ``fp32``.

    Raises:
        ConfigError: A parameter is out of range.
    """
    return None if mode == "fp32" else GradScaler(**asdict(scaler), enabled=mode == "amp")


def new_state(device: Device, settings: Settings, dataset: Dataset) -> RunState:
    """Initialize the fp32 master weights and the optimizer on ``device``."""
    xp = device.xp
    sizes = [dataset.features, *settings.hidden, dataset.classes]
    masters = {name: xp.asarray(value) for name, value in init_params(sizes, settings.seed).items()}
    return RunState(step=0, masters=masters, optimizer=make_optimizer(settings, masters), history=History())


class Trainer:
    """Runs steps of one mode on one device; the state and the scaler are read and changed in place."""

    def __init__(
        self,
        mode: str,
        settings: Settings,
        dataset: Dataset,
        device: Device,
        state: RunState,
        scaler: GradScaler | None,
        *,
        measure_underflow: bool = False,
        report: bool = False,
    ) -> None:
        self.mode = mode
        self.settings = settings
        self.device = device
        self.state = state
        self.scaler = scaler
        self.underflow = Underflow() if measure_underflow and mode != "fp32" else None
        # With `report`: each step's (step, scale, numerics report), for the end-of-run table and the plot.
        self.reports: list[tuple[int, float, tuple[GradientNumerics, ...]]] | None = [] if report else None
        xp = device.xp
        self._order = BatchOrder(settings.seed, len(dataset.y_train))
        self._x_train, self._y_train = xp.asarray(dataset.x_train), xp.asarray(dataset.y_train)
        self._x_eval, self._y_eval = xp.asarray(dataset.x_eval), xp.asarray(dataset.y_eval)
        self._dtype = np.float32 if mode == "fp32" else np.float16
        # The fp32 master gradients: allocated once, so the scaler and the optimizer see the same arrays every step.
        self._master_grads = {name: xp.zeros_like(p) for name, p in state.masters.items()}
        self._grad_list = list(self._master_grads.values())  # in the optimizer's parameter order
        # fp32 runs scale nothing but still skip non-finite steps and clip: a scaler whose scale stays 1.
        self._guard = GradScaler.guard()
        self._max_norm = settings.clip * settings.loss_weight  # the clip threshold, for the weighted loss
        self._weights = self._working_weights()

    def _working_weights(self) -> dict[str, Any]:
        """The weights the forward and backward passes use: fp16 copies of the masters, or the masters."""
        if self._dtype == np.float32:
            return self.state.masters
        return {name: master.astype(np.float16) for name, master in self.state.masters.items()}

    def step(self) -> StepOutcome:
        """Train one step and record it in the history."""
        xp = self.device.xp
        indices = xp.asarray(self._order.batch(self.state.step, self.settings.batch_size))
        x, y = self._x_train[indices], self._y_train[indices]
        with np.errstate(over="ignore", invalid="ignore"):  # fp16 overflow is expected; the scaler handles it
            outcome = self._step_fp32(x, y) if self.scaler is None else self._step_fp16(x, y, self.scaler)
        self.state.step += 1
        self.state.history.append(outcome)
        return outcome

    def _step_fp16(self, x: Any, y: Any, scaler: GradScaler) -> StepOutcome:
        xp = self.device.xp
        scale = scaler.scale_factor()
        weights = self._weights
        fwd = forward(xp, weights, x)  # fp16 forward pass
        mean_loss = cross_entropy(xp, fwd.probs, y)  # 0-d fp32 array
        loss = xp.array(mean_loss * np.float32(self.settings.loss_weight))  # the training loss, 0-d fp32
        scaler.scale_loss(loss)  # loss *= scale, in place
        # An autograd framework would now call loss.backward(); by hand, the backward pass starts
        # from d(scaled loss)/d(mean loss) = scale * loss weight.
        grads16, activation_grads = backward(xp, weights, fwd, y, scale * self.settings.loss_weight)
        for name, grad in grads16.items():
            self._master_grads[name][...] = grad  # upcast the scaled fp16 gradients into fp32 master gradients
        # One read of the gradients: inf/nan anywhere, and the norm for clipping (of the unscaled gradients).
        # With the numerics report of the same read: each gradient's largest magnitude, zeros and subnormals.
        stats = scaler.check(self._master_grads, max_norm=self._max_norm, report=True)
        # Unscale, clip and update the fp32 masters in one pass; after an overflow it changes nothing.
        self.state.optimizer.step(self._grad_list, stats)
        finite = bool(stats.finite)
        if finite:
            self._weights = self._working_weights()  # refresh the fp16 copies
            if self.underflow is not None:
                self._count_underflow(self.underflow, weights, fwd, y, (grads16, activation_grads))
        before = scaler.stats()
        scaler.update()  # back off after an overflow, grow after growth_interval clean steps
        after = scaler.stats()
        backoff = after.backoffs > before.backoffs
        numerics = tuple(scaler.gradient_numerics()) if backoff or self.reports is not None else ()
        if self.reports is not None:
            self.reports.append((self.state.step + 1, scale, numerics))
        return StepOutcome(
            step=self.state.step + 1,
            loss=float(mean_loss),
            accuracy=float((fwd.probs.argmax(axis=1) == y).mean()),
            scale=scale,
            skipped=not finite,
            nonfinite=tuple(str(name) for name in scaler.nonfinite_gradients()),
            backoff=(before.scale, after.scale) if backoff else None,
            growth=(before.scale, after.scale) if after.growths > before.growths else None,
            skipped_total=after.skipped_steps,
            numerics=numerics if backoff else (),
        )

    def _step_fp32(self, x: Any, y: Any) -> StepOutcome:
        xp = self.device.xp
        fwd = forward(xp, self.state.masters, x)
        mean_loss = cross_entropy(xp, fwd.probs, y)
        grads, _ = backward(xp, self.state.masters, fwd, y, self.settings.loss_weight)
        for name, grad in grads.items():
            self._master_grads[name][...] = grad
        stats = self._guard.check(self._master_grads, max_norm=self._max_norm)
        self.state.optimizer.step(self._grad_list, stats)
        self._guard.update()
        return StepOutcome(
            step=self.state.step + 1,
            loss=float(mean_loss),
            accuracy=float((fwd.probs.argmax(axis=1) == y).mean()),
            scale=1.0,
            skipped=not bool(stats.finite),
        )

    def _count_underflow(
        self,
        underflow: Underflow,
        weights: dict[str, Any],
        fwd: Forward,
        y: Any,
        fp16_grads: tuple[dict[str, Any], dict[str, Any]],
    ) -> None:
        """Compare a step's fp16 gradients with an fp32 backward pass from the same weights and activations.

        Scaling never turns a nonzero into 0 or back, so the scaled run's
        fp16 gradients are compared as they are.
        """
        xp = self.device.xp
        weights32 = {name: w.astype(np.float32) for name, w in weights.items()}
        fwd32 = Forward(inputs=[h.astype(np.float32) for h in fwd.inputs], probs=fwd.probs)
        reference = backward(xp, weights32, fwd32, y, self.settings.loss_weight)
        for fp16_set, ref_set in zip(fp16_grads, reference, strict=True):
            for name, grad in fp16_set.items():
                ref_nonzero = ref_set[name] != 0
                zeroed = int(xp.count_nonzero((grad == 0) & ref_nonzero))
                underflow.add(name, zeroed, int(xp.count_nonzero(ref_nonzero)))

    def evaluate(self) -> tuple[float, float]:
        """Return the held-out (loss, accuracy), computed in the run's own precision."""
        xp = self.device.xp
        with np.errstate(over="ignore", invalid="ignore"):
            fwd = forward(xp, self._weights, self._x_eval)
            loss = float(cross_entropy(xp, fwd.probs, self._y_eval))
            accuracy = float((fwd.probs.argmax(axis=1) == self._y_eval).mean())
        return loss, accuracy


def run_steps(trainer: Trainer, total: int, on_step: Callable[[StepOutcome], None]) -> None:
    """Step ``trainer`` until its state reaches step ``total``, calling ``on_step`` after each."""
    while trainer.state.step < total:
        on_step(trainer.step())
