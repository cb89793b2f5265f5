"""The demo's task and network, by hand over an array module ``xp`` (NumPy or CuPy).

The data: five interleaved spirals generated from the seed (default) or
scikit-learn's bundled digits; every batch is a function of (seed, step), so
no random state needs saving. The network: an MLP whose float16 matrix
products take fp16 inputs, accumulate in fp32 and round to fp16 (what tensor
cores do), everything else in fp16; softmax and the loss in fp32 from the fp16
logits. The dtype of the weights passed in decides the precision (the
optimizer is cupy_amp.optim.AdamW, on fp32 master weights).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cupy_amp.demo.settings import DemoError

__all__ = [
    "Dataset",
    "Forward",
    "backward",
    "batch_indices",
    "cross_entropy",
    "forward",
    "init_params",
    "load_dataset",
    "parameter_names",
]

SPIRAL_ARMS = 5
SPIRAL_TRAIN = 8192
SPIRAL_EVAL = 2048
SPIRAL_TURNS = 1.5
SPIRAL_NOISE = 0.05  # radians of jitter on each point's angle


@dataclass(frozen=True)
class Dataset:
    """A classification task held in host memory, float32 inputs and int64 labels."""

    name: str
    description: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_eval: np.ndarray
    y_eval: np.ndarray
    classes: int

    @property
    def features(self) -> int:
        """Input width."""
        return int(self.x_train.shape[1])


def load_dataset(name: str, seed: int) -> Dataset:
    """Build the named dataset; every number is a function of ``seed`` alone.

    Raises:
        DemoError: "digits" without scikit-learn installed.
    """
    if name == "digits":
        return _digits(seed)
    return _spirals(seed)


def batch_indices(seed: int, step: int, batch_size: int, examples: int) -> np.ndarray:
    """Return the training-example indices of ``step``: distinct, and a pure function of its arguments.

    No random state is carried from step to step, so a resumed run draws
    exactly the batches an uninterrupted one would.
    """
    rng = np.random.default_rng([seed, 2, step])
    return rng.permutation(examples)[:batch_size]


def _spirals(seed: int) -> Dataset:
    rng = np.random.default_rng([seed, 0])
    x_train, y_train = _spiral_points(rng, SPIRAL_TRAIN)
    x_eval, y_eval = _spiral_points(rng, SPIRAL_EVAL)
    return Dataset(
        name="builtin",
        description=f"{SPIRAL_ARMS} interleaved spirals in 2-D ({SPIRAL_TRAIN} training / {SPIRAL_EVAL} held-out)",
        x_train=x_train,
        y_train=y_train,
        x_eval=x_eval,
        y_eval=y_eval,
        classes=SPIRAL_ARMS,
    )


def _spiral_points(rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray]:
    labels = rng.integers(0, SPIRAL_ARMS, count)
    radius = rng.uniform(0.05, 1.0, count)
    angle = radius * SPIRAL_TURNS * 2 * np.pi + labels * (2 * np.pi / SPIRAL_ARMS) + rng.normal(0, SPIRAL_NOISE, count)
    points = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=1)
    return points.astype(np.float32), labels.astype(np.int64)


def _digits(seed: int) -> Dataset:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DemoError(
            '--data digits needs scikit-learn, which ships the digits with it (pip install "cupy-amp[demo]"); '
            "or use the default --data builtin"
        ) from None
    bunch = load_digits()
    images = np.asarray(bunch.data, dtype=np.float32) / np.float32(16.0)  # pixel values 0..16 -> 0..1
    labels = np.asarray(bunch.target, dtype=np.int64)
    order = np.random.default_rng([seed, 0]).permutation(len(labels))
    held_out = len(labels) // 5
    eval_part, train_part = order[:held_out], order[held_out:]
    return Dataset(
        name="digits",
        description=f"scikit-learn digits, 8x8 images ({len(train_part)} training / {held_out} held-out)",
        x_train=images[train_part],
        y_train=labels[train_part],
        x_eval=images[eval_part],
        y_eval=labels[eval_part],
        classes=10,
    )


LAST_LAYER_STD = 0.01  # a small readout, so the first logits are near 0 and the first loss near log(classes)


def parameter_names(layers: int) -> list[str]:
    """Return ``["W1", "b1", ..., "W<layers>", "b<layers>"]``, the order used everywhere."""
    return [name for i in range(1, layers + 1) for name in (f"W{i}", f"b{i}")]


def init_params(sizes: list[int], seed: int) -> dict[str, np.ndarray]:
    """Return float32 host arrays: He-normal hidden layers, a small last layer, zero biases."""
    rng = np.random.default_rng([seed, 1])
    params: dict[str, np.ndarray] = {}
    layers = len(sizes) - 1
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes), start=1):
        std = LAST_LAYER_STD if i == layers else float(np.sqrt(2.0 / fan_in))
        params[f"W{i}"] = (rng.standard_normal((fan_in, fan_out)) * std).astype(np.float32)
        params[f"b{i}"] = np.zeros(fan_out, dtype=np.float32)
    return params


def _matmul(xp: Any, a: Any, b: Any) -> Any:
    """Multiply in the inputs' dtype; fp16 through an fp32 accumulator, like a GPU's tensor cores."""
    if a.dtype == np.float16:
        return xp.matmul(a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
    return xp.matmul(a, b)


@dataclass
class Forward:
    """What the backward pass needs from the forward pass.

    Attributes:
        inputs: The input of each layer, in the compute dtype (``inputs[0]`` is the batch).
        probs: Softmax probabilities, float32.
    """

    inputs: list[Any] = field(default_factory=list)
    probs: Any = None


def forward(xp: Any, params: Mapping[str, Any], x: Any) -> Forward:
    """Run the network on ``x`` in the dtype of ``params``."""
    layers = len(params) // 2
    dtype = params["W1"].dtype
    result = Forward()
    h = x.astype(dtype)
    for i in range(1, layers + 1):
        result.inputs.append(h)
        z = _matmul(xp, h, params[f"W{i}"]) + params[f"b{i}"]
        h = xp.maximum(z, 0) if i < layers else z
    logits = h.astype(np.float32)
    logits -= logits.max(axis=1, keepdims=True)
    exp = xp.exp(logits)
    result.probs = exp / exp.sum(axis=1, keepdims=True)
    return result


def cross_entropy(xp: Any, probs: Any, labels: Any) -> Any:
    """Return the mean cross-entropy as a 0-d float32 array (no host synchronization)."""
    picked = probs[xp.arange(labels.shape[0]), labels]
    return -xp.log(xp.maximum(picked, np.float32(1e-30))).mean()


def backward(
    xp: Any, params: Mapping[str, Any], fwd: Forward, labels: Any, seed: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Backpropagate ``seed`` times the mean cross-entropy, in the dtype of ``params``.

    ``seed`` is d(training loss)/d(mean cross-entropy): the loss weight, times
    the loss scale when the loss was scaled. The gradient of the logits is
    formed in fp32 and rounded to the compute dtype, so in fp16 it overflows
    to inf or underflows to 0 right there, as it would in a framework.

    Returns:
        The weight gradients (name -> array, compute dtype) and the activation
        gradients ("logits", "h<i>": the gradients flowing into each layer's output).
    """
    layers = len(params) // 2
    dtype = params["W1"].dtype
    batch = labels.shape[0]
    delta = fwd.probs.copy()
    delta[xp.arange(batch), labels] -= 1
    delta *= np.float32(seed / batch)
    g = delta.astype(dtype)
    activation_grads = {"logits": g}
    grads: dict[str, Any] = {}
    for i in range(layers, 0, -1):
        h_in = fwd.inputs[i - 1]
        grads[f"W{i}"] = _matmul(xp, h_in.T, g)
        grads[f"b{i}"] = g.sum(axis=0, dtype=np.float32).astype(dtype)
        if i > 1:
            g = _matmul(xp, g, params[f"W{i}"].T) * (h_in > 0)  # h_in is a ReLU output
            activation_grads[f"h{i - 1}"] = g
    ordered = {name: grads[name] for name in parameter_names(layers)}
    return ordered, activation_grads
