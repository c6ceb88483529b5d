"""The cpu target's GEMM for bfloat16/float16 weights stored ``[in, out]``.

The spec transposes every linear weight at load (``x @ Wt``, what the card's
matmul wants). On a CPU without AVX-512 BF16/FP16 or AMX, PyTorch has no fast
16-bit GEMM for that layout: ATen falls back to scalar loops. The first answer
was a float32 copy of every weight and MKL's float32 GEMM, which reads twice the
weight bytes per decode step (the step is memory bound at batch 1) and doubles
the weights' memory. This module builds a small AVX2 / AVX-512 kernel
(``csrc/host_gemm.c``, the build chosen per CPU by
:func:`spyre_inference.platform.native_build.select_isa`) that reads the
16-bit weight of record directly and accumulates in float32, with results
that depend neither on the batch size nor on the build (see the C file).
Measured on a 2-core Zen 1 EPYC (AVX2 build) it is 1.5-2.5x faster than the
float32 copy at 1-3 rows and as fast or faster from 5 rows up. On AVX-512 CPUs
without BF16 (Ice Lake Xeon) oneDNN runs bfloat16 GEMMs by widening in
software; there this kernel is used too (see
:func:`spyre_inference.platform.device.has_fast_16bit_gemm`).

The kernel is built once per machine with the system C compiler into
``$XDG_CACHE_HOME/spyre-inference/kernels`` and loaded with ctypes (no torch
headers: a build takes about a second). It is exposed as the custom op
``torch.ops.spyre_inference.host_gemm_w16`` so the block graphs call it as one
opaque node. The op's CPU kernel is C++ (``csrc/linear_dispatch.cpp``, given the
kernel's address by :func:`dispatch`) where the linear ops' C++ library builds:
the block graphs call it for every linear of every layer, and through the
Python kernel below each call also paid the interpreter and ctypes. Measured on
a 2-core AVX2 EPYC (SmolLM2-135M, 120 calls per decode step): the step budget
put 13.7 ms of a decode step in these calls, the same 120 products in a C loop
take 8.9 ms, and the C++ kernel made the step 2.4 ms shorter.

Where it cannot be used (not x86-64 with AVX2/FMA/F16C, no
compiler, ``SPYRE_CPU_GEMM_KERNEL=torch``) :func:`kernel_available` says why and
the layers keep the float32 copy.
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
    kernel_cache_dir,
    load_kernel,
)

logger = get_logger(__name__)

OP_NAME = "host_gemm_w16"
QUALNAME = f"{OP_NAMESPACE}::{OP_NAME}"

_SOURCE = Path(__file__).with_name("csrc") / "host_gemm.c"
_DTYPES = (torch.bfloat16, torch.float16)

#: The kernel cannot be built or run on this host (the message says why).
HostGemmUnavailable = NativeKernelUnavailable


@functools.cache
def _library_or_error() -> ctypes.CDLL | str:
    """The loaded kernel, or why it cannot be had (tried once per process)."""
    try:
        return _load()
    except (HostGemmUnavailable, OSError) as exc:
        logger.info("cpu target: host GEMM kernel unavailable (%s); using float32 copies", exc)
        return str(exc)


def _library() -> ctypes.CDLL:
    lib = _library_or_error()
    if isinstance(lib, str):
        raise HostGemmUnavailable(lib)
    return lib


#: Instruction sets ``csrc/host_gemm.c`` has builds for (bit-identical results).
ISAS = ("avx512", "avx2")


def _load() -> ctypes.CDLL:
    lib, isa = load_kernel(_SOURCE, ISAS)
    lib.spyre_gemm_isa.restype = ctypes.c_int
    width = {"avx512": 512, "avx2": 256}[isa]
    if lib.spyre_gemm_isa() != width:  # the build flags and the C file disagree
        raise HostGemmUnavailable(f"{lib._name} is not the {isa} build")
    fn = lib.spyre_gemm_w16
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_void_p,  # x
        ctypes.c_long,  # M
        ctypes.c_long,  # K
        ctypes.c_long,  # ldx
        ctypes.c_void_p,  # w
        ctypes.c_long,  # N
        ctypes.c_long,  # ldw
        ctypes.c_void_p,  # y
        ctypes.c_long,  # ldy
        ctypes.c_int,  # float16 (else bfloat16)
        ctypes.c_int,  # threads
    ]
    lib.spyre_isa = isa
    logger.info("cpu target: host GEMM kernel, %s build, loaded from %s", isa, lib._name)
    return lib


def reset_for_tests() -> None:
    """Forget the loaded build, so the next call selects one again (tests that force
    ``SPYRE_CPU_ISA``; the process keeps every build it loaded)."""
    _library_or_error.cache_clear()
    dispatch.cache_clear()


def kernel_isa() -> str | None:
    """The instruction set of the loaded host GEMM build, or None when it is unavailable."""
    lib = _library_or_error()
    return None if isinstance(lib, str) else lib.spyre_isa


def kernel_unavailable_reason(dtype: torch.dtype) -> str | None:
    """None when :func:`host_gemm_w16` serves ``dtype`` weights here, else why not."""
    if dtype not in _DTYPES:
        return f"{dtype} weights use torch's own GEMM"
    if settings.get("SPYRE_CPU_GEMM_KERNEL") == "torch":
        return "SPYRE_CPU_GEMM_KERNEL=torch"
    lib = _library_or_error()
    return lib if isinstance(lib, str) else None


def kernel_address() -> int:
    """Address of the loaded build's ``spyre_gemm_w16`` (for C++ callers in this process)."""
    address = ctypes.cast(_library().spyre_gemm_w16, ctypes.c_void_p).value
    assert address is not None
    return address


