"""The cpu target's INT8 x INT8 -> INT32 product for INT8 W8A8 weights stored ``[in, out]``.

:class:`~spyre_inference.ops.quantized_linear.SpyreInt8ScaledMMKernel` quantizes
the activations per token and needs ``x_q @ w_q`` exactly, in int32.
``torch._int_mm`` (oneDNN) does that, but on the plain ``[in, out]`` weight it
ran a decode step's products far below the memory's pace (one row, SmolLM2's
120 products on a 2-core Zen 4: 10.7 ms, against 6.5 ms for the 16-bit host
GEMM reading twice the bytes), so INT8 decoded slower than bfloat16. For a few
rows (decode steps of a few sequences) this module's kernel
(``csrc/host_int8_mm.c``, AVX2 and AVX-512 builds chosen per CPU by
:func:`spyre_inference.platform.native_build.select_isa`) streams the 8-bit
weight of record. More rows go to ``torch._int_mm`` where the CPU has AVX-512
VNNI (its oneDNN path); without VNNI ``torch._int_mm`` is a scalar loop (2.5
GOPS on a 2-core AVX2 EPYC, fifty times slower than a float32 matmul of the
same shape), so there the kernel's register-blocked many-rows path takes every
row count (:func:`max_rows`, decided once per process and logged). The result
equals ``torch._int_mm``'s bit for bit (integer sums), so the choice never
changes a token. A host where the kernel cannot be built, or
``SPYRE_CPU_GEMM_KERNEL=torch``, uses ``torch._int_mm`` throughout.

The op ``torch.ops.spyre_inference.int8_mm(x, weight_t)`` is what the block
graphs call (one opaque node per linear, like the 16-bit linear ops). Its CPU
kernel is C++ (``csrc/linear_dispatch.cpp``, with the oneDNN linear op's) where
a C++ toolchain exists, so a call goes dispatcher -> C++ -> the host kernel
without the interpreter or ctypes: from Python the argument checks and the
ctypes call cost more than the product itself at one row (~120 calls per decode
step). :func:`dispatch` points it at the loaded host kernel when INT8 weights
load. Without a toolchain :func:`int8_mm_in_python` (the same contract) serves.
INT8 is a cpu-target format (the card has no integer compute), so nothing here
runs on the card path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from spyre_inference.ops.linear_op import (
    OP_NAMESPACE,
    as_rows,
    native_kernels_unavailable_reason,
    register_linear_op,
)
from spyre_inference.platform import settings
from spyre_inference.platform.logs import get_logger
from spyre_inference.platform.native_build import (
    NativeKernelUnavailable,
    cpu_flags,
    load_kernel,
)

logger = get_logger(__name__)

OP_NAME = "int8_mm"
QUALNAME = f"{OP_NAMESPACE}::{OP_NAME}"

_SOURCE = Path(__file__).with_name("csrc") / "host_int8_mm.c"

#: Instruction sets ``csrc/host_int8_mm.c`` has builds for (bit-identical results).
ISAS = ("avx512", "avx2")

#: Rows of the kernel's few-rows (memory-bound) path; the most it takes where
#: ``torch._int_mm`` runs oneDNN (:func:`max_rows`).
HOST_ROWS_MAX = 4

#: CPU flag without which ``torch._int_mm`` has no oneDNN path on the CPU (its
#: scalar fallback: the backtrace of a slow INT8 prefill on an AVX2 EPYC ends in
#: ``at::native::_int_mm_out_cpu``'s own ``parallel_for`` loop, while an AVX-512
#: VNNI Zen 4 runs oneDNN for the same call).
ONEDNN_INT8_FLAG = "avx512_vnni"

#: ``max_rows`` where the kernel takes every product (no row limit).
ALL_ROWS = 2**62

#: int32 sums of int8 products are exact while |sum| <= 128 * 128 * K fits.
_MAX_K = (2**31 - 1) // (128 * 128)


@functools.cache
def _library_or_error() -> ctypes.CDLL | str:
    """The loaded kernel, or why it cannot be had (tried once per process)."""
    try:
        lib, isa = load_kernel(_SOURCE, ISAS)
    except (NativeKernelUnavailable, OSError) as exc:
        logger.info("cpu target: INT8 host kernel unavailable (%s); using torch._int_mm", exc)
        return str(exc)
    lib.spyre_int8_mm_isa.restype = ctypes.c_int
    if lib.spyre_int8_mm_isa() != {"avx512": 512, "avx2": 256}[isa]:
        return f"{lib._name} is not the {isa} build"
    fn = lib.spyre_int8_mm
    fn.restype = ctypes.c_int
    L, P = ctypes.c_long, ctypes.c_void_p
    fn.argtypes = [P, L, L, L, P, L, L, P, L, ctypes.c_int]  # x M K ldx, w N ldw, y ldy, threads
    lib.spyre_isa = isa
    logger.info("cpu target: INT8 host kernel, %s build, loaded from %s", isa, lib._name)
    return lib


def reset_for_tests() -> None:
    """Decide the build and the choice again (tests that force ``SPYRE_CPU_ISA`` or
    ``SPYRE_CPU_GEMM_KERNEL``): the op's C++ kernel follows at once."""
    _library_or_error.cache_clear()
    kernel_unavailable_reason.cache_clear()
    max_rows.cache_clear()
    dispatch.cache_clear()
    dispatch()


