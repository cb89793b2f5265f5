"""Helpers shared by the test modules: the two scaler faces, bit-level comparison, a demo run's saved arrays."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cupy_amp import GradScaler, RanksMayDisagreeError, SyncFreeGradScaler
from cupy_amp.dtypes import bfloat16

__all__ = [
    "FACES",
    "GRAD_SCALER",
    "MASKS",
    "SYNC_FREE",
    "Face",
    "assert_same_bits",
    "awkward",
    "bits",
    "capture",
    "on_the_bits",
    "open_step",
    "refuses_every_call",
    "saved_arrays",
    "saved_file",
]


@dataclass(frozen=True)
class Face:
    """One of the two scalers over the step machine, built and read alike by the tests that both must pass."""

    name: str
    cls: type[GradScaler] | type[SyncFreeGradScaler]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Build a scaler of this face (the constructor arguments both faces share)."""
        return self.cls(*args, **kwargs)

    def ok(self, verdict: Any) -> bool:
        """Return a gradient call's verdict as a bool, after asserting it has this face's own type.

        GradScaler answers with a Python bool; the sync-free face (on the
        NumPy path) with a 0-d bool NumPy array, which is read here at once:
        it is the step's live flag, so a later call of the step can change it.
        """
        if self.cls is GradScaler:
            assert type(verdict) is bool, f"GradScaler answered {type(verdict).__name__}, not a bool"
            return verdict
        assert type(verdict) is np.ndarray, f"SyncFreeGradScaler answered {type(verdict).__name__}, not an ndarray"
        assert verdict.shape == () and verdict.dtype == np.bool_, (verdict.shape, verdict.dtype)
        return bool(verdict)

    def __repr__(self) -> str:
        return self.name


GRAD_SCALER = Face("GradScaler", GradScaler)
SYNC_FREE = Face("SyncFree", SyncFreeGradScaler)
# For @pytest.mark.parametrize("face", FACES) where a fixture cannot be used (Hypothesis); else the `face` fixture.
FACES = [pytest.param(GRAD_SCALER, id=GRAD_SCALER.name), pytest.param(SYNC_FREE, id=SYNC_FREE.name)]


def open_step(scaler: Any, xp: Any = np) -> Any:
    """Open a step as the protocol asks: ``scaler.scale_loss`` of a float32 loss (of ``xp``, NumPy or CuPy).

    For tests whose subject is what comes after (the gradient calls, ``update()``): the loss's value is
    never read. With CuPy gradients pass ``xp=cupy``, so that the loss lives where the scaler's state does
    (on the current device). Returns ``scaler``, for a scaler built in the same expression.
    """
    scaler.scale_loss(xp.ones((), dtype=xp.float32))
    return scaler


def bits(array: Any) -> np.ndarray:
    """Return the raw bits of a NumPy or CuPy float array as unsigned integers (C order, on the host)."""
    host = np.ascontiguousarray(array.get() if hasattr(array, "get") and not isinstance(array, np.ndarray) else array)
    return host.view(f"u{host.itemsize}")


def assert_same_bits(actual: Any, expected: Any) -> None:
    """Assert two arrays (NumPy or CuPy, or None) have the same dtype, shape and bits, NaN payloads included."""
    if expected is None:
        assert actual is None
        return
    assert actual is not None
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    np.testing.assert_array_equal(bits(actual), bits(expected))


def saved_file(directory: Path, name: str) -> Path:
    """Return the path of ``name`` in the newest save of a demo run directory."""
    from cupy_amp.demo.run_files import latest_save

    save = latest_save(directory)
    assert save is not None, f"{directory} holds no save"
    return save / name


def saved_arrays(directory: Path) -> dict[str, np.ndarray]:
    """Return every array of the newest save's state.npz in a demo run directory."""
    from cupy_amp.demo.run_files import latest_save

    save = latest_save(directory)
    assert save is not None, f"{directory} holds no save"
    with np.load(save / "state.npz", allow_pickle=False) as npz:
        return {key: npz[key] for key in npz.files}


