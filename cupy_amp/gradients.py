"""Turn the user's gradient and loss arguments into validated arrays.

Everything that can be wrong with an argument is found here, before any
array is touched, so a rejected call leaves every array as it was.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from cupy_amp.array_backend import ArrayBackend, backend_for
from cupy_amp.errors import DuplicateGradientError, GradientTypeError, GradientValueError

__all__ = ["GradientBatch", "GradientSet", "check_disjoint", "collect_gradients", "collect_loss", "describe"]


class GradientBatch(NamedTuple):
    """The arrays of one ``unscale_and_check`` call, validated.

    A NamedTuple rather than a frozen dataclass: one is built on every call,
    and a tuple is several times cheaper to build.

    Attributes:
        labels: For each array, its position in the argument (an int) or its
            key in a mapping.
        arrays: The arrays, in argument order, ``None`` entries left out.
        backend: The backend all arrays belong to; None for an empty batch.
        native: True when every entry already was the backend's own array type
            (no zero-copy wrapping of a foreign array was needed).
    """

    labels: tuple[Hashable, ...]
    arrays: tuple[Any, ...]
    backend: ArrayBackend | None
    native: bool = True


@dataclass(frozen=True)
class _Claim:
    """The bytes one gradient spans, tagged with the call it came from."""

    domain: Hashable
    start: int
    stop: int
    call: int
    label: Hashable
    array: Any


class GradientSet:
    """A fixed, validated collection of gradient arrays, recognised in O(1) every step.

    ``unscale_and_check`` accepts plain lists, tuples and dicts and recognises
    them when the same arrays come back (a scan over the entries). Wrapping the
    gradients once in a ``GradientSet`` (a list, tuple or mapping name -> array;
    ``None`` entries allowed) removes even that scan: the set is immutable, so
    passing the same set again needs no per-gradient work on the host. Useful
    with thousands of gradient arrays that live as long as the model.

    The set holds its arrays; it is validated on construction with the same
    rules as ``unscale_and_check``.
    """

    __slots__ = ("__weakref__", "_batch", "_keys", "_values")

    def __init__(self, gradients: Any) -> None:
        if isinstance(gradients, Mapping):
            self._keys: tuple[Hashable, ...] | None = tuple(gradients)
            self._values: tuple[Any, ...] = tuple(gradients.values())
        else:
            self._keys = None
            self._values = tuple(value for _, value in _entries(gradients))
        self._batch = collect_gradients(self)
        check_disjoint([self._batch])

    @property
    def batch(self) -> GradientBatch:
        """The validated arrays and their labels."""
        return self._batch

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
        return f"GradientSet({len(self._values)} entries by {kind}, {len(self._batch.arrays)} arrays)"


def describe(label: Hashable) -> str:
    """Name a gradient for a message: ``gradient #3`` or ``gradient 'fc1.W'``."""
    return f"gradient #{label}" if isinstance(label, int) else f"gradient {label!r}"


def collect_loss(loss: Any) -> tuple[ArrayBackend, Any]:
    """Return the backend and array for a loss, or raise if it cannot be scaled in place."""
    found = backend_for(loss)
    if found is None:
        raise GradientTypeError(
            f"scale_loss expected a NumPy or CuPy float array (it scales in place; a 0-d array is fine), "
            f"got {type(loss).__name__}."
        )
    backend, array = found
    problem = backend.dtype_problem(array) or backend.write_problem(array)
    if problem is not None:
        error = GradientTypeError if backend.dtype_problem(array) else GradientValueError
        raise error(f"scale_loss cannot scale this loss in place: {problem}.")
    return backend, array


def collect_gradients(gradients: Any) -> GradientBatch:
    """Validate the ``gradients`` argument of ``unscale_and_check``.

    Accepts an iterable of arrays (``None`` entries skipped, their positions
    still counted) or a mapping name -> array.

    Raises:
        GradientTypeError: Not an iterable/mapping, an entry that is not a
            supported float array, or NumPy and CuPy arrays mixed in one call.
        GradientValueError: A read-only array.
        DuplicateGradientError: Two entries share memory.
    """
    entries = _entries(gradients)
    labels: list[Hashable] = []
    arrays: list[Any] = []
    backend: ArrayBackend | None = None
    first_label: Hashable = None
    native = True
    for label, entry in entries:
        if entry is None:
            continue
        found = backend_for(entry)
        if found is None:
            raise GradientTypeError(
                f"{describe(label)}: expected a NumPy or CuPy float array, got {type(entry).__name__}."
            )
        entry_backend, array = found
        if backend is None:
            backend, first_label = entry_backend, label
        elif entry_backend is not backend:
            raise GradientTypeError(
                f"{describe(label)} is a {entry_backend.name} array but {describe(first_label)} is a "
                f"{backend.name} array; pass arrays of one kind per unscale_and_check call."
            )
        problem = entry_backend.dtype_problem(array)
        if problem is not None:
            raise GradientTypeError(f"{describe(label)}: {problem}.")
        problem = entry_backend.write_problem(array)
        if problem is not None:
            raise GradientValueError(f"{describe(label)} cannot be unscaled in place: {problem}.")
        labels.append(label)
        arrays.append(array)
        native = native and array is entry
    return GradientBatch(tuple(labels), tuple(arrays), backend, native)


def check_disjoint(batches: Sequence[GradientBatch]) -> None:
    """Check that no element is claimed twice by the batches of one step.

    The last batch is the new call; earlier batches were checked before, so
    only pairs involving the new one are examined. Extents are compared after
    sorting and only overlapping extents are checked element by element, so
    the usual disjoint case costs a sort.

    Raises:
        DuplicateGradientError: Two arrays of the new batch share memory, or one
            of them shares memory with an array an earlier call of this step unscaled.
    """
    new_call = len(batches) - 1
    claims = []
    for call, batch in enumerate(batches):
        if batch.backend is None:
            continue
        for label, array in zip(batch.labels, batch.arrays):
            domain, start, stop = batch.backend.memory_extent(array)
            if stop > start:
                claims.append(_Claim(domain, start, stop, call, label, array))
    claims.sort(key=lambda claim: (repr(claim.domain), claim.start))
    active: list[_Claim] = []
    backend = batches[-1].backend
    for claim in claims:
        active = [other for other in active if other.domain == claim.domain and other.stop > claim.start]
        for other in active:
            if backend is not None and new_call in (other.call, claim.call):
                _raise_if_shared(backend, other, claim, new_call)
        active.append(claim)


def _raise_if_shared(backend: ArrayBackend, first: _Claim, second: _Claim, new_call: int) -> None:
    if not backend.shares_memory(first.array, second.array):
        return
    if first.call == second.call:
        raise DuplicateGradientError(
            f"{describe(first.label)} and {describe(second.label)} share memory: unscaling both would divide "
            f"the shared elements twice. Pass each gradient once."
        )
    old, new = (first, second) if first.call < new_call else (second, first)
    raise DuplicateGradientError(
        f"{describe(new.label)} shares memory with {describe(old.label)}, which an earlier unscale_and_check "
        f"call of this step (call {old.call + 1}) already unscaled; unscaling it again would divide it twice. "
        f"Call update() to end the step first, or pass each gradient to one call only."
    )


def _entries(gradients: Any) -> Iterable[tuple[Hashable, Any]]:
    if isinstance(gradients, GradientSet):
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
