"""The demo's flags, and the validated settings of a run built from them (or read back on resume).

Flags that define a run (seed, data, batch size, learning rate, loss weight,
scaler parameters) default to None at parse time, so that ``--resume`` can tell
a flag the user gave from one left out: left out, it takes the resumed run's
value (or the default for a new run); given, it must agree with the run.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from cupy_amp.errors import CupyAmpError
from cupy_amp.rule import power_of_two

__all__ = [
    "DEFAULTS",
    "SCALER_DEFAULTS",
    "DemoError",
    "DemoUsageError",
    "ScalerSettings",
    "Settings",
    "add_arguments",
    "check_settings",
    "settings_from_args",
    "show",
]


class DemoError(CupyAmpError, RuntimeError):
    """The demo cannot run as asked (no GPU, unreadable resume directory, missing extra); exit status 1."""


class DemoUsageError(DemoError):
    """The flags contradict each other or a resumed run; exit status 2."""


@dataclass(frozen=True)
class ScalerSettings:
    """The GradScaler parameters the demo passes through."""

    init_scale: float = 2.0**36
    growth_interval: int = 50
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float | None = 1.0
    max_scale: float | None = None
    hysteresis: int = 1


@dataclass(frozen=True)
class Settings:
    """Everything besides the scaler that decides a run's numbers (saved with every checkpoint)."""

    data: str = "builtin"
    seed: int = 0
    batch_size: int = 512
    lr: float = 0.005
    loss_weight: float = 2.0**-13
    hidden: tuple[int, ...] = (64, 64)
    clip: float = 0.5  # the largest global gradient norm of the (unweighted) loss; larger ones are scaled down


DEFAULTS = Settings()
SCALER_DEFAULTS = ScalerSettings()
DEFAULT_STEPS = 600
DATA_CHOICES = ("builtin", "digits")


def show(value: float | None) -> str:
    """Write a number for the log: ``2**N`` for a power of two, 'none' for None, else briefly."""
    if value is None:
        return "none"
    return power_of_two(value) or f"{value:.4g}"


def check_settings(settings: Settings) -> str | None:
    """Return what is wrong with ``settings`` (flags, or values read back from a saved run), or None."""

    def integer(value: Any, minimum: int) -> bool:
        return type(value) is int and value >= minimum

    def positive(value: Any) -> bool:
        return type(value) in (int, float) and math.isfinite(value) and value > 0

    checks = {
        "data": settings.data in DATA_CHOICES,
        "seed": integer(settings.seed, 0),
        "batch_size": integer(settings.batch_size, 1),
        "lr": positive(settings.lr),
        "loss_weight": positive(settings.loss_weight),
        "clip": positive(settings.clip) and 2.0**-126 <= settings.clip * settings.loss_weight <= 3.0e38,
        "hidden": type(settings.hidden) is tuple
        and 0 < len(settings.hidden) <= 8
        and all(integer(width, 1) and width <= 4096 for width in settings.hidden),
    }
    bad = [f"{name}={getattr(settings, name)!r}" for name, ok in checks.items() if not ok]
    return None if not bad else ", ".join(bad)


_POWER = re.compile(r"^\s*2\s*\*\*\s*\(?\s*(-?\d+)\s*\)?\s*$")


def _number(text: str) -> float:
    match = _POWER.match(text)
    try:
        value = 2.0 ** int(match.group(1)) if match and abs(int(match.group(1))) <= 1000 else float(text)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"expected a number such as 0.5 or 2**16, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


_NO_CLAMP = "none"  # what --min-scale/--max-scale parse "none" to; None means the flag was not given


def _scale_or_none(text: str) -> float | str:
    return _NO_CLAMP if text.strip().lower() == _NO_CLAMP else _number(text)


