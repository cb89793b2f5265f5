"""Measure a history-based scale rule against PyTorch's on the demo's fp16 training, before building it in.

Trains the demo's classifier (``cupy_amp.demo``: fp16 forward and backward, fp32 master weights, fused
AdamW) on the CPU or the GPU, once per (rule, start, seed), with every step also measuring its own
ceiling: the largest scale at which this step's fp16 backward pass would have stayed finite, from the
largest magnitude of every fp16 value the pass made (weight and activation gradients), which scales
with the loss scale (on an overflowing step, the pass is run again at smaller scales until it is
finite). The highest scale that would have stayed clean at a step is the lowest of those ceilings over
that step and the growth interval after it (a scale is kept at least that long). Reported per run:
skipped steps; steps spent more than 2x below that scale; the step from which the scale stays within
2x of it; the fraction of fp16 weight-gradient elements that are zero or
subnormal; the loss over the last 50 steps and on held-out data.

The rules:

- ``pytorch`` and ``headroom``: the scaler's own rules, ``GradScaler(rule=...)``
  (:func:`cupy_amp.rule.headroom_state`);
- the prototypes that were measured before the headroom rule was built in (BENCHMARKS.md's first study
  calls them by their names without ``journal-``):
- ``journal-headroom``: ``journal-bisect``, then the ceiling the last overflow showed, moved by how far the
  norm fell since (:func:`headroom_rule`);
- ``journal-bisect``: a PyTorch-rule scaler, with its scale set after each ``update()`` from its step journal
  (``scaler.journal()``) by :func:`bisect_rule`: climb fast until the first overflow, back off faster
  while no scale below has been seen clean, then halve the gap in exponents between the highest clean
  scale and the lowest overflowing one, one probe per step, until they are a growth factor apart;
  from there on, PyTorch's rule. The scale is set through ``load_checkpoint`` (a study, not the build).

Usage: python tools/rule_study.py [--steps N] [--seeds 0 1 2] [--starts 2**36 1 2**44] [--rules pytorch headroom]
       [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from cupy_amp import GradScaler
from cupy_amp.demo.model import backward, cross_entropy, forward, init_params, load_dataset
from cupy_amp.demo.settings import Settings
from cupy_amp.demo.training import BatchOrder, make_optimizer

FP16_MAX = 65504.0
FP16_TINY = 2.0**-14  # the smallest normal float16


def largest(arrays: Any) -> float:
    """The largest finite magnitude among ``arrays``' elements, or inf if any is inf/nan."""
    top = 0.0
    for array in arrays:
        values = np.abs(array.astype(np.float32))
        if not np.isfinite(values).all():
            return math.inf
        top = max(top, float(values.max()))
    return top


def ceiling(weights: dict[str, Any], fwd: Any, y: Any, weight: float, scale: float) -> float:
    """The largest scale at which this step's fp16 backward pass stays finite (from a finite pass)."""
    probe = scale
    while True:
        grads, activations = backward(np, weights, fwd, y, probe * weight)
        top = largest([*grads.values(), *activations.values()])
        if math.isfinite(top):
            return math.inf if top == 0.0 else probe * FP16_MAX / top
        probe /= 2.0**8


def bisect_rule(entries: np.ndarray, growth_factor: float, growth_interval: int, climb: int = 4) -> float | None:
    """Return the scale the next step should use, from the journal (oldest first); None: the scaler's own.

    - No overflow yet: after each clean step, grow by growth_factor**climb (from a scale far too low, the
      right one comes in a few steps).
    - The last steps overflowed and no scale below them is known clean: back off by growth_factor**(2**n)
      after the n-th overflow in a row (from a scale far too high).
    - Otherwise, with H the lowest scale that overflowed since the last clean run of growth_interval steps
      at H, and L the highest scale seen clean below H: while H / L > growth_factor, probe the scale
      halfway between them in exponents (rounded down to a power of growth_factor times L; after an
      overflow, no higher than the backoff).
    """
    if len(entries) == 0:
        return None
    overflowed = entries["agreed"] == 1
    last = entries[-1]
    if not overflowed.any():
        return float(last["scale"]) * growth_factor**climb
    run = 0
    for flag in overflowed[::-1]:
        if not flag:
            break
        run += 1
    lowest_over = float(entries["scale"][overflowed].min())
    clean = entries[(~overflowed) & (entries["scale"] < lowest_over)]
    if run and len(clean) == 0:
        return float(last["scale"]) / growth_factor ** (2 ** (run - 1))
    if len(clean) == 0:
        return None
    high = float(entries["scale"][overflowed][-1])  # the latest overflow: the ceiling as it is now
    below = entries[(~overflowed) & (entries["scale"] < high)]
    if len(below) == 0:
        return None
    low = float(below["scale"].max())
    gap = math.log(high / low, growth_factor)
    if gap <= 1.0:
        return None  # one growth factor apart: PyTorch's rule from here
    probe = low * growth_factor ** max(math.floor(gap / 2), 1)
    return min(probe, float(last["next_scale"])) if overflowed[-1] else probe


