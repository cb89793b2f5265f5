"""The --plot figure: loss and loss scale over steps. matplotlib is imported only here, only when asked."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from cupy_amp.demo.options import DemoError
from cupy_amp.demo.train import MODES, History

__all__ = ["require_matplotlib", "save_plot"]


def require_matplotlib() -> None:
    """Fail early, before training, when matplotlib is missing.

    Raises:
        DemoError: matplotlib cannot be imported.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise DemoError('--plot needs matplotlib: pip install "cupy-amp[demo]" (or pip install matplotlib)') from None


def save_plot(path: str | os.PathLike[str], history: History, others: dict[str, History], title: str) -> None:
    """Draw the loss (log axis) and the loss scale (log2 axis) over steps, marking skipped steps.

    ``others`` adds the loss curves of the --compare runs, by mode. Uses
    matplotlib's object API with the Agg canvas, so no global backend is set.

    Raises:
        DemoError: matplotlib is missing.
        OSError: The file cannot be written.
    """
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 6), layout="constrained")
    FigureCanvasAgg(figure)
    loss_axis, scale_axis = figure.subplots(2, 1, sharex=True)
    steps = np.arange(1, len(history) + 1)
    skipped = np.asarray(history.skipped, dtype=bool)

    loss_axis.plot(steps, history.loss, lw=1, color="tab:blue", label=MODES["amp"])
    styles = {"fp16": "tab:red", "fp32": "tab:gray"}
    for mode, other in others.items():
        loss_axis.plot(np.arange(1, len(other) + 1), other.loss, lw=1, color=styles.get(mode), label=MODES[mode])
    loss_axis.set_yscale("log")
    loss_axis.set_ylabel("training loss (batch mean)")
    loss_axis.set_title(title)
    loss_axis.grid(True, alpha=0.3)
    loss_axis.legend(loc="lower left")

    scale_axis.step(steps, history.scale, where="post", color="tab:green", lw=1.2, label="loss scale used")
    if skipped.any():
        scale_axis.plot(
            steps[skipped],
            np.asarray(history.scale)[skipped],
            "x",
            color="tab:red",
            ms=6,
            label=f"skipped step (overflow): {int(skipped.sum())}",
        )
    scale_axis.set_yscale("log", base=2)
    scale_axis.set_ylabel("loss scale")
    scale_axis.set_xlabel("step")
    scale_axis.grid(True, alpha=0.3)
    scale_axis.legend(loc="lower right")
    _save(figure, path)


def _save(figure: Any, path: str | os.PathLike[str]) -> None:
    figure.savefig(os.fspath(path), dpi=110, format="png")
