"""Matrix products for the demo's device step, through a cuBLAS handle of the step's own: capturable in a graph.

CuPy's cuBLAS binding refuses every call made during a stream capture (it
binds its shared handle to the current stream first, cupy/cupy#6290), yet
cuBLAS itself can be captured when its handle is bound to the capturing stream
and owns a workspace, so nothing is allocated while the graph is recorded. So
this module calls the library CuPy loaded directly, through ``ctypes``, with one
such handle per :class:`Products`. A product takes fp16 operands, sums in fp32
(reductions too, never in the fp16 output type) and rounds the result to fp16,
as :func:`cupy_amp.demo.model.forward` computes it.
"""

from __future__ import annotations

import ctypes
import sys
import weakref
from typing import Any

import cupy
import numpy as np

from cupy_amp.demo.settings import DemoError

__all__ = ["Products"]

_OP_N, _OP_T = 0, 1  # cublasOperation_t
_R_16F = 2  # cudaDataType_t
_COMPUTE_32F = 68  # cublasComputeType_t
_GEMM_DEFAULT = -1  # cublasGemmAlgo_t
_NO_REDUCED_PRECISION_REDUCTION = 16  # cublasMath_t: split-K partial sums stay fp32
_WORKSPACE_BYTES = 32 << 20  # what NVIDIA's cuBLAS guide suggests for Hopper; more than enough before it


def _library() -> ctypes.CDLL:
    """Return the cuBLAS that CuPy loaded (the soname finds the copy already in the process).

    Raises:
        DemoError: CuPy's cuBLAS does not load.
    """
    try:
        from cupy_backends.cuda.libs import cublas as cupy_cublas  # loads the library: not at import time

        major = cupy_cublas.getVersion(cupy.cuda.device.get_cublas_handle()) // 10000
        name = f"cublas64_{major}.dll" if sys.platform == "win32" else f"libcublas.so.{major}"
        library = ctypes.CDLL(name)
    except (ImportError, OSError, RuntimeError) as exc:  # pathfinder's not-found error is a RuntimeError
        raise DemoError(f"the demo's device step calls cuBLAS, which does not load: {exc}") from exc
    pointer, integer = ctypes.c_void_p, ctypes.c_int
    library.cublasCreate_v2.argtypes = [ctypes.POINTER(pointer)]
    library.cublasDestroy_v2.argtypes = [pointer]
    library.cublasSetStream_v2.argtypes = [pointer, pointer]
    library.cublasSetWorkspace_v2.argtypes = [pointer, pointer, ctypes.c_size_t]
    library.cublasSetMathMode.argtypes = [pointer, integer]
    # handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, compute, algo
    library.cublasGemmEx.argtypes = [pointer, integer, integer, integer, integer, integer, pointer, pointer, integer]
    library.cublasGemmEx.argtypes += [integer, pointer, integer, integer, pointer, pointer, integer, integer]
    library.cublasGemmEx.argtypes += [integer, integer]
    return library


def _check(status: int, call: str) -> None:
    if status != 0:
        raise DemoError(f"cuBLAS {call} failed with status {status} (a cublasStatus_t)")


class Products:
    """Matrix products on one stream, for 2-D C-contiguous fp16 arrays; each call is one cuBLAS launch.

    The handle is bound to ``stream`` for good and owns its workspace, so the
    calls can be captured in a CUDA graph on that stream (or run eagerly on it).
    Nothing here synchronizes the device.
    """

    def __init__(self, stream: cupy.cuda.Stream) -> None:
        self._library = library = _library()
        handle = ctypes.c_void_p()
        _check(library.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        self._handle = handle
        # The handle is destroyed with this object; the workspace (below) outlives every call it serves.
        weakref.finalize(self, library.cublasDestroy_v2, handle)
        self._workspace = cupy.empty(_WORKSPACE_BYTES, cupy.uint8)
        # SetStream drops a workspace set before it, so the workspace comes second.
        _check(library.cublasSetStream_v2(handle, stream.ptr), "cublasSetStream")
        _check(library.cublasSetWorkspace_v2(handle, self._workspace.data.ptr, _WORKSPACE_BYTES), "cublasSetWorkspace")
        _check(library.cublasSetMathMode(handle, _NO_REDUCED_PRECISION_REDUCTION), "cublasSetMathMode")
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def bind(self, a: Any, b: Any, out: Any, *, transpose_a: bool = False, transpose_b: bool = False) -> _Product:
        """Return the call ``out = op(a) @ op(b)`` (op: a transpose where asked) with its arguments fixed.

        The arrays must keep their buffers (a graph replays the addresses); the
        returned call holds them, so they live as long as it does.

        Raises:
            ValueError: An array is not 2-D C-contiguous fp16, or the shapes do not chain.
        """
        for name, array in (("a", a), ("b", b), ("out", out)):
            if array.dtype != np.float16 or array.ndim != 2 or not array.flags.c_contiguous:
                raise ValueError(
                    f"{name!r}: expected a 2-D C-contiguous float16 array, got {array.dtype} {array.shape}"
                )
        rows, inner = a.shape[::-1] if transpose_a else a.shape
        inner_b, cols = b.shape[::-1] if transpose_b else b.shape
        if inner != inner_b or out.shape != (rows, cols):
            transposes = f"transpose_a={transpose_a}, transpose_b={transpose_b}"
            raise ValueError(f"cannot multiply {a.shape} by {b.shape} into {out.shape} ({transposes})")
        # cuBLAS is column-major: a row-major (r, c) array is its (c, r) transpose, so out.T = op(b).T @ op(a).T.
        arguments = (
            self._handle,
            _OP_T if transpose_b else _OP_N,
            _OP_T if transpose_a else _OP_N,
            cols,
            rows,
            inner,
            ctypes.addressof(self._one),
            b.data.ptr,
            _R_16F,
            b.shape[1],
            a.data.ptr,
            _R_16F,
            a.shape[1],
            ctypes.addressof(self._zero),
            out.data.ptr,
            _R_16F,
            cols,
            _COMPUTE_32F,
            _GEMM_DEFAULT,
        )
        return _Product(self, arguments, (a, b, out))


class _Product:
    """One bound ``cublasGemmEx`` call (see :meth:`Products.bind`)."""

    def __init__(self, products: Products, arguments: tuple[Any, ...], arrays: tuple[Any, ...]) -> None:
        self._gemm = products._library.cublasGemmEx
        self._arguments = arguments
        self._keep = (products, arrays)  # the handle, its workspace and the operands outlive the call

    def __call__(self) -> None:
        _check(self._gemm(*self._arguments), "cublasGemmEx")
