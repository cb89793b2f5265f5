"""The scale-rule study of tools/rule_study.py on a real fp16 transformer: GPT-2 on a synthetic task.

Trains GPT-2 (built from its configuration, no weights downloaded; GPT-2-small by default) on sequences
of a fixed random first-order Markov chain, once per (rule, start, seed), with the loss scaling done by
cupy-amp's ``GradScaler`` and every step also measuring its own ceiling: the largest scale at which this
step's fp16 backward pass would have stayed finite. Each run of a seed sees the same model
initialization and the same batches.

Two precisions (``--precision``):

- ``autocast``: fp32 parameters, forward under ``torch.autocast(float16)``; the optimizer steps the
  parameters themselves;
- ``fp16``: the model in float16, fp32 master weights: the fp16 gradients are copied into the
  masters' fp32 gradients, the optimizer steps the masters, and they are copied back.

A step, and how torch meets cupy-amp:

1. The loss is computed in float32 (the logits cast up), and the backward pass starts from a float32
   0-d tensor holding 1, which ``scaler.scale_loss`` multiplies by the scale in place, through a
   zero-copy view (DLPack to CuPy on the GPU, ``.numpy()`` on the CPU): so ``loss.backward(that)`` is
   ``(loss * scale).backward()``, the scaler's own kernel applies the scale, and its step is opened by a
   real ``scale_loss`` (scaling the loss tensor itself in place would change nothing: autograd seeds
   the backward pass with 1, not with the loss's value).
2. ``scaler.check(gradients, max_norm=--clip)`` reads the parameters' gradients as they are (fp16 in
   ``fp16``, fp32 in ``autocast``), again through zero-copy views (``cupy.from_dlpack(p.grad)`` or
   ``p.grad.numpy()``), without writing them.
3. If ``bool(stats.finite)``, the fp32 gradients are multiplied by ``stats.factor`` (the inverse scale
   times the clip coefficient, in float32: unscaling and clipping in one product; in ``fp16`` only after
   the copy to fp32, so that unscaling cannot underflow), and AdamW steps; else the step is skipped.
4. ``scaler.update()``; for a prototype rule (tools/rule_study.py's ``RULES``; not for the scaler's own,
   ``pytorch`` and ``headroom``, which are ``GradScaler(rule=...)``), that rule sets
   the next scale from ``scaler.journal()`` through ``load_checkpoint``, as ``rule_study.train`` does.

The ceiling of a step. A pre-hook on every node of the autograd graph records the largest magnitude
of every float16 gradient that enters a node, that is every fp16 tensor the backward pass produces
(activation gradients, sums of branches, the parameters' gradients as they reach AccumulateGrad);
nodes that only change a layout (views, transposes) are left out, as what they pass on is recorded at
the next node. Backpropagation is linear in its seed, so a clean pass at scale s whose largest fp16
magnitude is m would overflow from about s * 65504 / m. An overflowing pass is run again (same graph,
gradients discarded; autograd.grad runs no AccumulateGrad node, so the parameters' gradients are
recorded from what it returns) at s / 2**8, s / 2**16, ... until it is finite, and the estimate is
taken there. On the CPU (2 layers, width 64, both precisions), a pass at 1.02x the ceiling so measured
overflowed and one at 0.98x did not, whether it was measured from a clean pass or an overflowing one.
Approximations: values inside one fused kernel (flash attention's backward, a matmul's accumulator)
are not seen (those kernels normally accumulate in fp32); fp32 tensors (autocast's layer norms, softmax and
residual stream) are not counted (they overflow only at float32's limit); float16 rounds up to inf from
65520, not 65504 (a hair conservative); and rounding makes m move very slightly with the scale. A
tensor that overflows without reaching a parameter's gradient lowers the ceiling here though the
scaler would not have skipped that step.

The highest scale that would have stayed clean at step t is, as in rule_study, the lowest ceiling over
steps t to t + growth_interval - 1 (a scale is kept at least that long). Reported per run: skipped
steps; steps spent more than 2x below that scale; the step from which the scale stays within 2x of
it; the fraction of parameter-gradient elements that are zero or subnormal in float16 (|g| < 2**-14,
counted on the scaled gradients of clean steps; under autocast on the fp32 gradients, which hold the
fp16 ones' values except for the few parameters autocast leaves in fp32: layer norms, the embeddings'
lookup); the mean loss of the last 50 steps (the chain's own entropy, the lowest loss possible, is
printed per seed); and the run's time.

Usage: python tools/rule_study_gpt2.py [--precision autocast|fp16] [--steps 300] [--seeds 0]
       [--starts 2**16 1 2**24] [--rules pytorch headroom] [--layers 12 --width 768 --heads 12
       --context 1024 --vocab 50257] [--batch 8 --length 1024] [--json PATH] [--budget-s SECONDS]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

import cupy_amp
from cupy_amp import GradScaler

sys.path.insert(0, os.path.dirname(__file__))  # rule_study is a sibling script, not a package
from rule_study import BUILT_IN, FP16_MAX, FP16_TINY, RULES, parse_scale

# Autograd nodes that only change a tensor's layout: what enters them leaves them, to a node that records it.
LAYOUT_NODES = frozenset(
    {"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "TransposeBackward0", "TBackward0",
     "PermuteBackward0", "AliasBackward0"}
)  # fmt: skip
MAX_RERUNS = 16  # an overflowing pass is rerun down to scale / 2**128 at most; past that, the forward was non-finite
CLAMP = (1.0, 2.0**120)  # the scales a rule may set, as in rule_study


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=["autocast", "fp16"], default="autocast")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--starts", nargs="+", default=["2**16", "1", "2**24"])
    parser.add_argument("--rules", nargs="+", default=list(BUILT_IN), choices=[*BUILT_IN, *RULES])
    parser.add_argument("--growth-interval", type=int, default=25)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--dropout", type=float, default=0.0, help="the synthetic task needs no regularization")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, help="tokens per sequence (default: the context)")
    parser.add_argument("--branches", type=int, default=4, help="successors of each token in the Markov chain")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--clip", type=float, default=1.0, help="max_norm of check()")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--json", help="write every run, with its per-step loss, scale and ceiling, after each run")
    parser.add_argument("--budget-s", type=float, help="start no run that the last one's time says would end later")
    args = parser.parse_args(argv)
    args.length = args.length or args.context
    if args.length > args.context:
        parser.error(f"--length {args.length} is longer than --context {args.context}")
    return args


def environment(device: torch.device) -> dict[str, str]:
    """The machine and the versions the numbers come from."""
    found = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": f"{cpu_name()} ({os.cpu_count()} logical cores)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": np.__version__,
        "cupy-amp": cupy_amp.__version__,
        "device": str(device),
    }
    try:
        import cupy

        found["cupy"] = cupy.__version__
    except ImportError:
        found["cupy"] = "not installed"
    if device.type == "cuda":
        import cupy

        found["gpu"] = torch.cuda.get_device_name(device)
        found["cuda"] = f"torch built for {torch.version.cuda}, CuPy runtime {cupy.cuda.runtime.runtimeGetVersion()}"
        found["driver"] = str(cupy.cuda.runtime.driverGetVersion())
    return found


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


@dataclasses.dataclass(frozen=True)
class Task:
    tokens: np.ndarray  # (steps, batch, length) int64: every batch of a run
    best_loss: float  # the mean -log P(next | previous) of the targets under the chain: no model does better


def markov_task(seed: int, vocab: int, branches: int, steps: int, batch: int, length: int) -> Task:
    """Sequences of a first-order Markov chain drawn from ``seed``: each token has ``branches`` random
    successors with random probabilities (a table the model must learn), the first token uniform."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab, size=(vocab, branches))
    probabilities = rng.dirichlet(np.ones(branches), size=vocab)
    cumulative = probabilities.cumsum(axis=1)
    rows = steps * batch
    tokens = np.empty((rows, length), dtype=np.int64)
    tokens[:, 0] = rng.integers(0, vocab, size=rows)
    surprise = 0.0
    for t in range(1, length):
        previous = tokens[:, t - 1]
        draws = rng.random(rows)[:, None]
        branch = np.minimum((cumulative[previous] < draws).sum(axis=1), branches - 1)  # the last sum may be < 1
        tokens[:, t] = successors[previous, branch]
        # A successor drawn twice in a row of the table: its probability is the sum of its branches'.
        chance = (probabilities[previous] * (successors[previous] == tokens[:, t, None])).sum(axis=1)
        surprise -= float(np.log(chance).sum())
    return Task(tokens.reshape(steps, batch, length), surprise / (rows * (length - 1)))


