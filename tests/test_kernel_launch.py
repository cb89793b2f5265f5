"""KernelLaunch packs kernel arguments exactly as cuLaunchKernel reads them (no GPU needed).

The driver call is replaced by a recorder that reads each parameter back
through the pointer array, the way the driver does during the launch.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cupy_amp.kernel_launch import KernelLaunch  # noqa: E402

TYPES = (np.uint64, np.int64, np.float32, np.int32, np.uint64)


class FakeFunction:
    ptr = 0xF00D


class FakeStream:
    ptr = 0x5EED


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []

    def record(
        function: int,
        gx: int,
        gy: int,
        gz: int,
        bx: int,
        by: int,
        bz: int,
        shared: int,
        stream: int,
        params: int,
        extra: int,
    ) -> None:
        pointers = (ctypes.c_uint64 * len(TYPES)).from_address(params)
        values = [
            np.frombuffer(ctypes.string_at(pointers[i], np.dtype(kind).itemsize), dtype=kind)[0]
            for i, kind in enumerate(TYPES)
        ]
        seen.append(
            {
                "function": function,
                "grid": (gx, gy, gz),
                "block": (bx, by, bz),
                "shared": shared,
                "stream": stream,
                "values": values,
                "extra": extra,
            }
        )

    monkeypatch.setattr(cupy.cuda.driver, "launchKernel", record)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: FakeStream())
    return seen


def test_fixed_and_changing_arguments_reach_the_driver_with_their_types(launches: list[dict[str, Any]]) -> None:
    launch = KernelLaunch(FakeFunction(), TYPES, fixed={0: 2**63 + 5, 3: -7})
    launch(12, 512, -(2**40), np.float32(2.0**-16), 2**64 - 1)
    assert launches == [
        {
            "function": 0xF00D,
            "grid": (12, 1, 1),
            "block": (512, 1, 1),
            "shared": 0,
            "stream": 0x5EED,
            "values": [2**63 + 5, -(2**40), np.float32(2.0**-16), -7, 2**64 - 1],
            "extra": 0,
        }
    ]


def test_each_launch_sees_its_own_values(launches: list[dict[str, Any]]) -> None:
    launch = KernelLaunch(FakeFunction(), TYPES, fixed={0: 1})
    for i in range(3):
        launch(1, 32, i, np.float32(i + 0.5), i, 100 + i)
    assert [entry["values"] for entry in launches] == [[1, i, np.float32(i + 0.5), i, 100 + i] for i in range(3)]


def test_float32_argument_keeps_its_bits(launches: list[dict[str, Any]]) -> None:
    launch = KernelLaunch(FakeFunction(), TYPES, fixed={0: 0, 1: 0, 3: 0, 4: 0})
    tiny = np.float32(2.0**-149)  # the smallest subnormal: must not be flushed or rounded
    launch(1, 32, tiny)
    assert launches[0]["values"][2].view(np.uint32) == tiny.view(np.uint32)


def test_wrong_number_of_changing_arguments_is_refused_before_launching(launches: list[dict[str, Any]]) -> None:
    launch = KernelLaunch(FakeFunction(), TYPES, fixed={0: 1})
    with pytest.raises(TypeError, match="takes 4 changing arguments, got 2"):
        launch(1, 32, 1, 2)
    assert launches == []


def test_parameter_wider_than_a_slot_is_refused() -> None:
    with pytest.raises(ValueError, match="parameter 1 of type complex128 does not fit in 8 bytes"):
        KernelLaunch(FakeFunction(), (np.int32, np.complex128))


def test_concurrent_launches_never_mix_their_arguments(launches: list[dict[str, Any]]) -> None:
    launch = KernelLaunch(FakeFunction(), TYPES, fixed={0: 9})

    def worker(base: int) -> None:
        for i in range(500):
            launch(1, 32, base + i, np.float32(base + i), base + i, base + i)

    # Switch threads as often as the interpreter allows, so unlocked writes would interleave.
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker, args=(k * 1000,)) for k in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(previous)
    assert len(launches) == 2000
    for entry in launches:
        _, a, f, b, c = entry["values"]
        assert a == int(f) == b == c
