"""Let Chainer 7.8.1 import on NumPy 2, when you ask: the two names it needs that NumPy 2 no longer has.

Chainer 7.8.1 reads ``numpy.sctypes`` (``chainer.functions.array.as_strided``)
and imports ``numpy.distutils.system_info`` (``chainer._environment_check``);
NumPy 2 removed the first, and the second on Python 3.12 and later. CuPy 14
needs NumPy 2, so Chainer on CuPy 14 needs both back. cupy-amp never calls
this itself: NumPy is changed only by a program that calls it.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np

__all__ = ["chainer_on_numpy2"]


def _no_info(name: str, notfound_action: int = 0) -> dict[str, Any]:
    """``numpy.distutils.system_info.get_info``: no library information (Chainer only logs what it finds)."""
    return {}


def chainer_on_numpy2() -> None:
    """Give NumPy 2 what Chainer 7.8.1 imports; call it before ``import chainer``. Does nothing on NumPy 1.

    Sets ``numpy.sctypes`` (the scalar types by kind, as NumPy 1 lists them)
    unless it exists, and, where ``numpy.distutils.system_info`` does not import
    (NumPy 2 on Python 3.12+), a stand-in module whose ``get_info`` returns ``{}``.
    """
    if int(np.__version__.split(".")[0]) < 2:
        return
    if "sctypes" not in vars(np):
        np.sctypes = {  # type: ignore[attr-defined]
            "int": [np.int8, np.int16, np.int32, np.int64],
            "uint": [np.uint8, np.uint16, np.uint32, np.uint64],
            "float": [np.float16, np.float32, np.float64, np.longdouble],
            "complex": [np.complex64, np.complex128, np.clongdouble],
            "others": [bool, object, bytes, str, np.void],
        }
    if "numpy.distutils.system_info" in sys.modules:
        return
    try:
        import numpy.distutils.system_info  # noqa: F401  # NumPy 2 on Python < 3.12 still has it
    except ImportError:
        package = sys.modules.get("numpy.distutils") or types.ModuleType("numpy.distutils")
        package.__path__ = getattr(package, "__path__", [])
        module = types.ModuleType("numpy.distutils.system_info")
        module.get_info = _no_info  # type: ignore[attr-defined]
        package.system_info = module  # type: ignore[attr-defined]
        sys.modules["numpy.distutils"], sys.modules["numpy.distutils.system_info"] = package, module
