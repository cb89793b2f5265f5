"""Crash safety of GradScalerCheckpoint.save: a writer killed at any moment never leaves a torn file.

SIGKILL stops the process between any two system calls, which is what a crash
of the training job does; it does not simulate a power loss (that is what the
fsync calls are for, and no test here can pull the plug).
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cupy_amp.checkpoint import GradScalerCheckpoint

REPO_ROOT = Path(__file__).resolve().parents[2]

COMMON: dict[str, Any] = {
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    "enabled": True,
    "hysteresis": 1,
    "hysteresis_tracker": 1,
}
# Two checkpoints of different sizes, so that a file mixing them could not pass for either.
FIRST = GradScalerCheckpoint(
    scale=65536.0,
    consecutive_good_steps=5,
    min_scale=1.0,
    max_scale=2.0**24,
    steps=10,
    skipped_steps=1,
    growths=0,
    backoffs=1,
    found_overflow=False,
    found_overflow_local=False,
    remote_skipped_steps=0,
    **COMMON,
)
SECOND = GradScalerCheckpoint(
    scale=0.5,
    consecutive_good_steps=1999,
    min_scale=None,
    max_scale=None,
    steps=2**40,
    skipped_steps=2**33,
    growths=2**20,
    backoffs=2**19,
    found_overflow=True,
    found_overflow_local=False,
    remote_skipped_steps=2**18,
    **COMMON,
)

WRITER = """
import sys
from cupy_amp.checkpoint import GradScalerCheckpoint

target = sys.argv[1]
checkpoints = [GradScalerCheckpoint.from_bytes(bytes.fromhex(arg)) for arg in sys.argv[2:]]
checkpoints[1].save(target)
print("ready", flush=True)
while True:
    for checkpoint in checkpoints:
        checkpoint.save(target)
"""

ITERATIONS = 30
TEMPORARY_NAME = re.compile(r"^\.scaler\.ckpt\.tmp-[0-9a-f]{16}$")


@pytest.mark.slow
@pytest.mark.skipif(os.name != "posix", reason="SIGKILL is POSIX")
def test_killed_writer_always_leaves_a_complete_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "scaler.ckpt"
    FIRST.save(target)
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-c", WRITER, str(target), FIRST.to_bytes().hex(), SECOND.to_bytes().hex()]
    started = time.monotonic()
    for iteration in range(ITERATIONS):
        writer = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert writer.stdout is not None
            ready = writer.stdout.readline()
            assert ready == "ready\n", f"writer failed to start: {writer.stderr.read() if writer.stderr else ''}"
            time.sleep(rng.uniform(0.0, 0.02))
        finally:
            writer.kill()
            writer.communicate(timeout=30)
        loaded = GradScalerCheckpoint.load(target)
        assert loaded in (FIRST, SECOND), f"seed {seed}, iteration {iteration}: {loaded}"
        assert time.monotonic() - started < 120, f"seed {seed}: too slow"

    # Temporary files of killed writers may remain; they never replace or hide the target.
    leftovers = [name for name in os.listdir(tmp_path) if name != target.name]
    assert all(TEMPORARY_NAME.match(name) for name in leftovers), leftovers
    assert GradScalerCheckpoint.load(target) in (FIRST, SECOND)
    FIRST.save(target)
    assert GradScalerCheckpoint.load(target) == FIRST
