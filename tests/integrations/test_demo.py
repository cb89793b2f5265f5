"""cupy-amp demo, end to end on the CPU: the log, checkpoints, exact resume, --compare, --plot, errors."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from helpers import saved_arrays, saved_file

from cupy_amp.checkpoint import GradScalerCheckpoint
from cupy_amp.cli import main
from cupy_amp.demo.command import Reporter
from cupy_amp.demo.model import batch_indices
from cupy_amp.demo.settings import ScalerSettings, Settings
from cupy_amp.demo.training import StepOutcome, Trainer, make_scaler, new_state, select_device
from tests.conftest import gpu_unavailable_reason

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 120  # with the default scaler settings: overflows and backoffs at steps 1-6, a growth at 56, an overflow at 60
HALF = 60


@dataclass(frozen=True)
class Result:
    status: int
    out: str
    err: str


def demo(*args: str) -> Result:
    """Run ``cupy-amp demo ARGS`` in this process, on the CPU, capturing its output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["demo", "--device", "cpu", *args])
    return Result(status, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Result]:
    """One run of STEPS steps with every other setting at its default, saving into a directory."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    result = demo("--steps", str(STEPS), "--out", str(directory), "--save-every", "50")
    assert result.status == 0, result.err
    return directory, result


def test_default_settings_log_overflows_backoffs_and_growths(uninterrupted: tuple[Path, Result]) -> None:
    _, result = uninterrupted
    lines = result.out.splitlines()
    assert re.search(
        r"^step +1  overflow: inf/nan in \w+.* -> step skipped; backoff: scale 2\*\*36 -> 2\*\*35$", result.out, re.M
    )
    growths = [line for line in lines if "growth: scale" in line]
    backoffs = [line for line in lines if "backoff: scale" in line]
    assert growths and all(line.endswith("after 50 clean steps") for line in growths)
    # Every overflow names the gradients that held inf/nan, and each (with hysteresis 1) backs off.
    overflows = [line for line in lines if "overflow: inf/nan in" in line]
    assert len(overflows) == len(backoffs) >= 5
    assert all(re.search(r"inf/nan in (W|b)\d", line) for line in overflows)
    # Plain progress lines, since the output is not a terminal: every 50 steps and the last.
    progress = [line for line in lines if re.match(r"step +\d+/120  loss", line)]
    assert [line.split()[1] for line in progress] == ["50/120", "100/120", "120/120"]
    assert "\r" not in result.out and "\x1b" not in result.out
    assert result.err == ""


def test_the_log_agrees_with_the_saved_scaler_counters(uninterrupted: tuple[Path, Result]) -> None:
    directory, result = uninterrupted
    checkpoint = GradScalerCheckpoint.load(saved_file(directory, "scaler.ckpt"))
    assert checkpoint.steps == STEPS
    assert checkpoint.backoffs == result.out.count("backoff: scale")
    assert checkpoint.growths == result.out.count("growth: scale")
    assert checkpoint.skipped_steps == int(saved_arrays(directory)["history/skipped"].sum())
    assert f"skipped  {checkpoint.skipped_steps} of {STEPS} steps" in result.out


def test_the_saved_files_are_valid_for_the_validate_command(uninterrupted: tuple[Path, Result]) -> None:
    directory, _ = uninterrupted
    assert os.listdir(directory) == [f"step-{STEPS:06d}"]  # the last save alone: no older one, no temporary files
    save = directory / f"step-{STEPS:06d}"
    assert sorted(os.listdir(save)) == ["adamw.state", "scaler.ckpt", "state.npz"]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["validate", str(save / "scaler.ckpt"), str(save / "adamw.state")]) == 0
    assert out.getvalue().splitlines() == [f"OK  {save / 'scaler.ckpt'}", f"OK  {save / 'adamw.state'}"]


def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(
    uninterrupted: tuple[Path, Result], tmp_path: Path
) -> None:
    full_dir, full = uninterrupted
    first = demo("--steps", str(HALF), "--out", str(tmp_path), "--save-every", "50")
    assert first.status == 0, first.err
    assert GradScalerCheckpoint.load(saved_file(tmp_path, "scaler.ckpt")).steps == HALF
    second = demo("--resume", str(tmp_path), "--steps", str(STEPS))
    assert second.status == 0, second.err
    assert f"resumed  from {tmp_path} at step {HALF}" in second.out

    expected, actual = saved_arrays(full_dir), saved_arrays(tmp_path)
    assert sorted(expected) == sorted(actual)
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, key
        assert actual[key].tobytes() == value.tobytes(), key  # weights and loss history: bit for bit
    # The optimizer's state file too (its moments and counters), byte for byte.
    assert saved_file(tmp_path, "adamw.state").read_bytes() == saved_file(full_dir, "adamw.state").read_bytes()
    assert len(actual["history/loss"]) == STEPS
    assert (
        GradScalerCheckpoint.load(saved_file(tmp_path, "scaler.ckpt")).to_dict()
        == GradScalerCheckpoint.load(saved_file(full_dir, "scaler.ckpt")).to_dict()
    )
    # The final evaluation and the log of the second half match too.
    assert _line(second.out, "eval") == _line(full.out, "eval")
    assert _events_after(second.out, HALF) == _events_after(full.out, HALF)


def _line(text: str, prefix: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(prefix))


def _events_after(text: str, step: int) -> list[str]:
    events = re.findall(r"^step +(\d+)  (.*)$", text, re.M)
    return [event for number, event in events if int(number) > step]


def test_resume_refuses_flags_that_disagree_with_the_run(uninterrupted: tuple[Path, Result]) -> None:
    directory, _ = uninterrupted
    result = demo(
        "--resume", str(directory), "--steps", str(STEPS + 10), "--lr", "0.1", "--init-scale", "2**20", "--clip", "4"
    )
    assert result.status == 2
    assert "--lr 0.1 (the run has 0.005)" in result.err
    assert "--clip 2**2 (the run has 2**-1)" in result.err
    assert "--init-scale 2**20 (the run has 2**36)" in result.err
    assert "Traceback" not in result.err


def test_resume_refuses_a_run_already_at_the_target(uninterrupted: tuple[Path, Result]) -> None:
    directory, _ = uninterrupted
    result = demo("--resume", str(directory), "--steps", str(STEPS))
    assert result.status == 2
    assert f"already at step {STEPS}" in result.err


def test_a_new_run_does_not_overwrite_a_saved_one(uninterrupted: tuple[Path, Result]) -> None:
    directory, _ = uninterrupted
    result = demo("--steps", "5", "--out", str(directory))
    assert result.status == 2
    assert "already holds a demo run" in result.err


def test_resume_from_a_directory_without_a_run_fails_cleanly(tmp_path: Path) -> None:
    result = demo("--resume", str(tmp_path))
    assert result.status == 1
    assert "not a demo run (expected a step-N directory" in result.err
    assert "Traceback" not in result.err


def test_resume_detects_files_from_different_steps(tmp_path: Path) -> None:
    early, late = tmp_path / "early", tmp_path / "late"
    assert demo("--steps", "3", "--out", str(early)).status == 0
    assert demo("--steps", "4", "--out", str(late)).status == 0
    saved_file(late, "scaler.ckpt").write_bytes(saved_file(early, "scaler.ckpt").read_bytes())
    result = demo("--resume", str(late), "--steps", "10")
    assert result.status == 1
    assert "scaler.ckpt is at step 3, not 4" in result.err


def test_compare_prints_three_rows_and_a_real_difference() -> None:
    result = demo("--steps", "60", "--compare")
    assert result.status == 0, result.err
    rows = {}
    for label in ("fp16 + loss scaling", "fp16, no loss scaling", "fp32"):
        line = next(line for line in result.out.splitlines() if line.startswith(label + " "))
        rows[label] = line[len(label) :].split()
    accuracy, _, skipped, zeroed = rows["fp16 + loss scaling"]
    assert int(skipped) >= 4  # the too-high start overflows
    assert rows["fp16, no loss scaling"][2] == "0"  # nothing overflows without a scale (it underflows instead)
    assert rows["fp32"][2:] == ["0", "-"]
    # Measured, not asserted by construction: unscaled fp16 loses many gradient elements, scaled fp16 almost none.
    unscaled_zeroed = float(rows["fp16, no loss scaling"][3].rstrip("%"))
    assert unscaled_zeroed > 20
    assert float(zeroed.rstrip("%")) < 1
    assert "Without loss scaling" in result.out


def test_each_backoff_shows_the_steps_numerics_report(uninterrupted: tuple[Path, Result]) -> None:
    _, result = uninterrupted
    lines = result.out.splitlines()
    after_backoffs = [lines[i + 1] for i, line in enumerate(lines) if "backoff: scale" in line]
    assert after_backoffs
    # After an overflow the largest value shown is the largest finite one, among the gradients without inf/nan.
    pattern = (
        r"^ +numerics: largest finite \|g\| \S+ in [Wb]\d of the gradients without inf/nan \(float16's largest is "
        r"65504\); most zeros in [Wb]\d: \S+%$"
    )
    assert all(re.match(pattern, line) for line in after_backoffs), after_backoffs


def test_the_header_gives_the_clip_threshold_check_receives(uninterrupted: tuple[Path, Result]) -> None:
    _, result = uninterrupted
    assert "clip     the gradient norm at 2**-14 (check's max_norm: --clip 2**-1 for the mean loss" in result.out
    assert "clipped at 2**-1)" not in result.out


def test_report_prints_a_row_per_gradient(tmp_path: Path) -> None:
    result = demo("--steps", "30", "--report")
    assert result.status == 0, result.err
    rows = [line.split() for line in result.out.splitlines() if re.match(r"^ +[Wb]\d +\d+ elements  largest", line)]
    assert [row[0] for row in rows] == ["W1", "b1", "W2", "b2", "W3", "b3"]
    assert "report   per gradient" in result.out


def test_report_with_plot_draws_the_zero_fractions(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason='matplotlib is the optional "demo" extra (pip install "cupy-amp[demo]")')
    target = tmp_path / "report.png"
    result = demo("--steps", "20", "--report", "--plot", str(target))
    assert result.status == 0, result.err
    assert target.stat().st_size > 0


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason='matplotlib is the optional "demo" extra (pip install "cupy-amp[demo]")')
    target = tmp_path / "demo.png"
    result = demo("--steps", "40", "--plot", str(target))
    assert result.status == 0, result.err
    data = target.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000  # two labelled panels, not an empty canvas
    assert f"plot     {target}" in result.out


def test_plot_without_matplotlib_fails_before_training(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes "import matplotlib" raise ImportError
    result = demo("--steps", "40", "--plot", str(tmp_path / "demo.png"))
    assert result.status == 1
    assert 'pip install "cupy-amp[demo]"' in result.err
    assert result.out == ""  # nothing was trained
    assert not (tmp_path / "demo.png").exists()


def test_digits_needs_scikit_learn_or_learns() -> None:
    try:
        import sklearn  # noqa: F401
    except ImportError:
        result = demo("--data", "digits", "--steps", "5")
        assert result.status == 1
        assert "--data digits needs scikit-learn" in result.err
        return
    result = demo("--data", "digits", "--steps", "150", "--batch-size", "256")
    assert result.status == 0, result.err
    accuracy = float(re.search(r"accuracy ([\d.]+)%", _line(result.out, "eval")).group(1))  # type: ignore[union-attr]
    assert accuracy > 50  # 10 classes: chance is 10%


def test_gpu_without_a_gpu_fails_cleanly() -> None:
    if gpu_unavailable_reason() is None:
        pytest.skip("a GPU is usable here; tests/gpu/test_demo_gpu.py runs the demo on it")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["demo", "--device", "gpu", "--steps", "5"])
    assert status == 1
    assert err.getvalue().startswith("cupy-amp demo: --device gpu: no usable GPU")
    assert "Traceback" not in err.getvalue()
    assert out.getvalue() == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--compare", "--resume", "x"], "cannot be combined with --resume"),
        (["--backoff-factor", "1.5"], "Invalid 'backoff_factor'"),
        (["--init-scale", "2**40", "--max-scale", "2**30"], "Invalid 'init_scale'"),
        (["--batch-size", "100000"], "larger than the 8192 training examples"),
        (["--device", "cpu", "--sync-free"], "--sync-free trains on a GPU"),
        (["--device", "cpu", "--graph", "--sync-free"], "--graph trains on a GPU"),
        (["--report", "--sync-free"], "--report reads each step's numerics report"),
    ],
)
def test_contradictory_flags_are_usage_errors(args: list[str], message: str) -> None:
    result = demo(*args)
    assert result.status == 2
    assert message in result.err
    assert "Traceback" not in result.err


def test_malformed_numbers_are_rejected_by_the_parser() -> None:
    result = demo("--init-scale", "lots")
    assert result.status == 2
    assert "expected a number such as 0.5 or 2**16" in result.err


def test_help_explains_the_flags() -> None:
    result = demo("--help")
    assert result.status == 0
    for flag in (
        "--steps",
        "--batch-size",
        "--seed",
        "--lr",
        "--loss-weight",
        "--init-scale",
        "--growth-interval",
        "--growth-factor",
        "--backoff-factor",
        "--min-scale",
        "--max-scale",
        "--hysteresis",
        "--out",
        "--save-every",
        "--resume",
        "--plot",
        "--compare",
        "--device",
        "--data",
    ):
        assert flag in result.out


def test_batches_are_a_function_of_seed_and_step_only() -> None:
    first = batch_indices(3, 17, 64, 1000)
    assert np.array_equal(first, batch_indices(3, 17, 64, 1000))
    assert not np.array_equal(first, batch_indices(3, 18, 64, 1000))
    assert len(set(first.tolist())) == 64


def test_fp32_training_does_not_depend_on_a_power_of_two_loss_weight() -> None:
    """The --help claim: Adam's epsilon scales with the loss weight, so fp32 training is unchanged (here exactly)."""
    device, _ = select_device("cpu")
    from cupy_amp.demo.model import load_dataset

    dataset = load_dataset("builtin", 0)
    masters = []
    for weight in (1.0, 2.0**-13):
        settings = Settings(loss_weight=weight)
        trainer = Trainer("fp32", settings, dataset, device, new_state(device, settings, dataset), None)
        losses = [trainer.step().loss for _ in range(20)]
        masters.append((losses, {name: value.copy() for name, value in trainer.state.masters.items()}))
    assert masters[0][0] == masters[1][0]
    for name, value in masters[0][1].items():
        assert value.tobytes() == masters[1][1][name].tobytes(), name


