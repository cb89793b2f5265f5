"""The demo's command-line flags and the validated settings built from them.

Flags that define a training run (seed, data, batch size, learning rate, loss
weight, scaler parameters) default to None at parse time, so that ``--resume``
can tell a flag the user gave from one left out: left out, it takes the resumed
run's value (or the default below for a new run); given, it must agree with it.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from cupy_amp.errors import CupyAmpError

__all__ = [
    "DEFAULTS",
    "DemoError",
    "DemoUsageError",
    "ScalerSettings",
    "Settings",
    "add_arguments",
    "format_power",
    "settings_from_args",
]


class DemoError(CupyAmpError, RuntimeError):
    """The demo cannot run as asked (no GPU, unreadable resume directory, missing extra)."""


class DemoUsageError(DemoError):
    """The flags contradict each other or a resumed run (exit status 2)."""


@dataclass(frozen=True)
class ScalerSettings:
    """The GradScaler parameters the demo passes through, as floats and ints."""

    init_scale: float = 2.0**36
    growth_interval: int = 50
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float | None = 1.0
    max_scale: float | None = None
    hysteresis: int = 1


@dataclass(frozen=True)
class Settings:
    """Everything that decides a training run's numbers (saved with every checkpoint)."""

    data: str = "builtin"
    seed: int = 0
    batch_size: int = 512
    lr: float = 0.005
    loss_weight: float = 2.0**-13
    hidden: tuple[int, ...] = (64, 64)


DEFAULTS = Settings()
SCALER_DEFAULTS = ScalerSettings()
DEFAULT_STEPS = 600
DEFAULT_SAVE_EVERY = 100
DEFAULT_LOG_EVERY = 50


def format_power(value: float | None) -> str:
    """Write ``value`` as ``2**N`` when it is a power of two, else with repr; None as 'none'."""
    if value is None:
        return "none"
    if value > 0 and math.isfinite(value):
        mantissa, exponent = math.frexp(value)
        if mantissa == 0.5:
            return f"2**{exponent - 1}" if exponent != 1 else "1"
    return repr(value)


_POWER = re.compile(r"^\s*2\s*\*\*\s*\(?\s*(-?\d+)\s*\)?\s*$")


