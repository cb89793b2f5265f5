"""Compile the kernels once per device and launch them through the driver, one struct argument each.

Modules are compiled on first use, once per device (never at import), with
``cupy.RawModule`` and plain ``extern "C"`` entry points, so CuPy's on-disk
compile cache applies; what is compiled is
:func:`cupy_amp.kernel_interface.compile_source`. A :class:`_Launcher` queues
one driver call per launch on a given stream, from a parameter block reused
launch after launch; :func:`launcher` hands out one per (device, entry point),
its struct taken from :data:`cupy_amp.kernel_interface.ENTRIES`.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import cupy
import numpy as np

from cupy_amp.errors import ScalerProtocolError
from cupy_amp.kernel_interface import ENTRIES, STRUCTS, THREADS, compile_options, compile_source

__all__ = ["MAX_GRID", "StreamOrder", "capturing", "launcher", "order_after", "refuse_capture"]

MAX_GRID = 2**31 - 1  # the most blocks of a launch (gridDim.x); the kernels loop over the chunks beyond it


@cupy.memoize(for_each_device=True)  # type: ignore[untyped-decorator]
def _module(file_name: str) -> cupy.RawModule:
    return cupy.RawModule(code=compile_source(file_name), options=compile_options())


@cupy.memoize(for_each_device=True)  # type: ignore[untyped-decorator]
def _function(file_name: str, entry: str) -> Any:
    function = _module(file_name).get_function(entry)
    return getattr(function, "kernel", function)  # a RawKernel's compiled function for the current device


class _Launcher:
    """A kernel and its one struct argument, kept in host memory and refilled for each launch.

    The driver copies the argument when the launch is queued, so the block can
    be refilled right after; the lock keeps two threads from interleaving.
    """

    def __init__(self, function: Any, dtype: np.dtype[Any], threads: int = THREADS, **fixed: int) -> None:
        self._function = function  # holds the module loaded
        self._threads = threads
        self._record = np.zeros(1, dtype)
        for name, value in fixed.items():
            self._record[name] = value
        self._fields = {name: self._record[name] for name in dtype.names or ()}
        self._params = np.array([self._record.ctypes.data], dtype=np.uint64)  # the driver's void*[1]
        self._addresses = (int(function.ptr), self._params.ctypes.data)
        self._lock = threading.Lock()

    def __call__(self, grid: int, stream: int, **values: Any) -> None:
        """Launch on ``stream`` (a stream pointer) with ``values`` for the changing fields; never synchronizes."""
        function, params = self._addresses
        with self._lock:
            for name, value in values.items():
                self._fields[name][0] = value
            cupy.cuda.driver.launchKernel(function, grid, 1, 1, self._threads, 1, 1, 0, stream, params, 0)


@cupy.memoize(for_each_device=True)  # type: ignore[untyped-decorator]
def launcher(file_name: str, entry: str, *, threads: int = THREADS) -> _Launcher:
    """Return the current device's launcher of ``entry`` in ``file_name`` (compiles and loads it on first use).

    One per device and arguments as passed (``threads`` is keyword-only, so
    each kernel is asked for in one spelling): get it outside a CUDA graph
    capture first, since a capture cannot load modules.
    """
    return _Launcher(_function(file_name, entry), STRUCTS[ENTRIES[file_name][entry]], threads)


def _on_device(device_id: int) -> contextlib.AbstractContextManager[Any]:
    """Make ``device_id`` and its context current for a block; free when they already are (the usual case).

    The launches are driver calls, which need a current context: a new thread
    has none until something makes the device current.
    """
    if cupy.cuda.runtime.getDevice() == device_id:
        if not cupy.cuda.driver.ctxGetCurrent():
            cupy.cuda.runtime.setDevice(device_id)  # makes the device's primary context current in this thread
        return contextlib.nullcontext()
    device: contextlib.AbstractContextManager[Any] = cupy.cuda.Device(device_id)  # switches, context included
    return device


def capturing() -> bool:
    """Return whether the current stream is capturing a CUDA graph."""
    return bool(cupy.cuda.get_current_stream().is_capturing())


def refuse_capture(what: str) -> None:
    """Raise if the current stream is capturing a CUDA graph: ``what`` needs work that a capture cannot record.

    Raises:
        ScalerProtocolError: The stream is capturing.
    """
    if capturing():
        raise ScalerProtocolError(
            f"This call cannot run inside a CUDA graph capture: {what}. Before capturing, call "
            "scaler.prepare(gradients) and pass the GradientSet it returns (or run the step once)."
        )


def order_after(last: Any, stream: Any, refusal: str) -> None:
    """Make ``stream`` wait for the work queued so far on ``last`` (one event), when ``last`` is another stream.

    Free on one stream (the common case): nothing is recorded or waited for.

    Raises:
        ScalerProtocolError: ``stream`` is capturing a CUDA graph (a capture cannot wait for work outside
            it); the message is ``refusal``.
    """
    if last is None or last.ptr == stream.ptr:
        return
    if stream.is_capturing():
        raise ScalerProtocolError(refusal)
    event = cupy.cuda.Event(disable_timing=True)
    event.record(last)
    stream.wait_event(event)


class StreamOrder:
    """The order of a scaler state's work across streams: its writes, and every read of its statistics record.

    A write (any of the scaler's kernels) on a stream first waits for the last
    write if that went to another stream, and for every read since it on
    another stream: an event per reading stream, so any number of optimizers
    on any number of streams finish reading a record before it is rewritten.
    A read (an optimizer step) waits for the last write. On one stream (the
    common case, and the only one inside a CUDA graph capture) nothing is
    recorded or waited for.
    """

    def __init__(self, refusal: str) -> None:
        self._refusal = refusal  # the error's text for work a capture would have to wait for
        self._lock = threading.Lock()  # the streams are read and replaced in one step
        self._writer: Any = None  # where the last write went (None: all of it is done)
        self._readers: dict[int, tuple[Any, Any]] = {}  # stream pointer -> (stream, event after its last read)

    def write(self, stream: Any) -> None:
        """Order a write on ``stream`` after the last write and every read since it.

        Raises:
            ScalerProtocolError: ``stream`` is capturing and that work is on another stream.
        """
        with self._lock:
            order_after(self._writer, stream, self._refusal)
            for reader, event in self._readers.values():
                if reader.ptr != stream.ptr:
                    if stream.is_capturing():
                        raise ScalerProtocolError(self._refusal)
                    stream.wait_event(event)
            self._writer, self._readers = stream, {}

    def read(self, stream: Any) -> None:
        """Order a read on ``stream`` after the last write.

        Raises:
            ScalerProtocolError: ``stream`` is capturing and that write is on another stream.
        """
        with self._lock:
            order_after(self._writer, stream, self._refusal)

    def read_done(self, stream: Any) -> None:
        """Note that work queued on ``stream`` reads the record: the next write waits for it."""
        with self._lock:
            if self._writer is not None and stream.ptr == self._writer.ptr:
                return  # the next write, on this stream or after an event on it, comes after it anyway
            event = cupy.cuda.Event(disable_timing=True)
            event.record(stream)
            self._readers[stream.ptr] = (stream, event)

    def settled(self) -> None:
        """Forget every stream: the device was synchronized, so all the work is done."""
        with self._lock:
            self._writer, self._readers = None, {}
