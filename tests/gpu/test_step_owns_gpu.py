"""What a step shares, owned: every reader stream ordered, a refusal means skip, a collective joined once.

The four silent wrong answers of issue 30, each on the H200 (each test fails on commit 90b0989):

1. two optimizers on two streams apply one check's statistics; the next check must wait for both;
2. a Ctrl-C delivered as the NCCL all-reduce returns must not make the call join a second all-reduce as a
   vote: this rank cannot know the outcome, so it sends the poisoned vote once and refuses from then on;
3. an interrupt after the all-reduce answered, anywhere up to the verdict's read, must not make this rank
   count an overflow the others did not (its verdict is the answer's, or it refuses);
4. a check refused after a completed step leaves the record saying "skip", so an optimizer step replayed
   from a CUDA graph does nothing.

Defects 2 and 3 run over a real NCCL communicator of one rank, created in this process.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import capture, open_step, refuses_every_call
from interrupts import interrupted

cupy = pytest.importorskip("cupy")

from cupy_amp import GradScaler, RanksMayDisagreeError, ScalerProtocolError, SyncFreeGradScaler  # noqa: E402
from cupy_amp.optim import SGD  # noqa: E402
from cupy_amp.step import SCALED  # noqa: E402

FACES = [GradScaler, SyncFreeGradScaler]
POISON = 2.0**40

_SPIN = cupy.RawKernel(
    'extern "C" __global__ void spin(long long cycles) { long long t = clock64(); while (clock64() - t < cycles) {} }',
    "spin",
)


@pytest.mark.parametrize("face", FACES)
def test_the_next_check_waits_for_every_optimizer_stream_that_reads_the_record(face: type) -> None:
    """Step 1 overflows. Optimizer B reads its "skip" late (stream b, behind a long kernel); optimizer C reads it
    at once (stream c), last. Step 2's clean check must wait for B too, or B applies step 2's "apply" to its
    step-1 gradients, which hold inf."""
    a, b, c = (cupy.cuda.Stream(non_blocking=True) for _ in range(3))
    w_b, w_c = cupy.zeros(1000, cupy.float32), cupy.zeros(1000, cupy.float32)
    g_b, g_c, g_b2, g_c2 = (cupy.zeros(1000, cupy.float32) for _ in range(4))
    opt_b, opt_c = SGD([w_b], lr=1.0), SGD([w_c], lr=1.0)
    for optimizer, grads in ((opt_b, g_b), (opt_b, g_b2), (opt_c, g_c), (opt_c, g_c2)):
        optimizer.step([grads], None)  # tables built now (building waits, which would hide the race); zeros
    scaler = face(init_scale=1.0)
    cupy.cuda.Device().synchronize()
    with a:
        g_b.fill(cupy.inf)
        g_c.fill(1.0)
        stats = open_step(scaler, cupy).check([g_b, g_c])
    with b:
        _SPIN((1,), (1,), (np.int64(500_000_000),))  # about a quarter of a second
        opt_b.step([g_b], stats)  # must read step 1's "skip"
    with c:
        opt_c.step([g_c], stats)
    with a:
        scaler.update()
        g_b2.fill(1.0)
        g_c2.fill(1.0)
        stats = open_step(scaler, cupy).check([g_b2, g_c2])
        opt_b.step([g_b2], stats)
        opt_c.step([g_c2], stats)
    cupy.cuda.Device().synchronize()
    assert cupy.asnumpy(w_b).tolist() == [-1.0] * 1000, "optimizer B applied step 2's record to step 1"
    assert cupy.asnumpy(w_c).tolist() == [-1.0] * 1000
    assert (opt_b.step_count, opt_c.step_count) == (3, 3)  # two warm-ups and step 2 each


_DTYPES = {"NCCL_FLOAT64": np.float64, "NCCL_INT32": np.int32, "NCCL_INT64": np.int64, "NCCL_UINT8": np.uint8}


class RecordingNccl:
    """A raw one-rank NcclCommunicator that records every all-reduce's answer; optionally, as the ``at``-th
    all-reduce returns, a KeyboardInterrupt (a Ctrl-C delivered when the C call returns)."""

    def __init__(self, comm: Any, at: int = 0) -> None:
        from cupy.cuda import nccl

        self._comm, self._at, self._nccl = comm, at, nccl
        self.answers: list[list[float]] = []

    def allReduce(self, send: int, recv: int, count: int, dtype: int, op: int, stream: int) -> None:
        self._comm.allReduce(send, recv, count, dtype, op, stream)
        cupy.cuda.runtime.deviceSynchronize()
        kind = next(np.dtype(t) for name, t in _DTYPES.items() if getattr(self._nccl, name) == dtype)
        memory = cupy.cuda.UnownedMemory(recv, count * kind.itemsize, self)
        answer = cupy.ndarray((count,), kind, cupy.cuda.MemoryPointer(memory, 0))
        self.answers.append([float(x) for x in cupy.asnumpy(answer)])
        if len(self.answers) == self._at:
            raise KeyboardInterrupt


def sent(scaler: Any) -> None:
    """Wait for the poisoned vote, sent from a thread of its own, if the scaler sent one."""
    if scaler._step.poison_sender is not None:
        scaler._step.poison_sender.join(10.0)


@pytest.fixture(scope="module")
def nccl_comm() -> Any:
    try:
        from cupy.cuda import nccl
    except Exception as error:
        pytest.skip(f"CuPy has no NCCL here ({type(error).__name__}: {error})")
    return nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("method", ["unscale_and_check", "check"])
def test_a_ctrl_c_as_the_all_reduce_returns_sends_the_poison_once_instead_of_a_second_vote(
    nccl_comm: Any, face: type, method: str
) -> None:
    comm = RecordingNccl(nccl_comm, at=1)
    scaler = face(init_scale=4.0, comm=comm)
    grads = [cupy.ones(8, cupy.float32)]
    with pytest.raises(KeyboardInterrupt):
        getattr(open_step(scaler, cupy), method)(grads)
    sent(scaler)
    assert len(comm.answers) == 2, f"all-reduces joined: {comm.answers}"
    assert comm.answers[1][0] == POISON, f"the second all-reduce was a vote, not the poison: {comm.answers}"
    refuses_every_call(scaler, xp=cupy)


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("method", ["unscale_and_check", "check"])
def test_an_interrupt_at_any_line_keeps_the_answers_verdict_or_refuses(nccl_comm: Any, face: type, method: str) -> None:
    """One rank over real NCCL, clean gradients, an interrupt at each line of the call in turn. Whatever this
    rank sent to the all-reduce is what the other ranks decide from: its own verdict must be that answer's,
    or it must refuse every later call."""
    k, refused, kept = 1, 0, 0
    while True:
        comm = RecordingNccl(nccl_comm)
        scaler = face(init_scale=4.0, growth_interval=1, comm=comm)
        grads = [cupy.ones(8, cupy.float32)]
        open_step(scaler, cupy)
        if not interrupted(lambda: getattr(scaler, method)(grads), k):  # noqa: B023
            break
        sent(scaler)
        votes = [answer[0] for answer in comm.answers if answer[0] < POISON]
        assert len(votes) <= 1, f"line {k}: joined {len(votes)} votes"
        try:
            overflow = bool(scaler.had_overflow())
        except RanksMayDisagreeError:
            assert any(answer[0] >= POISON for answer in comm.answers), f"line {k}: refused without the poison"
            refuses_every_call(scaler, xp=cupy)
            refused += 1
        else:
            if votes:
                assert overflow == (votes[0] > 0), f"line {k}: the answer said {votes[0]}, the verdict {overflow}"
            kept += 1
            if scaler._step.phase != SCALED:  # the call counted (a call with no effect leaves the step as it was)
                scaler.update()
        k += 1
    assert k > 10 and kept > 0


@pytest.mark.parametrize("face", FACES)
def test_a_refused_check_leaves_the_record_saying_skip_for_a_replayed_optimizer_step(face: type) -> None:
    """An optimizer step captured in a CUDA graph reads the record on every replay. After a completed step,
    a check refused for a missing scale_loss must leave "skip" there: the replay then does nothing."""
    weights, grad = cupy.zeros(1000, cupy.float32), cupy.ones(1000, cupy.float32)
    optimizer = SGD([weights], lr=1.0)
    scaler = face(init_scale=1.0)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        optimizer.step([grad], None)  # tables built outside the capture; weights -1
        stats = open_step(scaler, cupy).check([grad])
        graph = capture(stream, lambda: optimizer.step([grad], stats))
        graph.launch(stream)  # step 1 applied from the record: weights -2
        scaler.update()
        with pytest.raises(ScalerProtocolError, match="scale_loss"):
            scaler.check([grad])  # step 2: the loss was never scaled
        graph.launch(stream)  # the training loop replays the optimizer step anyway
    stream.synchronize()
    assert cupy.asnumpy(weights).tolist() == [-2.0] * 1000, "the replay applied a step no check completed"
