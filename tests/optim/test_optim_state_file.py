"""Optimizer state files: bounded work on any file, one set of checks for validate and load, exact flags."""

from __future__ import annotations

import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from cupy_amp.cli import main
from cupy_amp.errors import CheckpointCorruptError, CheckpointFieldError
from cupy_amp.optim import SGD, AdamW, state_file


def adamw(**options: Any) -> AdamW:
    return AdamW([np.zeros(3, dtype=np.float16)], **options)


def write_raw(path: Path, state: dict[str, Any]) -> Path:
    """Pack a state as save() does, whatever it holds (state_file.write would pack it the same way)."""
    body = msgpack.packb(state, use_bin_type=True, use_single_float=False)
    path.write_bytes(body + zlib.crc32(body).to_bytes(4, "big"))
    return path


def test_a_small_file_with_a_beta_near_1_and_a_huge_step_is_judged_at_once(tmp_path: Path) -> None:
    """The issue's 267-byte file: replaying beta**(2**64 - 2) product by product would never end."""
    state = adamw(betas=(1 - 2**-52, 0.999)).state_dict()
    state["record"].update(step=2**64 - 2, beta1_power=0.5, beta2_power=0.0)
    path = write_raw(tmp_path / "adamw.state", state)
    assert path.stat().st_size < 300
    code = (
        "import sys\nfrom cupy_amp.cli import main\nfrom cupy_amp.optim import AdamW\nimport numpy as np\n"
        f"assert main(['validate', {str(path)!r}]) == 1\nassert main(['inspect', {str(path)!r}]) == 1\n"
        f"opt = AdamW([np.zeros(3, dtype=np.float16)], betas=(1 - 2**-52, 0.999))\n"
        f"try:\n    opt.load({str(path)!r})\nexcept ValueError as e:\n    print(e)\nelse:\n    sys.exit('loaded')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert "Invalid 'record.beta1_power'" in result.stdout


def test_a_power_past_the_replay_limit_is_held_to_its_rounding_bound() -> None:
    beta, steps = 1 - 2.0**-30, state_file.REPLAY_LIMIT + 5000
    power = state_file.power_bounds(beta, state_file.REPLAY_LIMIT)[0]
    for _ in range(5000):
        power *= beta  # the steps' own products past the limit
    low, high = state_file.power_bounds(beta, steps)
    assert low < power < high and high - low < 1e-11 * power
    opt = adamw(betas=(beta, 0.5))
    state = opt.state_dict()
    exact_beta2 = state_file.power_bounds(0.5, steps)[0]
    state["record"].update(step=steps, beta1_power=power, beta2_power=exact_beta2)
    opt.load_state_dict(state)
    assert opt.step_count == steps
    state["record"]["beta1_power"] = power * 1.001
    with pytest.raises(CheckpointFieldError, match=r"^Invalid 'record\.beta1_power': expected a number from "):
        adamw(betas=(beta, 0.5)).load_state_dict(state)


def test_powers_within_the_replay_limit_are_still_exact() -> None:
    replayed = 1.0
    for _ in range(1000):
        replayed *= 0.9
    assert state_file.power_bounds(0.9, 1000) == (replayed, replayed)
    assert state_file.power_bounds(0.5, 10**18) == (0.0, 0.0)  # a fixed point, found at once


@pytest.mark.parametrize(
    ("value", "accepted"),
    [(True, True), (1, True), (False, True), (0, True), (0.5, False), (0.99, False), (1.0, False),
     (2**40, False), (2**64 - 1, False), (1e30, False), (-1, False), ("1", False), (None, False)],
)  # fmt: skip
def test_sgd_nesterov_is_a_bool_or_0_or_1_and_nothing_else(tmp_path: Path, value: Any, accepted: bool) -> None:
    opt = SGD([np.zeros(3, dtype=np.float32)], lr=0.1, momentum=0.9, nesterov=True)
    state = opt.state_dict()
    state["record"]["nesterov"] = value
    path = write_raw(tmp_path / "sgd.state", state)
    fresh = SGD([np.zeros(3, dtype=np.float32)], lr=0.1, momentum=0.9, nesterov=bool(value) if accepted else True)
    if accepted:
        fresh.load(path)
        assert main(["validate", str(path)]) == 0
        return
    with pytest.raises(CheckpointFieldError, match=r"^Invalid 'record\.nesterov': expected a bool"):
        fresh.load(path)
    assert main(["validate", str(path)]) == 1


# Values no optimizer may hold, whichever loads them: validate refuses them as load does.
OUT_OF_RANGE = [
    ("adamw", "beta1", 5.0),
    ("adamw", "beta2", 1.0),
    ("adamw", "eps", -1.0),
    ("adamw", "weight_decay", -0.5),
    ("adamw", "lr", -1e-3),
    ("adamw", "beta1_power", 1.5),
    ("sgd", "dampening", 2.0),
    ("sgd", "momentum", -0.1),
    ("sgd", "lr", -1.0),
]


@pytest.mark.parametrize(("kind", "field", "value"), OUT_OF_RANGE)
def test_validate_refuses_what_load_refuses_without_the_optimizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, field: str, value: float
) -> None:
    make = (lambda: adamw(lr=1e-3)) if kind == "adamw" else (lambda: SGD([np.zeros(3, np.float32)], momentum=0.5))
    state = make().state_dict()
    state["record"][field] = value
    path = write_raw(tmp_path / f"{kind}.state", state)
    assert main(["validate", str(path)]) == 1
    assert f"Invalid 'record.{field}'" in capsys.readouterr().err
    with pytest.raises(CheckpointFieldError, match=rf"^Invalid 'record\.{field}'"):
        make().load(path)


