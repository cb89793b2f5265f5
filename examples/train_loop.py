"""The shortest complete fp16 training loop with cupy-amp's GradScaler.

Run with NumPy:  python examples/train_loop.py
Run with CuPy:   python examples/train_loop.py --gpu
"""

import argparse
import sys

import numpy as np

from cupy_amp import GradScaler

parser = argparse.ArgumentParser(description="Train a two-layer classifier in fp16 with cupy-amp's GradScaler.")
parser.add_argument("--gpu", action="store_true", help="run on a GPU through CuPy (default: the CPU through NumPy)")
xp = np
if parser.parse_args().gpu:
    try:
        import cupy as xp

        xp.arange(2).sum()  # a GPU and a working CUDA install, not just the package
    except Exception as exc:
        sys.exit(
            f"--gpu: no usable GPU ({type(exc).__name__}: {str(exc).splitlines()[0]}); run without --gpu for the CPU"
        )
np.seterr(over="ignore", invalid="ignore")  # fp16 overflow is expected now and then: the scaler catches it

rng = np.random.default_rng(0)
x_all = rng.standard_normal((4096, 16)).astype(np.float32)
y_all = (x_all[:, :8].sum(axis=1) > x_all[:, 8:].sum(axis=1)).astype(np.int64)  # a rule to learn
x_all, y_all = xp.asarray(x_all), xp.asarray(y_all)
shapes = {"W1": (16, 64), "W2": (64, 2)}
master = {name: xp.asarray(rng.normal(0, 0.25, shape), dtype=xp.float32) for name, shape in shapes.items()}
velocity = {name: xp.zeros_like(w) for name, w in master.items()}  # SGD momentum, fp32
grads = {name: xp.zeros_like(w) for name, w in master.items()}  # fp32 master gradients, reused every step
scaler = GradScaler(init_scale=2.0**16, growth_interval=100)
batch = 256

for step in range(1, 301):
    start = (step * batch) % len(y_all)
    x, y = x_all[start : start + batch].astype(xp.float16), y_all[start : start + batch]
    w1, w2 = master["W1"].astype(xp.float16), master["W2"].astype(xp.float16)  # fp16 working weights
    h = xp.maximum(x @ w1, 0)  # fp16 forward pass
    logits = (h @ w2).astype(xp.float32)
    p = xp.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    loss = xp.array(-xp.log(p[xp.arange(batch), y]).mean())  # a 0-d fp32 array
    loss_value = float(loss)
    scaler.scale_loss(loss)  # 1. loss *= scale, in place
    # 2. Backward from the scaled loss: d(scaled loss)/d(loss) = scale seeds the fp16 backward pass.
    d_logits = p.copy()
    d_logits[xp.arange(batch), y] -= 1
    d_logits = (d_logits * (scaler.scale_factor() / batch)).astype(xp.float16)
    grads["W2"][...] = h.T @ d_logits  # fp16 gradients, upcast into the fp32 buffers
    grads["W1"][...] = x.T @ ((d_logits @ w2.T) * (h > 0))
    if scaler.unscale_and_check(grads):  # 3. divide by the scale; False if any gradient held inf/nan
        for name, w in master.items():  # 4. optimizer step on the fp32 masters, only when finite
            velocity[name] = 0.9 * velocity[name] + grads[name]
            w -= 0.05 * velocity[name]
    else:
        print(f"step {step}: overflow in {scaler.nonfinite_gradients()}, step skipped")
    scaler.update()  # 5. back off after an overflow, grow after growth_interval clean steps
    if step % 50 == 0:
        accuracy = float((p.argmax(axis=1) == y).mean())
        print(f"step {step}: loss {loss_value:.4f}, accuracy {accuracy:.1%}, scale {scaler.scale_factor():g}")
