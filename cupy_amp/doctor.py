"""What a scaler's step journal shows, in plain words with the evidence: ``cupy-amp doctor FILE``.

Each rule below reads the journal a checkpoint carries (:mod:`cupy_amp.journal`) and either finds its
pattern, with the steps, names and numbers that show it, or stays silent; a journal where none finds a
problem is reported as healthy. The thresholds are stated with each rule.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import numpy as np

from cupy_amp import journal as step_journal
from cupy_amp.checkpoint import GradScalerCheckpoint

__all__ = ["SKIP_RATE", "Finding", "diagnose", "plot"]

SKIP_RATE = 0.05  # more skipped steps than this fraction of the journal is a problem
_SOURCE_STEPS = 3  # overflows with the same first culprit down at the floor (or at 1): not the scale's doing
_FLOORED = 3  # backoffs stopped by the floor: the scale has collapsed
_PINNED = 3  # growths stopped by max_scale with no overflow between them: the ceiling holds the scale down
_BLOCKING = 3  # overflows closer than growth_interval, with no growth in the journal: growth is blocked
_SOURCE_SHARE = 0.75  # of the overflows from a gradient's first to its last: it is the first culprit of most
_UNDERFLOW_STEPS = 3  # clean steps with the numerics report, at least, to judge underflow from
_UNDERFLOW_SHARE = 0.05  # zero or subnormal elements (median over those steps): many
_UNDERFLOW_HEADROOM = 4.0  # float16's largest over the largest |g| (median): two growths of 2 were left unused
FLOAT16_MAX = 65504.0


class Finding(NamedTuple):
    """One thing the journal shows: ``kind`` names the rule, ``problem`` says whether to act on it."""

    kind: str
    problem: bool
    summary: str
    evidence: dict[str, Any]


def diagnose(checkpoint: GradScalerCheckpoint) -> list[Finding]:
    """Return what ``checkpoint``'s journal shows: the problems found, or one "healthy" finding."""
    entries = checkpoint.journal_entries()
    if len(entries) == 0:
        return [
            Finding(
                "no journal",
                False,
                "The checkpoint holds no step journal (an older format version, or a scaler with journal=0): "
                "there is nothing to diagnose.",
                {},
            )
        ]
    names = checkpoint.journal_names
    findings = [
        finding
        for rule in (_inf_source, _at_floor, _skip_rate, _low_ceiling, _growth_blocked, _underflow)
        for finding in rule(checkpoint, entries, names)
    ]
    if not findings:
        scales = entries["scale"]
        findings.append(
            Finding(
                "healthy",
                False,
                f"Healthy: {len(entries)} steps (from step {entries['step'][0]} to {entries['step'][-1]}), "
                f"{int(entries['agreed'].sum())} skipped, the scale between {float(scales.min()):g} and "
                f"{float(scales.max()):g}.",
                _span(entries),
            )
        )
    return findings


def _movable(checkpoint: GradScalerCheckpoint) -> bool:
    """Whether the scale can move at all (a fixed scale, min_scale == max_scale, can neither back off nor grow)."""
    return checkpoint.min_scale is None or checkpoint.max_scale is None or checkpoint.min_scale < checkpoint.max_scale


def _floor(checkpoint: GradScalerCheckpoint) -> float:
    """The lowest scale a backoff reaches: min_scale, or 1 when there is none (the journal's "down to 1")."""
    return max(checkpoint.config().floor, 1.0)


def _span(entries: np.ndarray) -> dict[str, Any]:
    return {"steps": len(entries), "first_step": int(entries["step"][0]), "last_step": int(entries["step"][-1])}


def _name(names: tuple[tuple[str, ...], ...], call: int, position: int) -> str:
    """A culprit's name where the last step's calls name it, else its place (call, position)."""
    if 0 <= call < len(names) and 0 <= position < len(names[call]):
        return names[call][position]
    return f"call {call}, position {position}"


