"""The wheel ships the kernels inside the package and works installed in a clean virtual environment.

The wheel is built from a copy of the source tree (so the checkout gets no
build/ or *.egg-info/ folders, and no stale build/ can leak into the wheel).
With setuptools importable here it is built without build isolation, needing
no package index; otherwise pip builds it in an isolated environment, which
downloads setuptools. Installing the wheel into the clean venv fetches its
dependencies (numpy, msgpack) from the configured package index.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
KERNEL_SOURCES = sorted(path for path in (REPO / "kernels").iterdir() if path.suffix in (".cu", ".cuh"))
_SKIPPED_NAMES = {"build", "dist", "__pycache__", "node_modules"}


def _ignore_for_copy(folder: str, names: list[str]) -> set[str]:
    """Leave out hidden entries, build outputs and virtual environments."""
    return {
        name
        for name in names
        if name.startswith(".")
        or name in _SKIPPED_NAMES
        or name.endswith(".egg-info")
        or (Path(folder, name) / "pyvenv.cfg").exists()
    }


def _setuptools_usable() -> bool:
    if importlib.util.find_spec("setuptools") is None:
        return False
    major = int(importlib.metadata.version("setuptools").split(".")[0])
    return major >= 68


def committed_package_modules() -> set[str]:
    """Return the package's .py files that git tracks (all of them outside a git checkout).

    Untracked work in progress is left out: it need not be packaged before it is committed.
    """
    try:
        listed = subprocess.run(
            ["git", "ls-files", "cupy_amp"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        listed = [path.relative_to(REPO).as_posix() for path in (REPO / "cupy_amp").rglob("*.py")]
    modules = {name for name in listed if name.endswith(".py") and (REPO / name).is_file()}
    assert "cupy_amp/__init__.py" in modules
    return modules


def run(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("packaging")
    source = root / "source"
    shutil.copytree(REPO, source, ignore=_ignore_for_copy)
    out = root / "dist"
    isolation = ["--no-build-isolation"] if _setuptools_usable() else []
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", str(out), str(source)], cwd=root)
    (built,) = out.glob("cupy_amp-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def dist_info(names: set[str]) -> str:
    (folder,) = {name.split("/")[0] for name in names if name.split("/")[0].endswith(".dist-info")}
    return folder


def test_wheel_ships_every_kernel_source_byte_for_byte(wheel: Path, wheel_names: set[str]) -> None:
    assert {path.name for path in KERNEL_SOURCES} >= {"scale_loss.cu", "unscale_check.cu", "common.cuh"}
    shipped = {name.removeprefix("cupy_amp/kernels/") for name in wheel_names if name.startswith("cupy_amp/kernels/")}
    assert shipped == {path.name for path in KERNEL_SOURCES}
    with zipfile.ZipFile(wheel) as archive:
        for path in KERNEL_SOURCES:
            assert archive.read(f"cupy_amp/kernels/{path.name}") == path.read_bytes(), path.name


def test_wheel_holds_the_package_and_nothing_else(wheel_names: set[str]) -> None:
    top_level = {name.split("/")[0] for name in wheel_names}
    assert top_level == {"cupy_amp", dist_info(wheel_names)}
    assert "cupy_amp/py.typed" in wheel_names  # type information for mypy and pyright users
    assert any(name.endswith("/LICENSE") for name in wheel_names if name.startswith(dist_info(wheel_names)))
    assert not any(part in ("tests", "tools") for name in wheel_names for part in name.split("/"))
    missing = committed_package_modules() - wheel_names
    assert not missing, f"modules not shipped (is their package listed in pyproject.toml?): {sorted(missing)}"


def test_wheel_declares_the_console_script_and_dependencies(wheel: Path, wheel_names: set[str]) -> None:
    folder = dist_info(wheel_names)
    with zipfile.ZipFile(wheel) as archive:
        entry_points = archive.read(f"{folder}/entry_points.txt").decode()
        metadata = archive.read(f"{folder}/METADATA").decode()
    parser = configparser.ConfigParser()
    parser.read_string(entry_points)
    assert parser["console_scripts"]["cupy-amp"] == "cupy_amp.cli:main"
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert any(requirement.startswith("numpy") for requirement in requires)
    assert any(requirement.startswith("msgpack") for requirement in requires)
    assert not any(requirement.startswith("cupy") and "extra ==" not in requirement for requirement in requires)
    assert any(line == "License-Expression: MIT" for line in metadata.splitlines())


def test_installed_wheel_finds_its_kernels_in_site_packages(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "clean-venv"
    run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    run([str(python), "-m", "pip", "install", "--quiet", str(wheel)], cwd=tmp_path)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.pop("VIRTUAL_ENV", None)
    probe = (
        "import sys, sysconfig\n"
        "import cupy_amp\n"
        "from cupy_amp.kernel_sources import kernel_directory, read_kernel_source\n"
        "print(sysconfig.get_paths()['purelib'])\n"
        "print(cupy_amp.__file__)\n"
        "print(kernel_directory())\n"
        "source = read_kernel_source('unscale_check.cu')\n"
        "print('#include' not in source and 'mul_f32' in source)\n"
        "print('cupy' in sys.modules)\n"
    )
    result = run([str(python), "-c", probe], cwd=elsewhere, env=env)
    purelib, package_file, kernels, inlined, cupy_imported = result.stdout.splitlines()
    site_packages = Path(purelib).resolve()
    assert site_packages.is_relative_to(venv.resolve())
    assert Path(package_file).resolve() == site_packages / "cupy_amp" / "__init__.py"
    assert Path(kernels).resolve() == site_packages / "cupy_amp" / "kernels"
    assert not Path(kernels).resolve().is_relative_to(REPO)
    assert inlined == "True"
    assert cupy_imported == "False"

    cli = venv / "bin" / "cupy-amp"
    help_text = run([str(cli), "--help"], cwd=elsewhere, env=env).stdout
    assert "inspect" in help_text
    assert "validate" in help_text
    wheel_version = wheel.name.split("-")[1]
    assert run([str(cli), "--version"], cwd=elsewhere, env=env).stdout == f"cupy-amp {wheel_version}\n"
    assert "validate" in run([str(python), "-m", "cupy_amp", "--help"], cwd=elsewhere, env=env).stdout
    checkpoint = REPO / "tests" / "data" / "grad_scaler_v1.ckpt"
    run([str(cli), "validate", str(checkpoint)], cwd=elsewhere, env=env)
