"""``cupy-amp demo``: from flags to the final summary; the log, the comparison and the plot.

A run's saves are :mod:`cupy_amp.demo.run_files`' (each save a directory, complete or absent).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import numpy as np

from cupy_amp.demo.model import Dataset, load_dataset
from cupy_amp.demo.run_files import (
    OPTIMIZER_FILE,
    SCALER_FILE,
    STATE_FILE,
    latest_save,
    load_run,
    save_name,
    save_run,
)
from cupy_amp.demo.settings import (
    DEFAULT_STEPS,
    DemoError,
    DemoUsageError,
    ScalerSettings,
    Settings,
    check_settings,
    settings_from_args,
    show,
)
from cupy_amp.demo.training import (
    MODES,
    Device,
    History,
    RunState,
    StepOutcome,
    Trainer,
    Underflow,
    make_scaler,
    new_state,
    run_steps,
    select_device,
    small_matrix_threads,
)
from cupy_amp.errors import ConfigError
from cupy_amp.scaler import GradScaler
from cupy_amp.statistics import GradientNumerics
from cupy_amp.sync_free import SyncFreeGradScaler

if TYPE_CHECKING:
    from cupy_amp.demo.device_step import DeviceTrainer

__all__ = ["Reporter", "RunSummary", "run"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Run the demo for parsed ``args``, writing the report to ``out`` and errors to ``err``; return the exit status."""
    reporter = Reporter(out, log_every=args.log_every)
    progress: dict[str, int] = {}
    try:
        plan = _plan(args)
        with small_matrix_threads(plan.device):
            _train(args, plan, reporter, progress)
    except DemoUsageError as exc:
        reporter.end_progress()
        err.write(f"cupy-amp demo: error: {exc}\n")
        return EXIT_USAGE
    except (DemoError, OSError) as exc:
        reporter.end_progress()
        err.write(f"cupy-amp demo: {exc}\n")
        return EXIT_FAILED
    except KeyboardInterrupt:
        reporter.end_progress()
        err.write(_interrupted(args, progress))
        return EXIT_INTERRUPTED
    return EXIT_OK


@dataclass
class _Plan:
    """The validated run: what to train, where, and what to do with it."""

    settings: Settings
    scaler_settings: ScalerSettings
    steps: int
    device: Device
    gpu_note: str | None
    dataset: Dataset
    scaler: GradScaler
    state: RunState
    out: Path | None
    resumed_from: Path | None
    plot_format: str | None


def _plan(args: argparse.Namespace) -> _Plan:
    """Check everything that can be checked before training: flags, saved files, the plot's path, the device."""
    if args.compare and args.resume:
        raise DemoUsageError("--compare trains all three runs from step 0; it cannot be combined with --resume")
    if args.report and (args.sync_free or args.graph):
        raise DemoUsageError(
            "--report reads each step's numerics report, which the synchronous step does; a --sync-free or --graph "
            "step never waits for the device (run without them)"
        )
    plot_format = _plot_format(args.plot) if args.plot else None
    saved = load_run(Path(args.resume)) if args.resume else None
    settings, scaler_settings = settings_from_args(
        args, saved.settings if saved else None, saved.scaler_settings if saved else None
    )
    problem = check_settings(settings)  # flags that are each valid can still be out of range together
    if problem is not None:
        raise DemoUsageError(f"these settings cannot train: {problem} (--clip times --loss-weight must fit float32)")
    steps = args.steps if args.steps is not None else DEFAULT_STEPS
    if saved is not None and steps <= saved.state.step:
        raise DemoUsageError(
            f"{args.resume} is already at step {saved.state.step}; pass --steps N with N > {saved.state.step} "
            "to continue it"
        )
    out = Path(args.out) if args.out else (Path(args.resume) if args.resume else None)
    in_place = saved is not None and out is not None and out.resolve() == Path(args.resume).resolve()
    if out is not None and not in_place and latest_save(out) is not None:
        raise DemoUsageError(
            f"{out} already holds a demo run; continue it with --resume {out}, or choose another --out directory"
        )
    try:
        scaler = GradScaler(**asdict(scaler_settings))
    except ConfigError as exc:
        if saved is not None:  # flags were checked by the parser: this is a saved run's setting
            raise DemoError(f"cannot resume from {saved.folder}: {STATE_FILE} holds invalid settings: {exc}") from None
        raise DemoUsageError(f"scaler parameters: {exc}") from None
    device, gpu_note = select_device(args.device)
    if (args.sync_free or args.graph) and device.kind != "gpu":
        flag = "--graph" if args.graph else "--sync-free"
        raise DemoUsageError(f"{flag} trains on a GPU, and none is used here ({gpu_note or '--device cpu'})")
    dataset = load_dataset(settings.data, settings.seed)
    if settings.batch_size > len(dataset.y_train):
        raise DemoUsageError(
            f"--batch-size {settings.batch_size} is larger than the {len(dataset.y_train)} training examples"
        )
    fresh = new_state(device, settings, dataset)
    state = fresh
    if saved is not None:
        scaler.load_checkpoint(saved.scaler)
        state = saved.to_device(device)
        for name, master in fresh.masters.items():
            if state.masters[name].shape != master.shape:
                raise DemoError(f"cannot resume from {args.resume}: {name} has shape {state.masters[name].shape}")
    resumed = Path(args.resume) if args.resume else None
    return _Plan(settings, scaler_settings, steps, device, gpu_note, dataset, scaler, state, out, resumed, plot_format)


