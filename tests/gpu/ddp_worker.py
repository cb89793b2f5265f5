"""One rank of a multi-process GPU test: python ddp_worker.py SCENARIO RANK WORLD PORT OUTDIR.

Started by tests/gpu/test_multi_gpu.py, one process per GPU, with the
repository and tests/ (for tests/helpers.py) on PYTHONPATH; each writes its
results as JSON to OUTDIR/rank<RANK>.json for the parent to compare. A
scenario name may end in "+raw" (a bare NcclCommunicator) or "+syncfree"
(a SyncFreeGradScaler, its verdict read back only to report it).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import cupy
import numpy as np
from helpers import open_step  # tests/, on the path test_multi_gpu.py gives the ranks

from cupy_amp import GradScaler, GradScalerCheckpoint, SyncFreeGradScaler
from cupy_amp.optim import AdamW

SCALER: type = GradScaler  # SyncFreeGradScaler for "+syncfree" scenarios


def init(rank: int, world: int, port: int, out: Path, raw: bool = False) -> object:
    """Join the group: a cupyx NCCLBackend, or (raw) a bare NcclCommunicator whose id goes through OUTDIR."""
    cupy.cuda.Device(rank).use()
    if not raw:
        from cupyx.distributed import init_process_group

        return init_process_group(world, rank, host="127.0.0.1", port=port)
    from cupy.cuda import nccl

    id_file = out / "nccl_id.json"
    if rank == 0:
        unique_id = nccl.get_unique_id()  # bytes in current CuPy, a tuple of ints in older ones
        staging = out / "nccl_id.json.tmp"
        staging.write_text(json.dumps({"bytes": isinstance(unique_id, bytes), "values": list(unique_id)}))
        staging.replace(id_file)
    deadline = time.monotonic() + 60
    while not id_file.exists():
        if time.monotonic() > deadline:
            raise SystemExit("rank 0 never published the NCCL id")
        time.sleep(0.01)
    published = json.loads(id_file.read_text())
    unique_id = bytes(published["values"]) if published["bytes"] else tuple(published["values"])
    return nccl.NcclCommunicator(world, unique_id, rank)


def stats_row(scaler: GradScaler) -> dict[str, object]:
    return scaler.stats().to_dict()


def scripted_remote_overflow(rank: int, world: int, comm: object, out: Path) -> dict[str, object]:
    """An inf on rank 0 only at scripted steps; every rank must skip and back off identically."""
    scaler = SCALER(init_scale=2.0**10, growth_interval=3, comm=comm)
    inf_steps = {2, 3, 9, 15}
    results = {"finite": [], "stats": [], "culprits": []}
    for step in range(20):
        grads = {"w": cupy.ones((64, 64), cupy.float16), "b": cupy.ones(64, cupy.float32)}
        if rank == 0 and step in inf_steps:
            grads["w"][5, 7] = cupy.inf
        open_step(scaler, cupy)
        finite = bool(scaler.unscale_and_check(grads))
        results["finite"].append(finite)
        results["culprits"].append(scaler.nonfinite_gradients())
        scaler.update()
        results["stats"].append(stats_row(scaler))
    return results


def no_gradients(rank: int, world: int, comm: object, out: Path) -> dict[str, object]:
    """Rank 1 has no gradients at all; it must still take part in every vote."""
    scaler = SCALER(init_scale=2.0**10, growth_interval=2, comm=comm)
    results = {"finite": [], "stats": []}
    for step in range(10):
        if rank == 1:
            grads: list[object] = [] if step % 2 else [None]
        else:
            grads = [cupy.ones(1000, cupy.float32)]
            if step in (1, 6):
                grads[0][999] = cupy.nan
        open_step(scaler, cupy)  # a rank without gradients scales its loss too: every rank makes the same calls
        results["finite"].append(bool(scaler.unscale_and_check(grads)))
        scaler.update()
        results["stats"].append(stats_row(scaler))
    return results


def data_parallel(rank: int, world: int, comm: object, out: Path, use_comm: bool = True) -> dict[str, object]:
    """200 steps of data-parallel SGD, gradients all-reduced, random rank-local overflow injections."""
    rng = np.random.default_rng(1234)  # the same schedule of injections on every rank
    data_rng = np.random.default_rng(100 + rank)  # each rank its own data shard
    weights = cupy.asarray(np.random.default_rng(7).standard_normal((32, 8)).astype(np.float32))
    scaler = SCALER(init_scale=2.0**12, growth_interval=10, comm=comm if use_comm else None)
    scales = []
    for _ in range(200):
        x = cupy.asarray(data_rng.standard_normal((64, 32)).astype(np.float16))
        y = cupy.asarray(data_rng.standard_normal((64, 8)).astype(np.float16))
        residual = x @ weights.astype(cupy.float16) - y
        # The fp16 gradient of the scaled mean squared error (the scale enters as the loss's seed).
        grad = (x.T @ residual).astype(cupy.float16) * np.float16(scaler.scale_factor() / 64)
        comm.all_reduce(grad, grad, op="sum")
        grad /= world
        injected_rank = int(rng.integers(0, world * 4))  # about one step in four, on one rank
        if injected_rank == rank:
            grad[0, 0] = cupy.inf
        open_step(scaler, cupy)
        finite = scaler.unscale_and_check([grad])
        if SCALER is SyncFreeGradScaler:
            scaler.apply_if_finite([weights], [weights - 0.01 * grad.astype(cupy.float32)])
        elif finite:
            weights -= 0.01 * grad.astype(cupy.float32)
        scaler.update()
        scales.append(scaler.scale_factor())
    return {"weights": cupy.asnumpy(weights).tobytes().hex(), "scales": scales, "stats": stats_row(scaler)}


def data_parallel_without_comm(rank: int, world: int, comm: object, out: Path) -> dict[str, object]:
    """Negative control: the same run with a scaler that does not vote; ranks must diverge."""
    return data_parallel(rank, world, comm, out, use_comm=False)


def checkpoint_rank0_save(rank: int, world: int, comm: object, out: Path) -> dict[str, object]:
    """Rank 0 saves, a barrier, every rank loads; states must be equal."""
    scaler = GradScaler(init_scale=2.0**10, growth_interval=2, comm=comm)
    for step in range(7):
        grads = [cupy.ones(100, cupy.float32)]
        if rank == 1 and step == 3:
            grads[0][0] = cupy.inf
        open_step(scaler, cupy)
        scaler.unscale_and_check(grads)
        scaler.update()
    path = out / "scaler.ckpt"
    if rank == 0:
        scaler.checkpoint().save(path)
    comm.barrier()
    restored = GradScaler(comm=comm)
    restored.load_checkpoint(GradScalerCheckpoint.load(path))
    return {"own": scaler.checkpoint().to_dict(), "loaded": restored.checkpoint().to_dict()}


def captured_remote_overflow(rank: int, world: int, comm: object, out: Path) -> dict[str, object]:
    """scripted_remote_overflow's schedule, the step captured in a CUDA graph (all-reduce included) and replayed."""
    global SCALER
    SCALER = SyncFreeGradScaler
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        weights = cupy.zeros(64, cupy.float32)
        grad = cupy.ones(64, cupy.float32)
        scaler = SyncFreeGradScaler(init_scale=2.0**10, growth_interval=3, comm=comm)
        prepared = scaler.prepare([grad])
        step_size = cupy.full((), 0.5, cupy.float32)
        update = cupy.empty_like(weights)
        loss = cupy.empty((), cupy.float32)  # allocated before the capture

        def step() -> None:
            loss.fill(1.0)
            scaler.scale_loss(loss)
            scaler.unscale_and_check(prepared)
            cupy.subtract(weights, step_size * grad, out=update)
            scaler.apply_if_finite([weights], [update])
            scaler.update()

        step()  # eager warm-up: every kernel loaded, every buffer allocated
        stream.begin_capture()
        try:
            step()
        finally:
            graph = stream.end_capture()
        results: dict[str, list[object]] = {"stats": []}
        for replay in range(20):
            grad.fill(2.0**10)  # the gradient of this replay, already scaled
            if rank == 0 and replay in {2, 3, 9, 15}:
                grad[7] = cupy.inf
            graph.launch(stream)
            results["stats"].append(scaler.stats().to_dict())
        results["weights"] = cupy.asnumpy(weights).tolist()
    return results


