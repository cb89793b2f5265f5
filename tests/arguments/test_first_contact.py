"""What a new user meets first: each error names what went wrong and the call that does it right."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from helpers import FACES, Face

import cupy_amp
from cupy_amp import ArgumentTypeError, ConfigError, GradientTypeError, GradScaler, ScalerProtocolError
from cupy_amp.cli import main
from cupy_amp.optim import SGD, AdamW


@pytest.mark.parametrize("face", FACES)
def test_a_numpy_scalar_loss_is_named_and_the_fix_given(face: Face) -> None:
    loss = np.ones(8, dtype=np.float32).mean()  # what .mean() returns: a NumPy scalar, not an array
    with pytest.raises(GradientTypeError, match=r"got a NumPy scalar \(float32\), which cannot be changed in place"):
        face().scale_loss(loss)
    with pytest.raises(GradientTypeError, match=r"np\.asarray\(loss\).*seed the backward pass from that array"):
        face().scale_loss(loss)
    face().scale_loss(np.asarray(loss))  # the fix it gives works


def test_an_initial_scale_above_the_default_ceiling_says_how_to_lift_it() -> None:
    with pytest.raises(ConfigError, match=r"max_scale=None for no ceiling"):
        GradScaler(init_scale=2.0**30)
    assert GradScaler(init_scale=2.0**30, max_scale=None).scale_factor() == 2.0**30
    with pytest.raises(ConfigError, match=r"min_scale=None for no floor"):
        GradScaler(init_scale=0.25)


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize(
    ("name", "ours"),
    [("scale", "scale_loss(loss)"), ("get_scale", "scale_factor()"), ("unscale_", "unscale_and_check(gradients)"),
     ("state_dict", "checkpoint()"), ("load_state_dict", "load_checkpoint(checkpoint)"),
     ("get_growth_factor", "config.growth_factor")],
)  # fmt: skip
def test_a_pytorch_name_points_to_the_cupy_amp_call(face: Face, name: str, ours: str) -> None:
    scaler = face()
    with pytest.raises(AttributeError, match=rf"^{type(scaler).__name__} has no {name}\(\) .*use {re.escape(ours)}"):
        getattr(scaler, name)
    assert not hasattr(scaler, name)
    with pytest.raises(AttributeError, match=r"has no attribute 'no_such_thing'$"):
        scaler.no_such_thing  # noqa: B018


@pytest.mark.parametrize("face", FACES)
def test_stepping_a_second_optimizer_says_to_step_both_in_one_call(face: Face) -> None:
    w0, w1 = np.zeros(4, np.float32), np.zeros(4, np.float32)
    scaler, first, second = face(), AdamW([w0]), SGD([w1], lr=0.1)
    scaler.scale_loss(np.array(1.0, np.float32))
    g0, g1 = [np.full(4, 65536.0, np.float32)], [np.full(4, 65536.0, np.float32)]
    scaler.step(first, g0)
    with pytest.raises(ScalerProtocolError, match=r"scaler\.step\(\[optimizer0, optimizer1\], \[grads0, grads1\]"):
        scaler.step(second, g1)
    # The way the message gives works: one check over both, each optimizer its share.
    scaler, first, second = face(), AdamW([w0]), SGD([w1], lr=0.1)
    scaler.scale_loss(np.array(1.0, np.float32))
    stats = scaler.step([first, second], [g0, g1], max_norm=1.0)
    scaler.update()
    assert first.step_count == second.step_count == 1 and bool(stats.finite)


def test_missing_arguments_name_the_public_call_and_what_to_pass() -> None:
    optimizer = AdamW([np.zeros(2, np.float32)])
    with pytest.raises(ArgumentTypeError, match=r"^AdamW\.step\(gradients, stats\) needs stats.*Pass None only"):
        optimizer.step([np.zeros(2, np.float32)])
    with pytest.raises(ArgumentTypeError, match=r"^GradScaler\.step\(optimizer, gradients\) needs the gradients"):
        GradScaler().step(optimizer)
    for call in (lambda: optimizer.step([np.zeros(2, np.float32)]), lambda: GradScaler().step(optimizer)):
        with pytest.raises(TypeError) as raised:
            call()
        assert "FusedOptimizer" not in str(raised.value) and "Face" not in str(raised.value)


@pytest.mark.parametrize("face", FACES)
def test_the_statistics_carry_the_factor_an_optimizer_of_ones_own_applies(face: Face) -> None:
    scaler = face(init_scale=1024.0)
    scaler.scale_loss(np.array(1.0, np.float32))
    gradient = np.full(100, 1024.0 * 0.5, np.float32)  # unscaled, a norm of 5
    stats = scaler.check([gradient], max_norm=1.0)
    clip = np.float32(1.0) / (np.float32(5.0) + np.float32(1e-6))
    assert float(stats.clip_coefficient) == pytest.approx(float(clip), rel=1e-6)
    assert float(stats.factor) == float(np.float32(1 / 1024.0) * np.float32(stats.clip_coefficient))
    np.testing.assert_allclose(float(np.linalg.norm(gradient * stats.factor)), 1.0, rtol=1e-5)


def test_the_package_namespace_holds_the_public_names_alone() -> None:
    assert "version" not in vars(cupy_amp) and "PackageNotFoundError" not in vars(cupy_amp)
    assert cupy_amp.__version__
    for name in cupy_amp.__all__:
        assert hasattr(cupy_amp, name)


def test_inspect_torch_prints_pytorchs_state_dict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = f"{tmp_path}/scaler.ckpt"
    GradScaler(init_scale=2.0**10).checkpoint().save(path)
    assert main(["inspect", "--torch", path]) == 0
    captured = capsys.readouterr()
    assert '"scale": 1024.0' in captured.out and '"_growth_tracker": 0' in captured.out
    assert "note: PyTorch's GradScaler has no scale clamps" in captured.err


def readme_programs() -> list[str]:
    """The README's complete Python programs: blocks that import what they use and make their own data."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    return [block for block in blocks if block.startswith("import") and ("rng" in block or "tempfile" in block)]


@pytest.mark.parametrize("program", readme_programs())
def test_the_readmes_complete_programs_run(program: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(program, "README.md", "exec"), {"__name__": "__readme__"})


def test_the_readme_has_the_programs_this_test_runs() -> None:
    assert len(readme_programs()) >= 4  # the fused-optimizer loop, accumulation, clipping by hand, resuming