def _train(args: argparse.Namespace, plan: _Plan, reporter: Reporter, progress: dict[str, int]) -> None:
    settings = plan.settings
    _print_header(plan, reporter)
    scaler: GradScaler | SyncFreeGradScaler = plan.scaler
    trainer: Trainer | DeviceTrainer
    if args.sync_free or args.graph:
        from cupy_amp.demo.device_step import DeviceTrainer  # imports CuPy

        scaler = SyncFreeGradScaler(**asdict(plan.scaler_settings))
        scaler.load_checkpoint(plan.scaler.checkpoint())  # the resumed state, if any
        trainer = DeviceTrainer(settings, plan.dataset, plan.state, scaler, graph=args.graph, chunk=args.log_every)
        reporter.line(f"mode     {'CUDA graph replays' if args.graph else 'sync-free eager steps'}")
    else:
        trainer = Trainer(
            "amp", settings, plan.dataset, plan.device, plan.state, plan.scaler, measure_underflow=args.compare,
            report=args.report,
        )  # fmt: skip
    progress["step"] = plan.state.step
    if plan.resumed_from is not None:
        progress["saved"] = plan.state.step

    def save_at(step: int) -> None:
        if plan.out is not None and (step % args.save_every == 0 or step == plan.steps):
            save_run(plan.out, settings, plan.scaler_settings, scaler, plan.state, plan.device)
            progress["saved"] = step

    def on_step(outcome: StepOutcome) -> None:
        progress["step"] = outcome.step
        reporter.event(outcome, plan.scaler_settings.growth_interval)
        reporter.progress(outcome, plan.steps)
        if isinstance(trainer, Trainer):
            save_at(outcome.step)

    started, first = time.perf_counter(), plan.state.step
    if isinstance(trainer, Trainer):
        run_steps(trainer, plan.steps, on_step)
    else:  # chunks end where the run is saved, if it is
        trainer.run(plan.steps, on_step, save_at, args.save_every if plan.out is not None else plan.steps)
    finished = time.perf_counter()
    seconds = finished - started
    reporter.end_progress()
    eval_loss, eval_accuracy = trainer.evaluate()
    stats = scaler.stats()
    total = plan.state.step
    first_chunk = None if isinstance(trainer, Trainer) else trainer.first_chunk_done
    reporter.line(f"done     {_speed(plan.steps - first, seconds, (plan.steps, finished), first_chunk)}")
    reporter.line(f"skipped  {stats.skipped_steps} of {total} steps ({100 * stats.skipped_steps / total:.1f}%)")
    reporter.line(
        f"eval     accuracy {100 * eval_accuracy:.1f}% (chance {100 / plan.dataset.classes:.1f}%), "
        f"loss {eval_loss:.4f} on {len(plan.dataset.y_eval)} held-out examples"
    )
    reporter.line(
        f"scaler   final scale {show(stats.scale)}; {stats.backoffs} backoffs, {stats.growths} growths, "
        f"{stats.consecutive_good_steps} clean steps since the last change"
    )
    reports = trainer.reports if isinstance(trainer, Trainer) else None
    if reports:
        _print_report(reports, reporter)
    others: dict[str, History] = {}
    if args.compare:
        others = _compare(
            plan, reporter, RunSummary("amp", eval_accuracy, eval_loss, stats.skipped_steps, trainer.underflow)
        )
    if args.plot:
        title = f"cupy-amp demo: {plan.dataset.description.split(' (')[0]}, seed {settings.seed}"
        _save_plot(args.plot, plan.plot_format or "png", plan.state.history, others, title, reports)
        reporter.line(f"plot     {args.plot}")
    if plan.out is not None:
        reporter.line(
            f"saved    {plan.out / save_name(plan.state.step)}: {SCALER_FILE}, {OPTIMIZER_FILE}, {STATE_FILE}; "
            f"continue with: cupy-amp demo --resume {plan.out} --steps N (N > {plan.state.step})"
        )