def kernel_available(dtype: torch.dtype) -> bool:
    return kernel_unavailable_reason(dtype) is None


def host_gemm_w16_in_python(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """The op's kernel where its C++ kernel cannot be built (the same results)."""
    if weight_t.dim() != 2 or weight_t.dtype not in _DTYPES:
        raise ValueError(
            f"host_gemm_w16 takes a 2-D bfloat16/float16 weight, got {weight_t.dtype} "
            f"{tuple(weight_t.shape)}"
        )
    x2, n = as_rows(OP_NAME, x, weight_t)
    k = x2.shape[1]
    if x2.dtype != torch.float32 or x2.stride(-1) != 1:
        x2 = x2.to(torch.float32).contiguous()
    if weight_t.stride(1) != 1:
        weight_t = weight_t.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)
    if m and n:
        failed = _library().spyre_gemm_w16(
            x2.data_ptr(),
            m,
            k,
            x2.stride(0),
            weight_t.data_ptr(),
            n,
            weight_t.stride(0),
            y.data_ptr(),
            n,
            int(weight_t.dtype == torch.float16),
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError(f"host GEMM [{m}, {k}] x [{k}, {n}]: no memory for its scratch")
    return y.view(*x.shape[:-1], n)


# The product is float32 whatever the weight's 16-bit dtype. The Python kernel is
# the composite one: a CPU kernel, once the C++ library is loaded, takes
# precedence over it in the dispatcher, whatever the order of the registrations.
_LIB = register_linear_op(OP_NAME, None, lambda weight_t: torch.float32)
_LIB.impl(OP_NAME, host_gemm_w16_in_python, "CompositeExplicitAutograd")


@functools.cache
def dispatch() -> str:
    """Which kernel serves the op on the CPU: ``native`` (C++) or ``python``.

    Decided once per process, when a layer first takes the host kernel (and again
    after :func:`reset_for_tests`): once the linear ops' C++ library is loaded its
    CPU kernel serves the op, so it must be given the loaded build's address.
    """
    reason = native_kernels_unavailable_reason()
    if reason is not None:
        logger.info("cpu target: host GEMM op in Python (%s)", reason)
        return "python"
    lib = _library_or_error()
    address = 0 if isinstance(lib, str) else kernel_address()
    torch.ops.spyre_inference_native.set_host_gemm_w16(address)
    return "native"


def host_gemm_w16(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """``x @ weight_t`` in float32 for a bfloat16/float16 ``[in, out]`` weight.

    ``x`` may have any leading dimensions; it is widened to float32 (exactly,
    for 16-bit inputs) before the product. Pass it already in float32 inside
    compiled code, so the cast fuses into the op that produces it. The result
    is float32.
    """
    if not torch.compiler.is_compiling():
        dispatch()  # cached; traced code runs after a layer's load called it
    return torch.ops.spyre_inference.host_gemm_w16.default(x, weight_t)


__all__ = [
    "HostGemmUnavailable",
    "dispatch",
    "host_gemm_w16",
    "host_gemm_w16_in_python",
    "kernel_address",
    "kernel_available",
    "kernel_cache_dir",
    "kernel_isa",
    "kernel_unavailable_reason",
    "reset_for_tests",
]