def capture(stream: Any, step: Any) -> Any:
    """Record ``step()`` on a CuPy ``stream`` as a CUDA graph and return the graph (the capture always ends)."""
    stream.begin_capture()
    try:
        step()
    finally:
        graph = stream.end_capture()
    return graph


def refuses_every_call(scaler: Any, optimizer: Any = None, xp: Any = np) -> None:
    """Assert that every public call of a poisoned scaler raises RanksMayDisagreeError and changes nothing.

    ``optimizer`` (over a float32 parameter of 3 elements and one of 2) adds ``scaler.step``; ``xp`` is the
    array module of the gradients (NumPy or CuPy).
    """
    loss = np.ones((), np.float32)
    grads = [xp.ones(2, xp.float32)]
    calls = [
        scaler.stats,
        scaler.scale_factor,
        scaler.had_overflow,
        scaler.update,
        scaler.checkpoint,
        lambda: scaler.scale_loss(loss),
        scaler.abandon_step,
        scaler.is_step_open,
        lambda: scaler.unscale_and_check(grads),
        lambda: scaler.check(grads),
        lambda: scaler.load_checkpoint(type(scaler)().checkpoint()),
        scaler.journal,
        scaler.journal_names,
        scaler.gradient_numerics,
        scaler.nonfinite_gradients,
    ]
    if hasattr(scaler, "set_enabled"):  # GradScaler's
        calls += [scaler.is_enabled, lambda: scaler.set_enabled(True)]
    else:  # SyncFreeGradScaler's
        calls += [lambda: scaler.prepare(grads), lambda: scaler.apply_if_finite([xp.zeros(2, xp.float32)], grads)]
    if optimizer is not None:
        calls.append(lambda: scaler.step(optimizer, [xp.ones(3, xp.float32), xp.ones(2, xp.float32)]))
    for call in calls:
        with pytest.raises(RanksMayDisagreeError):
            call()
    assert float(loss) == 1.0 and xp.all(grads[0] == 1)


# dtype -> (unsigned view, magnitude mask, infinity's bits, smallest normal's bits)
MASKS: dict[Any, tuple[Any, int, int, int]] = {
    np.dtype(np.float16): (np.uint16, 0x7FFF, 0x7C00, 0x0400),
    np.dtype(np.float32): (np.uint32, 0x7FFFFFFF, 0x7F800000, 0x00800000),
    np.dtype(np.float64): (np.uint64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000, 0x0010000000000000),
}
if bfloat16() is not None:
    MASKS[np.dtype(bfloat16())] = (np.uint16, 0x7FFF, 0x7F80, 0x0080)


def on_the_bits(array: np.ndarray) -> tuple[float, int, int]:
    """(amax, zeros, subnormals) from the bits alone."""
    unsigned, magnitude_mask, infinity, min_normal = MASKS[array.dtype]
    magnitude = np.ascontiguousarray(array).view(unsigned).reshape(-1) & unsigned(magnitude_mask)
    finite = magnitude[magnitude < infinity]
    amax = float(finite.max().astype(unsigned).reshape(1).view(array.dtype)[0]) if finite.size else 0.0
    return (
        amax,
        int(np.count_nonzero(magnitude == 0)),
        int(np.count_nonzero((magnitude > 0) & (magnitude < min_normal))),
    )


def awkward(rng: np.random.Generator, dtype: Any, size: int) -> np.ndarray:
    """Values of every class: normals of both signs, +-0, subnormals, the largest finite, and (some) inf/nan."""
    unsigned, magnitude_mask, infinity, min_normal = MASKS[np.dtype(dtype)]
    bits = rng.integers(0, int(infinity), size=size, dtype=np.uint64).astype(unsigned)  # finite magnitudes
    bits[rng.random(size) < 0.2] = 0
    subnormal = rng.random(size) < 0.2
    bits[subnormal] = rng.integers(1, int(min_normal), size=int(subnormal.sum()), dtype=np.uint64).astype(unsigned)
    sign = unsigned(magnitude_mask + 1)
    bits[rng.random(size) < 0.5] |= sign
    return bits.view(np.dtype(dtype))
