"""A demo run's directory: each save a complete set of files, or none at all.

A save of step N is a directory ``step-<N>`` (six digits at least) holding
three files: ``scaler.ckpt`` (the scaler's :class:`~cupy_amp.GradScalerCheckpoint`),
``adamw.state`` (the optimizer's own state file, ``AdamW.save``) and
``state.npz`` (the demo's own: its settings, the step, the fp32 weights and
the history). The three are written into a hidden temporary directory, each
flushed to disk, and the directory is then renamed to ``step-<N>`` in one
atomic step: that rename is the save. Older saves are then renamed out of sight
and deleted. So an interrupt or a crash at any point leaves the last complete
save as the newest ``step-*`` directory: ``--resume`` never meets files of
different steps. Every value read back is checked as a flag would be.
"""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import shutil
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cupy_amp._fileio import read_regular_file, write_file_atomic
from cupy_amp.checkpoint import GradScalerCheckpoint
from cupy_amp.demo.model import parameter_names
from cupy_amp.demo.settings import DemoError, ScalerSettings, Settings, check_settings
from cupy_amp.demo.training import Device, History, RunState, make_optimizer
from cupy_amp.errors import CheckpointError
from cupy_amp.scaler import GradScaler
from cupy_amp.sync_free import SyncFreeGradScaler

__all__ = [
    "OPTIMIZER_FILE",
    "SCALER_FILE",
    "STATE_FILE",
    "SavedRun",
    "latest_save",
    "load_run",
    "save_name",
    "save_run",
]

SCALER_FILE, OPTIMIZER_FILE, STATE_FILE = "scaler.ckpt", "adamw.state", "state.npz"
_SAVE = re.compile(r"step-(\d{6,})")
_FORMAT, _VERSION = "cupy-amp-demo", 3  # 3: the optimizer in its own state file, each save a directory
_HISTORY = ("loss", "accuracy", "scale", "skipped")
_STATE_LIMIT = 1 << 30


@dataclass(frozen=True)
class SavedRun:
    """A run read back from its directory, in host memory."""

    settings: Settings
    scaler_settings: ScalerSettings
    scaler: GradScalerCheckpoint
    state: RunState
    folder: Path  # the save it came from

    def to_device(self, device: Device) -> RunState:
        """Return the state with its arrays on ``device`` (the optimizer rebuilt over them)."""
        masters = {name: device.xp.asarray(array) for name, array in self.state.masters.items()}
        optimizer = make_optimizer(self.settings, masters)
        optimizer.load_state_dict(self.state.optimizer.state_dict())
        return RunState(step=self.state.step, masters=masters, optimizer=optimizer, history=self.state.history)


def save_name(step: int) -> str:
    """The directory name of the save of ``step``."""
    return f"step-{step:06d}"


def latest_save(run: Path) -> Path | None:
    """Return the newest complete save in ``run`` (the directory with the highest step), or None."""
    try:
        names = os.listdir(run)
    except (FileNotFoundError, NotADirectoryError):
        return None
    steps = [int(match.group(1)) for match in map(_SAVE.fullmatch, names) if match]
    return run / save_name(max(steps)) if steps else None


def save_run(
    run: Path,
    settings: Settings,
    scaler_settings: ScalerSettings,
    scaler: GradScaler | SyncFreeGradScaler,
    state: RunState,
    device: Device,
) -> Path:
    """Save the run at its current step as one directory, renamed into place whole; return it.

    Raises:
        OSError: A file or the directory cannot be written; the saves already there are untouched.
    """
    run.mkdir(parents=True, exist_ok=True)
    target = run / save_name(state.step)
    staging = run / f".{target.name}.tmp-{secrets.token_hex(8)}"
    staging.mkdir()
    try:
        scaler.checkpoint().save(staging / SCALER_FILE)
        state.optimizer.save(staging / OPTIMIZER_FILE)
        write_file_atomic(staging / STATE_FILE, _state_bytes(settings, scaler_settings, state, device))
        _discard(target)  # a save of this very step, left by a run that was resumed from an older one
        os.replace(staging, target)  # the save: every file, or none
    except BaseException:
        _discard(staging)
        raise
    _sync_directory(run)
    for name in os.listdir(run):
        if name != target.name and (_SAVE.fullmatch(name) or name.startswith(".step-")):
            _discard(run / name)  # older saves, and the leftovers of interrupted ones
    return target


