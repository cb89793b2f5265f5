"""The kernels' interface in Python: every struct of ``kernels/common.cuh`` as a NumPy dtype, and the checks.

Each record the kernels read or write (a chunk table, a kernel's one
argument, a scaler's State, the statistics record, an optimizer's record) is
one C struct mirrored here by one structured dtype (``align=True``, so C's
layout rules give both the same offsets). :data:`ENTRIES` names each kernel
file's ``extern "C"`` entry points and the struct each takes by value;
:func:`compile_source` is what is compiled for a file: its inlined source,
then :func:`layout_checks`, static assertions that fail the compile unless
the structs, the dtypes and the entry points' signatures agree. Needs no CuPy
(tools/check_kernels.py compiles through NVRTC without a GPU).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np

from cupy_amp.kernel_sources import read_kernel_source

if TYPE_CHECKING:  # importlib.resources.abc from Python 3.11 on
    from importlib.abc import Traversable

__all__ = [
    "ADAMW_STATE",
    "BEGIN_ARGS",
    "CHUNK",
    "CHUNK_BYTES",
    "ENTRIES",
    "FINISH_ARGS",
    "JOURNAL_ENTRY",
    "KERNEL_FILES",
    "MAX_NDIM",
    "OPTIMIZER_ARGS",
    "PARAM_CHUNK",
    "PARAM_DTYPE_NAMES",
    "SCALE_ARGS",
    "SGD_STATE",
    "STATE",
    "STATE_ARGS",
    "STATS",
    "STATS_ARGS",
    "STATS_DTYPE_NAMES",
    "STRUCTS",
    "THREADS",
    "UNSCALE_ARGS",
    "UNSCALE_DTYPE_NAMES",
    "UPDATE_ARGS",
    "compile_options",
    "compile_source",
    "layout_checks",
]

THREADS = 512  # per block; passed to the kernels with -D
CHUNK_BYTES = 32768  # a block's unit of work (the statistics pass: a warp's); tuned on an H200: BENCHMARKS.md
MAX_NDIM = 64  # kMaxNdim: the most dimensions of a strided tensor

# The structs of kernels/common.cuh, field for field (compile_source() checks it).
CHUNK = np.dtype(
    [("address", "<u8"), ("first", "<i8"), ("last", "<i8"), ("tensor", "<i4"), ("layout", "<i4")], align=True
)
UNSCALE_ARGS = np.dtype(
    [
        ("chunks", "<u8"),
        ("layouts", "<u8"),
        ("chunk_count", "<i8"),
        ("tensor_found", "<u8"),
        ("state", "<u8"),
        ("positions", "<u8"),
        ("call", "<u8"),
    ],
    align=True,
)
SCALE_ARGS = np.dtype(
    [("base", "<u8"), ("numel", "<i8"), ("layout", "<u8"), ("chunk_size", "<i8"), ("state", "<u8")], align=True
)
STATE = np.dtype(
    [
        ("consecutive_good_steps", "<u8"),
        ("hysteresis_tracker", "<u8"),
        ("steps", "<u8"),
        ("skipped_steps", "<u8"),
        ("growths", "<u8"),
        ("backoffs", "<u8"),
        ("remote_skipped_steps", "<u8"),
        ("epoch", "<u8"),
        ("updated_epoch", "<u8"),
        ("folded_step", "<u8"),
        ("growth_factor", "<f8"),
        ("backoff_factor", "<f8"),
        ("floor", "<f8"),
        ("max_scale", "<f8"),
        ("growth_interval", "<u8"),
        ("hysteresis", "<u8"),
        ("bad_votes", "<u8"),
        ("bad_vote_epoch", "<u8"),
        ("stats", "<u8"),
        ("journal", "<u8"),
        ("journal_capacity", "<u8"),
        ("first_culprit", "<u8"),
        ("checked_epoch", "<u8"),
        ("reported_epoch", "<u8"),
        ("overflows_in_row", "<u8"),
        ("rule", "<u8"),
        ("vote_count", "<f8"),
        ("vote_sum", "<f8"),
        ("scale", "<f4"),
        ("overflow_scale", "<f4"),
        ("overflow_norm", "<f4"),
        ("clean_scale", "<f4"),
        ("clean_norm", "<f4"),
        ("checked_norm", "<f4"),
        ("report_amax", "<f4"),
        ("zero_fraction", "<f4"),
        ("subnormal_fraction", "<f4"),
        ("report_call", "<i4"),
        ("report_position", "<i4"),
        ("found", "<i4"),
        ("agreed", "<i4"),
        ("poisoned", "<i4"),
        ("culprits", "<i4"),
        ("finite", "u1"),
    ],
    align=True,
)
JOURNAL_ENTRY = np.dtype(
    [
        ("step", "<u8"),
        ("scale", "<f4"),
        ("next_scale", "<f4"),
        ("norm", "<f4"),
        ("clip_coefficient", "<f4"),
        ("culprits", "<i4"),
        ("culprit_call", "<i4"),
        ("culprit", "<i4"),
        ("local", "u1"),
        ("agreed", "u1"),
        ("action", "u1"),
        ("amax", "<f4"),
        ("zero_fraction", "<f4"),
        ("subnormal_fraction", "<f4"),
        ("amax_call", "<i4"),
        ("amax_position", "<i4"),
    ],
    align=True,
)
STATE_ARGS = np.dtype([("state", "<u8")], align=True)
UPDATE_ARGS = np.dtype([("state", "<u8"), ("step", "<u8")], align=True)
STATS = np.dtype(
    [
        ("overflowed", "<f8"),
        ("sum_of_squares", "<f8"),
        ("own_sum_of_squares", "<f8"),
        ("norm", "<f4"),
        ("clip_coefficient", "<f4"),
        ("factor", "<f4"),
        ("found", "<i4"),
        ("skip", "<i4"),
        ("bad_vote", "<i4"),
    ],
    align=True,
)
STATS_ARGS = np.dtype(
    [
        ("chunks", "<u8"),
        ("layouts", "<u8"),
        ("chunk_count", "<i8"),
        ("partials", "<u8"),
        ("tensor_found", "<u8"),
        ("state", "<u8"),
        ("report", "<u8"),
        ("positions", "<u8"),
        ("call", "<u8"),
        ("step_report", "<u8"),
    ],
    align=True,
)
FINISH_ARGS = np.dtype(
    [
        ("stats", "<u8"),
        ("partials", "<u8"),
        ("partial_count", "<i8"),
        ("state", "<u8"),
        ("max_norm", "<f4"),
        ("stage", "<i4"),
        ("step_report", "<u8"),
        ("elements", "<i8"),
        ("call", "<i8"),
    ],
    align=True,
)
PARAM_CHUNK = np.dtype(
    [
        ("grad", "<u8"),
        ("param", "<u8"),
        ("master", "<u8"),
        ("first_moment", "<u8"),
        ("second_moment", "<u8"),
        ("count", "<i8"),
    ],
    align=True,
)
OPTIMIZER_ARGS = np.dtype([("chunks", "<u8"), ("chunk_count", "<i8"), ("hyper", "<u8")], align=True)
BEGIN_ARGS = np.dtype([("hyper", "<u8"), ("stats", "<u8")], align=True)
ADAMW_STATE = np.dtype(
    [
        ("step", "<u8"),
        ("lr", "<f8"),
        ("beta1", "<f8"),
        ("beta2", "<f8"),
        ("eps", "<f8"),
        ("weight_decay", "<f8"),
        ("beta1_power", "<f8"),
        ("beta2_power", "<f8"),
        ("factor", "<f4"),
        ("decay", "<f4"),
        ("neg_step_size", "<f4"),
        ("bias_correction2_sqrt", "<f4"),
        ("lerp_weight", "<f4"),
        ("beta2_f", "<f4"),
        ("one_minus_beta2", "<f4"),
        ("eps_f", "<f4"),
        ("skip", "<i4"),
    ],
    align=True,
)
SGD_STATE = np.dtype(
    [
        ("step", "<u8"),
        ("lr", "<f8"),
        ("momentum", "<f8"),
        ("dampening", "<f8"),
        ("weight_decay", "<f8"),
        ("factor", "<f4"),
        ("neg_lr", "<f4"),
        ("momentum_f", "<f4"),
        ("one_minus_dampening", "<f4"),
        ("weight_decay_f", "<f4"),
        ("nesterov", "<i4"),
        ("first", "<i4"),
        ("skip", "<i4"),
    ],
    align=True,
)
# The C++ name of each struct (the order numbers the layout checks' probes).
STRUCTS = {
    "cupy_amp::Chunk": CHUNK,
    "cupy_amp::UnscaleArgs": UNSCALE_ARGS,
    "cupy_amp::ScaleArgs": SCALE_ARGS,
    "cupy_amp::State": STATE,
    "cupy_amp::JournalEntry": JOURNAL_ENTRY,
    "cupy_amp::StateArgs": STATE_ARGS,
    "cupy_amp::UpdateArgs": UPDATE_ARGS,
    "cupy_amp::Stats": STATS,
    "cupy_amp::StatsArgs": STATS_ARGS,
    "cupy_amp::FinishArgs": FINISH_ARGS,
    "cupy_amp::ParamChunk": PARAM_CHUNK,
    "cupy_amp::OptimizerArgs": OPTIMIZER_ARGS,
    "cupy_amp::BeginArgs": BEGIN_ARGS,
    "cupy_amp::AdamWState": ADAMW_STATE,
    "cupy_amp::SgdState": SGD_STATE,
}
UNSCALE_DTYPE_NAMES = ("float16", "float32", "float64")
STATS_DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")
PARAM_DTYPE_NAMES = ("float16", "bfloat16", "float32")
# Each kernel file's entry points and the struct each takes, by value.
ENTRIES = {
    "unscale_check.cu": {f"cupy_amp_unscale_check_{name}": "cupy_amp::UnscaleArgs" for name in UNSCALE_DTYPE_NAMES},
    "scale_loss.cu": {f"cupy_amp_scale_loss_{name}": "cupy_amp::ScaleArgs" for name in UNSCALE_DTYPE_NAMES},
    "grad_stats.cu": {
        **{f"cupy_amp_gradient_stats_{name}": "cupy_amp::StatsArgs" for name in STATS_DTYPE_NAMES},
        **{f"cupy_amp_gradient_report_{name}": "cupy_amp::StatsArgs" for name in STATS_DTYPE_NAMES},
        "cupy_amp_finish_stats": "cupy_amp::FinishArgs",
    },
    **{
        f"{kind}.cu": {
            f"cupy_amp_{kind}_begin": "cupy_amp::BeginArgs",
            **{f"cupy_amp_{kind}_{name}": "cupy_amp::OptimizerArgs" for name in PARAM_DTYPE_NAMES},
        }
        for kind in ("adamw", "sgd")
    },
    "step_state.cu": {
        "cupy_amp_begin_step": "cupy_amp::StateArgs",
        "cupy_amp_cast_vote": "cupy_amp::StateArgs",
        "cupy_amp_combine_vote": "cupy_amp::StateArgs",
        "cupy_amp_mark_overflow": "cupy_amp::StateArgs",
        "cupy_amp_update_state": "cupy_amp::StateArgs",
        "cupy_amp_update_and_begin": "cupy_amp::UpdateArgs",
    },
}

KERNEL_FILES = tuple(sorted(ENTRIES))  # every kernel file, each compiled on its own


def compile_options() -> tuple[str, ...]:
    """Return the options passed to ``cupy.RawModule`` (CuPy adds its own)."""
    return ("--std=c++17", f"-DCUPY_AMP_THREADS={THREADS}", f"-DCUPY_AMP_CHUNK_BYTES={CHUNK_BYTES}")


_C_TYPES = {
    "<u8": "unsigned long long",
    "<i8": "long long",
    "<i4": "int",
    "<f4": "float",
    "<f8": "double",
    "|u1": "unsigned char",
}


def layout_checks(file_name: str, source: str) -> str:
    """Return C++ that fails to compile unless each struct matches its NumPy dtype and each entry takes its struct.

    Checked: every struct of :data:`STRUCTS` that ``source`` (the file's inlined
    text) declares; an optimizer's State is declared in its own file only.

    A constant of each struct is built by aggregate initialization, which fills
    the fields in declaration order: each field must hold its own probe value
    and have the dtype's type; a structured binding must name exactly the
    dtype's fields; the sizes must agree. Same fields, order, types and size
    give the same offsets under C's layout rules, which the dtypes follow
    (``align=True``). The file's entry points must take their struct by value.
    """
    lines = [
        "namespace cupy_amp_layout_checks {",
        "template <class A, class B> struct same { static constexpr bool value = false; };",
        "template <class A> struct same<A, A> { static constexpr bool value = true; };",
    ]
    for number, (struct, dtype) in enumerate(STRUCTS.items()):
        if not re.search(rf"\bstruct\b[^;{{}}]*\b{struct.removeprefix('cupy_amp::')}\s*{{", source):
            continue
        probe, names = f"probe{number}", dtype.names or ()
        bound = ", ".join(f"b{i}" for i in range(len(names)))
        lines.append(f"constexpr {struct} {probe}{{{', '.join(str(i + 1) for i in range(len(names)))}}};")
        lines.append(f'static_assert(sizeof({struct}) == {dtype.itemsize}, "{struct}: size differs from Python");')
        lines.append(f"inline void count{number}() {{ [[maybe_unused]] auto [{bound}] = {probe}; }}  // these fields")
        for index, name in enumerate(names):
            c_type = _C_TYPES[dtype[name].str]
            lines.append(
                f"static_assert({probe}.{name} == {index + 1} && same<decltype({struct}::{name}), {c_type}>::value, "
                f'"{struct}::{name}: position or type differs from Python");'
            )
    for entry, struct in ENTRIES[file_name].items():
        lines.append(f'static_assert(same<decltype(&{entry}), void (*)({struct})>::value, "{entry}: signature");')
    return "\n".join([*lines, "}  // namespace cupy_amp_layout_checks"]) + "\n"


def compile_source(file_name: str, directory: Traversable | None = None) -> str:
    """Return what is compiled for ``file_name``: its inlined source, then the layout checks."""
    source = read_kernel_source(file_name, directory)
    return source + '#line 1 "layout_checks"\n' + layout_checks(file_name, source)
