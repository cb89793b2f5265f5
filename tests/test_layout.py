"""The package's layout rules, read from its source: one door to CuPy, and no import circle.

Every import is counted, wherever it stands: at the top, inside a function (a lazy import), or under
``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cupy_amp"
CUPY_MODULES = ("cupy", "cupyx", "cupy_backends")
DOOR = PACKAGE / "gpu"
APPLICATION = PACKAGE / "demo"  # the demo is an application of the library, as examples/ are: it imports CuPy
IMPORTERS = ("import_module", "__import__", "find_spec")  # calls that import (or look up) a module by its name


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(path: Path) -> set[str]:
    """Every module name an import statement of ``path`` names (relative imports resolved)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:  # `from pkg import module` imports the module; else it reads pkg
                names.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return names


def test_only_the_gpu_package_imports_cupy() -> None:
    outside = {
        name: sorted(m for m in imported(path) if m.split(".")[0] in CUPY_MODULES)
        for name, path in MODULES.items()
        if DOOR not in path.parents and APPLICATION not in path.parents
    }
    assert {name: found for name, found in outside.items() if found} == {}
    peeks = [
        name
        for name, path in MODULES.items()
        if DOOR not in path.parents
        and any("sys.modules" in line and "cupy" in line for line in path.read_text(encoding="utf-8").splitlines())
    ]
    assert peeks == []  # CuPy, where it may be loaded, is asked of cupy_amp.gpu.loaded_cupy()
    by_name = [  # importlib.import_module("cupy") or __import__("cupy"): an import the statements do not show
        name
        for name, path in MODULES.items()
        if DOOR not in path.parents and APPLICATION not in path.parents and _imports_cupy_by_name(path)
    ]
    assert by_name == []
    assert any(m.startswith("cupy") for m in imported(DOOR / "backend.py"))  # the rule reads real imports


def test_no_import_circle_lazy_and_typing_imports_included() -> None:
    graph = {name: {m for m in imported(path) if m in MODULES and m != name} for name, path in MODULES.items()}
    # An import names its module, not the packages above it (importing those first is Python's, not a design
    # edge); ``from cupy_amp import GradScaler`` inside cupy_amp names the package, and would be a circle.
    circles = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    circles.append(path)
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert circles == []
    assert graph["cupy_amp.chainer.attach"] >= {"cupy_amp.chainer.extension"}  # the graph is read, not empty


def _imports_cupy_by_name(path: Path) -> bool:
    """Whether ``path`` passes a CuPy module's name to a call (``import_module``, ``__import__``, ``find_spec``)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            name = node.args[0].value
            if called in IMPORTERS and isinstance(name, str) and name.split(".")[0] in CUPY_MODULES:
                return True
    return False


def test_the_rules_see_a_planted_import(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text('import importlib\n\ndef f():\n    return importlib.import_module("cupy")\n')
    assert _imports_cupy_by_name(planted)
    planted.write_text('def f(m):\n    return m.startswith("cupy")\n')
    assert not _imports_cupy_by_name(planted)


def test_importing_every_module_but_the_demo_imports_no_cupy() -> None:
    # Importing any module outside the door, and the door's package itself, loads no CuPy: CuPy is loaded
    # only by the door's modules, when a CuPy array or a GPU scaler asks for them. The demo is an application.
    names = sorted(
        name
        for name, path in MODULES.items()
        if APPLICATION not in path.parents and not name.startswith("cupy_amp.gpu.")
    )
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "sys.exit(sorted(m for m in ('cupy', 'cupyx') if m in sys.modules) != [])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert len(names) > 30


def test_every_kernel_has_its_numpy_twin_under_its_own_stem() -> None:
    # Every kernel file, and every header of shared device code (not common.cuh: types and primitives), has
    # its twin; every twin is one's.
    folder = PACKAGE.parent / "kernels"
    kernels = {path.stem for path in folder.glob("*.cu")}
    shared = {path.stem for path in folder.glob("*.cuh")} - {"common"}
    twins = {path.stem for path in (PACKAGE / "twins").glob("*.py")} - {"__init__"}
    assert kernels | shared == twins
    assert len(kernels) >= 6 and shared == {"optimizer"}
    for path in [folder / f"{stem}.cu" for stem in kernels] + [folder / f"{stem}.cuh" for stem in shared]:
        assert f"cupy_amp.twins.{path.stem}" in path.read_text(encoding="utf-8"), path.name  # names its twin