def _inf_source(checkpoint: GradScalerCheckpoint, entries: np.ndarray, names: Any) -> list[Finding]:
    """The same gradient held inf/nan first in overflows down at the floor (at least 3; or at a scale of 1 or
    less), and in 3 of 4 of the overflows from its first to its last: backing off did not help, since a
    smaller scale cannot make an inf finite. A start from too high a scale stops overflowing on the way
    down, so it is not one of these."""
    if not _movable(checkpoint):
        return []
    floor = np.float32(_floor(checkpoint))
    bad = entries[(entries["local"] == 1) & (entries["culprit"] >= 0)]
    findings = []
    for call, position in sorted({(int(e["culprit_call"]), int(e["culprit"])) for e in bad}):
        mine = bad[(bad["culprit_call"] == call) & (bad["culprit"] == position)]
        first, last = int(mine["step"][0]), int(mine["step"][-1])
        during = int(np.sum((entries["agreed"] == 1) & (entries["step"] >= first) & (entries["step"] <= last)))
        at_floor = int(np.sum(mine["scale"] <= floor))
        if at_floor >= _SOURCE_STEPS and len(mine) >= _SOURCE_SHARE * during:
            name = _name(names, call, position)
            high, low = float(mine["scale"].max()), float(mine["scale"].min())
            findings.append(
                Finding(
                    "inf source",
                    True,
                    f"Gradient {name!r} held inf/nan first in {len(mine)} skipped steps, at every scale from "
                    f"{high:g} down to {low:g}, {at_floor} of them at the floor: the scale is not the cause. Look at "
                    f"what computes {name!r} (a log or a division of 0, a bad batch, a learning rate that "
                    f"diverged) from step {first}. (Names are those of the last step's gradient calls.)",
                    {"gradient": name, "steps": mine["step"].tolist(), "scales": mine["scale"].tolist()},
                )
            )
    return findings


def _at_floor(checkpoint: GradScalerCheckpoint, entries: np.ndarray, names: Any) -> list[Finding]:
    """Backoffs stopped by the floor, at least 3 of them, and the scale still there: it has collapsed."""
    stopped = entries[entries["action"] == step_journal.AT_FLOOR]
    if not _movable(checkpoint) or len(stopped) < _FLOORED or entries["next_scale"][-1] > stopped["scale"][-1]:
        return []
    floor = float(stopped["scale"][-1])
    return [
        Finding(
            "scale at the floor",
            True,
            f"The scale has collapsed to its floor, {floor:g}: {len(stopped)} backoffs were stopped there (from step "
            f"{int(stopped['step'][0])}), so the gradients overflow even unscaled by more than that. An inf/nan "
            f"source (see its finding) or too high a learning rate does this; min_scale only hides it.",
            {"steps": stopped["step"].tolist(), "floor": floor},
        )
    ]


def _skip_rate(checkpoint: GradScalerCheckpoint, entries: np.ndarray, names: Any) -> list[Finding]:
    """More than SKIP_RATE of the journal's steps skipped."""
    skipped = entries[entries["agreed"] == 1]
    rate = len(skipped) / len(entries)
    if rate <= SKIP_RATE:
        return []
    remote = int(np.sum(skipped["local"] == 0))
    where = f" ({remote} of them overflowed on other ranks only)" if remote else ""
    backoffs = int(np.sum(entries["action"] == step_journal.BACKED_OFF))
    return [
        Finding(
            "skip rate",
            True,
            f"{len(skipped)} of {len(entries)} steps were skipped ({rate:.0%}, above {SKIP_RATE:.0%}){where}: each "
            f"skipped step is a lost update. The backoffs: {backoffs}.",
            {**_span(entries), "skipped": skipped["step"].tolist(), "rate": rate},
        )
    ]