@functools.cache
def kernel_unavailable_reason() -> str | None:
    """None when the host kernel serves few-row products here, else why not (decided
    once per process: every INT8 linear asks, ~120 times per decode step)."""
    if settings.get("SPYRE_CPU_GEMM_KERNEL") == "torch":
        return "SPYRE_CPU_GEMM_KERNEL=torch"
    lib = _library_or_error()
    return lib if isinstance(lib, str) else None


def kernel_isa() -> str | None:
    """The instruction set of the loaded build, or None when it is unavailable."""
    lib = _library_or_error()
    return None if isinstance(lib, str) else lib.spyre_isa


@functools.cache
def max_rows() -> int:
    """The most rows a product may have to run on the host kernel (decided once).

    :data:`HOST_ROWS_MAX` where ``torch._int_mm`` runs oneDNN (the CPU has
    :data:`ONEDNN_INT8_FLAG`), else :data:`ALL_ROWS`: ``torch._int_mm``'s scalar
    loop is no fallback for a prefill chunk. 0 when the kernel is unavailable.
    """
    if kernel_unavailable_reason() is not None:
        return 0
    if ONEDNN_INT8_FLAG in cpu_flags():
        logger.info(
            "cpu target: INT8 products of up to %d rows on the host kernel, more on "
            "torch._int_mm (oneDNN, %s)",
            HOST_ROWS_MAX,
            ONEDNN_INT8_FLAG,
        )
        return HOST_ROWS_MAX
    logger.info(
        "cpu target: every INT8 product on the host kernel (no %s: torch._int_mm has no "
        "oneDNN path here)",
        ONEDNN_INT8_FLAG,
    )
    return ALL_ROWS


def serves(rows: int, in_features: int) -> bool:
    """Whether a product of ``rows`` rows with ``in_features`` runs on the host kernel."""
    return 0 < rows <= max_rows() and in_features <= _MAX_K


def int8_mm_in_python(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """The op's kernel where its C++ kernel cannot be built (the same results)."""
    if x.dtype != torch.int8 or weight_t.dtype != torch.int8 or weight_t.dim() != 2:
        raise ValueError(
            f"int8_mm takes int8 x and a 2-D int8 weight, got {x.dtype} and {weight_t.dtype} "
            f"{tuple(weight_t.shape)}"
        )
    x2, n = as_rows(OP_NAME, x, weight_t)
    m, k = x2.shape
    lead = x.shape[:-1]
    if not serves(m, k) or n == 0:
        return torch._int_mm(x2, weight_t).view(*lead, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight_t.stride(1) != 1:
        weight_t = weight_t.contiguous()
    y = torch.empty((m, n), dtype=torch.int32)
    lib = _library_or_error()
    assert not isinstance(lib, str)
    failed = lib.spyre_int8_mm(
        x2.data_ptr(),
        m,
        k,
        x2.stride(0),
        weight_t.data_ptr(),
        n,
        weight_t.stride(0),
        y.data_ptr(),
        n,
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError(f"INT8 host kernel [{m}, {k}] x [{k}, {n}]: no memory for its scratch")
    return y.view(*lead, n)


_LIB = register_linear_op(OP_NAME, None, lambda weight_t: torch.int32)
# The Python kernel is the composite one: a CPU kernel, once the C++ library is
# loaded, takes precedence over it in the dispatcher, whatever the order of the
# two registrations; until then (or without a toolchain) this one serves.
_LIB.impl(OP_NAME, int8_mm_in_python, "CompositeExplicitAutograd")


@functools.cache
def dispatch() -> str:
    """Which kernel serves the op on the CPU: ``native`` (C++) or ``python``.

    Decided once per process when INT8 weights load (and again by
    :func:`reset_for_tests`); the C++ kernel is given the host kernel's address,
    or none (``torch._int_mm`` for every product) when :func:`kernel_unavailable_reason`
    says why not.
    """
    reason = native_kernels_unavailable_reason()
    if reason is not None:
        logger.info("cpu target: INT8 linear op in Python (%s)", reason)
        return "python"
    address = 0
    if kernel_unavailable_reason() is None:
        lib = _library_or_error()
        assert not isinstance(lib, str)
        address = ctypes.cast(lib.spyre_int8_mm, ctypes.c_void_p).value or 0
    torch.ops.spyre_inference_native.set_host_int8(address, max_rows(), _MAX_K)
    return "native"


def describe() -> str | None:
    """How this process runs INT8 products (for reports), or None if no INT8
    weights have loaded (:func:`dispatch` has not run)."""
    if not dispatch.cache_info().currsize:
        return None
    isa = kernel_isa()
    if kernel_unavailable_reason() is not None or isa is None:
        return f"torch._int_mm for every product ({kernel_unavailable_reason()})"
    limit = max_rows()
    rows = "every row count" if limit == ALL_ROWS else f"up to {limit} rows, torch._int_mm above"
    return f"plugin INT8 kernel, {isa} build, {rows} ({dispatch()} op kernel)"


def int8_mm(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """``x @ weight_t`` in int32 for int8 ``x`` and an int8 ``[in, out]`` weight (exact)."""
    return torch.ops.spyre_inference.int8_mm.default(x, weight_t)


__all__ = [
    "ALL_ROWS",
    "HOST_ROWS_MAX",
    "ONEDNN_INT8_FLAG",
    "QUALNAME",
    "describe",
    "dispatch",
    "int8_mm",
    "int8_mm_in_python",
    "kernel_isa",
    "kernel_unavailable_reason",
    "max_rows",
    "reset_for_tests",
    "serves",
]
