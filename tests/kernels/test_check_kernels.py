"""tools/check_kernels.py: every kernel compiles cleanly, and planted problems are reported at their source line."""

from __future__ import annotations

import re
from itertools import product
from pathlib import Path
from typing import Any

import pytest

from cupy_amp.kernel_interface import KERNEL_FILES, STRUCTS, compile_source, layout_checks
from cupy_amp.kernel_interface import compile_options as runtime_options
from cupy_amp.kernel_sources import read_kernel_source
from tools import check_kernels

pytestmark = pytest.mark.nvrtc

REPO = Path(__file__).resolve().parents[2]
HEADER = "common.cuh"
_REPORTED = re.compile(r"^\s*(?P<path>\S+?):(?P<line>\d+): (?P<kind>error|warning): (?P<text>.*)$", re.MULTILINE)


def insert_line(path: Path, after: str, text: str) -> int:
    """Insert ``text`` after the first line containing ``after``; return the new line's 1-based number."""
    lines = path.read_text(encoding="utf-8").splitlines()
    index = next(i for i, line in enumerate(lines) if after in line) + 1
    lines.insert(index, text)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return index + 1


def reported(stderr: str) -> list[tuple[str, int, str, str]]:
    return [(m["path"], int(m["line"]), m["kind"], m["text"]) for m in _REPORTED.finditer(stderr)]


def test_check_all_compiles_every_kernel_for_sm70_sm80_sm90_without_diagnostics() -> None:
    results = check_kernels.check_all()
    assert sorted((r.file, r.arch) for r in results) == sorted(product(KERNEL_FILES, ("70", "80", "90")))
    for result in results:
        assert result.diagnostics == (), (result.file, result.arch)
        assert result.ok, (result.file, result.arch)


def test_main_on_the_source_kernels_returns_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert check_kernels.main(["--arch", "80"]) == 0
    out, err = capsys.readouterr()
    assert f"kernels from {REPO / 'kernels'}" in out
    assert all(f"ok     sm_80 {name}" in out for name in KERNEL_FILES)
    assert err == ""


@pytest.mark.parametrize("arch", ["70", "80", "90"])
def test_compile_options_are_cupys_plus_cupy_amps(arch: str) -> None:
    options = check_kernels.compile_options(arch)
    for cupy_adds in ("-ftz=true", "--device-as-default-execution-space", f"-arch=sm_{arch}"):
        assert cupy_adds in options
    assert set(runtime_options()) <= set(options)
    assert "--std=c++17" in options
    assert any(option.startswith("-DCUPY_AMP_THREADS=") for option in options)
    assert len(options) == len(runtime_options()) + 3


def test_compile_kernel_passes_exactly_those_options_to_nvrtc(monkeypatch: pytest.MonkeyPatch) -> None:
    from cupy.cuda import nvrtc

    seen: list[tuple[str, ...]] = []
    real = nvrtc.compileProgram

    def spy(program: Any, options: Any) -> Any:
        seen.append(tuple(options))
        return real(program, options)

    monkeypatch.setattr(nvrtc, "compileProgram", spy)
    result = check_kernels.compile_kernel("scale_loss.cu", "90")
    assert result.ok
    assert seen == [check_kernels.compile_options("90")]


def test_compiled_source_is_the_inlined_kernel_source(monkeypatch: pytest.MonkeyPatch) -> None:
    from cupy.cuda import nvrtc

    sources: list[str] = []
    real = nvrtc.createProgram

    def spy(source: str, name: str, headers: Any, include_names: Any) -> Any:
        sources.append(source)
        return real(source, name, headers, include_names)

    monkeypatch.setattr(nvrtc, "createProgram", spy)
    check_kernels.compile_kernel("unscale_check.cu", "80")

    assert sources == [compile_source("unscale_check.cu")]
    assert sources[0].startswith('#line 1 "unscale_check.cu"')
    assert sources[0].endswith(layout_checks("unscale_check.cu", read_kernel_source("unscale_check.cu")))