def _low_ceiling(checkpoint: GradScalerCheckpoint, entries: np.ndarray, names: Any) -> list[Finding]:
    """Growths stopped by max_scale, at least _PINNED of them after the last overflow: the clean steps would
    have let the scale grow, so gradients keep less headroom against underflow than they could."""
    if not _movable(checkpoint) or checkpoint.max_scale is None:
        return []  # a fixed scale cannot grow; without a ceiling, only float32's range stops a growth
    overflows = np.flatnonzero(entries["agreed"] == 1)
    after = entries[overflows[-1] + 1 :] if len(overflows) else entries
    pinned = after[after["action"] == step_journal.AT_CEILING]
    if len(pinned) < _PINNED:
        return []
    return [
        Finding(
            "ceiling too low",
            True,
            f"The scale sat at max_scale = {float(pinned['scale'][-1]):g} through {len(after)} clean steps (from step "
            f"{int(after['step'][0])}), and {len(pinned)} growths were stopped there with no overflow: raise "
            f"max_scale (or pass max_scale=None) so that small gradients keep more headroom against underflow.",
            {"steps": pinned["step"].tolist(), "max_scale": float(pinned["scale"][-1])},
        )
    ]


def _growth_blocked(checkpoint: GradScalerCheckpoint, entries: np.ndarray, names: Any) -> list[Finding]:
    """No growth in the journal, with overflows (at least 3) closer together than growth_interval (the median
    gap): each resets the count of clean steps, so the scale cannot grow.
    Hysteresis holds the scale at the first overflows after a growth, and never refills without one."""
    interval = checkpoint.growth_interval
    overflows = entries["step"][entries["agreed"] == 1].astype(np.int64)
    if not _movable(checkpoint) or np.any(entries["action"] == step_journal.GREW) or len(overflows) < _BLOCKING:
        return []
    gap = float(np.median(np.diff(overflows)))
    if gap >= interval or gap <= 1.0:
        return []  # rare enough to allow growth, or every step overflows (no clean steps to count: see the floor)
    held = int(np.sum(entries["action"] == step_journal.HELD))
    by = f", {held} of them held by hysteresis (hysteresis = {checkpoint.hysteresis}, refilled only by a growth)"
    return [
        Finding(
            "growth blocked by hysteresis" if held else "growth blocked",
            True,
            f"The scale never grew in {len(entries)} steps: overflows came every {gap:g} steps (median), sooner than "
            f"growth_interval = {interval}, and each resets the count of clean steps ({len(overflows)} "
            f"overflows{by if held else ''}). Find what overflows; a shorter growth_interval only helps if the "
            f"overflows are rare.",
            {"overflows": overflows.tolist(), "median_gap": gap, "held": held},
        )
    ]


def _underflow(checkpoint: GradScalerCheckpoint, entries: np.ndarray, names: Any) -> list[Finding]:
    """Clean steps with the numerics report (``check(report=True)``), at least _UNDERFLOW_STEPS, where a median
    _UNDERFLOW_SHARE or more of the elements were 0 or subnormal while the largest |g| stayed a median
    _UNDERFLOW_HEADROOM times or more below float16's largest: small gradients were lost at a scale that had
    room to grow (for float16 gradients: the report does not say the dtype, so the headroom is float16's)."""
    # Reported clean steps with elements (a report over none has NaN fractions).
    reported = entries[(entries["agreed"] == 0) & ~np.isnan(entries["amax"]) & ~np.isnan(entries["zero_fraction"])]
    if len(reported) < _UNDERFLOW_STEPS or not _movable(checkpoint):
        return []
    lost = float(np.median(reported["zero_fraction"] + reported["subnormal_fraction"]))
    amax = float(np.median(reported["amax"]))
    headroom = FLOAT16_MAX / amax if amax > 0 else None  # None: every element 0, any scale had room
    if not (lost >= _UNDERFLOW_SHARE and (headroom is None or headroom >= _UNDERFLOW_HEADROOM)):
        return []
    room = f"stayed {headroom:.3g}x below" if headroom is not None else "was 0, far below"
    last = reported[-1]
    held = last["amax_call"] >= 0  # a step whose elements are all 0 names no gradient
    where = f", last in gradient {_name(names, int(last['amax_call']), int(last['amax_position']))!r}" if held else ""
    return [
        Finding(
            "underflow risk",
            True,
            f"In {len(reported)} reported clean steps, a median {100 * lost:.1f}% of the gradient elements were 0 or "
            f"subnormal ({100 * float(np.median(reported['subnormal_fraction'])):.2f}% subnormal), while the largest "
            f"|g| (a median {amax:g}{where}) {room} float16's largest: "
            f"with float16 gradients the scale had room to grow. Raise it: a higher init_scale or max_scale, a "
            f"shorter growth_interval, or rule='headroom'.",
            {
                "steps": reported["step"].tolist(),
                "zero_or_subnormal": lost,
                "median_amax": amax,
                "headroom": headroom,
                "scale": float(last["scale"]),
            },
        )
    ]