def sharded_check_adamw(rank: int, world: int, comm: object, out: Path) -> dict[str, object]:
    """Each rank holds half of the gradients (sharded): check() gives both the global norm and one verdict."""
    rng = np.random.default_rng(100 + rank)
    scaler = SCALER(init_scale=2.0**8, growth_interval=4, comm=comm)
    weights = cupy.asarray(np.random.default_rng(7).standard_normal(4096).astype(np.float16))  # same on both
    optimizer = AdamW([weights], lr=1e-3)
    results: dict[str, list[object]] = {"norms": [], "local_sums": [], "finite": [], "stats": []}
    for step in range(12):
        grad = cupy.asarray((rng.standard_normal(4096) * 3).astype(np.float16))
        if rank == 1 and step in (3, 8):
            grad[17] = cupy.nan
        results["local_sums"].append(float(cupy.sum(grad.astype(cupy.float64) ** 2)))
        scale = scaler.scale_factor()
        open_step(scaler, cupy)
        stats = scaler.check([grad], max_norm=50.0)
        optimizer.step([grad], stats)  # each rank updates the same weights from its own shard here
        results["norms"].append(float(cupy.asnumpy(stats.norm)) * scale)
        results["finite"].append(bool(stats.finite))
        scaler.update()
        results["stats"].append(stats_row(scaler))
    results["optimizer_steps"] = optimizer.step_count
    return results


SCENARIOS = {
    "sharded_check_adamw": sharded_check_adamw,
    "captured_remote_overflow": captured_remote_overflow,
    "scripted_remote_overflow": scripted_remote_overflow,
    "no_gradients": no_gradients,
    "data_parallel": data_parallel,
    "data_parallel_without_comm": data_parallel_without_comm,
    "checkpoint_rank0_save": checkpoint_rank0_save,
}


def main() -> int:
    scenario, out = sys.argv[1], Path(sys.argv[5])
    rank, world, port = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    global SCALER
    name, *variants = scenario.split("+")
    raw = "raw" in variants
    if "syncfree" in variants:
        SCALER = SyncFreeGradScaler
    comm = init(rank, world, port, out, raw=raw)
    if raw and name not in ("scripted_remote_overflow", "captured_remote_overflow", "sharded_check_adamw"):
        raise SystemExit("the raw-communicator variant is only wired for the scripted scenarios")
    result = SCENARIOS[name](rank, world, comm, out)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
