"""Test options: GPU and NVRTC tests skip where unavailable, unless required."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
from helpers import FACES, Face


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--require-gpu",
        action="store_true",
        help="fail (instead of skip) tests marked 'gpu' when no CUDA GPU with CuPy is usable",
    )
    parser.addoption(
        "--require-nvrtc",
        action="store_true",
        help="fail (instead of skip) tests marked 'nvrtc' when CuPy's NVRTC bindings or library are missing",
    )


@functools.cache
def gpu_unavailable_reason() -> str | None:
    """Return why no GPU test can run here, or None when CuPy sees a usable GPU."""
    try:
        import cupy
    except ImportError as exc:
        return f"CuPy is not installed ({exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CuPy raises CUDARuntimeError or ImportError-like errors without a driver
        return f"no CUDA driver/GPU usable by CuPy ({type(exc).__name__}: {exc})"
    if count < 1:
        return "CuPy sees no CUDA device"
    return None


@functools.cache
def nvrtc_unavailable_reason() -> str | None:
    """Return why NVRTC cannot compile here, or None when it can."""
    try:
        from tools.check_kernels import nvrtc_problem
    except ImportError as exc:
        return f"tools.check_kernels cannot be imported ({exc})"
    return nvrtc_problem()


_REQUIREMENTS = (
    ("gpu", "--require-gpu", gpu_unavailable_reason),
    ("nvrtc", "--require-nvrtc", nvrtc_unavailable_reason),
)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a gpu/nvrtc test where its requirement is missing, or fail it when required."""
    for marker, option, reason_of in _REQUIREMENTS:
        if item.get_closest_marker(marker) is None:
            continue
        reason = reason_of()
        if reason is None:
            continue
        if item.config.getoption(option):
            pytest.fail(f"{option} was given but: {reason}", pytrace=False)
        pytest.skip(f"{reason} (pass {option} to fail instead)")


@pytest.fixture
def kernel_copy(tmp_path: Path) -> Path:
    """A copy of kernels/ to plant problems in (tools and tests pass the folder explicitly)."""
    copy = tmp_path / "kernels_copy"
    shutil.copytree(Path(__file__).resolve().parent.parent / "kernels", copy)
    return copy


@pytest.fixture(params=FACES)
def face(request: pytest.FixtureRequest) -> Face:
    """Each scaler face in turn: GradScaler (a host bool per call) and SyncFreeGradScaler (a 0-d bool array)."""
    face: Face = request.param
    return face
