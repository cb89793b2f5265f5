"""``python -m cupy_amp``: the ``cupy-amp`` command line."""

from cupy_amp.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