def test_planted_warning_fails_and_points_at_its_line(kernel_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = kernel_copy / "scale_loss.cu"
    # Into the body of the template scale_loss (its signature ends on this line).
    line = insert_line(
        target, "__device__ void scale_loss(const ScaleArgs& args) {", "    int planted_unused_variable = 3;"
    )
    assert check_kernels.main(["--arch", "80", "--kernel-dir", str(kernel_copy)]) == 1
    out, err = capsys.readouterr()
    assert "FAILED sm_80 scale_loss.cu" in out
    assert "ok     sm_80 unscale_check.cu" in out
    findings = reported(err)
    assert findings
    assert {(path, number, kind) for path, number, kind, _ in findings} == {(str(target), line, "warning")}
    assert all("planted_unused_variable" in text for *_, text in findings)


def test_planted_error_after_the_include_points_at_its_line(
    kernel_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = kernel_copy / "unscale_check.cu"
    line = insert_line(target, f'#include "{HEADER}"', "int planted_error = planted_undefined_identifier;")
    assert check_kernels.main(["--arch", "80", "--kernel-dir", str(kernel_copy)]) == 1
    out, err = capsys.readouterr()
    assert "FAILED sm_80 unscale_check.cu" in out
    assert "ok     sm_80 scale_loss.cu" in out
    findings = reported(err)
    assert {(path, number, kind) for path, number, kind, _ in findings} == {(str(target), line, "error")}
    assert "planted_undefined_identifier" in findings[0][3]


def test_planted_error_in_the_shared_header_points_at_the_header(
    kernel_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    header = kernel_copy / HEADER
    line = insert_line(header, "typedef unsigned long long u64;", "planted_unknown_type planted_variable;")
    assert line > 20  # far enough down that a wrong mapping would show
    assert check_kernels.main(["--arch", "80", "--arch", "90", "--kernel-dir", str(kernel_copy)]) == 1
    out, err = capsys.readouterr()
    for name, arch in product(KERNEL_FILES, ("80", "90")):
        assert f"FAILED sm_{arch} {name}" in out
    findings = reported(err)
    assert len(findings) == 2 * len(KERNEL_FILES)  # once per kernel file and architecture
    assert {(path, number, kind) for path, number, kind, _ in findings} == {(str(header), line, "error")}
    assert all("planted_unknown_type" in text for *_, text in findings)


def test_compile_result_carries_the_diagnostics(kernel_copy: Path) -> None:
    target = kernel_copy / "scale_loss.cu"
    line = insert_line(
        target, "CUPY_AMP_SCALE_LOSS(cupy_amp_scale_loss_float64", 'static_assert(sizeof(int) == 0, "planted");'
    )
    result = check_kernels.compile_kernel("scale_loss.cu", "70", kernel_copy)
    assert not result.ok
    assert (result.file, result.arch) == ("scale_loss.cu", "70")
    assert any(d.startswith(f"{target}:{line}: error: ") and "planted" in d for d in result.diagnostics)


def test_catastrophic_error_points_at_its_line(kernel_copy: Path) -> None:
    target = kernel_copy / "scale_loss.cu"
    line = insert_line(target, "CUPY_AMP_SCALE_LOSS(cupy_amp_scale_loss_float64", "#error planted stop")
    result = check_kernels.compile_kernel("scale_loss.cu", "80", kernel_copy)
    assert not result.ok
    assert any(d.startswith(f"{target}:{line}: ") and "planted stop" in d for d in result.diagnostics)


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        # Two fields of one type swapped: the same size, other offsets.
        (
            "    long long first;  // dense: 0; strided: the chunk's first element, counted in C order\n"
            "    long long last;   // one past the chunk's last element (dense: its element count)\n",
            "    long long last;\n    long long first;\n",
            "cupy_amp::Chunk::first",
        ),
        # A field's type changed to another of the same size.
        ("    float max_norm;", "    int max_norm;", "cupy_amp::FinishArgs::max_norm"),
        # A field added, changing the size, and one added into the padding, not changing it.
        ("    u64 state;             // State*: the loss", "    u64 planted;\n    u64 state;", "cupy_amp::ScaleArgs"),
        ("    unsigned char finite;", "    unsigned char finite;\n    unsigned char planted;", "more elements"),
    ],
    ids=["swapped", "retyped", "added", "added-into-padding"],
)
def test_a_struct_that_no_longer_matches_its_numpy_mirror_fails_to_compile(
    kernel_copy: Path, old: str, new: str, field: str
) -> None:
    header = kernel_copy / HEADER
    text = header.read_text(encoding="utf-8")
    assert old in text
    header.write_text(text.replace(old, new), encoding="utf-8")
    results = check_kernels.check_all(("80",), kernel_copy)
    assert not any(result.ok for result in results)
    assert all(any(field in line for line in result.diagnostics) for result in results)


def test_an_entry_point_that_no_longer_takes_its_struct_by_value_fails_to_compile(kernel_copy: Path) -> None:
    target = kernel_copy / "unscale_check.cu"
    text = target.read_text(encoding="utf-8")
    assert "NAME(const cupy_amp::UnscaleArgs args)" in text
    text = text.replace("NAME(const cupy_amp::UnscaleArgs args)", "NAME(const cupy_amp::UnscaleArgs* pointer)")
    text = text.replace("unscale_check<cupy_amp::TYPE>(args);", "unscale_check<cupy_amp::TYPE>(*pointer);")
    target.write_text(text, encoding="utf-8")
    result = check_kernels.compile_kernel("unscale_check.cu", "80", kernel_copy)
    assert not result.ok
    assert any("cupy_amp_unscale_check_float32: signature" in line for line in result.diagnostics)


def test_every_mirrored_struct_is_checked_in_a_file_that_declares_it() -> None:
    # A struct is checked where the compiled source declares it (an optimizer's State only in its own file):
    # a mirror no file checks would drift silently.
    checked = {
        name: [f for f in KERNEL_FILES if f"static_assert(sizeof({name})" in compile_source(f)] for name in STRUCTS
    }
    assert all(checked.values()), [name for name, files in checked.items() if not files]
    assert checked["cupy_amp::AdamWState"] == ["adamw.cu"] and checked["cupy_amp::SgdState"] == ["sgd.cu"]
    assert checked["cupy_amp::State"] == list(KERNEL_FILES)  # common.cuh's structs, in every file


def test_an_optimizer_state_that_no_longer_matches_its_mirror_fails_its_own_file(kernel_copy: Path) -> None:
    target = kernel_copy / "sgd.cu"
    text = target.read_text(encoding="utf-8")
    assert "    int first;" in text
    target.write_text(text.replace("    int first;", "    int planted;\n    int first;"), encoding="utf-8")
    result = check_kernels.compile_kernel("sgd.cu", "80", kernel_copy)
    assert not result.ok
    assert any("cupy_amp::SgdState" in line for line in result.diagnostics)
    assert check_kernels.compile_kernel("adamw.cu", "80", kernel_copy).ok  # the other optimizer's file is unaffected
