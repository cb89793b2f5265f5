"""Turn ``scale_loss`` and ``unscale_and_check`` arguments into validated arrays.

Everything that can be wrong with an argument is found here, before any array
is touched: its type, dtype, writability and alignment, elements repeated
within one array, memory shared by two arrays of a call (:func:`parse_gradients`);
memory shared with an array an earlier call of the step unscaled is
:mod:`cupy_amp.claims`' to find.
A parsed call is plain data (:class:`Call`) that the scaler hands to the
backend that owns its arrays: :mod:`cupy_amp.numpy_backend` or
:mod:`cupy_amp.gpu.backend` (imported only when a GPU array shows up).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Hashable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from cupy_amp import numpy_backend
from cupy_amp.dtypes import bfloat16, dtype_name, is_bfloat16
from cupy_amp.errors import DuplicateGradientError, GradientTypeError, GradientValueError, ScalerProtocolError
from cupy_amp.state import Backend, Call, Footprint

__all__ = [
    "CallCache",
    "GradientSet",
    "describe",
    "parse_gradients",
    "parse_loss",
    "shares_memory",
]


def describe(label: Hashable) -> str:
    """Name a gradient for a message: ``gradient #3`` or ``gradient 'fc1.W'``."""
    return f"gradient #{label}" if type(label) is int else f"gradient {label!r}"


def _cupy_backend() -> Backend | None:
    try:
        from cupy_amp.gpu import backend
    except ImportError:  # no CuPy: the NumPy path works without it
        return None
    return backend


