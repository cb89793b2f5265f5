"""``cupy-amp demo``: put the pieces together, from flags to the final summary."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from cupy_amp.demo.data import Dataset, load_dataset
from cupy_amp.demo.device import Device, select_device, small_matrix_threads
from cupy_amp.demo.options import (
    DEFAULT_STEPS,
    DemoError,
    DemoUsageError,
    ScalerSettings,
    Settings,
    format_power,
    settings_from_args,
)
from cupy_amp.demo.plot import require_matplotlib, save_plot
from cupy_amp.demo.report import Reporter, RunSummary, format_scale, summary_table
from cupy_amp.demo.state import SCALER_FILE, STATE_FILE, load_run, save_run
from cupy_amp.demo.train import (
    MODES,
    History,
    RunState,
    StepOutcome,
    Trainer,
    build_scaler,
    make_scaler,
    new_state,
    run_steps,
)
from cupy_amp.errors import ConfigError
from cupy_amp.scaler import GradScaler

__all__ = ["run"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


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
    except DemoError as exc:
        reporter.end_progress()
        err.write(f"cupy-amp demo: {exc}\n")
        return EXIT_FAILED
    except OSError as exc:
        reporter.end_progress()
        err.write(f"cupy-amp demo: {exc}\n")
        return EXIT_FAILED
    except KeyboardInterrupt:
        reporter.end_progress()
        err.write(_interrupted_message(args, progress))
        return EXIT_INTERRUPTED
    return EXIT_OK


def _plan(args: argparse.Namespace) -> _Plan:
    if args.compare and args.resume:
        raise DemoUsageError("--compare trains all three runs from step 0; it cannot be combined with --resume")
    if args.plot:
        require_matplotlib()
    saved = load_run(args.resume) if args.resume else None
    settings, scaler_settings = settings_from_args(
        args, saved.settings if saved else None, saved.scaler_settings if saved else None
    )
    steps = args.steps if args.steps is not None else DEFAULT_STEPS
    if saved is not None and steps <= saved.state.step:
        raise DemoUsageError(
            f"{args.resume} is already at step {saved.state.step}; pass --steps N with N > {saved.state.step} "
            "to continue it"
        )
    out = Path(args.out) if args.out else (Path(args.resume) if args.resume else None)
    continuing_in_place = saved is not None and out is not None and out.resolve() == Path(args.resume).resolve()
    if out is not None and not continuing_in_place and (out / STATE_FILE).exists():
        raise DemoUsageError(
            f"{out} already holds a demo run; continue it with --resume {out}, or choose another --out directory"
        )
    try:
        scaler = build_scaler(scaler_settings)
    except ConfigError as exc:
        raise DemoUsageError(f"scaler parameters: {exc}") from None
    device, gpu_note = select_device(args.device)
    dataset = load_dataset(settings.data, settings.seed)
    if settings.batch_size > len(dataset.y_train):
        raise DemoUsageError(
            f"--batch-size {settings.batch_size} is larger than the {len(dataset.y_train)} training examples"
        )
    if saved is not None:
        scaler.load_checkpoint(saved.scaler)
        state = saved.to_device(device)
        _check_shapes(state, new_state(device, settings, dataset), args.resume)
    else:
        state = new_state(device, settings, dataset)
    return _Plan(
        settings,
        scaler_settings,
        steps,
        device,
        gpu_note,
        dataset,
        scaler,
        state,
        out,
        Path(args.resume) if args.resume else None,
    )


def _check_shapes(state: RunState, fresh: RunState, directory: str) -> None:
    for name, master in fresh.masters.items():
        if state.masters[name].shape != master.shape:
            raise DemoError(
                f"cannot resume from {directory}: {name} has shape {state.masters[name].shape}, "
                f"the model needs {master.shape}"
            )


def _train(args: argparse.Namespace, plan: _Plan, reporter: Reporter, progress: dict[str, int]) -> None:
    _print_header(plan, reporter)
    settings, scaler = plan.settings, plan.scaler
    trainer = Trainer("amp", settings, plan.dataset, plan.device, plan.state, scaler, measure_underflow=args.compare)
    interval = plan.scaler_settings.growth_interval
    progress["step"] = plan.state.step
    if plan.resumed_from is not None:
        progress["saved"] = plan.state.step

    def on_step(outcome: StepOutcome) -> None:
        progress["step"] = outcome.step
        reporter.event(outcome, interval)
        reporter.progress(outcome, plan.steps)
        if plan.out is not None and (outcome.step % args.save_every == 0 or outcome.step == plan.steps):
            save_run(plan.out, settings, plan.scaler_settings, scaler, plan.state, plan.device)
            progress["saved"] = outcome.step

    started = time.perf_counter()
    first = plan.state.step
    run_steps(trainer, plan.steps, on_step)
    seconds = time.perf_counter() - started
    reporter.end_progress()
    eval_loss, eval_accuracy = trainer.evaluate()
    _print_result(plan, reporter, plan.steps - first, seconds, eval_loss, eval_accuracy)

    others: dict[str, History] = {}
    if args.compare:
        main = RunSummary("amp", eval_accuracy, eval_loss, scaler.stats().skipped_steps, trainer.underflow)
        others = _compare(plan, reporter, main)
    if args.plot:
        title = f"cupy-amp demo: {plan.dataset.description.split(' (')[0]}, seed {settings.seed}"
        save_plot(args.plot, plan.state.history, others, title)
        reporter.line(f"plot     {args.plot}")
    if plan.out is not None:
        reporter.line(
            f"saved    {plan.out / SCALER_FILE} and {plan.out / STATE_FILE} (step {plan.state.step}); "
            f"continue with: cupy-amp demo --resume {plan.out} --steps N (N > {plan.state.step})"
        )


def _print_header(plan: _Plan, reporter: Reporter) -> None:
    settings, scaler = plan.settings, plan.scaler_settings
    device = plan.device.description + (f"; not the GPU: {plan.gpu_note}" if plan.gpu_note else "")
    sizes = "-".join(str(n) for n in (plan.dataset.features, *settings.hidden, plan.dataset.classes))
    reporter.line("cupy-amp demo: float16 training with dynamic loss scaling")
    reporter.line(f"device   {device}")
    reporter.line(f"data     {plan.dataset.description}, seed {settings.seed}")
    reporter.line(
        f"model    MLP {sizes}: fp16 weights and activations, fp32 master weights, Adam (lr {settings.lr}), "
        f"batch {settings.batch_size}"
    )
    reporter.line(f"loss     batch-mean cross-entropy x {format_power(settings.loss_weight)} (--loss-weight)")
    reporter.line(
        f"scaler   init {format_power(scaler.init_scale)}, x{scaler.growth_factor} after {scaler.growth_interval} "
        f"clean steps, x{scaler.backoff_factor} on overflow, min {format_power(scaler.min_scale)}, "
        f"max {format_power(scaler.max_scale)}, hysteresis {scaler.hysteresis}"
    )
    if plan.resumed_from is not None:
        reporter.line(
            f"resumed  from {plan.resumed_from} at step {plan.state.step} "
            f"(scale {format_scale(plan.scaler.scale_factor())}); training to step {plan.steps}"
        )


def _print_result(
    plan: _Plan, reporter: Reporter, steps_run: int, seconds: float, eval_loss: float, eval_accuracy: float
) -> None:
    stats = plan.scaler.stats()
    total = plan.state.step
    reporter.line(
        f"done     {steps_run} steps in {seconds:.1f} s; {stats.skipped_steps} of {total} steps skipped "
        f"({100 * stats.skipped_steps / total:.1f}%)"
    )
    reporter.line(
        f"eval     accuracy {100 * eval_accuracy:.1f}% (chance {100 / plan.dataset.classes:.1f}%), "
        f"loss {eval_loss:.4f} on {len(plan.dataset.y_eval)} held-out examples"
    )
    reporter.line(
        f"scaler   final scale {format_scale(stats.scale)}; {stats.backoffs} backoffs, {stats.growths} growths, "
        f"{stats.consecutive_good_steps} clean steps since the last change"
    )


def _compare(plan: _Plan, reporter: Reporter, main: RunSummary) -> dict[str, History]:
    rows = [main]
    histories: dict[str, History] = {}
    for mode in ("fp16", "fp32"):
        state = new_state(plan.device, plan.settings, plan.dataset)
        scaler = make_scaler(mode, plan.scaler_settings)
        trainer = Trainer(mode, plan.settings, plan.dataset, plan.device, state, scaler, measure_underflow=True)
        label = {"fp16": "fp16, no scaling", "fp32": "fp32"}[mode]

        def show(outcome: StepOutcome, label: str = label) -> None:
            reporter.progress(outcome, plan.steps, label, every=0)

        reporter.line(f"compare  training {MODES[mode]} ...")
        run_steps(trainer, plan.steps, show)
        reporter.end_progress()
        loss, accuracy = trainer.evaluate()
        skipped = None if scaler is None else scaler.stats().skipped_steps
        rows.append(RunSummary(mode, accuracy, loss, skipped, trainer.underflow))
        histories[mode] = state.history
    reporter.line()
    reporter.line(f"compare  the same model, data and seed, {plan.steps} steps each:")
    for text in summary_table(rows, plan.dataset.classes):
        reporter.line(text)
    reporter.line()
    return histories


def _interrupted_message(args: argparse.Namespace, progress: dict[str, int]) -> str:
    text = f"cupy-amp demo: interrupted at step {progress.get('step', 0)}"
    directory = args.out or args.resume
    if directory and "saved" in progress:
        text += (
            f"; the last checkpoint in {directory} is at step {progress['saved']}; continue with: "
            f"cupy-amp demo --resume {directory}"
        )
        if args.steps:
            text += f" --steps {args.steps}"
    return text + "\n"
