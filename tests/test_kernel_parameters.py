"""The parameter blocks the launches fill match the kernels' C signatures, slot for slot."""

from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("cupy")

from cupy_amp import cuda_kernels
from cupy_amp.kernel_sources import read_kernel_source

# How each C parameter type travels in an 8-byte slot (pointers as their address).
C_TYPES = {"long long": np.int64, "int": np.int32, "float": np.float32, "cupy_amp_u64": np.uint64}


def entry_parameter_types(file_name: str, macro: str) -> list[type]:
    """Return the slot types of the entry points that ``macro`` defines in ``file_name``."""
    source = read_kernel_source(file_name).replace("\\\n", " ")
    definition = re.search(rf"#define {macro}\(NAME, TYPE\)(.*?)\n", source)
    assert definition is not None, f"{macro} not found in {file_name}"
    parameters = re.search(r"NAME\(([^)]*)\)", definition.group(1))
    assert parameters is not None
    types = []
    for parameter in parameters.group(1).split(","):
        declaration = " ".join(parameter.split())
        if "*" in declaration:
            types.append(np.uint64)
            continue
        c_type = declaration.rsplit(" ", 1)[0].removeprefix("const ")
        assert c_type in C_TYPES, f"unmapped parameter type {c_type!r} in {file_name}"
        types.append(C_TYPES[c_type])
    return types


def test_unscale_launch_matches_the_kernel_signature() -> None:
    expected = entry_parameter_types("unscale_check.cu", "CUPY_AMP_UNSCALE_CHECK_ENTRY")
    assert list(cuda_kernels._UNSCALE_PARAMETERS) == expected


def test_scale_loss_launch_matches_the_kernel_signature() -> None:
    expected = entry_parameter_types("scale_loss.cu", "CUPY_AMP_SCALE_LOSS_ENTRY")
    assert list(cuda_kernels._SCALE_PARAMETERS) == expected
