"""Save and load a demo run: ``scaler.ckpt`` (the scaler) beside ``state.npz`` (everything else).

Both files are replaced atomically (temporary file, fsync, rename). The scaler
file is written first and carries the step count (``steps``), so a crash
between the two writes is detected on resume instead of resuming a mix.
No random state needs saving: every batch is a function of (seed, step).
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cupy_amp._fileio import write_file_atomic
from cupy_amp.checkpoint import GradScalerCheckpoint
from cupy_amp.demo.device import Device
from cupy_amp.demo.model import Adam, parameter_names
from cupy_amp.demo.options import DemoError, ScalerSettings, Settings
from cupy_amp.demo.train import ADAM_EPS, History, RunState
from cupy_amp.errors import CheckpointError
from cupy_amp.scaler import GradScaler

__all__ = ["SCALER_FILE", "STATE_FILE", "SavedRun", "load_run", "save_run"]

SCALER_FILE = "scaler.ckpt"
STATE_FILE = "state.npz"
FORMAT = "cupy-amp-demo"
VERSION = 1
_HISTORY = ("loss", "accuracy", "scale", "skipped")


@dataclass(frozen=True)
class SavedRun:
    """A run read back from its directory, in host memory."""

    settings: Settings
    scaler_settings: ScalerSettings
    scaler: GradScalerCheckpoint
    state: RunState

    def to_device(self, device: Device) -> RunState:
        """Return the state with its arrays moved to ``device``."""
        xp = device.xp
        saved = self.state

        def move(arrays: dict[str, Any]) -> dict[str, Any]:
            return {name: xp.asarray(array) for name, array in arrays.items()}

        adam = Adam(lr=saved.adam.lr, eps=saved.adam.eps, m=move(saved.adam.m), v=move(saved.adam.v), t=saved.adam.t)
        return RunState(step=saved.step, masters=move(saved.masters), adam=adam, history=saved.history)


def save_run(
    directory: str | os.PathLike[str],
    settings: Settings,
    scaler_settings: ScalerSettings,
    scaler: GradScaler,
    state: RunState,
    device: Device,
) -> None:
    """Write the scaler checkpoint, then the model/optimizer state, each atomically."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    scaler.checkpoint().save(folder / SCALER_FILE)
    arrays: dict[str, Any] = {
        "format": np.array(FORMAT),
        "version": np.array(VERSION, dtype=np.int64),
        "settings": np.array(json.dumps({"run": _settings_dict(settings), "scaler": asdict(scaler_settings)})),
        "step": np.array(state.step, dtype=np.int64),
        "adam_t": np.array(state.adam.t, dtype=np.int64),
    }
    for prefix, group in (("master", state.masters), ("adam_m", state.adam.m), ("adam_v", state.adam.v)):
        for name, array in group.items():
            arrays[f"{prefix}/{name}"] = device.to_host(array)
    history = state.history
    arrays["history/loss"] = np.array(history.loss, dtype=np.float64)
    arrays["history/accuracy"] = np.array(history.accuracy, dtype=np.float64)
    arrays["history/scale"] = np.array(history.scale, dtype=np.float64)
    arrays["history/skipped"] = np.array(history.skipped, dtype=bool)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    write_file_atomic(folder / STATE_FILE, buffer.getvalue())


def load_run(directory: str | os.PathLike[str]) -> SavedRun:
    """Read a run saved by :func:`save_run`.

    Raises:
        DemoError: The directory or a file is missing, unreadable, of another
            format, or the two files are from different steps.
    """
    folder = Path(directory)
    state_path, scaler_path = folder / STATE_FILE, folder / SCALER_FILE
    if not state_path.is_file() or not scaler_path.is_file():
        raise DemoError(
            f"{folder}: not a demo checkpoint directory (expected {SCALER_FILE} and {STATE_FILE}, "
            f"written by cupy-amp demo --out)"
        )
    try:
        checkpoint = GradScalerCheckpoint.load(scaler_path)
    except (CheckpointError, OSError) as exc:
        raise DemoError(f"cannot resume from {folder}: {exc}") from None
    try:
        with np.load(state_path, allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise DemoError(f"cannot resume from {folder}: {state_path.name} is unreadable ({exc})") from None
    try:
        saved = _parse(arrays, checkpoint)
    except (KeyError, ValueError, TypeError) as exc:
        raise DemoError(f"cannot resume from {folder}: {state_path.name} is not a valid demo state ({exc})") from None
    if checkpoint.steps != saved.state.step:
        raise DemoError(
            f"cannot resume from {folder}: {SCALER_FILE} is at step {checkpoint.steps} but {STATE_FILE} at step "
            f"{saved.state.step} (a save was interrupted between the two files); start a new run"
        )
    return saved


def _settings_dict(settings: Settings) -> dict[str, Any]:
    fields = asdict(settings)
    fields["hidden"] = list(settings.hidden)
    return fields


def _parse(arrays: dict[str, np.ndarray], checkpoint: GradScalerCheckpoint) -> SavedRun:
    if str(arrays["format"]) != FORMAT or int(arrays["version"]) != VERSION:
        raise ValueError(f"format {arrays['format']!s} version {arrays['version']!s}, expected {FORMAT} {VERSION}")
    document = json.loads(str(arrays["settings"]))
    run = dict(document["run"])
    run["hidden"] = tuple(int(width) for width in run["hidden"])
    settings = Settings(**run)
    scaler_settings = ScalerSettings(**document["scaler"])
    step = int(arrays["step"])
    history = History(**{name: arrays[f"history/{name}"].tolist() for name in _HISTORY})
    if len(history) != step or any(len(getattr(history, name)) != step for name in _HISTORY):
        raise ValueError(f"the history holds {len(history)} steps, expected {step}")

    names = parameter_names(len(settings.hidden) + 1)

    def group(prefix: str) -> dict[str, np.ndarray]:
        return {name: arrays[f"{prefix}/{name}"] for name in names}

    adam = Adam(
        lr=settings.lr,
        eps=ADAM_EPS * settings.loss_weight,
        m=group("adam_m"),
        v=group("adam_v"),
        t=int(arrays["adam_t"]),
    )
    masters = group("master")
    return SavedRun(settings, scaler_settings, checkpoint, RunState(step, masters, adam, history))