def _speed(steps: int, seconds: float, end: tuple[int, float], first_chunk: tuple[int, float] | None) -> str:
    """Say how fast the run went and what the time includes.

    ``end`` and ``first_chunk`` are (step, time) at the end of the run and, in a device run, when its first
    chunk was read back: the rate between them leaves out the kernel compilation and the graph's capture.
    """
    text = f"{steps} steps in {seconds:.1f} s: {steps / seconds:,.0f} steps/s for the whole loop"
    if first_chunk is None:
        return text + " (each step's batch, forward, backward, scaler, optimizer and log)"
    text += " (the first chunk's kernel compilation and graph capture, and every read-back, included)"
    (last, ended), (reached, at) = end, first_chunk
    if last > reached and ended > at:
        text += f"; {(last - reached) / (ended - at):,.0f} steps/s after the first chunk"
    return text


def _print_header(plan: _Plan, reporter: Reporter) -> None:
    settings, scaler = plan.settings, plan.scaler_settings
    device = plan.device.description + (f"; not the GPU: {plan.gpu_note}" if plan.gpu_note else "")
    sizes = "-".join(str(n) for n in (plan.dataset.features, *settings.hidden, plan.dataset.classes))
    reporter.line("cupy-amp demo: float16 training with dynamic loss scaling")
    reporter.line(f"device   {device}")
    reporter.line(f"data     {plan.dataset.description}, seed {settings.seed}")
    reporter.line(
        f"model    MLP {sizes}: fp16 weights and activations, fp32 master weights, fused AdamW (lr {settings.lr}), "
        f"batch {settings.batch_size}"
    )
    reporter.line(f"loss     batch-mean cross-entropy x {show(settings.loss_weight)} (--loss-weight)")
    reporter.line(
        f"clip     the gradient norm at {show(settings.clip * settings.loss_weight)} (check's max_norm: --clip "
        f"{show(settings.clip)} for the mean loss, times the loss weight)"
    )
    reporter.line(
        f"scaler   init {show(scaler.init_scale)}, x{scaler.growth_factor} after {scaler.growth_interval} "
        f"clean steps, x{scaler.backoff_factor} on overflow, min {show(scaler.min_scale)}, "
        f"max {show(scaler.max_scale)}, hysteresis {scaler.hysteresis}"
    )
    if plan.resumed_from is not None:
        reporter.line(
            f"resumed  from {plan.resumed_from} at step {plan.state.step} "
            f"(scale {show(plan.scaler.scale_factor())}); training to step {plan.steps}"
        )