def headroom_rule(
    entries: np.ndarray, growth_factor: float, growth_interval: int, climb: int = 4, margin: int = 1
) -> float | None:
    """:func:`bisect_rule`, then, where it leaves the scale to PyTorch's rule: follow the ceiling that the last
    overflow showed, moved by how far check()'s norm has fallen since.

    With H the scale of the latest overflow and n_H the norm of the last clean step before it, the
    ceiling now is estimated at H * n_H / n (n: the last step's norm), and the scale jumps up to the
    largest power of growth_factor (times the current scale) at least one growth factor below that
    estimate; it never moves down here (a backoff does that).
    """
    chosen = bisect_rule(entries, growth_factor, growth_interval, climb)
    if chosen is not None or len(entries) == 0:
        return chosen
    overflowed = entries["agreed"] == 1
    last = entries[-1]
    if not overflowed.any() or overflowed[-1] or not np.isfinite(last["norm"]) or last["norm"] <= 0:
        return None
    latest = int(np.flatnonzero(overflowed)[-1])
    before = entries[:latest]
    before = before[(before["agreed"] == 0) & np.isfinite(before["norm"]) & (before["norm"] > 0)]
    if len(before) == 0:
        return None
    estimate = float(entries["scale"][latest]) * float(before["norm"][-1]) / float(last["norm"])
    current = float(last["next_scale"])
    steps = math.floor(math.log(estimate / current, growth_factor)) - margin  # whole growth factors, margin left
    return current * growth_factor**steps if steps >= 1 else None


@dataclasses.dataclass
class Run:
    rule: str
    start: float
    seed: int
    skipped: int = 0
    low_steps: int = 0  # steps more than 2x below the ceiling
    settled_at: int | None = None  # the step from which the scale stays within 2x below the ceiling
    underflow: float = 0.0  # fraction of fp16 weight-gradient elements that are 0 or subnormal (clean steps)
    final_loss: float = 0.0  # mean training loss over the last 50 steps
    eval_loss: float = 0.0
    eval_accuracy: float = 0.0
    losses: list[float] = dataclasses.field(default_factory=list)
    scales: list[float] = dataclasses.field(default_factory=list)
    ceilings: list[float] = dataclasses.field(default_factory=list)


