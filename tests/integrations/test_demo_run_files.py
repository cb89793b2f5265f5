"""A demo run's saves: each one complete or absent, whatever line an interrupt lands on."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from helpers import saved_arrays
from interrupts import interrupted

from cupy_amp import GradScaler
from cupy_amp.demo.model import load_dataset
from cupy_amp.demo.run_files import latest_save, load_run, save_run
from cupy_amp.demo.settings import ScalerSettings, Settings
from cupy_amp.demo.training import Trainer, new_state, select_device


def training(steps: int) -> tuple[Settings, ScalerSettings, Any, GradScaler, Any]:
    settings, scaler_settings = Settings(batch_size=64, hidden=(8,)), ScalerSettings()
    device, _ = select_device("cpu")
    dataset = load_dataset(settings.data, settings.seed)
    state, scaler = new_state(device, settings, dataset), GradScaler(**asdict(scaler_settings))
    trainer = Trainer("amp", settings, dataset, device, state, scaler)
    for _ in range(steps):
        trainer.step()
    return settings, scaler_settings, state, scaler, (device, trainer)


def snapshot(run: Path) -> dict[str, Any]:
    """What a resume reads from a run directory, as plain values."""
    saved = load_run(run)
    return {
        "step": saved.state.step,
        "scaler": saved.scaler.to_dict(),
        "optimizer": saved.state.optimizer.state_dict(),
        "arrays": {name: value.tobytes() for name, value in saved_arrays(run).items()},
    }


def test_a_save_interrupted_at_any_line_leaves_the_last_complete_save(tmp_path: Path) -> None:
    settings, scaler_settings, state, scaler, (device, trainer) = training(2)
    reference_2, reference_4 = tmp_path / "at-2", tmp_path / "at-4"
    save_run(reference_2, settings, scaler_settings, scaler, state, device)
    for _ in range(2):
        trainer.step()
    save_run(reference_4, settings, scaler_settings, scaler, state, device)
    expected = {2: snapshot(reference_2), 4: snapshot(reference_4)}

    outcomes, k = set(), 0
    while True:
        k += 1
        run = tmp_path / f"run-{k}"
        run.mkdir()
        for name in os.listdir(reference_2):  # the run as its save at step 2 left it
            (run / name).mkdir()
            for file in os.listdir(reference_2 / name):
                (run / name / file).write_bytes((reference_2 / name / file).read_bytes())

        def save(run: Path = run) -> None:
            save_run(run, settings, scaler_settings, scaler, state, device)

        reached = interrupted(save, k)
        got = snapshot(run)  # a resume reads one complete save: the old one or the new one
        assert got == expected[got["step"]], k
        outcomes.add(got["step"])
        save()  # the next save clears whatever the interrupted one left
        assert [name for name in os.listdir(run)] == ["step-000004"], k
        if not reached:
            break
    assert outcomes == {2, 4} and k > 50  # the interrupt landed before and after the save's one rename


def test_the_newest_save_is_the_one_resumed(tmp_path: Path) -> None:
    settings, scaler_settings, state, scaler, (device, trainer) = training(1)
    save_run(tmp_path, settings, scaler_settings, scaler, state, device)
    trainer.step()
    newest = save_run(tmp_path, settings, scaler_settings, scaler, state, device)
    assert latest_save(tmp_path) == newest and newest.name == "step-000002"
    assert load_run(tmp_path).state.step == 2
    assert np.array_equal(load_run(tmp_path).state.masters["W1"], state.masters["W1"])