def gpt2_config(args: argparse.Namespace) -> GPT2Config:
    last = args.vocab - 1  # GPT-2's end-of-text token id, kept inside a shrunk vocabulary
    return GPT2Config(
        vocab_size=args.vocab, n_positions=args.context, n_embd=args.width, n_layer=args.layers,
        n_head=args.heads, resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout,
        bos_token_id=last, eos_token_id=last, use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip


@dataclasses.dataclass
class Trainee:
    model: torch.nn.Module
    params: list[torch.nn.Parameter]  # the model's own: their gradients go to the scaler
    masters: list[torch.Tensor]  # what the optimizer steps: the params under autocast, fp32 copies in fp16
    optimizer: torch.optim.Optimizer
    autocast: bool


def build_trainee(config: GPT2Config, seed: int, precision: str, device: torch.device, lr: float) -> Trainee:
    """GPT-2 initialized from ``seed`` (on the CPU, so that every device starts from the same weights)."""
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).to(device)
    if precision == "autocast":
        params = list(model.parameters())
        return Trainee(model, params, params, torch.optim.AdamW(params, lr=lr), autocast=True)
    masters = [p.detach().clone() for p in model.parameters()]
    for master in masters:
        master.grad = torch.zeros_like(master)  # kept between steps: the fp16 gradients are copied into it
    model.half()
    return Trainee(model, list(model.parameters()), masters, torch.optim.AdamW(masters, lr=lr), autocast=False)