def test_clipping_happens_inside_the_fused_update_when_the_norm_exceeds_clip() -> None:
    """The default clip scales a few steps' gradients down; a clip above every norm changes nothing at all."""
    default, loose, tight = (
        demo("--steps", "120"),
        demo("--steps", "120", "--clip", "1e9"),
        demo("--steps", "120", "--clip", "0.05"),
    )
    assert default.status == loose.status == tight.status == 0
    final = [_line(result.out, "eval") for result in (default, loose, tight)]
    assert final[0] != final[2] and final[1] != final[2]


def test_the_comparison_counts_the_skips_of_a_run_without_scaling() -> None:
    """A disabled scaler's check() skips steps with inf/nan; the table counts them from the run's history."""
    result = demo("--steps", "30", "--compare", "--loss-weight", "2**20", "--init-scale", "1", "--clip", "1")
    assert result.status == 0, result.err
    line = next(line for line in result.out.splitlines() if line.startswith("fp16, no loss scaling "))
    assert int(line[len("fp16, no loss scaling") :].split()[2]) > 0


def test_a_disabled_scaler_makes_the_loop_plain_fp16() -> None:
    device, _ = select_device("cpu")
    from cupy_amp.demo.model import load_dataset

    dataset = load_dataset("builtin", 0)
    settings = Settings()
    scaler = make_scaler("fp16", ScalerSettings())
    assert scaler is not None and not scaler.is_enabled()
    trainer = Trainer("fp16", settings, dataset, device, new_state(device, settings, dataset), scaler)
    outcomes = [trainer.step() for _ in range(5)]
    assert all(o.scale == 1.0 and not o.skipped and o.backoff is None for o in outcomes)