def plot(checkpoint: GradScalerCheckpoint, path: str) -> None:
    """Draw the journal into ``path`` (its extension names the format): the scale each step used, with the
    skipped steps and what the rule did; where the steps had the numerics report, the headroom (the scale at
    which their largest |g| would reach float16's largest); and ``check()``'s norm where the steps had one.

    Raises:
        ValueError: matplotlib is missing, or writes no such format, or the folder does not exist; the
            message says which.
    """
    try:
        import matplotlib  # noqa: F401  (first: a missing package must not hide behind cached submodules)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError('--plot needs matplotlib: pip install "cupy-amp[demo]" (or pip install matplotlib)') from None
    extension = os.path.splitext(path)[1].lower().lstrip(".")
    supported = FigureCanvasAgg(Figure()).get_supported_filetypes()
    if extension not in supported:
        raise ValueError(f"--plot {path}: matplotlib writes {', '.join(sorted(supported))} files; end the name so")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise ValueError(f"--plot {path}: {folder} is not a folder")
    entries = checkpoint.journal_entries()
    figure = Figure(figsize=(8, 6), layout="constrained")
    FigureCanvasAgg(figure)
    scale_axis, norm_axis = figure.subplots(2, 1, sharex=True)
    steps, scales = entries["step"].astype(np.float64), entries["scale"].astype(np.float64)
    scale_axis.step(steps, scales, where="post", color="tab:green", lw=1.2, label="scale used")
    for action, marker, color in ((step_journal.BACKED_OFF, "v", "tab:red"), (step_journal.GREW, "^", "tab:blue")):
        chosen = entries["action"] == action
        if chosen.any():
            label = f"{step_journal.ACTIONS[action]}: {int(chosen.sum())}"
            scale_axis.plot(steps[chosen], scales[chosen], marker, color=color, ms=5, ls="none", label=label)
    skipped = entries["agreed"] == 1
    if skipped.any():
        label = f"skipped: {int(skipped.sum())}"
        scale_axis.plot(steps[skipped], scales[skipped], "x", color="black", ms=5, ls="none", label=label)
    reported = ~np.isnan(entries["amax"]) & (entries["amax"] > 0)
    if reported.any():
        ceiling = scales[reported] * FLOAT16_MAX / entries["amax"][reported].astype(np.float64)
        scale_axis.plot(steps[reported], ceiling, ":", color="tab:orange", lw=1, label="headroom: |g| at fp16 max")
    if len(entries):
        scale_axis.set_yscale("log", base=2)
    scale_axis.set(ylabel="loss scale", title=f"step journal: {len(entries)} steps")
    scale_axis.grid(True, alpha=0.3)
    scale_axis.legend(loc="lower right", fontsize="small")
    checked = ~np.isnan(entries["norm"]) & np.isfinite(entries["norm"])
    if checked.any():
        norm_axis.plot(steps[checked], entries["norm"][checked], lw=1, color="tab:purple", label="check() norm")
        norm_axis.set_yscale("log")
        norm_axis.legend(loc="upper right", fontsize="small")
    else:
        norm_axis.text(
            0.5, 0.5, "no step used check(): no norm", ha="center", va="center", transform=norm_axis.transAxes
        )
    norm_axis.set(ylabel="gradient norm (unscaled)", xlabel="step")
    norm_axis.grid(True, alpha=0.3)
    try:
        figure.savefig(path, dpi=110, format=extension)
    except OSError:
        raise
    except Exception as exc:  # a format that needs a program matplotlib did not find (pgf: LaTeX), and the like
        raise ValueError(f"--plot {path}: matplotlib could not write it ({type(exc).__name__}: {exc})") from None
