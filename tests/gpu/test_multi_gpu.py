"""Multi-process agreement over NCCL on a real multi-GPU machine (one process per GPU).

Each scenario starts one tests/gpu/ddp_worker.py process per rank and compares
what the ranks report. Skipped with fewer than two GPUs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multi_gpu

WORKER = Path(__file__).with_name("ddp_worker.py")
WORLD = 2


def _gpu_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy or no driver: the gpu marker already skips or fails the test
        return 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(scenario: str, tmp_path: Path, world: int = WORLD) -> list[dict]:
    if _gpu_count() < world:
        pytest.skip(f"needs {world} GPUs, found {_gpu_count()}")
    port = _free_port()
    root = Path(__file__).resolve().parents[2]
    # The repository (cupy_amp) and tests/ (helpers, shared with the in-process tests).
    path = os.pathsep.join(filter(None, [str(root), str(root / "tests"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), scenario, str(rank), str(world), str(port), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank in range(world)
    ]
    outputs = []
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            pytest.fail(f"{scenario}: a rank hung (the ranks disagreed on a collective?)")
        outputs.append(output)
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"{scenario} rank {rank} failed:\n{output[-4000:]}"
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)]


AGREED = ("scale", "consecutive_good_steps", "hysteresis_tracker", "steps", "skipped_steps", "growths", "backoffs")


def _agreed(stats: dict) -> tuple:
    return tuple(stats[key] for key in AGREED)


@pytest.mark.parametrize(
    "variant",
    ["", "+raw", "+syncfree", "+raw+syncfree"],
    ids=["NCCLBackend", "NcclCommunicator", "sync-free", "sync-free-raw"],
)
def test_inf_on_rank0_only_makes_every_rank_skip_and_back_off(tmp_path: Path, variant: str) -> None:
    rank0, rank1 = run_ranks("scripted_remote_overflow" + variant, tmp_path)
    assert rank0["finite"] == rank1["finite"]
    assert [i for i, ok in enumerate(rank0["finite"]) if not ok] == [2, 3, 9, 15]
    assert [_agreed(s) for s in rank0["stats"]] == [_agreed(s) for s in rank1["stats"]]
    assert rank0["stats"][-1]["skipped_steps"] == 4 and rank0["stats"][-1]["backoffs"] == 4
    assert rank0["stats"][-1]["growths"] > 0
    # Culprits and the origin of the overflow stay local.
    assert rank0["culprits"][2] == ["w"] and rank1["culprits"][2] == []
    assert rank0["stats"][2]["last_overflow"] == "local" and rank1["stats"][2]["last_overflow"] == "remote"
    assert rank0["stats"][-1]["remote_skipped_steps"] == 0 and rank1["stats"][-1]["remote_skipped_steps"] == 4


def test_a_rank_without_gradients_still_votes(tmp_path: Path) -> None:
    rank0, rank1 = run_ranks("no_gradients", tmp_path)
    assert rank0["finite"] == rank1["finite"]
    assert [i for i, ok in enumerate(rank0["finite"]) if not ok] == [1, 6]
    assert [_agreed(s) for s in rank0["stats"]] == [_agreed(s) for s in rank1["stats"]]


@pytest.mark.parametrize("variant", ["", "+syncfree"], ids=["GradScaler", "SyncFreeGradScaler"])
def test_parameters_stay_identical_over_200_steps_with_random_overflows(tmp_path: Path, variant: str) -> None:
    rank0, rank1 = run_ranks("data_parallel" + variant, tmp_path)
    assert rank0["scales"] == rank1["scales"]
    assert rank0["weights"] == rank1["weights"]
    assert rank0["stats"]["skipped_steps"] >= 20  # the injections really happened
    assert rank0["stats"]["skipped_steps"] == rank1["stats"]["skipped_steps"]


def test_negative_control_without_agreement_ranks_diverge(tmp_path: Path) -> None:
    rank0, rank1 = run_ranks("data_parallel_without_comm", tmp_path)
    assert rank0["weights"] != rank1["weights"]
    assert rank0["scales"] != rank1["scales"]


def test_rank0_saves_every_rank_loads_the_same_state(tmp_path: Path) -> None:
    rank0, rank1 = run_ranks("checkpoint_rank0_save", tmp_path)
    assert rank0["own"] == rank0["loaded"] == rank1["loaded"]
    assert {k: v for k, v in rank1["own"].items() if k not in ("found_overflow_local", "remote_skipped_steps")} == {
        k: v for k, v in rank0["own"].items() if k not in ("found_overflow_local", "remote_skipped_steps")
    }


@pytest.mark.parametrize("variant", ["", "+raw"], ids=["NCCLBackend", "NcclCommunicator"])
def test_a_captured_sync_free_step_with_its_all_reduce_agrees_on_every_rank(tmp_path: Path, variant: str) -> None:
    rank0, rank1 = run_ranks("captured_remote_overflow" + variant, tmp_path)
    assert [_agreed(s) for s in rank0["stats"]] == [_agreed(s) for s in rank1["stats"]]
    skipped = [s["skipped_steps"] for s in rank0["stats"]]
    # The warm-up step was clean; replays 2, 3, 9 and 15 overflowed on rank 0 only.
    assert [i for i in range(1, 20) if skipped[i] > skipped[i - 1]] == [2, 3, 9, 15] and skipped[0] == 0
    assert rank0["stats"][2]["last_overflow"] == "local" and rank1["stats"][2]["last_overflow"] == "remote"
    assert rank0["weights"] == rank1["weights"]


@pytest.mark.parametrize(
    "variant",
    ["", "+raw", "+syncfree", "+raw+syncfree"],
    ids=["NCCLBackend", "NcclCommunicator", "sync-free", "sync-free-raw"],
)
def test_check_gives_every_rank_the_global_norm_of_sharded_gradients_and_one_verdict(
    tmp_path: Path, variant: str
) -> None:
    rank0, rank1 = run_ranks("sharded_check_adamw" + variant, tmp_path)
    assert rank0["finite"] == rank1["finite"]
    assert [i for i, ok in enumerate(rank0["finite"]) if not ok] == [3, 8]
    for step, ok in enumerate(rank0["finite"]):
        if ok:
            expected = (rank0["local_sums"][step] + rank1["local_sums"][step]) ** 0.5
            assert rank0["norms"][step] == rank1["norms"][step]
            assert abs(rank0["norms"][step] - expected) <= expected * 2**-23
    assert [_agreed(s) for s in rank0["stats"]] == [_agreed(s) for s in rank1["stats"]]
    assert rank0["optimizer_steps"] == rank1["optimizer_steps"] == 10
    assert rank0["stats"][3]["last_overflow"] == "remote" and rank1["stats"][3]["last_overflow"] == "local"