def test_reporter_draws_a_bar_on_a_terminal_and_prints_events_above_it() -> None:
    stream = io.StringIO()
    reporter = Reporter(stream, terminal=True)
    outcome = StepOutcome(step=10, loss=0.5, accuracy=0.75, scale=2.0**33, skipped=False, skipped_total=2)
    reporter.progress(outcome, 20)
    overflow = StepOutcome(
        step=20, loss=0.4, accuracy=0.8, scale=2.0**33, skipped=True, nonfinite=("W3",), backoff=(2.0**33, 2.0**32)
    )
    reporter.event(overflow, 50)
    reporter.progress(overflow, 20)
    reporter.end_progress()
    text = stream.getvalue()
    assert text.startswith("\r\x1b[2K[############............] step 10/20  loss 0.5000  acc  75.0%  scale 2**33")
    assert "\r\x1b[2Kstep    20  overflow: inf/nan in W3 -> step skipped; backoff: scale 2**33 -> 2**32\n" in text
    assert text.endswith("[########################] step 20/20  loss 0.4000  acc  80.0%  scale 2**33  skipped 0\n")


def test_importing_the_cli_imports_neither_cupy_nor_the_demo_machinery() -> None:
    code = (
        "import sys; import cupy_amp.cli; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'matplotlib', 'sklearn') "
        "or m.startswith('cupy_amp.demo')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


def test_the_console_entry_point_runs_the_demo_in_a_subprocess(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from cupy_amp.cli import main; raise SystemExit(main())",
            "demo",
            "--device",
            "cpu",
            "--steps",
            "30",
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "done     30 steps" in done.stdout
    assert saved_file(tmp_path / "run", "scaler.ckpt").is_file()


def test_the_example_script_trains(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "train_loop.py")],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("step 300: ")
    accuracy = float(re.search(r"accuracy ([\d.]+)%", last).group(1))  # type: ignore[union-attr]
    assert accuracy > 90


@pytest.mark.parametrize(
    ("group", "name", "value", "shown"),
    [
        ("run", "lr", float("nan"), "lr=nan"),
        ("run", "batch_size", 0, "batch_size=0"),
        ("run", "seed", "/etc/passwd", "seed='/etc/passwd'"),
        ("run", "hidden", [64, -1], "hidden=(64, -1)"),
        ("run", "data", "imagenet", "data='imagenet'"),
        ("run", "clip", -1.0, "clip=-1.0"),
        ("scaler", "init_scale", float("nan"), "Invalid 'init_scale'"),
        ("scaler", "growth_interval", 0, "Invalid 'growth_interval'"),
    ],
)
def test_resume_validates_every_setting_it_reads_back(
    tmp_path: Path, group: str, name: str, value: object, shown: str
) -> None:
    assert demo("--steps", "3", "--out", str(tmp_path)).status == 0
    arrays = saved_arrays(tmp_path)
    document = json.loads(str(arrays["settings"]))
    document[group][name] = value
    arrays["settings"] = np.array(json.dumps(document))
    np.savez(saved_file(tmp_path, "state.npz"), **arrays)
    result = demo("--resume", str(tmp_path), "--steps", "6")
    assert result.status == 1
    assert result.err.startswith(f"cupy-amp demo: cannot resume from {saved_file(tmp_path, '')}")
    assert shown in result.err
    assert "Traceback" not in result.err
    assert result.out == ""  # refused before training


def test_resume_refuses_a_state_file_with_unknown_settings(tmp_path: Path) -> None:
    assert demo("--steps", "3", "--out", str(tmp_path)).status == 0
    arrays = saved_arrays(tmp_path)
    document = json.loads(str(arrays["settings"]))
    document["run"]["momentum"] = 0.9
    arrays["settings"] = np.array(json.dumps(document))
    np.savez(saved_file(tmp_path, "state.npz"), **arrays)
    result = demo("--resume", str(tmp_path), "--steps", "6")
    assert result.status == 1
    assert "momentum" in result.err
    assert "Traceback" not in result.err


@pytest.mark.parametrize(
    ("name", "message"),
    [("loss.xyz", "matplotlib writes"), ("loss", "matplotlib writes"), ("absent/loss.png", "does not exist")],
)
def test_plot_checks_its_path_and_format_before_training(tmp_path: Path, name: str, message: str) -> None:
    pytest.importorskip("matplotlib", reason='matplotlib is the optional "demo" extra (pip install "cupy-amp[demo]")')
    result = demo("--steps", "20", "--plot", str(tmp_path / name))
    assert result.status == 2
    assert message in result.err
    assert result.out == ""  # nothing was trained
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(("extension", "magic"), [("svg", b"<?xml"), ("pdf", b"%PDF")])
def test_plot_writes_the_format_its_extension_names(tmp_path: Path, extension: str, magic: bytes) -> None:
    pytest.importorskip("matplotlib", reason='matplotlib is the optional "demo" extra (pip install "cupy-amp[demo]")')
    target = tmp_path / f"loss.{extension}"
    assert demo("--steps", "20", "--plot", str(target)).status == 0
    assert target.read_bytes().startswith(magic)


def test_the_example_script_has_help_and_a_one_line_error_without_a_gpu(tmp_path: Path) -> None:
    script = str(REPO_ROOT / "examples" / "train_loop.py")
    shown = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, env=_env(), check=False)
    assert shown.returncode == 0 and "--gpu" in shown.stdout
    if gpu_unavailable_reason() is None:
        return  # a GPU is usable here: tests/gpu/test_demo_gpu.py runs the example on it
    refused = subprocess.run([sys.executable, script, "--gpu"], capture_output=True, text=True, env=_env(), check=False)
    assert refused.returncode == 1
    assert refused.stderr.startswith("--gpu: no usable GPU")
    assert len(refused.stderr.splitlines()) == 1
    assert refused.stdout == ""