def _state_bytes(settings: Settings, scaler_settings: ScalerSettings, state: RunState, device: Device) -> bytes:
    document = {"run": {**asdict(settings), "hidden": list(settings.hidden)}, "scaler": asdict(scaler_settings)}
    arrays: dict[str, Any] = {
        "format": np.array(_FORMAT),
        "version": np.array(_VERSION, dtype=np.int64),
        "settings": np.array(json.dumps(document)),
        "step": np.array(state.step, dtype=np.int64),
    }
    for name, array in state.masters.items():
        arrays[f"weights/{name}"] = device.to_host(array)
    for name in _HISTORY:
        arrays[f"history/{name}"] = np.array(getattr(state.history, name), dtype=bool if name == "skipped" else float)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _discard(path: Path) -> None:
    """Remove a directory: first renamed out of sight (so no half-deleted save is ever seen), then deleted."""
    if not path.exists():
        return
    hidden = path.with_name(f".{path.name.lstrip('.')}.old-{secrets.token_hex(8)}")
    os.replace(path, hidden)
    shutil.rmtree(hidden, ignore_errors=True)


def _sync_directory(path: Path) -> None:
    """Flush a directory's entries to disk, where the system allows it (so the rename survives a power loss)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_run(run: Path) -> SavedRun:
    """Read the newest save of a run directory written by :func:`save_run`.

    Raises:
        DemoError: There is no save, or a file of it is unreadable, invalid, or of another step than the save.
    """
    folder = latest_save(run)
    if folder is None:
        raise DemoError(f"{run}: not a demo run (expected a step-N directory, written by cupy-amp demo --out)")
    try:
        checkpoint = GradScalerCheckpoint.load(folder / SCALER_FILE)
        data = read_regular_file(folder / STATE_FILE, _STATE_LIMIT, DemoError)
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
        settings, scaler_settings, masters, history, step = _parse_state(arrays)
        optimizer = make_optimizer(settings, masters)
        optimizer.load(folder / OPTIMIZER_FILE)
    except (CheckpointError, OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as exc:
        raise DemoError(f"cannot resume from {folder}: {exc}") from None
    problems = []
    if int(_step_of(folder)) != step:
        problems.append(f"{STATE_FILE} is at step {step}, not the save's {_step_of(folder)}")
    if checkpoint.steps != step:
        problems.append(f"{SCALER_FILE} is at step {checkpoint.steps}, not {step}")
    if not 0 <= optimizer.step_count <= step:
        problems.append(f"{OPTIMIZER_FILE} made {optimizer.step_count} updates in {step} steps")
    if problems:
        raise DemoError(f"cannot resume from {folder}: " + "; ".join(problems) + " (files from different runs?)")
    return SavedRun(settings, scaler_settings, checkpoint, RunState(step, masters, optimizer, history), folder)


def _step_of(folder: Path) -> int:
    match = _SAVE.fullmatch(folder.name)
    return int(match.group(1)) if match else -1


def _parse_state(arrays: dict[str, np.ndarray]) -> tuple[Settings, ScalerSettings, dict[str, Any], History, int]:
    if str(arrays["format"]) != _FORMAT or int(arrays["version"]) != _VERSION:
        raise ValueError(f"{STATE_FILE} is not a demo state of format {_FORMAT} version {_VERSION}")
    document = json.loads(str(arrays["settings"]))
    run = dict(document["run"])
    run["hidden"] = tuple(run["hidden"]) if isinstance(run["hidden"], list) else run["hidden"]
    settings = Settings(**run)
    problem = check_settings(settings)
    if problem is not None:
        raise ValueError(f"{STATE_FILE} holds invalid settings: {problem}")
    scaler_settings = ScalerSettings(**document["scaler"])
    step = int(arrays["step"])
    history = History(**{name: arrays[f"history/{name}"].tolist() for name in _HISTORY})
    if any(len(getattr(history, name)) != step for name in _HISTORY):
        raise ValueError(f"the history of {STATE_FILE} holds {len(history)} steps, expected {step}")
    names = parameter_names(len(settings.hidden) + 1)
    masters = {name: np.array(arrays[f"weights/{name}"], dtype=np.float32) for name in names}
    return settings, scaler_settings, masters, history, step
