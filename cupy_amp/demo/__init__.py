"""``cupy-amp demo``: a hand-written fp16 training loop around the loss scaler.

Modules, in the order data flows: ``options`` (flags and settings),
``device`` (NumPy or CuPy), ``data`` (the task), ``model`` (the network and
Adam, by hand), ``train`` (the loop and the scaler protocol), ``state``
(checkpoints), ``report`` (all output), ``plot`` (the optional figure) and
``command`` (the subcommand itself). Importing this package imports nothing
else: ``cupy-amp`` builds its parser from ``options`` alone, and CuPy is
imported only when the GPU is chosen.
"""