def _interrupted(args: argparse.Namespace, progress: dict[str, int]) -> str:
    text = f"cupy-amp demo: interrupted at step {progress.get('step', 0)}"
    directory = args.out or args.resume
    if directory and "saved" in progress:
        text += (
            f"; the last checkpoint in {directory} is at step {progress['saved']}; continue with: "
            f"cupy-amp demo --resume {directory}" + (f" --steps {args.steps}" if args.steps else "")
        )
    return text + "\n"


# The log


class Reporter:
    """Write progress, events and summaries to ``stream``.

    On a terminal, progress is one bar redrawn in place (at most ten times a
    second) and other lines are printed above it; elsewhere (a file, a pipe, a
    test) progress is a plain line every ``log_every`` steps.
    """

    def __init__(self, stream: TextIO, *, log_every: int = 50, terminal: bool | None = None) -> None:
        self.stream = stream
        self.log_every = log_every
        if terminal is None:
            try:
                terminal = stream.isatty()
            except (AttributeError, ValueError):  # closed or file-like objects without isatty
                terminal = False
        self.terminal = terminal
        self._bar_shown = False
        self._last_draw = 0.0

    def line(self, text: str = "") -> None:
        """Print one line (above the progress bar, if one is drawn)."""
        if self._bar_shown:
            self.stream.write("\r\x1b[2K")
            self._bar_shown = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def event(self, outcome: StepOutcome, growth_interval: int) -> None:
        """Log an overflow, backoff or growth, if the step had one."""
        parts = []
        if outcome.nonfinite:
            parts.append(f"overflow: inf/nan in {', '.join(outcome.nonfinite)} -> step skipped")
        elif outcome.skipped:  # a sync-free run does not read which gradients overflowed
            parts.append("overflow -> step skipped")
        if outcome.backoff is not None:
            parts.append(f"backoff: scale {show(outcome.backoff[0])} -> {show(outcome.backoff[1])}")
        if outcome.growth is not None:
            before, after = outcome.growth
            parts.append(f"growth: scale {show(before)} -> {show(after)} after {growth_interval} clean steps")
        if parts:
            self.line(f"step {outcome.step:>5}  " + "; ".join(parts))
        if outcome.numerics:
            self.line(f"{'':11}  numerics: {_numerics_line(outcome.numerics)}")

    def progress(self, outcome: StepOutcome, total: int, label: str = "", every: int | None = None) -> None:
        """Show where the run is: a redrawn bar on a terminal, else a line every ``every`` steps (0: the last only)."""
        status = (
            f"step {outcome.step:>{len(str(total))}}/{total}  loss {outcome.loss:.4f}  "
            f"acc {100 * outcome.accuracy:5.1f}%  scale {show(outcome.scale)}  skipped {outcome.skipped_total}"
        )
        prefix = f"[{label}] " if label else ""
        if not self.terminal:
            every = self.log_every if every is None else every
            if outcome.step == total or (every > 0 and outcome.step % every == 0):
                self.line(prefix + status)
            return
        now = time.monotonic()
        if outcome.step != total and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        filled = 24 * outcome.step // total
        self.stream.write(f"\r\x1b[2K{prefix}[{'#' * filled}{'.' * (24 - filled)}] {status}")
        self.stream.flush()
        self._bar_shown = True

    def end_progress(self) -> None:
        """Leave the last drawn bar on screen as a finished line."""
        if self._bar_shown:
            self.stream.write("\n")
            self.stream.flush()
            self._bar_shown = False


# --compare


@dataclass(frozen=True)
class RunSummary:
    """The end of one run, for the comparison table."""

    mode: str
    eval_accuracy: float
    eval_loss: float
    skipped: int | None
    underflow: Underflow | None


