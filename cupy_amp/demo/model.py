"""The demo's task and network, by hand over an array module ``xp`` (NumPy or CuPy).

The data: five interleaved spirals generated from the seed (default) or
scikit-learn's bundled digits; every batch is a function of (seed, step), so
no random state needs saving. The network: an MLP whose float16 matrix
products take fp16 inputs and round their sums to fp16 (exact sums on the CPU,
so every CPU gives the same bits; fp32 sums on a GPU, as its tensor cores
do), everything else in fp16; softmax and the loss in fp32 from the fp16
logits. The dtype of the weights passed in decides the precision (the
optimizer is cupy_amp.optim.AdamW, on fp32 master weights).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cupy_amp.demo import host_math
from cupy_amp.demo.settings import DemoError

__all__ = [
    "BatchOrder",
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
    """Return the training-example indices of ``step``: a pure function of its arguments, the same on the GPU.

    Epochs of ``examples // batch_size`` steps each visit distinct examples in
    an order that :class:`BatchOrder` draws per (seed, epoch). No random state
    is carried from step to step, so a resumed run draws exactly the batches
    an uninterrupted one would, and the device step computes them itself.
    """
    return BatchOrder(seed, examples).batch(step, batch_size)


_MIX_1, _MIX_2, _GOLDEN = 0x7FEB352D, 0x846CA68B, 0x9E3779B9
_ROUNDS = 4
_WORD = 0xFFFFFFFF


def _mix(x: Any) -> Any:
    """A 32-bit integer hash (lowbias32): an int, or a uint32 array (wrapping arithmetic)."""
    if isinstance(x, int):
        x ^= x >> 16
        x = (x * _MIX_1) & _WORD
        x ^= x >> 15
        x = (x * _MIX_2) & _WORD
        return x ^ (x >> 16)
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(_MIX_1)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(_MIX_2)
    return x ^ (x >> np.uint32(16))


@dataclass(frozen=True)
class BatchOrder:
    """The order in which one run visits its training examples: a keyed permutation per epoch.

    Position p of epoch e holds example ``permute(p)``: a Feistel network of
    four rounds over the ``bits`` bits that hold ``examples - 1`` (halves of
    ``bits // 2`` and ``bits - bits // 2`` bits, ``lowbias32`` as the round
    function, keyed by the seed and the epoch), applied again while the result
    is not below ``examples``. Such cycle walking stays a permutation of the
    examples and ends, because the walk follows a cycle back below
    ``examples``; the network covers fewer than 2 * ``examples`` values, so a
    walk is short. Only 32-bit integer arithmetic, so the demo's CUDA kernel
    computes the same indices (``cupy_amp_demo_gather``).

    Attributes:
        examples: How many examples there are (at least 1, below 2**31).
        keys: The seed's four round keys, uint32 (from ``np.random.SeedSequence``).
        bits: The Feistel network's width.
    """

    examples: int
    keys: tuple[int, ...]
    bits: int

    def __init__(self, seed: int, examples: int) -> None:
        if not 1 <= examples < 2**31:
            raise ValueError(f"BatchOrder needs 1 to 2**31 - 1 examples, got {examples}")
        words = np.random.SeedSequence([seed, 2]).generate_state(_ROUNDS, np.uint32)
        object.__setattr__(self, "examples", examples)
        object.__setattr__(self, "keys", tuple(int(word) for word in words))
        object.__setattr__(self, "bits", max(1, (examples - 1).bit_length()))

    def epoch_keys(self, epoch: int) -> list[int]:
        """Return the round keys of ``epoch`` (>= 0, below 2**64)."""
        low, high = epoch & _WORD, epoch >> 32
        return [_mix(key ^ _mix(low ^ _mix(high ^ ((_GOLDEN * r) & _WORD)))) for r, key in enumerate(self.keys)]

    def permute(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Return the examples at ``positions`` (each below ``examples``) of ``epoch``'s order."""
        keys = [np.uint32(key) for key in self.epoch_keys(epoch)]
        values = self._feistel(positions.astype(np.uint32), keys)
        outside = values >= np.uint32(self.examples)
        while outside.any():  # each walk ends within the network's 2**bits values; most end at once
            values[outside] = self._feistel(values[outside], keys)
            outside = values >= np.uint32(self.examples)
        return values.astype(np.int64)

    def _feistel(self, values: np.ndarray, keys: list[np.uint32]) -> np.ndarray:
        left_bits, right_bits = self.bits // 2, self.bits - self.bits // 2
        left, right = values >> np.uint32(right_bits), values & np.uint32((1 << right_bits) - 1)
        for key in keys:  # (left, right) -> (right, left ^ F(right)): the halves trade widths each round
            left, right = right, left ^ (_mix(right ^ key) & np.uint32((1 << left_bits) - 1))
            left_bits, right_bits = right_bits, left_bits
        combined: np.ndarray = (left << np.uint32(right_bits)) | right
        return combined

    def batch(self, step: int, batch_size: int) -> np.ndarray:
        """Return the examples of ``step`` (>= 0): batch ``step % steps_per_epoch`` of its epoch."""
        per_epoch = self.examples // batch_size
        epoch, first = divmod(step, per_epoch)
        return self.permute(epoch, np.arange(first * batch_size, (first + 1) * batch_size))


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
    sine, cosine = host_math.sin_cos(angle)  # NumPy's sin and cos may differ in the last bit by CPU
    points = np.stack([radius * cosine, radius * sine], axis=1)
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


