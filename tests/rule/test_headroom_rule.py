"""The headroom rule (``rule="headroom"``): its formula step by step, with values worked out by hand, and the
two faces following it together on a simulated run whose ceiling is known."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any

import numpy as np
import pytest
from helpers import GRAD_SCALER, SYNC_FREE, Face

from cupy_amp import GradScaler, GradScalerCheckpoint, SyncFreeGradScaler, journal
from cupy_amp.errors import CheckpointFieldError, ConfigError, ScalerProtocolError
from cupy_amp.rule import FLOAT32_MAX, ScalerConfig, ScalerState, initial_state, next_state

HEADROOM = ScalerConfig(growth_interval=3, min_scale=1.0, max_scale=None, rule="headroom")


def run(config: ScalerConfig, scale: float, verdicts: list[tuple[bool, float]]) -> list[ScalerState]:
    """The states after each (overflow, norm) step, from ``scale``."""
    state, states = initial_state(config, scale), []
    for overflow, norm in verdicts:
        state = next_state(config, state, overflow, overflow, norm)
        states.append(state)
    return states


CLEAN, OVER = (False, math.nan), (True, math.nan)


def test_climbs_by_growth_factor_to_the_4th_after_each_clean_step_until_the_first_overflow() -> None:
    states = run(HEADROOM, 1.0, [CLEAN] * 4)
    assert [s.scale for s in states] == [16.0, 256.0, 4096.0, 65536.0]
    assert [s.growths for s in states] == [1, 2, 3, 4] and states[-1].consecutive_good_steps == 0


def test_descends_2x_4x_16x_while_no_clean_scale_is_known_below() -> None:
    states = run(HEADROOM, 2.0**40, [OVER] * 6)
    assert [s.scale for s in states] == [2.0**39, 2.0**37, 2.0**33, 2.0**25, 2.0**9, 1.0]  # the last at min_scale
    assert [s.overflows_in_row for s in states] == [1, 2, 3, 4, 5, 6]
    assert states[-1].overflow_scale == 2.0**9 and states[-1].clean_scale == 0.0


def test_probes_halfway_in_exponents_between_the_clean_and_the_overflowing_scale() -> None:
    # From 16: clean (climb to 256), overflow at 256 (16 known clean: 4 factors apart, probe 64), clean at 64
    # (2 factors below 256: probe 128), overflow at 128 (one factor above 64: back off to 64), then clean
    # steps at 64 grow after growth_interval (3) as PyTorch's rule does.
    states = run(HEADROOM, 16.0, [CLEAN, OVER, CLEAN, OVER, CLEAN, CLEAN, CLEAN])
    assert [s.scale for s in states] == [256.0, 64.0, 128.0, 64.0, 64.0, 64.0, 128.0]
    assert [(s.overflow_scale, s.clean_scale) for s in states[3:5]] == [(128.0, 64.0), (128.0, 64.0)]
    assert [s.consecutive_good_steps for s in states[3:]] == [0, 1, 2, 0]
    assert (states[-1].growths, states[-1].backoffs, states[-1].skipped_steps) == (3, 2, 2)


def test_jumps_as_far_below_the_last_overflows_ceiling_as_the_norm_has_fallen_with_one_factor_of_margin() -> None:
    # An overflow at 2**10 after a clean step of norm 4 (at 2**9, known clean): the ceiling then was about
    # 2**10 * 4 / n at a norm n. Back at 2**9: norm 0.5 estimates 2**13, so the scale jumps to 2**12; norm 2
    # estimates 2**11: 2**10; norm 4 estimates 2**10: no jump (it would leave no margin).
    start = run(HEADROOM, 2.0**5, [CLEAN, (False, 4.0), OVER])  # 2**5 -> 2**9 (clean, norm 4) -> 2**13
    assert [s.scale for s in start] == [2.0**9, 2.0**13, 2.0**11]
    before = start[-1]
    assert (before.overflow_scale, before.overflow_norm, before.clean_scale) == (2.0**13, 4.0, 2.0**9)
    at = dataclasses.replace(before, scale=2.0**12, clean_scale=2.0**12)  # then clean up to one factor below
    for norm, expected in [(0.5, 2.0**15), (2.0, 2.0**13), (4.0, 2.0**12), (8.0, 2.0**12), (math.nan, 2.0**12)]:
        after = next_state(HEADROOM, at, False, False, norm)
        assert after.scale == expected, norm
        assert after.consecutive_good_steps == (0 if expected != at.scale else 1)
        assert after.clean_norm == (norm if math.isfinite(norm) else 4.0)


def test_a_clean_step_above_the_last_overflow_keeps_probing_at_pytorchs_pace() -> None:
    config = ScalerConfig(growth_interval=2, min_scale=1.0, max_scale=None, rule="headroom")
    state = ScalerState(scale=2.0**12, consecutive_good_steps=0, hysteresis_tracker=1, overflow_scale=2.0**11)
    states = [state := next_state(config, state, False) for _ in range(3)]
    assert [s.scale for s in states] == [2.0**12, 2.0**13, 2.0**13]
    assert states[0].clean_scale == 0.0  # not below the last overflow: nothing learned about the gap


def test_clamps_growth_at_max_scale_and_tells_the_journal_so() -> None:
    config = ScalerConfig(max_scale=2.0**10, rule="headroom")
    states = run(config, 2.0**8, [CLEAN, CLEAN])
    assert [s.scale for s in states] == [2.0**10, 2.0**10]
    before = initial_state(config, 2.0**10)
    assert journal.action_of(config, before, states[1], False) == journal.AT_CEILING
    assert journal.action_of(config, initial_state(config, 2.0**8), states[0], False) == journal.GREW


def test_a_growth_that_would_reach_inf_keeps_the_scale() -> None:
    config = ScalerConfig(max_scale=None, rule="headroom")
    (state,) = run(config, FLOAT32_MAX / 8, [CLEAN])
    assert state.scale == np.float32(FLOAT32_MAX / 8)


def test_overflows_in_row_counts_the_descent_and_a_clean_step_resets_it() -> None:
    states = run(HEADROOM, 2.0**20, [OVER, OVER, CLEAN, OVER])
    assert [s.overflows_in_row for s in states] == [1, 2, 0, 1]
    # The clean step at 2**17, two factors below the overflow at 2**19, probes 2**18; its overflow then backs
    # off to the clean 2**17 (one factor apart), not by a descent.
    assert [s.scale for s in states] == [2.0**19, 2.0**17, 2.0**18, 2.0**17]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rule": "torch"}, "Invalid 'rule': expected one of 'pytorch', 'headroom', got 'torch'."),
        ({"rule": None}, "Invalid 'rule'"),
        ({"rule": "headroom", "hysteresis": 2}, "Invalid 'hysteresis': expected 1 with rule='headroom'"),
    ],
)
def test_a_bad_rule_is_a_config_error(kwargs: dict[str, Any], message: str) -> None:
    for make in (GradScaler, SyncFreeGradScaler):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            make(**kwargs)


class Simulated:
    """A training whose every step overflows above a known ceiling; the gradient's true value falls over time."""

    def __init__(self, ceiling: float) -> None:
        self.ceiling = ceiling

    def gradients(self, step: int, scale: float) -> list[np.ndarray]:
        value = 2.0 / (1 + step // 10)  # the norm halves, then thirds... every ten steps
        scaled = np.float32(value * scale) if scale <= self.ceiling * value else np.float32(np.inf)
        return [np.array([scaled, 0.0], np.float32)]


def train(face: Face, rule: str, start: float, steps: int, simulated: Simulated) -> Any:
    scaler = face(init_scale=start, growth_interval=5, min_scale=1.0, max_scale=None, rule=rule)
    for step in range(steps):
        scale = scaler.stats().scale
        scaler.scale_loss(np.ones((), np.float32))
        scaler.check(simulated.gradients(step, scale), max_norm=1.0)
        scaler.update()
    return scaler


@pytest.mark.parametrize("start", [1.0, 2.0**16, 2.0**40])
def test_both_faces_follow_the_rule_and_journal_it_the_same(start: float) -> None:
    simulated = Simulated(2.0**16)
    grad, free = (train(face, "headroom", start, 60, simulated) for face in (GRAD_SCALER, SYNC_FREE))
    assert grad.checkpoint().to_bytes() == free.checkpoint().to_bytes()
    entries = grad.journal()
    assert entries.tobytes() == free.journal().tobytes()
    # The journal replays through next_state with its own norms: the rule read what check() computed.
    state = initial_state(ScalerConfig(growth_interval=5, max_scale=None, rule="headroom"), start)
    config = ScalerConfig(growth_interval=5, max_scale=None, rule="headroom")
    for entry in entries:
        assert entry["scale"] == state.scale
        state = next_state(config, state, bool(entry["agreed"]), bool(entry["local"]), float(entry["norm"]))
        assert entry["next_scale"] == state.scale
    assert grad.checkpoint().state() == state


@pytest.mark.parametrize("start", [1.0, 2.0**40])
def test_from_a_bad_start_the_scale_is_within_2x_of_the_ceiling_in_ten_steps_where_pytorchs_is_not(
    start: float,
) -> None:
    simulated = Simulated(2.0**16)
    scales = {rule: train(GRAD_SCALER, rule, start, 10, simulated).journal()["next_scale"] for rule in journal_rules()}
    ceiling = simulated.ceiling  # the value 2 of the first ten steps: overflows above ceiling * 2
    assert ceiling <= scales["headroom"][-1] <= 2 * ceiling
    assert not ceiling <= scales["pytorch"][-1] <= 2 * ceiling


def journal_rules() -> tuple[str, str]:
    return ("pytorch", "headroom")


def test_a_checkpoint_carries_the_rules_memory_and_the_run_continues_identically(tmp_path: Any) -> None:
    simulated = Simulated(2.0**16)
    whole = train(GRAD_SCALER, "headroom", 2.0**40, 40, simulated)
    half = train(GRAD_SCALER, "headroom", 2.0**40, 20, simulated)
    half.checkpoint().save(tmp_path / "half.ckpt")
    loaded = GradScalerCheckpoint.load(tmp_path / "half.ckpt")
    assert loaded.rule == "headroom" and loaded.overflow_scale > 0 and loaded.clean_norm > 0
    resumed = GradScaler(rule="headroom", max_scale=None)
    resumed.load_checkpoint(loaded)
    for step in range(20, 40):
        resumed.scale_loss(np.ones((), np.float32))
        resumed.check(simulated.gradients(step, resumed.scale_factor()), max_norm=1.0)
        resumed.update()
    assert resumed.checkpoint().to_bytes() == whole.checkpoint().to_bytes()


def test_a_pytorch_rule_checkpoint_holding_headroom_memory_is_refused() -> None:
    fields = GradScaler(max_scale=None).checkpoint().to_dict()
    with pytest.raises(CheckpointFieldError, match="must be 0 with rule='pytorch'"):
        GradScalerCheckpoint.from_dict({**fields, "overflow_scale": 2.0**10})
    assert GradScalerCheckpoint.from_dict({**fields, "rule": "headroom", "overflow_scale": 2.0**10}).rule == "headroom"


def test_the_torch_state_dict_warns_that_pytorch_runs_its_own_rule() -> None:
    checkpoint = GradScaler(rule="headroom", min_scale=None, max_scale=None).checkpoint()
    with pytest.warns(UserWarning, match="rule='headroom'"):
        checkpoint.to_torch_state_dict()


@pytest.mark.parametrize("face", [GRAD_SCALER, SYNC_FREE], ids=lambda face: face.name)
def test_ranks_with_sharded_gradients_move_their_scales_together(face: Face) -> None:
    # The rule reads check()'s all-reduced norm, the same on every rank, and the agreed verdict: the ranks'
    # scales and memories stay equal, though only rank 1's gradients overflow, and each journals its own report.
    from fake_comm import FakeVote, FakeWorld, run_ranks

    world = FakeWorld(2)
    simulated = Simulated(2.0**12)

    def rank_body(world: FakeWorld, rank: int) -> tuple[Any, np.ndarray]:
        scaler = face(init_scale=1.0, growth_interval=3, max_scale=None, rule="headroom", comm=FakeVote(world, rank))
        for step in range(30):
            grads = simulated.gradients(step, scaler.stats().scale) if rank == 1 else [np.full(3, 0.25, np.float32)]
            scaler.scale_loss(np.ones((), np.float32))
            scaler.check(grads, max_norm=1.0, report=True)
            scaler.update()
        return scaler.checkpoint().state(), scaler.journal()

    (state0, journal0), (state1, journal1) = run_ranks(world, rank_body)
    # Equal but for the remote skips: rank 0's skips are all remote.
    assert dataclasses.replace(state0, remote_skipped_steps=0) == dataclasses.replace(state1, remote_skipped_steps=0)
    assert state0.remote_skipped_steps == state0.skipped_steps > 0 and state1.remote_skipped_steps == 0
    assert journal0["next_scale"].tobytes() == journal1["next_scale"].tobytes()
    assert (journal0["norm"].tobytes(), journal0["agreed"].tolist()) == (
        journal1["norm"].tobytes(),
        journal1["agreed"].tolist(),
    )
    assert (journal0["amax"] == 0.25).all() and not np.isnan(journal1["amax"]).any()  # each rank's own report


def test_every_result_stays_inside_the_clamps_and_a_clean_step_never_lowers_the_scale() -> None:
    # States no run of these configurations reaches (the checkpoint refuses them, below), made by hand: the
    # rule still clamps. An overflow whose probe falls below min_scale stops at min_scale; a clean step whose
    # probe falls below its own scale keeps its scale.
    config = ScalerConfig(min_scale=2048.0, max_scale=None, rule="headroom")
    known = ScalerState(scale=2.0**16, consecutive_good_steps=0, hysteresis_tracker=1, clean_scale=2.0**4)
    assert next_state(config, known, True).scale == 2048.0
    above = ScalerState(
        scale=2.0**16, consecutive_good_steps=0, hysteresis_tracker=1, overflow_scale=2.0**14, clean_scale=2.0**4
    )
    after = next_state(config, above, False)
    assert after.scale == 2.0**16 and after.growths == 0


@pytest.mark.parametrize(
    ("memory", "message"),
    [
        ({"clean_scale": float(np.float32(1e-45))}, "Invalid 'clean_scale': expected a float32 value from 2**-128"),
        ({"clean_scale": 0.5}, "Invalid 'clean_scale': expected a value >= min_scale (1.0)"),
        ({"overflow_scale": 2.0**30}, "Invalid 'overflow_scale': expected a value <= max_scale (16777216.0)"),
        ({"overflow_scale": 2.0**10, "clean_scale": 2.0**10}, "Invalid 'clean_scale': expected a value below"),
    ],
)
def test_a_checkpoint_whose_memory_no_run_reaches_is_refused(memory: dict[str, float], message: str) -> None:
    fields = GradScaler(rule="headroom").checkpoint().to_dict()
    with pytest.raises(CheckpointFieldError, match=re.escape(message)):
        GradScalerCheckpoint.from_dict({**fields, **memory})


def test_a_check_interrupted_at_any_line_never_journals_the_last_steps_norm() -> None:
    # The NumPy record is marked checked after its numbers are written (as the device's epoch is): an
    # interrupt in between leaves the step unchecked, not checked with the previous step's norm.
    from interrupts import interrupted

    k, reached = 1, True
    while reached:
        scaler = GradScaler(init_scale=4.0, rule="headroom")
        scaler.scale_loss(np.ones((), np.float32))
        first = float(scaler.check([np.full(4, 8.0, np.float32)], max_norm=1.0).norm)
        scaler.update()
        scaler.scale_loss(np.ones((), np.float32))
        second = functools.partial(scaler.check, [np.full(4, 2.0, np.float32)], max_norm=1.0, report=True)
        reached = interrupted(second, k)
        try:
            scaler.update()
        except ScalerProtocolError:  # interrupted before the check's gradients were taken: check again
            second()
            scaler.update()
        (_, entry) = scaler.journal()
        # The scale is 64 here (4, then a climb of 16x): this check's norm is sqrt(4) * 2 / 64.
        assert entry["norm"] != first and (np.isnan(entry["norm"]) or entry["norm"] == 0.0625), f"line {k}"
        assert np.isnan(entry["amax"]) or entry["amax"] == 2.0, f"line {k}"  # the gradients as they are
        k += 1
    assert k > 20