def _integer(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


DESCRIPTION = """\
Train a small classifier in float16 with the loss scaler, as a hand-written
NumPy/CuPy training loop: fp16 weights and activations, fp32 master weights
updated by cupy-amp's fused AdamW, and the scaler around the backward pass: one
read-only check of the gradients (inf/nan and their global norm), then one
pass that unscales, clips (--clip) and updates, or skips the step. Runs on the
CPU (NumPy) or, when CuPy finds a usable GPU, on the GPU; needs no download.

The model is small, so its gradients are naturally far above float16's
smallest value (2**-24); large models' gradients are not, because their loss
is averaged over millions of tokens and their backward passes are long. To
show what the scaler is for, the loss is multiplied by --loss-weight (default
2**-13), which shifts every gradient down by 2**13 into that regime. AdamW does
not care (its epsilon and the clip threshold are scaled too), but float16
without loss scaling does: see --compare.
"""

EPILOG = """\
examples:
  cupy-amp demo                                   the default run, on the GPU if CuPy can use one
  cupy-amp demo --compare                         also train fp16 without scaling and fp32
  cupy-amp demo --out run1 --steps 300            stop at step 300, checkpoints in run1/
  cupy-amp demo --resume run1 --steps 600         continue it; ends exactly as one 600-step run
  cupy-amp demo --plot demo.png                   loss and scale over steps (needs matplotlib)
  cupy-amp demo --loss-weight 1 --compare         see that unscaled fp16 is fine when gradients are large

exit status: 0 done, 1 the run could not start or failed (no GPU for
--device gpu, bad --resume directory, matplotlib missing), 2 bad flags,
130 interrupted.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's flags to ``parser``."""
    positive_int, number = _integer(1), _number
    run = parser.add_argument_group("run")
    run.add_argument(
        "--device",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="auto: the GPU through CuPy when CuPy imports and a device works, else the CPU through NumPy "
        "(default: auto); gpu without a usable GPU is an error",
    )
    run.add_argument(
        "--data",
        choices=DATA_CHOICES,
        default=None,
        help="builtin: five interleaved spirals generated from --seed (default); digits: scikit-learn's "
        'bundled 8x8 digit images (needs scikit-learn: pip install "cupy-amp[demo]"; no download)',
    )
    run.add_argument(
        "--steps", type=positive_int, metavar="N", help=f"total optimizer steps (default: {DEFAULT_STEPS})"
    )
    run.add_argument(
        "--batch-size",
        type=positive_int,
        metavar="N",
        help=f"examples per step, drawn as a function of (seed, step) (default: {DEFAULTS.batch_size})",
    )
    run.add_argument("--seed", type=_integer(0), metavar="N", help="data, initialization and batches (default: 0)")
    run.add_argument("--lr", type=number, metavar="X", help=f"AdamW's learning rate (default: {DEFAULTS.lr})")
    run.add_argument(
        "--clip",
        type=number,
        metavar="X",
        help="clip the global gradient norm of the loss at X, inside the fused optimizer's update "
        f"(default: {DEFAULTS.clip})",
    )
    run.add_argument(
        "--loss-weight",
        type=number,
        metavar="X",
        help="multiply the batch-mean loss by this, making every gradient that much smaller "
        f"(default: {show(DEFAULTS.loss_weight)}; 1 for a plain mean loss)",
    )
    run.add_argument(
        "--sync-free",
        action="store_true",
        help="GPU only: train with a SyncFreeGradScaler and a step that never waits for the GPU (records are "
        "read back once per --log-every steps); prints steps per second",
    )
    run.add_argument(
        "--graph",
        action="store_true",
        help="GPU only: as --sync-free, with the whole step captured once in a CUDA graph and replayed",
    )
    run.add_argument(
        "--compare",
        action="store_true",
        help="also train the same model in fp16 without loss scaling and in fp32, and print a summary "
        "(three runs; not with --resume)",
    )

    scaler = parser.add_argument_group(
        "loss scaler (GradScaler's parameters; numbers may be written as 2**N)",
        "The defaults differ from the library's (init 2**16, ceiling 2**24): --loss-weight makes\n"
        "this run's gradients tiny, and its scale settles between 2**31 and 2**35. The start is\n"
        "deliberately too high, so that the first steps overflow and the scaler backs off.",
    )
    scaler_flags = {
        "--init-scale": (number, "starting scale", SCALER_DEFAULTS.init_scale),
        "--growth-interval": (positive_int, "clean steps in a row before the scale grows", 50),
        "--growth-factor": (number, "growth multiplier, > 1", SCALER_DEFAULTS.growth_factor),
        "--backoff-factor": (number, "backoff multiplier, in (0, 1)", SCALER_DEFAULTS.backoff_factor),
        "--min-scale": (_scale_or_none, "floor after a backoff, or 'none'", SCALER_DEFAULTS.min_scale),
        "--max-scale": (_scale_or_none, "ceiling after a growth, or 'none'", SCALER_DEFAULTS.max_scale),
        "--hysteresis": (positive_int, "overflowing steps before a backoff", 1),
    }
    for flag, (kind, text, default) in scaler_flags.items():
        shown = show(default) if isinstance(default, float) or default is None else default
        scaler.add_argument(
            flag, type=kind, metavar="N" if kind is positive_int else "X", help=f"{text} (default: {shown})"
        )

    output = parser.add_argument_group("output")
    output.add_argument(
        "--out",
        metavar="DIR",
        help="save the run here, each save a directory step-N holding scaler.ckpt (GradScalerCheckpoint), "
        "adamw.state (AdamW.save) and state.npz (fp32 weights, step, loss history), renamed into place whole, "
        "so an interrupted save leaves the last one intact (default: the --resume directory, else none)",
    )
    output.add_argument(
        "--save-every", type=positive_int, default=100, metavar="N", help="save every N steps and at the end (100)"
    )
    output.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the run saved in DIR up to --steps; the result is bit for bit that of an "
        "uninterrupted run on the same device",
    )
    output.add_argument(
        "--plot",
        metavar="FILE",
        help="save the loss and the loss scale over steps as an image, in the format its extension names "
        '(png, pdf, svg...; needs matplotlib: pip install "cupy-amp[demo]")',
    )
    output.add_argument(
        "--report",
        action="store_true",
        help="print the numerics report of check(report=True) at the end: per gradient, its largest magnitude and "
        "its fractions of zeros and subnormals, first and last step (with --plot, a panel of the zero fractions)",
    )
    output.add_argument(
        "--log-every",
        type=positive_int,
        default=50,
        metavar="N",
        help="when output is not a terminal, print a progress line every N steps (default: 50); "
        "on a terminal a progress bar is drawn instead",
    )