def test_nesterov_without_momentum_is_refused_by_validate_and_load(tmp_path: Path) -> None:
    state = SGD([np.zeros(3, np.float32)], momentum=0.9, nesterov=True).state_dict()
    state["record"]["momentum"] = 0.0
    path = write_raw(tmp_path / "sgd.state", state)
    assert main(["validate", str(path)]) == 1
    with pytest.raises(CheckpointFieldError, match=r"^Invalid 'record\.nesterov': expected false unless momentum > 0"):
        SGD([np.zeros(3, np.float32)], momentum=0.9, nesterov=True).load(path)


def damaged(data: bytes, how: str) -> bytes:
    if how == "flipped byte":
        middle = len(data) // 2
        return data[:middle] + bytes([data[middle] ^ 0x40]) + data[middle + 1 :]
    if how == "truncated":
        return data[: len(data) - 9]
    return data[:-4] + bytes(4)  # a wrong CRC


@pytest.mark.parametrize("how", ["flipped byte", "truncated", "bad CRC"])
@pytest.mark.parametrize("command", ["validate", "inspect"])
def test_a_damaged_optimizer_state_is_called_one_by_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str, command: str
) -> None:
    good = tmp_path / "good.state"
    adamw().save(good)
    bad = tmp_path / "adamw.state"
    bad.write_bytes(damaged(good.read_bytes(), how))
    with pytest.raises(CheckpointCorruptError, match="CRC-32 mismatch"):
        adamw().load(bad)
    assert main([command, str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"optimizer state {str(bad)!r}" in err and "CRC-32 mismatch" in err
    assert "grad-scaler" not in err


def test_the_command_line_says_what_a_foreign_file_is(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    npz, text = tmp_path / "state.npz", tmp_path / "notes.txt"
    np.savez(npz, weights=np.zeros(3))
    text.write_text("hello\n")
    assert main(["validate", str(npz), str(text)]) == 1
    first, second = capsys.readouterr().err.splitlines()
    assert "a zip archive (a NumPy .npz)" in first and "cupy-amp demo --resume" in first
    assert "not a cupy-amp file" in second


def test_a_state_of_another_kind_is_refused_by_load_and_accepted_by_the_cli(tmp_path: Path) -> None:
    sgd = SGD([np.zeros(3, dtype=np.float16)], momentum=0.5)
    path = tmp_path / "sgd.state"
    sgd.save(path)
    optimizer = adamw()
    before = optimizer.state_dict()
    with pytest.raises(CheckpointFieldError, match=r"^Invalid 'kind': expected 'adamw', got 'sgd'\.$"):
        optimizer.load(path)
    assert optimizer.state_dict() == before  # nothing half-loaded
    assert main(["validate", str(path)]) == 0  # the CLI knows every kind (cupy_amp.optim.LAYOUTS)
    state = sgd.state_dict()
    state["kind"] = "lamb"
    with pytest.raises(CheckpointFieldError, match=r"expected one of 'adamw', 'sgd', got 'lamb'"):
        state_file.validated(state, {layout.kind: layout for layout in (AdamW.layout, SGD.layout)})