def _backend_of(obj: Any) -> tuple[Backend, Any] | None:
    """Return the backend module for ``obj`` and ``obj`` as that backend's array, or None."""
    if isinstance(obj, np.ndarray):
        # A view of our own, whose layout no other thread can change between validation and the multiply
        # (NumPy arrays' strides and dtype are settable in place); a subclass (a masked array, a matrix)
        # is so judged and unscaled on its data, never through its own arithmetic.
        return numpy_backend, numpy_backend.as_array(obj)
    module = type(obj).__module__ or ""
    gpu_like = (
        module.startswith("cupy")
        or hasattr(obj, "__cuda_array_interface__")
        or (hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"))
    )
    backend = _cupy_backend() if gpu_like else None
    if backend is None:
        return None
    array = backend.as_array(obj)
    return None if array is None else (backend, array)


def _problem(backend: Backend, array: Any, source: Any) -> tuple[type[Exception], str] | None:
    """Return (error class, reason) if ``array`` (made from ``source``) cannot be modified in place, else None."""
    if dtype_name(array.dtype) is None:
        return GradientTypeError, (
            f"dtype {array.dtype} is not supported (expected float16, float32 or float64; bfloat16 too, "
            "with the ml_dtypes package)"
        )
    problem = backend.write_problem(array, source)
    if problem is not None:
        return GradientValueError, problem
    if _repeats_elements(array.shape, array.strides, array.itemsize):
        return GradientValueError, (
            f"its elements overlap in memory (shape {array.shape}, strides {array.strides}, as from broadcasting "
            "or as_strided), so some would be multiplied twice"
        )
    return None


def _repeats_elements(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """Return True unless the layout provably gives every element bytes of its own.

    Dimensions sorted by stride must each step over everything the smaller
    ones span. Every layout made by slicing, transposing or reshaping a
    contiguous array passes; a layout that fails may still be disjoint (an
    exotic ``as_strided``), and is refused all the same.
    """
    if 0 in shape:
        return False
    span = itemsize
    for stride, extent in sorted((abs(stride), extent) for extent, stride in zip(shape, strides) if extent > 1):
        if stride < span:
            return True
        span += stride * (extent - 1)
    return False


def _footprint(backend: Backend, array: Any) -> Footprint:
    address, device = backend.location(array)
    start = stop = address
    if array.size:
        for extent, stride in zip(array.shape, array.strides):
            if stride < 0:
                start += (extent - 1) * stride
            else:
                stop += (extent - 1) * stride
        stop += array.itemsize
    return Footprint(start, stop, address, array.shape, array.strides, array.itemsize, device)


def shares_memory(first: Footprint, second: Footprint) -> bool:
    """Return True if two footprints (whose extents overlap) may share a byte."""
    try:
        return bool(np.shares_memory(_Layout(first).view(), _Layout(second).view(), max_work=10_000))  # type: ignore[arg-type]
    except np.exceptions.TooHardError:
        return True  # cannot prove them disjoint: treat as shared


class _Layout:
    """A footprint as NumPy's array interface, so NumPy can solve overlaps on addresses it never reads."""

    def __init__(self, footprint: Footprint) -> None:
        self.__array_interface__ = {
            "data": (footprint.address, False),
            "shape": footprint.shape,
            "strides": footprint.strides,
            "typestr": f"|V{footprint.itemsize}",
            "version": 3,
        }

    def view(self) -> np.ndarray:
        return np.asarray(self)


def parse_loss(loss: Any) -> tuple[Backend, Any]:
    """Return the backend and array for a loss, or raise if it cannot be scaled in place."""
    found = _backend_of(loss)
    if found is None and isinstance(loss, np.generic):  # what NumPy's .mean() and .sum() return
        raise GradientTypeError(
            f"scale_loss got a NumPy scalar ({type(loss).__name__}), which cannot be changed in place. Pass a 0-d "
            "array instead, loss = np.asarray(loss) (or compute the loss with keepdims or np.mean(..., out=...)), "
            "and seed the backward pass from that array once scale_loss has scaled it."
        )
    if found is None:
        raise GradientTypeError(
            f"scale_loss expected a NumPy or CuPy float array (it scales in place; a 0-d array is fine), "
            f"got {type(loss).__name__}."
        )
    backend, array = found
    if is_bfloat16(array.dtype):
        raise GradientTypeError(
            "scale_loss cannot scale a bfloat16 loss: bfloat16 needs no loss scaling. Skip scale_loss and use a "
            "guard scaler (GradScaler.guard()) whose check(gradients) finds inf/nan and clips."
        )
    if array.dtype == np.float16:
        # Refused on every scaler, guards and a disabled GradScaler included (they scale by 1, so nothing would
        # overflow there): parsing reads no scaler state, and a loop must not work only while scaling is off.
        raise GradientTypeError(
            "scale_loss cannot scale a float16 loss: a float16 loss times the scale (65536 by default) is inf in "
            "float16 (its largest value is 65504). Compute the loss in float32 (cast the logits or the loss with "
            ".astype(float32) before the reduction); the backward pass can still run in float16. PyTorch's "
            "GradScaler.scale() promotes a float16 loss to float32 likewise."
        )
    problem = _problem(backend, array, loss)
    if problem is not None:
        error, reason = problem
        raise error(f"scale_loss cannot scale this loss in place: {reason}.")
    return backend, array


def parse_gradients(
    gradients: Any, cache: CallCache | None = None, *, one_device: str | None = None, in_place: bool = True
) -> Call:
    """Validate the ``gradients`` argument of ``unscale_and_check`` and prepare its run.

    Accepts an iterable of arrays (``None`` entries skipped, their positions
    still counted), a mapping name -> array, or a :class:`GradientSet`. A call
    whose arrays cannot change layout in place is looked up in, and stored
    into, ``cache``; every other call is validated in full. ``one_device``,
    when given, is the reason a call must have all its arrays on one device.

    Raises:
        GradientTypeError: Not an iterable/mapping, an entry that is not a
            supported float array, or NumPy and CuPy arrays mixed in one call.
        GradientValueError: A read-only, misaligned or self-overlapping array,
            or (with ``one_device``) arrays on several devices.
        DuplicateGradientError: Two entries share memory.
    """
    call = gradients._call if type(gradients) is GradientSet else None
    if call is None or not call.cacheable:
        call = cache.lookup(gradients) if cache is not None else None
    fresh = call is None
    if call is None:
        call = _parse(gradients)
    if in_place and call.bfloat16:
        raise GradientTypeError(
            "unscale_and_check cannot take bfloat16 gradients (they are never unscaled in place): use "
            "check(gradients), which only reads them, with a guard scaler (GradScaler.guard())."
        )
    if one_device is not None and len(call.devices) > 1:
        raise GradientValueError(f"{one_device}; got devices {list(call.devices)}.")
    if call.backend is not None and type(gradients) is not GradientSet and call.backend.capturing():
        raise ScalerProtocolError(
            "A CUDA graph capture needs the gradients as the GradientSet from scaler.prepare(gradients): the set "
            "keeps the device tables the graph replays alive for as long as the set lives, where the tables of a "
            "plain list or dict can be freed by later calls. Capture with the set, and keep it while the graph is "
            "replayed."
        )
    if fresh:  # every refusal is above: only a call that will run gets device work
        call = _prepared(call)
        if cache is not None and call.cacheable:
            cache.store(gradients, call)
    return call


def _prepared(call: Call) -> Call:
    """Return ``call`` with its backend's plan (CuPy: device tables, built or found in the table cache)."""
    if call.backend is None:
        return call
    return call._replace(plan=call.backend.prepare(call.arrays))


def _parse(gradients: Any) -> Call:
    labels: list[Hashable] = []
    arrays: list[Any] = []
    backend: Backend | None = None
    first_label: Hashable = None
    native = True
    for label, entry in _entries(gradients):
        if entry is None:
            continue
        found = _backend_of(entry)
        if found is None:
            raise GradientTypeError(
                f"{describe(label)}: expected a NumPy or CuPy float array, got {type(entry).__name__}."
            )
        entry_backend, array = found
        if backend is None:
            backend, first_label = entry_backend, label
        elif entry_backend is not backend:
            raise GradientTypeError(
                f"{describe(label)} is a {entry_backend.NAME} array but {describe(first_label)} is a "
                f"{backend.NAME} array; pass arrays of one kind per unscale_and_check call."
            )
        problem = _problem(entry_backend, array, entry)
        if problem is not None:
            error, reason = problem
            where = ":" if error is GradientTypeError else " cannot be unscaled in place:"
            raise error(f"{describe(label)}{where} {reason}.")
        labels.append(label)
        arrays.append(array)
        # A remembered call must stand for the very objects passed: not for CUDA arrays of other libraries,
        # wrapped anew on every call (their memory can change behind the same object).
        native = native and (array is entry or isinstance(entry, np.ndarray))
    if backend is None:
        return Call((), (), None, (), None, False)
    footprints = tuple(_footprint(backend, array) for array in arrays)
    _refuse_shared_memory(labels, footprints)
    cacheable = native and backend.LAYOUT_FIXED
    has_bfloat16 = bfloat16() is not None and any(is_bfloat16(array.dtype) for array in arrays)
    devices = tuple(sorted({footprint.device for footprint in footprints}))
    return Call(tuple(labels), tuple(arrays), backend, footprints, None, cacheable, has_bfloat16, devices)


def _refuse_shared_memory(labels: list[Hashable], footprints: tuple[Footprint, ...]) -> None:
    """Raise if two arrays of one call share memory; only arrays whose extents overlap are solved exactly."""
    order = sorted(range(len(footprints)), key=lambda i: footprints[i].start)
    active: list[int] = []
    for i in order:
        footprint = footprints[i]
        active = [j for j in active if footprints[j].stop > footprint.start]
        for j in active:
            if shares_memory(footprints[j], footprint):
                first, second = sorted((i, j))
                raise DuplicateGradientError(
                    f"{describe(labels[first])} and {describe(labels[second])} share memory: unscaling both would "
                    f"divide the shared elements twice. Pass each gradient once."
                )
        if footprint.stop > footprint.start:
            active.append(i)


def _entries(gradients: Any) -> Iterable[tuple[Hashable, Any]]:
    if type(gradients) is GradientSet:
        return gradients.entries()
    if isinstance(gradients, Mapping):
        return list(gradients.items())
    if isinstance(gradients, (str, bytes)) or _is_single_array(gradients):
        raise GradientTypeError(
            f"unscale_and_check expected an iterable of gradient arrays or a mapping name -> array, "
            f"got a single {type(gradients).__name__}; wrap it in a list: unscale_and_check([grad])."
        )
    try:
        return list(enumerate(gradients))
    except TypeError:
        raise GradientTypeError(
            f"unscale_and_check expected an iterable of gradient arrays or a mapping name -> array, "
            f"got {type(gradients).__name__}."
        ) from None


def _is_single_array(obj: Any) -> bool:
    return hasattr(obj, "__array_interface__") or hasattr(obj, "__cuda_array_interface__") or hasattr(obj, "dtype")


class GradientSet:
    """A fixed, validated collection of gradient arrays, recognised in O(1) every step.

    ``unscale_and_check`` accepts plain lists, tuples and dicts and recognises
    them when the same CuPy arrays come back (a scan over the entries).
    Wrapping the gradients once in a ``GradientSet`` (a list, tuple or mapping
    name -> array; ``None`` entries allowed) removes even that scan: the set is
    immutable, and CuPy arrays cannot change their memory layout in place, so
    passing the same set again needs no per-gradient work on the host. NumPy
    arrays can (their strides, dtype and writability are settable), so a set
    of NumPy arrays is validated again on every call. Useful with thousands of
    gradient arrays that live as long as the model.

    The set holds its arrays; it is validated on construction with the same
    rules as ``unscale_and_check``.
    """

    __slots__ = ("__weakref__", "_call", "_keys", "_values")

    def __init__(self, gradients: Any) -> None:
        if isinstance(gradients, Mapping):
            self._keys: tuple[Hashable, ...] | None = tuple(gradients)
            self._values: tuple[Any, ...] = tuple(gradients.values())
        else:
            self._keys = None
            self._values = tuple(value for _, value in _entries(gradients))
        self._call: Call | None = None
        self._call = _prepared(_parse(self))  # the set holds its device tables for its whole life

    def entries(self) -> list[tuple[Hashable, Any]]:
        """Return (position or name, array or None) pairs, in order."""
        labels = self._keys if self._keys is not None else range(len(self._values))
        return list(zip(labels, self._values))

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)

    def __repr__(self) -> str:
        kind = "names" if self._keys is not None else "positions"
        arrays = sum(value is not None for value in self._values)
        return f"GradientSet({len(self._values)} entries by {kind}, {arrays} arrays)"


def _dead() -> None:
    return None


class _Remembered(NamedTuple):
    refs: tuple[Any, ...]  # weak references to the entries (a function returning None for a None entry)
    alive: list[bool]  # set to [False] by a callback when any entry dies, before its id can be reused
    has_none: bool
    call: Call  # with no arrays: the cache never keeps a gradient alive


class CallCache:
    """The few most recent list, tuple or dict arguments (one per optimizer, say) and their calls.

    An argument is recognised when every entry is the very same object as
    before, in the same order; a dict's keys are read afresh, so renamed
    entries are reported under their new names.
    """

    def __init__(self, capacity: int = 4) -> None:
        self._capacity = capacity
        self._remembered: list[_Remembered] = []

    def lookup(self, gradients: Any) -> Call | None:
        """Return the call for ``gradients`` if its entries are those of a remembered call, else None."""
        kind = type(gradients)
        if kind is list or kind is tuple:
            keys, values = None, gradients
        elif kind is dict:
            keys, values = tuple(gradients), tuple(gradients.values())
        else:
            return None
        for index, known in enumerate(self._remembered):
            if (
                known.alive[0]
                and len(known.refs) == len(values)
                and all(map(operator.is_, values, [ref() for ref in known.refs]))
            ):
                if index:
                    self._remembered.insert(0, self._remembered.pop(index))
                arrays = tuple(v for v in values if v is not None) if known.has_none else tuple(values)
                labels = known.call.labels
                if keys is not None:
                    labels = tuple(key for key, value in zip(keys, values) if value is not None)
                return known.call._replace(labels=labels, arrays=arrays)
        return None

    def store(self, gradients: Any, call: Call) -> None:
        """Remember ``call`` for ``gradients`` (a list, tuple or dict; anything else is not remembered)."""
        kind = type(gradients)
        if kind is not list and kind is not tuple and kind is not dict:
            return
        values = tuple(gradients.values()) if kind is dict else tuple(gradients)
        alive = [True]

        def entry_died(_: object) -> None:
            alive[0] = False

        refs = tuple(_dead if value is None else weakref.ref(value, entry_died) for value in values)
        remembered = _Remembered(refs, alive, any(value is None for value in values), call._replace(arrays=()))
        self._remembered.insert(0, remembered)
        del self._remembered[self._capacity :]

    def clear(self) -> None:
        """Forget every remembered call."""
        self._remembered.clear()
