"""Run the CPU demo under several BLAS kernels, thread counts and NumPy instruction sets; fail unless all agree.

Each run is the README's ``cupy-amp demo --compare --device cpu`` (with
``--out``), in a fresh process whose environment picks the kernel that
OpenBLAS uses (``OPENBLAS_CORETYPE``), its thread count
(``OPENBLAS_NUM_THREADS``, which the demo obeys), or turns off NumPy's
vectorized loops beyond its baseline (``NPY_DISABLE_CPU_FEATURES``). Every run
must print the same lines (the timing line aside) and save the same scaler
checkpoint bytes and the same arrays, bit for bit. The kernel OpenBLAS
really ran is read back in each environment (threadpoolctl): fewer than three
different ones is a failure too, since the comparison would then prove little.
Last, a run stopped half-way under the first environment and resumed under the
last must save what the uninterrupted runs saved: resume is exact across
machines.

Usage: python tools/demo_determinism.py [--steps 600] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from cupy_amp.demo.run_files import latest_save

# OpenBLAS's x86-64 kernels, oldest first, with the CPU flags each one needs.
CORE_TYPES = {
    "Prescott": {"pni"},  # SSE3, as Linux names it
    "Nehalem": {"sse4_2"},
    "Sandybridge": {"avx"},
    "Haswell": {"avx2", "fma"},
    "SkylakeX": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
}
PROBE = (
    "import json, numpy, threadpoolctl; "
    "info = [i for i in threadpoolctl.threadpool_info() if i.get('internal_api') == 'openblas']; "
    "print(json.dumps(info[0] if info else {}))"
)
DISPATCH_PROBE = (
    "import json, numpy as np\n"
    "core = getattr(np, '_core', None) or np.core\n"
    "m = core._multiarray_umath\n"
    "print(json.dumps([f for f in m.__cpu_dispatch__ if m.__cpu_features__.get(f)]))"
)


def cpu_flags() -> set[str]:
    """Return this CPU's flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def environments() -> list[tuple[str, dict[str, str]]]:
    """Return the (label, environment variables) of every run: each usable kernel at 1 and 2 threads, then
    NumPy without its dispatched loops."""
    flags = cpu_flags()
    runs = []
    for core, needs in CORE_TYPES.items():
        if needs <= flags:
            for threads in ("1", "2"):
                runs.append(
                    (f"{core}, {threads} thread(s)", {"OPENBLAS_CORETYPE": core, "OPENBLAS_NUM_THREADS": threads})
                )
    dispatched = json.loads(subprocess.run([sys.executable, "-c", DISPATCH_PROBE], capture_output=True, text=True,
                                           check=True).stdout)  # fmt: skip
    if dispatched:
        runs.append((f"NumPy without {' '.join(dispatched)}", {"NPY_DISABLE_CPU_FEATURES": " ".join(dispatched)}))
    return runs


def _environment(extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, **extra}
    for name in ("OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS", "NPY_DISABLE_CPU_FEATURES"):
        if name not in extra:
            env.pop(name, None)
    return env


def _demo(extra: dict[str, str], *flags: str) -> str:
    command = [sys.executable, "-m", "cupy_amp", "demo", "--device", "cpu", *flags]
    result = subprocess.run(command, env=_environment(extra), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"the demo failed under {extra}:\n{result.stderr}")
    return result.stdout


def _saved(out: Path) -> dict[str, Any]:
    """Digests of the run's newest save: the demo's arrays, and the scaler's and optimizer's files' bytes."""
    save = latest_save(out)
    if save is None:
        raise SystemExit(f"the demo saved nothing in {out}")
    with np.load(save / "state.npz") as saved:
        arrays = {name: hashlib.sha256(np.ascontiguousarray(saved[name]).tobytes()).hexdigest() for name in saved}
    files = {name: hashlib.sha256((save / name).read_bytes()).hexdigest() for name in ("scaler.ckpt", "adamw.state")}
    return {"arrays": arrays, "checkpoint": files}


def run_demo(extra: dict[str, str], steps: int, out: Path) -> dict[str, Any]:
    """Run the demo once; return what it printed (timing aside), its saved files' digests and OpenBLAS's kernel."""
    probe = subprocess.run([sys.executable, "-c", PROBE], env=_environment(extra), capture_output=True, text=True)
    blas = json.loads(probe.stdout or "{}")
    printed = _demo(extra, "--compare", "--steps", str(steps), "--out", str(out)).splitlines()
    printed = [line for line in printed if not line.startswith(("done", "saved"))]
    return {"printed": printed, **_saved(out), "blas": blas.get("architecture")}


def run_resumed(first: dict[str, str], second: dict[str, str], steps: int, out: Path) -> dict[str, Any]:
    """Run half the steps under ``first``, the rest under ``second`` (--resume); return the saved files' digests."""
    _demo(first, "--steps", str(steps // 2), "--out", str(out))
    _demo(second, "--steps", str(steps), "--resume", str(out))
    return _saved(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="steps per run (default: 600, the README's)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    runs = environments()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for index, (label, extra) in enumerate(runs):
            results[label] = run_demo(extra, args.steps, Path(scratch) / str(index))
            print(f"{label:<40} OpenBLAS kernel {results[label]['blas']}", flush=True)
        resumed_label = f"{runs[0][0]}, resumed under {runs[-1][0]}"
        resumed = run_resumed(runs[0][1], runs[-1][1], args.steps, Path(scratch) / "resumed")
        print(resumed_label, flush=True)
    first_label, first = next(iter(results.items()))
    failures = []
    for label, result in [*results.items(), (resumed_label, resumed)]:
        for part in ("printed", "arrays", "checkpoint"):
            if part in result and result[part] != first[part]:
                failures.append(f"{label}: {part} not as in {first_label}")
    kernels = {result["blas"] for result in results.values()}
    if len(kernels) < 3:
        failures.append(f"only {len(kernels)} OpenBLAS kernel(s) ran ({sorted(map(str, kernels))}): too few to tell")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump({"runs": results, "resumed": resumed, "failures": failures}, file, indent=2)
    if failures:
        print("\n".join(["DIFFERENT:", *failures]))
        return 1
    table = [line for line in first["printed"] if line.startswith(("fp16", "fp32", " "))][-4:]
    print(f"the same bits in all {len(results)} runs ({len(kernels)} OpenBLAS kernels):", *table, sep="\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
