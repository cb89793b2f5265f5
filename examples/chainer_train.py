"""Train a float16 MLP with a Chainer 7.8 Trainer and a cupy-amp GradScaler attached to its optimizer.

The data: the demo's five interleaved spirals, generated (nothing is downloaded).
The model computes in float16 (``chainer.config.dtype = float16``), its logits are
cast to float32 before the loss, and Adam updates fp32 master weights
(``use_fp32_update()``). Needs Chainer 7.8.1 (and so NumPy < 2).

    python examples/chainer_train.py                       # NumPy, about 20 s on 2 cores
    python examples/chainer_train.py --log2-loss-weight -24  # gradients 2**-24 as large: fp16 alone would flush
                                                             # many to zero; scaled, the run trains as before
    python examples/chainer_train.py --device gpu          # CuPy (@cupy:0); on NumPy 2 (CuPy 14) too

It prints the training steps per second: each update (the batch's transfer,
the forward and backward passes, the scaler's check and Adam), from the second
on; the evaluation, the log and the snapshot are left out.
"""

import argparse
import time

from cupy_amp.chainer import chainer_on_numpy2

chainer_on_numpy2()  # Chainer 7.8.1 on NumPy 2 (CuPy 14): the two names it imports; nothing on NumPy 1

import chainer  # noqa: E402
import chainer.functions as F  # noqa: E402
import chainer.links as L  # noqa: E402
import numpy as np  # noqa: E402
from chainer.training import extensions  # noqa: E402

from cupy_amp import GradScaler  # noqa: E402
from cupy_amp.chainer import attach  # noqa: E402
from cupy_amp.demo.model import load_dataset  # noqa: E402

parser = argparse.ArgumentParser(description="A Chainer Trainer run in float16 with cupy-amp's loss scaler.")
parser.add_argument("--epochs", type=int, default=20)
parser.add_argument("--batch-size", type=int, default=256)
parser.add_argument("--log2-loss-weight", type=int, default=0, help="multiply the loss by 2**N (try -24)")
parser.add_argument("--device", default="cpu", help="cpu, gpu, or a Chainer device (@numpy, @cupy:1)")
parser.add_argument("--out", default="result", help="where the log and the last snapshot go")
args = parser.parse_args()
weight = 2.0**args.log2_loss_weight
np.seterr(over="ignore", invalid="ignore")  # float16 overflow is expected now and then: the scaler skips those steps


class MLP(chainer.Chain):
    def __init__(self, classes: int) -> None:
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(None, 64)
            self.l2 = L.Linear(64, 64)
            self.l3 = L.Linear(64, classes)

    def forward(self, x):
        return F.cast(self.l3(F.relu(self.l2(F.relu(self.l1(x))))), "float32")  # a float32 loss follows


data = load_dataset("spirals", seed=0)
chainer.config.dtype = np.dtype(np.float16)
train = chainer.datasets.TupleDataset(data.x_train.astype(np.float16), data.y_train.astype(np.int32))
test = chainer.datasets.TupleDataset(data.x_eval.astype(np.float16), data.y_eval.astype(np.int32))
device = chainer.get_device({"cpu": "@numpy", "gpu": "@cupy:0"}.get(args.device, args.device))
model = L.Classifier(MLP(data.classes), lossfun=lambda y, t: F.softmax_cross_entropy(y, t) * weight)
model.to_device(device)
optimizer = chainer.optimizers.Adam(alpha=3e-3, eps=1e-8 * weight)  # eps follows the loss's scale
optimizer.setup(model)
optimizer.use_fp32_update()
attachment = attach(optimizer, GradScaler(init_scale=2.0**16, growth_interval=200))

train_iter = chainer.iterators.SerialIterator(train, args.batch_size)
test_iter = chainer.iterators.SerialIterator(test, len(test), repeat=False, shuffle=False)
updater = chainer.training.updaters.StandardUpdater(train_iter, optimizer, device=device)
trainer = chainer.training.Trainer(updater, (args.epochs, "epoch"), out=args.out)
trainer.extend(attachment.extension())  # reports loss_scale and skipped_steps; snapshots carry the scaler
trainer.extend(extensions.Evaluator(test_iter, model, device=device))
trainer.extend(extensions.snapshot(filename="snapshot"), trigger=(args.epochs, "epoch"))
trainer.extend(extensions.LogReport())
trainer.extend(
    extensions.PrintReport(
        ["epoch", "main/loss", "main/accuracy", "validation/main/accuracy", "loss_scale", "skipped_steps"]
    )
)
update_seconds: list[float] = []  # each update's wall time, its device work included
update_core = updater.update_core
synchronize = getattr(device, "synchronize", lambda: None)  # a GPU's; the host has nothing to wait for


def timed_update_core() -> None:
    start = time.perf_counter()
    update_core()
    synchronize()
    update_seconds.append(time.perf_counter() - start)


updater.update_core = timed_update_core
trainer.run()
steady = update_seconds[1:]  # the first update compiles kernels and builds the masters
if steady:
    print(f"{len(steady)} steps in {sum(steady):.2f} s: {len(steady) / sum(steady):.0f} steps/s on {device}")
print(f"final: {attachment.scaler.stats()}")