def forward_loss(trainee: Trainee, tokens: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy, in float32 (the fp16 logits cast up, as scale_loss needs)."""
    with torch.autocast(tokens.device.type, dtype=torch.float16, enabled=trainee.autocast):
        logits = trainee.model(tokens).logits
    predicted = logits[:, :-1].float()
    return F.cross_entropy(predicted.reshape(-1, predicted.shape[-1]), tokens[:, 1:].reshape(-1))


def arrays(tensors: list[torch.Tensor]) -> list[Any]:
    """Zero-copy views cupy-amp reads and writes in place: CuPy arrays on the GPU, NumPy arrays on the CPU.

    On the GPU, torch and CuPy both queue on the legacy default stream (neither is told otherwise here), so
    cupy-amp's kernels run after the backward pass that wrote the gradients, and before the next torch op.
    """
    if tensors and tensors[0].is_cuda:
        import cupy

        return [cupy.from_dlpack(tensor) for tensor in tensors]
    return [tensor.numpy() for tensor in tensors]


class BackwardPeak:
    """The largest magnitude among the float16 gradients that enter the nodes of one autograd graph.

    The per-tensor maxima stay on the device until :meth:`take`, which reads them once (one synchronization).
    """

    def __init__(self, loss: torch.Tensor) -> None:
        self.peaks: list[torch.Tensor] = []
        self.handles = [node.register_prehook(self.record) for node in graph_nodes(loss.grad_fn)]

    def record(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        for grad in grads:
            if grad is not None and grad.dtype == torch.float16 and grad.numel():
                self.peaks.append(torch.linalg.vector_norm(grad, math.inf))  # max |g|, inf or nan if any is

    def take(self) -> float:
        """The largest magnitude recorded since the last take (inf or nan if any was), and forget them."""
        top = float(torch.stack(self.peaks).max()) if self.peaks else 0.0
        self.peaks = []
        return top

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def graph_nodes(root: Any) -> list[Any]:
    """Every node of the autograd graph below ``root`` that does more than change a layout."""
    seen, pending = set(), [root]
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        pending.extend(following for following, _ in node.next_functions)
    return [node for node in seen if type(node).__name__ not in LAYOUT_NODES]


def step_ceiling(loss: torch.Tensor, params: list[torch.nn.Parameter], peak: BackwardPeak, scale: float) -> float:
    """The largest scale at which this step's fp16 backward pass stays finite, from the pass just made at ``scale``
    (an overflowing one is rerun at scale / 2**8, / 2**16, ... on the retained graph, gradients discarded)."""
    probe, top = scale, peak.take()
    for _ in range(MAX_RERUNS):
        if math.isfinite(top):
            return math.inf if top == 0.0 else probe * FP16_MAX / top
        probe /= 2.0**8
        start = torch.full((), probe, dtype=loss.dtype, device=loss.device)
        # autograd.grad runs no AccumulateGrad node: the parameters' gradients are recorded from what it returns.
        peak.record(torch.autograd.grad(loss, params, grad_outputs=start, retain_graph=True))
        top = peak.take()
    return 0.0  # still overflowing at a scale of ~2**-128 or below: the forward pass itself was not finite


def apply_update(trainee: Trainee, factor: float) -> None:
    """Unscale and clip the gradients in fp32 by ``factor`` (check()'s), step AdamW, copy fp32 masters back."""
    with torch.no_grad():
        for param, master in zip(trainee.params, trainee.masters):
            if master is not param:
                master.grad.copy_(param.grad)  # fp16 -> fp32 first: the unscaled values may be below fp16's range
            master.grad.mul_(factor)
        trainee.optimizer.step()
        for param, master in zip(trainee.params, trainee.masters):
            if master is not param:
                param.copy_(master)


def small_elements(grads: list[torch.Tensor]) -> int:
    """How many gradient elements are zero or subnormal in float16 (|g| < 2**-14)."""
    return int(sum(torch.count_nonzero(grad.abs() < FP16_TINY) for grad in grads))


def apply_rule(scaler: GradScaler, rule: str, growth_factor: float, growth_interval: int) -> None:
    """Set the next step's scale from the journal by ``rule`` (after update(), as rule_study.train does)."""
    if rule not in RULES:  # the scaler's own rule
        return
    chosen = RULES[rule](scaler.journal(), growth_factor, growth_interval)
    if chosen is None:
        return
    chosen = float(np.float32(min(max(chosen, CLAMP[0]), CLAMP[1])))
    checkpoint = scaler.checkpoint()
    fields = {**checkpoint.to_dict(), "scale": chosen, "consecutive_good_steps": 0}
    scaler.load_checkpoint(type(checkpoint).from_dict(fields))


@dataclasses.dataclass
class Run:
    rule: str
    start: float
    seed: int
    precision: str
    skipped: int = 0
    low_steps: int = 0  # steps more than 2x below the highest scale that would have stayed clean
    settled_at: int | None = None  # the step from which the scale stays within 2x below it
    underflow: float = 0.0  # fraction of parameter-gradient elements zero or subnormal in fp16 (clean steps)
    final_loss: float = 0.0  # mean training loss over the last 50 steps
    seconds: float = 0.0
    losses: list[float] = dataclasses.field(default_factory=list)
    scales: list[float] = dataclasses.field(default_factory=list)
    ceilings: list[float] = dataclasses.field(default_factory=list)


def train(args: argparse.Namespace, task: Task, rule: str, start: float, seed: int, device: torch.device) -> Run:
    began = time.perf_counter()
    trainee = build_trainee(gpt2_config(args), seed, args.precision, device, args.lr)
    growth_factor = 2.0
    built_in = rule if rule in BUILT_IN else "pytorch"
    scaler = GradScaler(
        init_scale=start, growth_interval=args.growth_interval, max_scale=None, min_scale=1.0, rule=built_in
    )
    start_grad = torch.ones((), dtype=torch.float32, device=device)  # what the backward pass starts from
    start_view = arrays([start_grad])[0]
    result = Run(rule, start, seed, args.precision)
    small = elements = 0
    for step in range(args.steps):
        tokens = torch.from_numpy(task.tokens[step]).to(device)
        trainee.model.zero_grad(set_to_none=False)  # keep the gradients' memory: the views stay valid
        loss = forward_loss(trainee, tokens)
        scale = scaler.scale_factor()
        start_grad.fill_(1.0)
        scaler.scale_loss(start_view)  # opens the step: start_grad now holds the scale
        peak = BackwardPeak(loss)
        loss.backward(start_grad, retain_graph=True)  # retained for the ceiling's reruns
        ceiling = step_ceiling(loss, trainee.params, peak, scale)
        peak.remove()
        result.losses.append(loss.item())
        del loss  # frees the retained graph before the next forward pass
        grads = [param.grad for param in trainee.params]
        stats = scaler.check(arrays(grads), max_norm=args.clip)
        finite = bool(stats.finite)
        if finite:
            small += small_elements(grads)
            elements += sum(grad.numel() for grad in grads)
            apply_update(trainee, float(stats.factor))
        scaler.update()
        apply_rule(scaler, rule, growth_factor, args.growth_interval)
        result.skipped += not finite
        result.scales.append(scale)
        result.ceilings.append(ceiling)
    summarize(result, args.growth_interval)
    result.underflow = small / max(elements, 1)
    result.seconds = time.perf_counter() - began
    return result


def summarize(result: Run, growth_interval: int) -> None:
    """Fill the run's scale figures from its per-step scales and ceilings, as rule_study does."""
    ceilings = np.asarray(result.ceilings)
    held = [float(ceilings[i : i + growth_interval].min()) for i in range(len(ceilings))]
    result.low_steps = sum(used < clean / 2 for used, clean in zip(result.scales, held))
    within = [clean / 2 <= used for used, clean in zip(result.scales, held)]
    result.settled_at = next((i + 1 for i in range(len(within)) if all(within[i:])), None)
    result.final_loss = float(np.mean(result.losses[-50:]))


def line(run: Run, start_text: str) -> str:
    settled = run.settled_at if run.settled_at is not None else "-"
    return (
        f"{run.rule:13} {start_text:>6} {run.seed:4d} {run.skipped:7d} {run.low_steps:7d} {settled:>7} "
        f"{run.underflow:8.4f} {run.final_loss:8.4f} {run.seconds:7.1f}"
    )


def write_json(
    path: str, found: dict[str, str], args: argparse.Namespace, runs: list[Run], best: dict[int, float]
) -> None:
    with open(path, "w") as file:
        json.dump(
            {"environment": found, "arguments": vars(args), "best_loss": best,
             "runs": [dataclasses.asdict(run) for run in runs]},
            file,
        )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    found = environment(device)
    for key, value in found.items():
        print(f"{key}: {value}")
    config = gpt2_config(args)
    print(
        f"GPT-2 {args.layers} layers, width {args.width}, {args.heads} heads, context {args.context}, vocab "
        f"{args.vocab} ({config._attn_implementation} attention); {args.precision}; batch {args.batch} x "
        f"{args.length} tokens, {args.steps} steps, growth_interval {args.growth_interval}, AdamW lr {args.lr}, "
        f"clip {args.clip}",
        flush=True,
    )
    runs: list[Run] = []
    best: dict[int, float] = {}
    began, last = time.time(), 0.0
    print(f"{'rule':13} {'start':>6} {'seed':>4} {'skipped':>7} {'<ceil/2':>7} {'settled':>7} {'zero|sub':>8} "
          f"{'loss50':>8} {'seconds':>7}")  # fmt: skip
    for seed in args.seeds:
        task = markov_task(seed, args.vocab, args.branches, args.steps, args.batch, args.length)
        best[seed] = task.best_loss
        print(f"# seed {seed}: the chain's entropy, the lowest loss possible: {task.best_loss:.4f}", flush=True)
        for start_text in args.starts:
            start = parse_scale(start_text)
            for rule in args.rules:
                if args.budget_s is not None and time.time() - began + last > args.budget_s:
                    print(f"stopped: the next run would pass --budget-s {args.budget_s:g}")
                    return 0
                run = train(args, task, rule, start, seed, device)
                last = run.seconds
                runs.append(run)
                print(line(run, start_text), flush=True)
                if args.json:
                    write_json(args.json, found, args, runs, best)  # after each run: a timeout keeps the rest
    print(f"{len(runs)} runs of {args.steps} steps in {time.time() - began:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
