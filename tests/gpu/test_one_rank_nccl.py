"""The real NCCL path on one GPU: the multi-GPU scenarios run as a world of one rank.

With one rank every all-reduce returns this rank's own values, so the answers are known: what this
exercises is the code between the scaler and NCCL (NcclAllReduce over a bare NcclCommunicator and over
cupyx's NCCLBackend, the flags and sums handed to the communicator on the step's stream, an all-reduce
captured in a CUDA graph and replayed), which the fake communicators of the CPU tests stand in for.
Each scenario runs in a process of its own (tests/gpu/ddp_worker.py), as on several GPUs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_multi_gpu import run_ranks

VARIANTS = ["", "+raw", "+syncfree", "+raw+syncfree"]
IDS = ["NCCLBackend", "NcclCommunicator", "sync-free", "sync-free-raw"]


@pytest.fixture(autouse=True)
def nccl_or_skip() -> None:
    pytest.importorskip("cupy")
    try:
        from cupy.cuda import nccl
    except Exception as error:  # CuPy without its NCCL binding, or no libnccl to load
        pytest.skip(f"CuPy has no NCCL here ({type(error).__name__}: {error})")
    if not getattr(nccl, "available", True):
        pytest.skip("CuPy was built without NCCL")


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_one_rank_skips_exactly_its_own_overflows(tmp_path: Path, variant: str) -> None:
    (rank0,) = run_ranks("scripted_remote_overflow" + variant, tmp_path, world=1)
    assert [i for i, ok in enumerate(rank0["finite"]) if not ok] == [2, 3, 9, 15]
    final = rank0["stats"][-1]
    assert (final["skipped_steps"], final["backoffs"], final["remote_skipped_steps"]) == (4, 4, 0)
    assert final["growths"] > 0
    assert rank0["culprits"][2] == ["w"] and rank0["culprits"][1] == []
    assert rank0["stats"][2]["last_overflow"] == "local"


@pytest.mark.parametrize("variant", ["", "+raw"], ids=["NCCLBackend", "NcclCommunicator"])
def test_one_rank_replays_a_captured_step_with_its_all_reduce(tmp_path: Path, variant: str) -> None:
    (rank0,) = run_ranks("captured_remote_overflow" + variant, tmp_path, world=1)
    skipped = [s["skipped_steps"] for s in rank0["stats"]]
    assert [i for i in range(1, 20) if skipped[i] > skipped[i - 1]] == [2, 3, 9, 15] and skipped[0] == 0
    assert rank0["stats"][2]["last_overflow"] == "local"
    # The eager warm-up (a gradient of ones, scale 2**10) and each clean replay (2**10 over the scale it ran
    # at) moved the weights by 0.5 * the unscaled gradient, in float32; no overflowed replay moved them.
    weights = np.float32(0.0) - np.float32(0.5) * np.float32(2.0**-10)
    scale_before = [2.0**10] + [s["scale"] for s in rank0["stats"][:-1]]
    for replay in range(20):
        if skipped[replay] == (skipped[replay - 1] if replay else 0):
            weights = weights - np.float32(0.5) * (np.float32(2.0**10) / np.float32(scale_before[replay]))
    assert set(rank0["weights"]) == {float(weights)}


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_one_rank_check_all_reduces_its_sums_to_its_own_norm(tmp_path: Path, variant: str) -> None:
    (rank0,) = run_ranks("sharded_check_adamw" + variant, tmp_path, world=1)
    assert all(rank0["finite"]) and rank0["optimizer_steps"] == 12
    for norm, local_sum in zip(rank0["norms"], rank0["local_sums"]):
        expected = local_sum**0.5
        assert abs(norm - expected) <= expected * 2**-23
    assert rank0["stats"][-1]["skipped_steps"] == 0
