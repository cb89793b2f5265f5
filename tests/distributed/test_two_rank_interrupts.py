"""Two ranks, one of them interrupted at every line of every public call: the ranks agree, or all refuse.

Two ranks (threads over :mod:`fake_comm`'s counting communicator) train the
same three steps with their own gradients and their own SGD. On rank 0, one
call of step 1 gets a KeyboardInterrupt at its k-th line inside cupy_amp
(tests/interrupts.py), for every k. Rank 0 then recovers as a careful user
would: a call that had no effect is made again; a gradient call that counted
is followed by the optimizer step only if the step did not overflow; an
interrupted ``update()`` is retried if the step is still open.

After every interrupt point exactly one of these holds:

- both ranks ran all three steps, and their scales, counters, verdicts and
  weights are equal and the collectives they joined pair up one to one; or
- both ranks refuse: from some call on, each rank raised
  :class:`~cupy_amp.RanksMayDisagreeError`, and every later call of its scaler
  raises it too.

Nothing else (a hang, a rank that differs without a word) is accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pytest
from fake_comm import FakeVote, FakeWorld, run_ranks
from helpers import refuses_every_call
from interrupts import interrupted

from cupy_amp import GradScaler, RanksMayDisagreeError, SyncFreeGradScaler
from cupy_amp.optim import SGD
from cupy_amp.step import IDLE, INSPECTED, SCALED, UNSCALED

STEPS = 3
# The call interrupted, by the kind of step the ranks train with (each kind's own calls, and the load).
CASES = [
    ("unscale", "scale_loss"),
    ("unscale", "abandon_step"),
    ("unscale", "unscale_and_check"),
    ("unscale", "update"),
    ("check", "check"),
    ("step", "step"),
    ("step", "load_checkpoint"),
    *(("check", read) for read in ("gradient_numerics", "nonfinite_gradients", "journal_names", "journal")),
    *(("check", read) for read in ("checkpoint", "stats", "scale_factor", "had_overflow", "is_step_open")),
    *(("check", read) for read in ("set_enabled", "is_enabled")),
]
# The calls that only read (or, set_enabled to the same flag, change nothing): interrupted, they are made again.
# (SyncFreeGradScaler's prepare() and apply_if_finite() are not in this loop: it trains with SGD's own skip.)
AFTER_CHECK = ("gradient_numerics", "nonfinite_gradients", "journal_names")
AFTER_UPDATE = ("journal", "checkpoint", "stats", "scale_factor", "had_overflow", "is_step_open", "set_enabled")
READS = (*AFTER_CHECK, *AFTER_UPDATE, "is_enabled")
ONLY_GRADSCALER = ("set_enabled", "is_enabled")
OVERFLOW = {"clean": None, "rank0-inf": 0, "rank1-inf": 1}  # whose gradients hold an inf in step 1
# A disabled GradScaler runs on its null lane: its check() and step() vote, its unscale_and_check() does not
# (it runs nothing, so there is nothing to agree on; it checks nothing either, so a loop of that kind applies
# an inf as it comes, and only its clean runs are swept).
DISABLED = partial(GradScaler, enabled=False)
SWEEPS = [
    *(pytest.param(face, kind, target, inf, id=f"{name}-{face.__name__}-{target}")
      for face in (GradScaler, SyncFreeGradScaler) for kind, target in CASES for name, inf in OVERFLOW.items()
      if face is GradScaler or target not in ONLY_GRADSCALER),
    *(pytest.param(DISABLED, kind, target, inf, id=f"{name}-disabled-{target}")
      for kind, target in CASES for name, inf in OVERFLOW.items() if kind != "unscale" or inf is None),
]  # fmt: skip


def base_gradients(rank: int, step: int, inf_rank: int | None) -> list[np.ndarray]:
    """The rank's unscaled gradients of ``step`` (all-reduced already, as in data parallelism: alike on every
    rank but for the inf): small powers of two, exact at any power-of-two scale."""
    grads = [np.full(3, 2.0**-step, np.float32), np.full(2, 0.5, np.float32)]
    if step == 1 and inf_rank == rank:
        grads[0][1] = np.inf
    return grads


class Rank:
    """One rank's training loop, with rank 0's interrupt and its recovery."""

    def __init__(self, face: Any, world: FakeWorld, rank: int, kind: str, target: str, k: int, inf: int | None):
        self.rank, self.kind, self.target, self.k, self.inf = rank, kind, target, k, inf
        self.scaler = face(init_scale=2.0**4, growth_interval=1, max_scale=2.0**10, comm=FakeVote(world, rank))
        self.weights = [np.zeros(3, np.float32), np.zeros(2, np.float32)]
        self.optimizer = SGD(self.weights, lr=0.5)
        self.verdicts: list[bool] = []
        self.reached = False

    def call(self, step: int, name: str, run: Callable[[], Any], effect: Callable[[], bool]) -> tuple[bool, Any]:
        """Run ``run`` (interrupted on rank 0 in step 1 if it is the target); return (interrupted, its result).

        An interrupted call whose ``effect()`` is False had no effect: it is made again, as a user would.
        """
        if not (self.rank == 0 and step == 1 and name == self.target):
            return False, run()
        result: list[Any] = []
        self.reached = interrupted(lambda: result.append(run()), self.k)
        if result:
            return False, result[0]
        if not self.reached or effect():
            return self.reached, None
        return False, run()

    def train(self, saved: Any) -> dict[str, Any]:
        scaler, step_machine = self.scaler, self.scaler._step
        for step in range(STEPS):
            if self.kind == "step" and step == 1:
                self.call(step, "load_checkpoint", lambda: scaler.load_checkpoint(saved), lambda: False)
            scale = scaler.scale_factor()
            loss = np.ones((), np.float32)
            self.call(step, "scale_loss", partial(scaler.scale_loss, loss), lambda: step_machine.phase == SCALED)
            if self.target == "abandon_step":  # a backward pass that failed: the step is dropped, then made again
                self.call(step, "abandon_step", scaler.abandon_step, lambda: step_machine.phase == IDLE)
                scaler.scale_loss(np.ones((), np.float32))
            grads = [g * np.float32(scale) for g in base_gradients(self.rank, step, self.inf)]
            if self.kind == "unscale":
                cut, ok = self.call(
                    step, "unscale_and_check", partial(scaler.unscale_and_check, grads), self.opened(UNSCALED)
                )
                ok = not scaler.had_overflow() if cut else ok
                if ok:
                    self.optimizer.step(grads, None)
            elif self.kind == "check":
                check = partial(scaler.check, grads, report=self.target in READS)
                cut, stats = self.call(step, "check", check, self.opened(INSPECTED))
                self.reads(step, AFTER_CHECK)
                if not cut:
                    self.optimizer.step(grads, stats)
                elif scaler.stats().enabled and not scaler.had_overflow():  # disabled: the last enabled step's
                    raise AssertionError("an interrupted check() let the step apply: the stats are lost")
            else:
                self.call(step, "step", partial(scaler.step, self.optimizer, grads), self.opened(INSPECTED))
            self.verdicts.append(bool(scaler.had_overflow()))
            self.call(step, "update", scaler.update, lambda: step_machine.phase == IDLE)
            self.reads(step, (*AFTER_UPDATE, "is_enabled"))
        stats = scaler.stats()
        return {
            "stats": (stats.scale, stats.steps, stats.skipped_steps, stats.growths, stats.backoffs),
            "verdicts": self.verdicts,
            "weights": [w.tobytes() for w in self.weights],
            "reached": self.reached,
        }

    def reads(self, step: int, names: tuple[str, ...]) -> None:
        """Make the read calls among ``names`` that this run interrupts (each is made again after it)."""
        for name in names:
            if name == self.target:
                read = getattr(self.scaler, name)
                self.call(step, name, partial(read, self.scaler.is_enabled()) if name == "set_enabled" else read, no)

    def opened(self, phase: str) -> Callable[[], bool]:
        return lambda: self.scaler._step.phase == phase

    def run(self, saved: Any) -> dict[str, Any]:
        try:
            return self.train(saved)
        except RanksMayDisagreeError:
            refuses_every_call(self.scaler, self.optimizer)
            return {"refused": True, "reached": self.reached}


def no() -> bool:
    """An interrupted read had no effect: it is made again."""
    return False


def run_rank(ranks: list[Rank], saved: Any, world: FakeWorld, rank: int) -> dict[str, Any]:
    return ranks[rank].run(saved)


@pytest.mark.parametrize(("face", "kind", "target", "inf"), SWEEPS)
def test_two_ranks_agree_or_both_refuse_after_an_interrupt_at_any_line(
    face: Any, kind: str, target: str, inf: int | None
) -> None:
    donor = face(init_scale=2.0**6, growth_interval=1, max_scale=2.0**10)
    saved = donor.checkpoint()
    outcomes: dict[str, int] = {"agreed": 0, "refused": 0}
    k = 1
    while True:
        world = FakeWorld(2, timeout=2.0)
        ranks = [Rank(face, world, rank, kind, target, k, inf) for rank in range(2)]
        results = run_ranks(world, partial(run_rank, ranks, saved))
        if not results[0]["reached"]:
            break
        if results[0].get("refused") or results[1].get("refused"):
            assert results[0].get("refused") and results[1].get("refused"), f"line {k}: only one rank refuses"
            outcomes["refused"] += 1
        else:
            del results[0]["reached"], results[1]["reached"]
            assert results[0] == results[1], f"line {k}: the ranks disagree without a word"
            sums = [[total for _, total in world.votes[rank]] for rank in range(2)]
            votes = 0 if face is DISABLED and kind == "unscale" else STEPS
            assert sums[0] == sums[1] and len(sums[0]) == votes, f"line {k}: the collectives do not pair up"
            outcomes["agreed"] += 1
        k += 1
    assert k > (1 if target in READS else 10), "the sweep went through the call's lines"  # reads are short
    assert outcomes["agreed"] > 0