def _number(text: str) -> float:
    match = _POWER.match(text)
    if match:
        exponent = int(match.group(1))
        if abs(exponent) > 1000:
            raise argparse.ArgumentTypeError(f"expected a number such as 0.5 or 2**16, got {text!r}")
        return 2.0**exponent
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number such as 0.5 or 2**16, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _positive_number(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


_NO_CLAMP = "none"  # what --min-scale/--max-scale parse "none" to; None means the flag was not given


def _optional_scale(text: str) -> float | str:
    return _NO_CLAMP if text.strip().lower() == _NO_CLAMP else _positive_number(text)


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """Return an argparse type accepting integers >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value: int | None = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1)
_seed = _int_at_least(0)


DESCRIPTION = """\
Train a small classifier in float16 with the loss scaler, as a hand-written
NumPy/CuPy training loop: fp16 weights and activations, fp32 master weights
updated by Adam, and the scaler around the backward pass. Runs on the CPU
(NumPy) or, when CuPy finds a usable GPU, on the GPU; needs no download.

The model is small, so its gradients are naturally far above float16's
smallest value (2**-24); large models' gradients are not, because their loss
is averaged over millions of tokens and their backward passes are long. To
show what the scaler is for, the loss is multiplied by --loss-weight (default
2**-13), which shifts every gradient down by 2**13 into that regime. Adam does
not care (its epsilon is scaled too, so fp32 training is unchanged), but
float16 without loss scaling does: see --compare.
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
        choices=("builtin", "digits"),
        default=None,
        help="builtin: five interleaved spirals generated from --seed (default); digits: scikit-learn's "
        "bundled 8x8 digit images (needs scikit-learn, no download)",
    )
    run.add_argument(
        "--steps",
        type=_positive_int,
        default=None,
        metavar="N",
        help=f"total optimizer steps (default: {DEFAULT_STEPS})",
    )
    run.add_argument(
        "--batch-size",
        type=_positive_int,
        default=None,
        metavar="N",
        help=f"examples per step, drawn as a function of (seed, step) (default: {DEFAULTS.batch_size})",
    )
    run.add_argument(
        "--seed",
        type=_seed,
        default=None,
        metavar="N",
        help=f"data, initialization and batches (default: {DEFAULTS.seed})",
    )
    run.add_argument(
        "--lr", type=_positive_number, default=None, metavar="X", help=f"Adam's learning rate (default: {DEFAULTS.lr})"
    )
    run.add_argument(
        "--loss-weight",
        type=_positive_number,
        default=None,
        metavar="X",
        help="multiply the batch-mean loss by this, making every gradient that much smaller "
        f"(default: {format_power(DEFAULTS.loss_weight)}; 1 for a plain mean loss)",
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
    scaler.add_argument(
        "--init-scale",
        type=_positive_number,
        default=None,
        metavar="X",
        help=f"starting scale (default: {format_power(SCALER_DEFAULTS.init_scale)})",
    )
    scaler.add_argument(
        "--growth-interval",
        type=_positive_int,
        default=None,
        metavar="N",
        help=f"clean steps in a row before the scale grows (default: {SCALER_DEFAULTS.growth_interval})",
    )
    scaler.add_argument(
        "--growth-factor",
        type=_positive_number,
        default=None,
        metavar="X",
        help=f"growth multiplier, > 1 (default: {SCALER_DEFAULTS.growth_factor})",
    )
    scaler.add_argument(
        "--backoff-factor",
        type=_positive_number,
        default=None,
        metavar="X",
        help=f"backoff multiplier, in (0, 1) (default: {SCALER_DEFAULTS.backoff_factor})",
    )
    scaler.add_argument(
        "--min-scale",
        type=_optional_scale,
        default=None,
        metavar="X",
        help=f"floor after a backoff, or 'none' (default: {format_power(SCALER_DEFAULTS.min_scale)})",
    )
    scaler.add_argument(
        "--max-scale",
        type=_optional_scale,
        default=None,
        metavar="X",
        help=f"ceiling after a growth, or 'none' (default: {format_power(SCALER_DEFAULTS.max_scale)})",
    )
    scaler.add_argument(
        "--hysteresis",
        type=_positive_int,
        default=None,
        metavar="N",
        help=f"overflowing steps before a backoff (default: {SCALER_DEFAULTS.hysteresis})",
    )

    output = parser.add_argument_group("output")
    output.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help="save checkpoints here: scaler.ckpt (GradScalerCheckpoint) and state.npz (fp32 master weights, "
        "Adam state, step, loss history), written atomically (default: the --resume directory, else none)",
    )
    output.add_argument(
        "--save-every",
        type=_positive_int,
        default=DEFAULT_SAVE_EVERY,
        metavar="N",
        help=f"save every N steps and at the end (default: {DEFAULT_SAVE_EVERY})",
    )
    output.add_argument(
        "--resume",
        metavar="DIR",
        default=None,
        help="continue the run saved in DIR up to --steps; the result is bit for bit that of an "
        "uninterrupted run on the same device",
    )
    output.add_argument(
        "--plot",
        metavar="FILE",
        default=None,
        help='save a PNG of the loss and the loss scale over steps (needs matplotlib: pip install "cupy-amp[demo]")',
    )
    output.add_argument(
        "--log-every",
        type=_positive_int,
        default=DEFAULT_LOG_EVERY,
        metavar="N",
        help="when output is not a terminal, print a progress line every N steps "
        f"(default: {DEFAULT_LOG_EVERY}); on a terminal a progress bar is drawn instead",
    )


_SETTINGS_FLAGS = {"data": "data", "seed": "seed", "batch_size": "batch-size", "lr": "lr", "loss_weight": "loss-weight"}
_SCALER_FLAGS = {field.name: field.name.replace("_", "-") for field in fields(ScalerSettings)}


def settings_from_args(
    args: argparse.Namespace, saved: Settings | None = None, saved_scaler: ScalerSettings | None = None
) -> tuple[Settings, ScalerSettings]:
    """Merge the flags with the defaults, or with a resumed run's values.

    Raises:
        DemoUsageError: A flag given explicitly disagrees with the resumed run.
    """
    base = saved if saved is not None else DEFAULTS
    base_scaler = saved_scaler if saved_scaler is not None else SCALER_DEFAULTS
    conflicts: list[str] = []
    settings = replace(base, **_given(args, _SETTINGS_FLAGS, base, saved is not None, conflicts))
    scaler = replace(base_scaler, **_given(args, _SCALER_FLAGS, base_scaler, saved_scaler is not None, conflicts))
    if conflicts:
        raise DemoUsageError(
            "--resume continues a run with its own settings; these flags disagree with it: "
            + "; ".join(conflicts)
            + ". Leave them out, or start a new run with --out."
        )
    return settings, scaler


def _given(
    args: argparse.Namespace, flags: dict[str, str], base: Any, resumed: bool, conflicts: list[str]
) -> dict[str, Any]:
    """Return the flags given explicitly; on resume, append those that disagree with the run to ``conflicts``."""
    changes: dict[str, Any] = {}
    for name, flag in flags.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        if value == _NO_CLAMP:
            value = None
        if resumed and value != getattr(base, name):
            conflicts.append(f"--{flag} {format_power(value)} (the run has {format_power(getattr(base, name))})")
        changes[name] = value
    return changes