_SETTINGS_FLAGS = {
    "data": "data",
    "seed": "seed",
    "batch_size": "batch-size",
    "lr": "lr",
    "loss_weight": "loss-weight",
    "clip": "clip",
}
_SCALER_FLAGS = {field.name: field.name.replace("_", "-") for field in fields(ScalerSettings)}


def settings_from_args(
    args: argparse.Namespace, saved: Settings | None = None, saved_scaler: ScalerSettings | None = None
) -> tuple[Settings, ScalerSettings]:
    """Merge the flags with the defaults, or with a resumed run's values.

    Raises:
        DemoUsageError: A flag given explicitly disagrees with the resumed run.
    """
    conflicts: list[str] = []

    def given(flags: dict[str, str], base: Any) -> dict[str, Any]:
        changes = {}
        for name, flag in flags.items():
            value = getattr(args, name, None)
            if value is None:
                continue
            value = None if value == _NO_CLAMP else value
            if saved is not None and value != getattr(base, name):
                conflicts.append(f"--{flag} {show(value)} (the run has {show(getattr(base, name))})")
            changes[name] = value
        return changes

    base, base_scaler = saved or DEFAULTS, saved_scaler or SCALER_DEFAULTS
    settings = replace(base, **given(_SETTINGS_FLAGS, base))
    scaler = replace(base_scaler, **given(_SCALER_FLAGS, base_scaler))
    if conflicts:
        raise DemoUsageError(
            "--resume continues a run with its own settings; these flags disagree with it: "
            + "; ".join(conflicts)
            + ". Leave them out, or start a new run with --out."
        )
    return settings, scaler