def _compare(plan: _Plan, reporter: Reporter, main: RunSummary) -> dict[str, History]:
    rows, histories = [main], {}
    for mode in ("fp16", "fp32"):
        state = new_state(plan.device, plan.settings, plan.dataset)
        scaler = make_scaler(mode, plan.scaler_settings)
        trainer = Trainer(mode, plan.settings, plan.dataset, plan.device, state, scaler, measure_underflow=True)
        label = {"fp16": "fp16, no scaling", "fp32": "fp32"}[mode]

        def show_progress(outcome: StepOutcome, label: str = label) -> None:
            reporter.progress(outcome, plan.steps, label, every=0)

        reporter.line(f"compare  training {MODES[mode]} ...")
        run_steps(trainer, plan.steps, show_progress)
        reporter.end_progress()
        loss, accuracy = trainer.evaluate()
        skips = sum(state.history.skipped)  # a disabled scaler's check() skips too (inf/nan), counting nothing
        rows.append(RunSummary(mode, accuracy, loss, skips, trainer.underflow))
        histories[mode] = state.history
    reporter.line()
    reporter.line(f"compare  the same model, data and seed, {plan.steps} steps each:")
    reporter.line(f"{'':<24}{'accuracy':>9}{'loss':>9}{'skipped':>9}{'grads zeroed in fp16':>22}")
    for row in rows:
        skipped = "-" if row.skipped is None else str(row.skipped)
        zeroed = "-" if row.underflow is None else _percent(row.underflow.fraction())
        reporter.line(
            f"{MODES[row.mode]:<24}{100 * row.eval_accuracy:>8.1f}%{row.eval_loss:>9.3f}{skipped:>9}{zeroed:>22}"
        )
    reporter.line(
        f"(held-out accuracy and loss; chance is {100 / plan.dataset.classes:.1f}%. 'grads zeroed': gradient "
        "elements, activation and weight gradients, that were exactly 0 in the fp16 backward pass while an fp32 "
        "backward pass from the same weights and activations had them nonzero.)"
    )
    for text in _verdict({row.mode: row for row in rows}, plan.dataset.classes):
        reporter.line(text)
    reporter.line()
    return histories