def _operand(xp: Any, matrix: Any) -> Any:
    """Return ``matrix`` ready for :func:`_matmul`: split once on the CPU (reusable as its transpose), else itself."""
    return host_math.Split(matrix) if xp is np else matrix


def _matmul(xp: Any, a: Any, b: Any) -> Any:
    """Multiply two :func:`_operand` values in their dtype.

    On the CPU the sums are exact (:func:`~cupy_amp.demo.host_math.exact_matmul`), so a run gives the same
    bits on every CPU and BLAS; on a GPU fp16 products sum in fp32, as its tensor cores do.
    """
    if xp is np:
        return host_math.exact_matmul(a, b)
    if a.dtype == np.float16:
        return xp.matmul(a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
    return xp.matmul(a, b)


@dataclass
class Forward:
    """What the backward pass needs from the forward pass.

    Attributes:
        inputs: The input of each layer, in the compute dtype (``inputs[0]`` is the batch).
        probs: Softmax probabilities, float32.
        operands: The inputs and the weights as :func:`_operand` values, when the forward pass made them.
    """

    inputs: list[Any] = field(default_factory=list)
    probs: Any = None
    operands: dict[str, Any] = field(default_factory=dict)


def forward(xp: Any, params: Mapping[str, Any], x: Any) -> Forward:
    """Run the network on ``x`` in the dtype of ``params``."""
    layers = len(params) // 2
    dtype = params["W1"].dtype
    result = Forward()
    h = x.astype(dtype)
    for i in range(1, layers + 1):
        result.inputs.append(h)
        result.operands[f"h{i - 1}"] = h_operand = _operand(xp, h)
        result.operands[f"W{i}"] = w_operand = _operand(xp, params[f"W{i}"])
        z = _matmul(xp, h_operand, w_operand) + params[f"b{i}"]
        h = xp.maximum(z, 0) if i < layers else z
    logits = h.astype(np.float32)
    logits -= logits.max(axis=1, keepdims=True)
    exp = host_math.exp(logits) if xp is np else xp.exp(logits)  # NumPy's exp differs in the last bit by CPU
    result.probs = exp / exp.sum(axis=1, keepdims=True)
    return result


def _made_operand(xp: Any, fwd: Forward, name: str, matrix: Any) -> Any:
    """Return the forward pass's operand of ``matrix`` when it made one of that dtype, else a new one."""
    made = fwd.operands.get(name)
    return made if made is not None and made.dtype == matrix.dtype else _operand(xp, matrix)


def cross_entropy(xp: Any, probs: Any, labels: Any) -> Any:
    """Return the mean cross-entropy as a 0-d float32 array (no host synchronization)."""
    picked = probs[xp.arange(labels.shape[0]), labels]
    floored = xp.maximum(picked, np.float32(1e-30))
    return -(host_math.log(floored) if xp is np else xp.log(floored)).mean()  # NumPy's log differs by CPU


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
    ones = _operand(xp, xp.ones((1, batch), dtype))  # a bias gradient is the column sums: ones @ g
    for i in range(layers, 0, -1):
        h_in = fwd.inputs[i - 1]
        g_operand = _operand(xp, g)
        grads[f"W{i}"] = _matmul(xp, _made_operand(xp, fwd, f"h{i - 1}", h_in).T, g_operand)
        grads[f"b{i}"] = _matmul(xp, ones, g_operand)[0]
        if i > 1:
            weights = _made_operand(xp, fwd, f"W{i}", params[f"W{i}"])
            g = _matmul(xp, g_operand, weights.T) * (h_in > 0)  # h_in is a ReLU output
            activation_grads[f"h{i - 1}"] = g
    ordered = {name: grads[name] for name in parameter_names(layers)}
    return ordered, activation_grads
