"""Everything the demo shows the user goes through one Reporter writing to one stream."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TextIO

from cupy_amp.demo.train import MODES, StepOutcome, Underflow

__all__ = ["Reporter", "RunSummary", "format_scale", "summary_table"]

_BAR_WIDTH = 24
_REDRAW_SECONDS = 0.1


def format_scale(scale: float) -> str:
    """Write a loss scale as ``2**N`` when it is a power of two (as scales usually are), else with 4 digits."""
    if scale > 0 and math.isfinite(scale):
        mantissa, exponent = math.frexp(scale)
        if mantissa == 0.5:
            return f"2**{exponent - 1}" if exponent != 1 else "1"
    return f"{scale:.4g}"


@dataclass(frozen=True)
class RunSummary:
    """The end of one run, for the comparison table."""

    mode: str
    eval_accuracy: float
    eval_loss: float
    skipped: int | None
    underflow: Underflow | None


class Reporter:
    """Write progress, events and summaries to ``stream``.

    On a terminal, progress is one bar redrawn in place (at most ten times a
    second) and other lines are printed above it; elsewhere (a file, a pipe, a
    test) progress is a plain line every ``log_every`` steps.
    """

    def __init__(self, stream: TextIO, *, log_every: int = 50, terminal: bool | None = None) -> None:
        self.stream = stream
        self.log_every = log_every
        self.terminal = _is_terminal(stream) if terminal is None else terminal
        self._bar_shown = False
        self._last_draw = 0.0

    def line(self, text: str = "") -> None:
        """Print one line (above the progress bar, if one is drawn)."""
        self._clear_bar()
        self.stream.write(text + "\n")
        self.stream.flush()

    def event(self, outcome: StepOutcome, growth_interval: int) -> None:
        """Log an overflow, backoff or growth, if the step had one."""
        parts = []
        if outcome.nonfinite:
            parts.append(f"overflow: inf/nan in {', '.join(outcome.nonfinite)} -> step skipped")
        if outcome.backoff is not None:
            parts.append(f"backoff: scale {format_scale(outcome.backoff[0])} -> {format_scale(outcome.backoff[1])}")
        if outcome.growth is not None:
            before, after = outcome.growth
            parts.append(
                f"growth: scale {format_scale(before)} -> {format_scale(after)} after {growth_interval} clean steps"
            )
        if parts:
            self.line(f"step {outcome.step:>5}  " + "; ".join(parts))

    def progress(self, outcome: StepOutcome, total: int, label: str = "", every: int | None = None) -> None:
        """Show where the run is: a redrawn bar on a terminal, else a line every ``every`` steps.

        ``every`` defaults to ``log_every``; 0 prints only the last step.
        """
        status = (
            f"step {outcome.step:>{len(str(total))}}/{total}  loss {outcome.loss:.4f}  "
            f"acc {100 * outcome.accuracy:5.1f}%  scale {format_scale(outcome.scale)}  skipped {outcome.skipped_total}"
        )
        prefix = f"[{label}] " if label else ""
        if not self.terminal:
            every = self.log_every if every is None else every
            if outcome.step == total or (every > 0 and outcome.step % every == 0):
                self.line(prefix + status)
            return
        now = time.monotonic()
        if outcome.step != total and now - self._last_draw < _REDRAW_SECONDS:
            return
        self._last_draw = now
        filled = _BAR_WIDTH * outcome.step // total
        bar = "#" * filled + "." * (_BAR_WIDTH - filled)
        self.stream.write(f"\r\x1b[2K{prefix}[{bar}] {status}")
        self.stream.flush()
        self._bar_shown = True

    def end_progress(self) -> None:
        """Leave the last drawn bar on screen as a finished line."""
        if self._bar_shown:
            self.stream.write("\n")
            self.stream.flush()
            self._bar_shown = False

    def _clear_bar(self) -> None:
        if self._bar_shown:
            self.stream.write("\r\x1b[2K")
            self._bar_shown = False


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or file-like objects without isatty
        return False


def summary_table(rows: list[RunSummary], classes: int) -> list[str]:
    """Return the lines of the side-by-side comparison and what it shows, computed from the numbers."""
    header = f"{'':<24}{'accuracy':>9}{'loss':>9}{'skipped':>9}{'grads zeroed in fp16':>22}"
    lines = [header]
    for row in rows:
        skipped = "-" if row.skipped is None else str(row.skipped)
        zeroed = "-" if row.underflow is None else _percent(row.underflow.fraction())
        lines.append(
            f"{MODES[row.mode]:<24}{100 * row.eval_accuracy:>8.1f}%{row.eval_loss:>9.3f}{skipped:>9}{zeroed:>22}"
        )
    lines.append(
        f"(held-out accuracy and loss; chance is {100 / classes:.1f}%. 'grads zeroed': gradient elements, "
        "activation and weight gradients, that were exactly 0 in the fp16 backward pass while an fp32 "
        "backward pass from the same weights and activations had them nonzero.)"
    )
    lines.extend(_verdict({row.mode: row for row in rows}, classes))
    return lines


def _verdict(rows: dict[str, RunSummary], classes: int) -> list[str]:
    amp, fp16, fp32 = rows["amp"], rows["fp16"], rows["fp32"]
    if amp.underflow is None or fp16.underflow is None:
        return []
    activation_names = ["logits", *[name for name in fp16.underflow.nonzero if name.startswith("h")]]
    gap = 100 * (amp.eval_accuracy - fp16.eval_accuracy)
    lines = [
        f"Without loss scaling, {_percent(fp16.underflow.fraction())} of the gradient elements underflowed to 0 "
        f"({_percent(fp16.underflow.fraction(activation_names))} of the activation gradients); with it, "
        f"{_percent(amp.underflow.fraction())}."
    ]
    if gap >= 5:
        lines.append(
            f"Here that cost {gap:.1f} points of accuracy: fp16 without scaling reached "
            f"{100 * fp16.eval_accuracy:.1f}% (chance {100 / classes:.1f}%), fp16 with the scaler "
            f"{100 * amp.eval_accuracy:.1f}% and fp32 {100 * fp32.eval_accuracy:.1f}%."
        )
    elif fp16.eval_loss > 1.1 * amp.eval_loss:
        lines.append(
            f"fp16 without scaling still learned this task ({100 * fp16.eval_accuracy:.1f}% vs "
            f"{100 * amp.eval_accuracy:.1f}%), but to a higher loss ({fp16.eval_loss:.3f} vs {amp.eval_loss:.3f})."
        )
    else:
        lines.append(
            "On this run, the underflow did not hurt: fp16 without scaling learned as well "
            f"({100 * fp16.eval_accuracy:.1f}% vs {100 * amp.eval_accuracy:.1f}%). Its gradients are large enough; "
            "lower --loss-weight to move them toward float16's smallest value, 2**-24."
        )
    return lines


def _percent(fraction: float) -> str:
    """Format a fraction as a percentage that never rounds a nonzero count to "0.0%"."""
    percent = 100 * fraction
    if percent == 0:
        return "0%"
    if percent < 0.05:
        return f"{percent:.1g}%"
    return f"{percent:.1f}%"
