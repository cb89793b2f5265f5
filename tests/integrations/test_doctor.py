"""cupy-amp doctor: each planted fault, run through a real scaler and saved, is recognised, and told apart."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cupy_amp import GradScaler
from cupy_amp.cli import main
from cupy_amp.doctor import diagnose

Planted = Callable[[int], set[str]]  # step -> the gradients that hold inf/nan in it


def train(path: Path, planted: Planted, steps: int, **config: Any) -> Path:
    """Run ``steps`` steps of a GradScaler over three named gradients with inf planted as ``planted`` says,
    and save its checkpoint to ``path``."""
    scaler = GradScaler(**config)
    for step in range(steps):
        grads = {name: np.full(4, 0.5, np.float32) for name in ("embed", "attn.w", "head")}
        for name in planted(step):
            grads[name][1] = np.inf
        scaler.scale_loss(np.ones((), np.float32))
        scaler.unscale_and_check(grads)
        scaler.update()
    scaler.checkpoint().save(path)
    return path


def kinds(path: Path) -> set[str]:
    from cupy_amp.checkpoint import GradScalerCheckpoint

    return {finding.kind for finding in diagnose(GradScalerCheckpoint.load(path))}


def test_a_healthy_run_is_reported_healthy(tmp_path: Path) -> None:
    path = train(tmp_path / "ok.ckpt", lambda step: {"head"} if step == 40 else set(), 200, growth_interval=50)
    assert kinds(path) == {"healthy"}


def test_a_gradient_that_is_inf_at_every_scale_is_named_as_the_source(tmp_path: Path) -> None:
    # From step 20 on, "attn.w" is inf whatever the scale: the scale collapses to its floor of 1.
    path = train(tmp_path / "source.ckpt", lambda step: {"attn.w"} if step >= 20 else set(), 60, init_scale=2.0**10)
    assert kinds(path) == {"inf source", "scale at the floor", "skip rate"}
    (source,) = [f for f in diagnose_file(path) if f.kind == "inf source"]
    assert source.evidence["gradient"] == "attn.w" and "attn.w" in source.summary
    assert source.evidence["steps"][0] == 21 and min(source.evidence["scales"]) == 1.0


def test_a_ceiling_that_holds_the_scale_down_is_found(tmp_path: Path) -> None:
    path = train(tmp_path / "ceiling.ckpt", lambda step: set(), 40, init_scale=4.0, growth_interval=2, max_scale=16.0)
    assert kinds(path) == {"ceiling too low"}


def test_a_high_skip_rate_without_a_single_source_is_only_a_skip_rate(tmp_path: Path) -> None:
    # Every 8th step overflows, each time in another gradient, at scales that barely move.
    names = ("embed", "attn.w", "head")
    path = train(
        tmp_path / "skips.ckpt", lambda step: {names[step // 8 % 3]} if step % 8 == 7 else set(), 120, growth_interval=4
    )
    assert kinds(path) == {"skip rate"}


def test_growth_blocked_by_hysteresis_is_found(tmp_path: Path) -> None:
    # An overflow every 5th step, in turn in each gradient, resets the clean count before growth_interval = 6:
    # the scale never grows; hysteresis 3 holds it at the first two overflows, then it backs off at each.
    names = ("embed", "attn.w", "head")
    path = train(
        tmp_path / "held.ckpt",
        lambda step: {names[step % 3]} if step % 5 == 4 else set(),
        60,
        growth_interval=6,
        hysteresis=3,
    )
    assert kinds(path) == {"growth blocked by hysteresis", "skip rate"}


def test_small_gradients_at_a_scale_with_room_to_grow_are_an_underflow_risk(tmp_path: Path) -> None:
    # float16 gradients a scale of 1 leaves mostly subnormal, the largest far below float16's maximum; the
    # scale would grow only after 2000 clean steps. Reported every step: the doctor sees the lost elements.
    scaler = GradScaler(init_scale=1.0, growth_interval=2000)
    rng = np.random.default_rng(0)
    for _ in range(20):
        grads = {"w": (rng.standard_normal(256) * 2.0**-16).astype(np.float16), "b": np.full(4, 0.5, np.float16)}
        scaler.scale_loss(np.ones((), np.float32))
        scaler.check(grads, max_norm=1.0, report=True)
        scaler.update()
    path = tmp_path / "underflow.ckpt"
    scaler.checkpoint().save(path)
    assert kinds(path) == {"underflow risk"}
    (finding,) = diagnose_file(path)
    assert finding.evidence["zero_or_subnormal"] > 0.5 and finding.evidence["headroom"] > 2.0**10
    assert "'b'" in finding.summary  # where the largest |g| is, by name
    # The same run, reported but with the gradients at a scale near float16's top: healthy.
    scaler = GradScaler(init_scale=2.0**14, growth_interval=2000)
    for _ in range(20):
        scaler.scale_loss(np.ones((), np.float32))
        scaler.check({"w": np.full(256, 2.0, np.float16)}, max_norm=1.0, report=True)
        scaler.update()
    scaler.checkpoint().save(path)
    assert kinds(path) == {"healthy"}


def diagnose_file(path: Path) -> list[Any]:
    from cupy_amp.checkpoint import GradScalerCheckpoint

    return diagnose(GradScalerCheckpoint.load(path))


def test_the_command_prints_each_finding_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = train(tmp_path / "source.ckpt", lambda step: {"attn.w"} if step >= 5 else set(), 30, init_scale=2.0**8)
    assert main(["doctor", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PROBLEM  inf source: Gradient 'attn.w'")
    assert main(["doctor", "--json", str(path)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["kind"] for row in rows} == {"inf source", "scale at the floor", "skip rate"}
    assert all(row["problem"] for row in rows)


def test_an_old_checkpoint_has_no_journal_to_diagnose(capsys: pytest.CaptureFixture[str]) -> None:
    old = Path(__file__).parent.parent / "data" / "grad_scaler_v2.ckpt"
    assert main(["doctor", str(old)]) == 0
    assert capsys.readouterr().out.startswith("OK  no journal:")


def test_a_file_that_is_not_a_checkpoint_is_one_line_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint")
    assert main(["doctor", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cupy-amp doctor:") and len(err.splitlines()) == 1
    assert main(["doctor", str(tmp_path / "missing.ckpt")]) == 1


def test_plot_draws_the_journal_into_the_named_format(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = train(tmp_path / "source.ckpt", lambda step: {"attn.w"} if step >= 5 else set(), 30, init_scale=2.0**8)
    assert main(["doctor", str(path), "--plot", str(tmp_path / "journal.png")]) == 0
    assert (tmp_path / "journal.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["doctor", str(path), "--plot", str(tmp_path / "journal.svg")]) == 0
    assert b"<svg" in (tmp_path / "journal.svg").read_bytes()[:400]


def test_plot_refuses_an_unknown_format_or_folder_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    path = train(tmp_path / "ok.ckpt", lambda step: set(), 5)
    assert main(["doctor", str(path), "--plot", str(tmp_path / "journal.xyz")]) == 1
    assert "matplotlib writes" in capsys.readouterr().err
    assert main(["doctor", str(path), "--plot", str(tmp_path / "no" / "journal.png")]) == 1
    err = capsys.readouterr().err
    assert "is not a folder" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "no").exists()


def test_plot_without_matplotlib_says_how_to_install_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    path = train(tmp_path / "ok.ckpt", lambda step: set(), 5)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it raises ImportError
    assert main(["doctor", str(path), "--plot", str(tmp_path / "journal.png")]) == 1
    assert 'pip install "cupy-amp[demo]"' in capsys.readouterr().err


def test_a_start_from_too_high_a_scale_is_not_an_inf_source(tmp_path: Path) -> None:
    # A default scaler's first steps overflow until the scale is low enough, then rarely: the gradient that
    # overflowed is named in every one, at scales 8x apart, but backing off helped: healthy.
    path = train(tmp_path / "start.ckpt", lambda step: {"head"} if step in (0, 1, 2, 47) else set(), 1000)
    assert kinds(path) == {"healthy"}


def test_periodic_overflows_that_block_growth_at_the_default_interval_are_found(tmp_path: Path) -> None:
    # An overflow every 300 steps, in turn in each gradient, with the default growth_interval of 2000: the
    # scale backs off to its floor and never grows. The journal (1024 steps) holds no growth interval.
    names = ("embed", "attn.w", "head")
    path = train(tmp_path / "blocked.ckpt", lambda step: {names[step // 300 % 3]} if step % 300 == 299 else set(), 8000)
    assert kinds(path) == {"growth blocked", "scale at the floor"}


def test_a_fixed_scale_has_no_ceiling_floor_or_growth_to_blame(tmp_path: Path) -> None:
    burst = {400, 401, 402}
    path = train(
        tmp_path / "fixed.ckpt", lambda step: {"head"} if step in burst else set(), 1000, init_scale=1024.0,
        min_scale=1024.0, max_scale=1024.0,
    )  # fmt: skip
    assert kinds(path) == {"healthy"}
    guard = train(tmp_path / "guard.ckpt", lambda step: set(), 300, init_scale=1.0, min_scale=1.0, max_scale=1.0)
    assert kinds(guard) == {"healthy"}


def test_gradients_of_zeros_only_are_an_underflow_risk_that_json_can_carry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Every element 0: the largest |g| is 0 (no headroom ratio to give); steps reporting no elements at all
    # (NaN fractions) in between are left out, not allowed to hide the finding.
    scaler = GradScaler(init_scale=1.0, growth_interval=2000)
    for step in range(8):
        scaler.scale_loss(np.ones((), np.float32))
        grads = [np.zeros(8, np.float16)] if step % 2 else [np.zeros(0, np.float16)]
        scaler.check(grads, max_norm=1.0, report=True)
        scaler.update()
    path = tmp_path / "zeros.ckpt"
    scaler.checkpoint().save(path)
    assert kinds(path) == {"underflow risk"}
    assert main(["doctor", "--json", str(path)]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["evidence"]["headroom"] is None and row["evidence"]["steps"] == [2, 4, 6, 8]
    assert "was 0, far below" in row["summary"] and "gradient" not in row["summary"].split("|g|")[1][:30]