def test_the_graph_example_has_help_and_a_one_line_error_without_a_gpu() -> None:
    script = str(REPO_ROOT / "examples" / "graph_step.py")
    shown = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, env=_env(), check=False)
    assert shown.returncode == 0 and "--steps" in shown.stdout
    if gpu_unavailable_reason() is None:
        return  # a GPU is usable here: tests/gpu/test_demo_gpu.py runs the example on it
    refused = subprocess.run([sys.executable, script], capture_output=True, text=True, env=_env(), check=False)
    assert refused.returncode == 1
    assert refused.stderr.startswith("this example needs a GPU")
    assert len(refused.stderr.splitlines()) == 1


def test_a_clip_threshold_that_cannot_fit_float32_is_a_usage_error() -> None:
    result = demo("--steps", "2", "--clip", "1e39", "--loss-weight", "1")
    assert result.status == 2 and "clip=" in result.err and "unexpected" not in result.err
    assert result.out == ""  # refused before training


def test_resume_refuses_an_optimizer_with_more_updates_than_steps(tmp_path: Path) -> None:
    assert demo("--steps", "3", "--out", str(tmp_path)).status == 0
    later = tmp_path / "later"
    assert demo("--steps", "20", "--out", str(later)).status == 0
    saved_file(tmp_path, "adamw.state").write_bytes(saved_file(later, "adamw.state").read_bytes())
    result = demo("--resume", str(tmp_path), "--steps", "6")
    assert result.status == 1 and re.search(r"adamw\.state made \d+ updates in 3 steps", result.err), result.err


@pytest.mark.slow
def test_the_readme_compare_table_is_what_the_demo_prints() -> None:
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    header = "                         accuracy     loss  skipped  grads zeroed in fp16"
    table = readme[readme.index(header) :].split("```")[0].strip("\n").splitlines()
    result = demo("--compare", "--device", "cpu")
    assert result.status == 0, result.err
    lines = result.out.splitlines()
    start = lines.index(header)
    assert lines[start : start + len(table)] == table


def test_a_cublas_that_does_not_load_is_a_demo_error() -> None:
    """Here (no GPU), CuPy's cuBLAS does not load: the demo says so, instead of an ImportError from CuPy."""
    pytest.importorskip("cupy")
    try:
        from cupy_backends.cuda.libs import cublas  # noqa: F401
    except Exception:  # what the demo turns into its own error
        pass
    else:
        pytest.skip("cuBLAS loads here (the GPU suite covers a library that then fails to open)")
    from cupy_amp.demo import products
    from cupy_amp.demo.settings import DemoError

    with pytest.raises(DemoError, match=r"the demo's device step calls cuBLAS, which does not load: .+"):
        products._library()
