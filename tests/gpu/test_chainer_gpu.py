"""The Chainer integration's tests on CuPy arrays: every test of tests/integrations/test_chainer.py, collected here
with its ``device`` fixture set to "@cupy:0" (fp16 parameters with fp32 masters, skips that leave Adam's state
untouched, hooks on unscaled gradients, Trainer snapshots resumed bit for bit, the culprits' names, the example
and the benchmark).

Chainer 7.8.1 must be importable (on NumPy 2, as on the GPU machine, through ``chainer_on_numpy2()``, which the
imported module calls); skipped otherwise, with the reason.
"""

from __future__ import annotations

import pytest

pytest.importorskip("cupy")

from integrations.test_chainer import *  # noqa: F403  (the tests, the helpers and the on_device fixture)
from integrations.test_chainer import _quiet_fp16  # noqa: F401  (autouse; a star import leaves it out)


@pytest.fixture
def device() -> str:
    return "@cupy:0"