def train(rule: str, start: float, seed: int, steps: int) -> Run:
    settings = dataclasses.replace(Settings(), seed=seed)
    dataset = load_dataset("builtin", seed)
    sizes = [dataset.features, *settings.hidden, dataset.classes]
    masters = {name: np.asarray(value) for name, value in init_params(sizes, seed).items()}
    optimizer = make_optimizer(settings, masters)
    growth_factor, growth_interval = 2.0, 50
    built_in = rule if rule in BUILT_IN else "pytorch"
    scaler = GradScaler(init_scale=start, growth_interval=growth_interval, max_scale=None, min_scale=1.0, rule=built_in)
    order = BatchOrder(seed, len(dataset.y_train))
    master_grads = {name: np.zeros_like(p) for name, p in masters.items()}
    grad_list = list(master_grads.values())
    weights = {name: master.astype(np.float16) for name, master in masters.items()}
    weight = settings.loss_weight
    result = Run(rule, start, seed)
    zeros = elements = 0
    for step in range(steps):
        indices = order.batch(step, settings.batch_size)
        x, y = dataset.x_train[indices], dataset.y_train[indices]
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):
            fwd = forward(np, weights, x)
            mean_loss = cross_entropy(np, fwd.probs, y)
            loss = np.array(mean_loss * np.float32(weight))
            scale = scaler.scale_factor()
            scaler.scale_loss(loss)
            grads16, _ = backward(np, weights, fwd, y, scale * weight)
            for name, grad in grads16.items():
                master_grads[name][...] = grad
            stats = scaler.check(master_grads, max_norm=settings.clip * weight)
            optimizer.step(grad_list, stats)
            top = ceiling(weights, fwd, y, weight, scale)
        finite = bool(stats.finite)
        if finite:
            weights = {name: master.astype(np.float16) for name, master in masters.items()}
            for grad in grads16.values():
                magnitudes = np.abs(grad.astype(np.float32))
                zeros += int(np.count_nonzero(magnitudes < FP16_TINY))
                elements += grad.size
        result.skipped += not finite
        result.losses.append(float(mean_loss))
        result.scales.append(scale)
        result.ceilings.append(top)
        scaler.update()
        if rule in RULES:
            chosen = RULES[rule](scaler.journal(), growth_factor, growth_interval)
            if chosen is not None:
                chosen = float(np.float32(min(max(chosen, 1.0), 2.0**120)))
                fields = {**scaler.checkpoint().to_dict(), "scale": chosen, "consecutive_good_steps": 0}
                scaler.load_checkpoint(type(scaler.checkpoint()).from_dict(fields))
    # The highest scale that would have stayed clean: one that every step of the next growth_interval
    # steps would have taken (each step's own ceiling varies with its batch by about a factor of 2).
    ceilings = np.asarray(result.ceilings)
    held = [float(ceilings[i : i + growth_interval].min()) for i in range(len(ceilings))]
    result.low_steps = sum(used < clean / 2 for used, clean in zip(result.scales, held))
    within = [clean / 2 <= used for used, clean in zip(result.scales, held)]
    result.settled_at = next((i + 1 for i in range(len(within)) if all(within[i:])), None)
    result.underflow = zeros / max(elements, 1)
    result.final_loss = float(np.mean(result.losses[-50:]))
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        fwd = forward(np, {name: m.astype(np.float16) for name, m in masters.items()}, dataset.x_eval)
        result.eval_loss = float(cross_entropy(np, fwd.probs, dataset.y_eval))
        result.eval_accuracy = float((fwd.probs.argmax(axis=1) == dataset.y_eval).mean())
    return result


def parse_scale(text: str) -> float:
    """A start scale from the command line: a number, or a power written ``2**36``."""
    base, _, exponent = text.partition("**")
    return float(base) ** float(exponent) if exponent else float(base)


# The scaler's own rules (GradScaler(rule=...)), and the prototypes measured before the headroom rule was
# built in: set from the journal after each update(), through load_checkpoint.
BUILT_IN = ("pytorch", "headroom")
RULES: dict[str, Callable[[np.ndarray, float, int], float | None]] = {
    "journal-bisect": bisect_rule,
    "journal-headroom": headroom_rule,
    # Variants: a slower climb (2x per step), and a wider margin below the norm's estimate (4x).
    "journal-headroom-c1": functools.partial(headroom_rule, climb=1),
    "journal-headroom-m2": functools.partial(headroom_rule, margin=2),
    "journal-headroom-c1m2": functools.partial(headroom_rule, climb=1, margin=2),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--starts", nargs="+", default=["2**36", "1", "2**44"])
    parser.add_argument("--rules", nargs="+", default=list(BUILT_IN), choices=[*BUILT_IN, *RULES])
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    runs = []
    began = time.time()
    header = f"{'rule':16} {'start':>6} {'seed':>4} {'skipped':>7} {'<ceil/2':>7} {'settled':>7} {'zero|sub':>8} "
    print(header + f"{'loss50':>8} {'eval':>8} {'acc':>6}")
    for start_text in args.starts:
        start = parse_scale(start_text)
        for seed in args.seeds:
            for rule in args.rules:
                run = train(rule, start, seed, args.steps)
                runs.append(run)
                line = (
                    f"{rule:16} {start_text:>6} {seed:4d} {run.skipped:7d} {run.low_steps:7d} "
                    f"{run.settled_at if run.settled_at is not None else '-':>7} {run.underflow:8.4f} "
                    f"{run.final_loss:8.4f} {run.eval_loss:8.4f} {run.eval_accuracy:6.3f}"
                )
                print(line, flush=True)
    print(f"{len(runs)} runs of {args.steps} steps in {time.time() - began:.0f} s")
    if args.json:
        with open(args.json, "w") as file:
            json.dump([dataclasses.asdict(run) for run in runs], file)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
