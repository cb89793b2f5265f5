"""The demo's data: built-in spirals (default) or scikit-learn's bundled digits; batches from (seed, step)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cupy_amp.demo.options import DemoError

__all__ = ["Dataset", "batch_indices", "load_dataset"]

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
            "--data digits needs scikit-learn, which ships the digits with it (pip install scikit-learn); "
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
