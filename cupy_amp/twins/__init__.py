"""The NumPy twins of the CUDA kernels: one module per file of ``kernels/``, with its stem.

The kernels' sources stay in the top-level ``kernels/`` (shipped as ``cupy_amp.kernels``); a source
checkout imports the package from ``cupy_amp/``, so the twins live here, each under its kernel's name:

- ``kernels/scale_loss.cu``    -> :mod:`cupy_amp.twins.scale_loss` (the loss times the scale, in place);
- ``kernels/unscale_check.cu`` -> :mod:`cupy_amp.twins.unscale_check` (inf/nan found, then the unscale);
- ``kernels/grad_stats.cu``    -> :mod:`cupy_amp.twins.grad_stats` (the statistics pass, its report, the
  finished record);
- ``kernels/step_state.cu``    -> :mod:`cupy_amp.twins.step_state` (``HostState``: a scaler's state and its
  one-thread steps, the update rule being :func:`cupy_amp.rule.next_state`);
- ``kernels/optimizer.cuh``   -> :mod:`cupy_amp.twins.optimizer` (what every fused optimizer shares), and
  ``kernels/adamw.cu``, ``kernels/sgd.cu`` -> :mod:`cupy_amp.twins.adamw`, :mod:`cupy_amp.twins.sgd`.

Each is the NumPy path itself, and the reference its kernel matches (bit for bit where the kernel's
comments say so). :mod:`cupy_amp.numpy_backend` is the NumPy arrays' backend over them.
"""