def _verdict(rows: dict[str, RunSummary], classes: int) -> list[str]:
    amp, fp16, fp32 = rows["amp"], rows["fp16"], rows["fp32"]
    if amp.underflow is None or fp16.underflow is None:
        return []
    activations = ["logits", *[name for name in fp16.underflow.nonzero if name.startswith("h")]]
    gap = 100 * (amp.eval_accuracy - fp16.eval_accuracy)
    lines = [
        f"Without loss scaling, {_percent(fp16.underflow.fraction())} of the gradient elements underflowed to 0 "
        f"({_percent(fp16.underflow.fraction(activations))} of the activation gradients); with it, "
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
    return "0%" if percent == 0 else f"{percent:.1g}%" if percent < 0.05 else f"{percent:.1f}%"


# The numerics report (check(report=True)): what a backoff looked like, and the run's table


def _numerics_line(rows: tuple[GradientNumerics, ...]) -> str:
    """The finite gradient nearest float16's maximum, and the one with the most zeros (underflow)."""
    clean = [row for row in rows if not row.nonfinite]
    largest = max(clean or rows, key=lambda row: row.amax)
    zeros = max(rows, key=lambda row: row.zero_fraction)
    among = " of the gradients without inf/nan" if len(clean) < len(rows) else ""
    return (
        f"largest finite |g| {largest.amax:.3g} in {largest.label}{among} (float16's largest is 65504); most "
        f"zeros in {zeros.label}: {_percent(zeros.zero_fraction)}"
    )


def _print_report(reports: list[tuple[int, float, tuple[GradientNumerics, ...]]], reporter: Reporter) -> None:
    """Per gradient: its largest magnitude over the run and its zero and subnormal fractions, first and last step."""
    (first, first_scale, first_rows), (last, last_scale, last_rows) = reports[0], reports[-1]
    largest: dict[object, float] = {}
    for _, _, rows in reports:
        for row in rows:
            if not row.nonfinite:
                largest[row.label] = max(largest.get(row.label, 0.0), row.amax)
    reporter.line(
        f"report   per gradient (scaled, as check() read them): largest finite |g| over the run; zeros and "
        f"subnormals at step {first} (scale {show(first_scale)}) -> step {last} (scale {show(last_scale)})"
    )
    for before, after in zip(first_rows, last_rows):
        reporter.line(
            f"         {after.label!s:<4} {after.size:>7} elements  largest {largest.get(after.label, 0.0):9.3g}  "
            f"zeros {_percent(before.zero_fraction):>6} -> {_percent(after.zero_fraction):>6}  "
            f"subnormals {_percent(before.subnormal_fraction):>6} -> {_percent(after.subnormal_fraction):>6}"
        )


# --plot (matplotlib is imported only here, only when asked)


def _plot_format(path: str) -> str:
    """Return the image format ``path`` asks for, after checking matplotlib, the format and the folder.

    Raises:
        DemoError: matplotlib is missing.
        DemoUsageError: The extension names no format matplotlib writes, or the folder does not exist.
    """
    try:
        import matplotlib  # noqa: F401  (first: a missing package must not hide behind cached submodules)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise DemoError('--plot needs matplotlib: pip install "cupy-amp[demo]" (or pip install matplotlib)') from None
    supported = FigureCanvasAgg(Figure()).get_supported_filetypes()
    extension = Path(path).suffix.lower().lstrip(".")
    if extension not in supported:
        raise DemoUsageError(
            f"--plot {path}: matplotlib writes {', '.join(sorted(supported))} files; end the name with one of "
            "these extensions"
        )
    folder = Path(path).parent
    if not folder.is_dir():
        raise DemoUsageError(f"--plot {path}: the folder {folder} does not exist")
    return extension


def _save_plot(
    path: str, image_format: str, history: History, others: dict[str, History], title: str,
    reports: list[tuple[int, float, tuple[GradientNumerics, ...]]] | None = None,
) -> None:  # fmt: skip
    """Draw the loss (log axis) and the loss scale (log2 axis) over steps, marking skipped steps.

    With ``reports`` (``--report``), a third panel draws each gradient's fraction of zeros over steps.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 8.5 if reports else 6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(3 if reports else 2, 1, sharex=True)
    loss_axis, scale_axis = axes[0], axes[1]
    steps = np.arange(1, len(history) + 1)
    skipped = np.asarray(history.skipped, dtype=bool)
    loss_axis.plot(steps, history.loss, lw=1, color="tab:blue", label=MODES["amp"])
    for mode, other in others.items():
        color = {"fp16": "tab:red", "fp32": "tab:gray"}.get(mode)
        loss_axis.plot(np.arange(1, len(other) + 1), other.loss, lw=1, color=color, label=MODES[mode])
    loss_axis.set(yscale="log", ylabel="training loss (batch mean)", title=title)
    loss_axis.grid(True, alpha=0.3)
    loss_axis.legend(loc="lower left")
    scale_axis.step(steps, history.scale, where="post", color="tab:green", lw=1.2, label="loss scale used")
    if skipped.any():
        label = f"skipped step (overflow): {int(skipped.sum())}"
        scale_axis.plot(steps[skipped], np.asarray(history.scale)[skipped], "x", color="tab:red", ms=6, label=label)
    scale_axis.set_yscale("log", base=2)
    scale_axis.set(ylabel="loss scale", xlabel="" if reports else "step")
    scale_axis.grid(True, alpha=0.3)
    scale_axis.legend(loc="lower right")
    if reports:
        zeros_axis = axes[2]
        report_steps = [step for step, _, _ in reports]
        for index, row in enumerate(reports[0][2]):
            fractions = [100 * rows[index].zero_fraction for _, _, rows in reports]
            zeros_axis.plot(report_steps, fractions, lw=1, label=str(row.label))
        zeros_axis.set(ylabel="gradient elements = 0 (%)", xlabel="step")
        zeros_axis.grid(True, alpha=0.3)
        zeros_axis.legend(loc="upper right", ncol=3, fontsize="small")
    figure.savefig(os.fspath(path), dpi=110, format=image_format)
