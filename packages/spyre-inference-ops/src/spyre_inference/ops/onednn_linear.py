"""The cpu target's GEMM on CPUs with a fast 16-bit matmul: oneDNN on prepacked weights.

Where the CPU has bfloat16/float16 matrix instructions (AVX-512 BF16, AMX;
:func:`spyre_inference.platform.device.has_fast_16bit_gemm`) the transposed
linear layers would compute ``x @ weight_t`` with torch's matmul, which hands
oneDNN the plain ``[in, out]`` matrix on every call; oneDNN then reorders it
into its blocked format each time. Measured on a 2-core AMD EPYC with AVX-512
BF16 (SmolLM2-135M's 120 decode GEMMs per step, weights cold): 23.9 ms per step
at 1 row and 42.4 ms at 32 rows through torch's matmul, 11-16 ms and 23-29 ms on
weights prepacked once (what vLLM's CPU backend does, ``onednn_mm``).

So at load each such weight also gets a copy in oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``) and the layers call the custom
op ``torch.ops.spyre_inference.onednn_linear_t`` on the ``[in, out]`` weight of
record: the op finds the packed copy by the weight's storage and runs
``mkldnn._linear_pointwise``. The packed copy cannot itself be a graph input
(Inductor lowers that op only for constants), hence the opaque op. It costs a
second copy of every linear weight in host memory (counted in the worker's
RSS, so the KV budget sees it); ``SPYRE_CPU_GEMM_PACK=off`` keeps torch's matmul
and one copy. cpu target only: the card runs its own matmul on ``[in, out]``.

The op's CPU kernel is C++ (``csrc/linear_dispatch.cpp``, built once per
machine with torch's headers) where a C++ toolchain exists: the block graphs
call the op ~120 times per decode step and a kernel registered from Python
puts the interpreter between the dispatcher and oneDNN on every call. The
same kernel sends products of at most ``SPYRE_CPU_GEMM_HOST_ROWS`` rows (2 by
default: decode steps of one or two sequences) to the host GEMM kernel
(:mod:`~spyre_inference.ops.host_gemm`) on the weight of record instead, where
oneDNN's fixed cost per call outweighs a single streaming pass over the
weight. Without a toolchain the Python kernel below runs (oneDNN only).
"""

from __future__ import annotations

import functools
import weakref

import torch

from spyre_inference.ops import host_gemm
from spyre_inference.ops.linear_op import (
    OP_NAMESPACE,
    native_kernels_unavailable_reason,
    register_linear_op,
)
from spyre_inference.platform import settings
from spyre_inference.platform.device import is_spyre
from spyre_inference.platform.logs import get_logger

logger = get_logger(__name__)

OP_NAME = "onednn_linear_t"
QUALNAME = f"{OP_NAMESPACE}::{OP_NAME}"
#: Products of at most this many rows go to the host GEMM kernel (set by kernel()).
_host_rows = 0

#: Storage address of a weight of record -> its oneDNN-packed copy.
_packed: dict[int, torch.Tensor] = {}


def unavailable_reason(dtype: torch.dtype) -> str | None:
    """None when 16-bit weights of ``dtype`` are prepacked for oneDNN here, else why not."""
    if is_spyre():
        return "the spyre target runs its own matmul"
    if settings.get("SPYRE_CPU_GEMM_PACK") == "off":
        return "SPYRE_CPU_GEMM_PACK=off"
    mkldnn = torch.ops.mkldnn
    if dtype == torch.bfloat16:
        supported = mkldnn._is_mkldnn_bf16_supported()
    elif dtype == torch.float16:
        supported = mkldnn._is_mkldnn_fp16_supported()
    else:
        return f"{dtype} weights use torch's own GEMM"
    return None if supported else f"oneDNN has no {dtype} matmul on this CPU"


@torch.no_grad()
def pack(weight_t: torch.Tensor) -> None:
    """Make (or remake, after the weight's values changed) the packed copy of ``weight_t``."""
    if weight_t.dim() != 2:
        raise ValueError(
            f"onednn_linear_t packs 2-D [in, out] weights, not {tuple(weight_t.shape)}"
        )
    native = kernel() == "native"
    key = weight_t.data_ptr()
    fresh = key not in _packed
    # oneDNN takes the linear convention, [out, in]. The batch-size hint (1)
    # only picks among blocked formats; measured 1 vs 32 vs 128: no difference.
    packed = torch.ops.mkldnn._reorder_linear_weight(weight_t.t().contiguous(), 1)
    _packed[key] = packed
    if native:
        torch.ops.spyre_inference_native.register_packed(weight_t, packed)
    if fresh:
        weakref.finalize(weight_t, _forget, key, native)


def _forget(key: int, native: bool) -> None:
    _packed.pop(key, None)
    if native:
        torch.ops.spyre_inference_native.forget_packed(key)


def host_gemm_rows() -> int:
    """Rows up to which the C++ op runs the host GEMM kernel (0: oneDNN throughout)."""
    kernel()
    return _host_rows


def is_packed(weight_t: torch.Tensor) -> bool:
    return weight_t.data_ptr() in _packed


def packed_bytes() -> int:
    """Host memory held by packed copies (for logs and tests)."""
    return sum(p.numel() * p.element_size() for p in _packed.values())


def _onednn_linear_t(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    packed = _packed.get(weight_t.data_ptr())
    if packed is None:
        raise RuntimeError(
            f"onednn_linear_t: the [in, out] weight {tuple(weight_t.shape)} has no packed copy "
            "(ops.onednn_linear.pack must run at load and after its values change)"
        )
    k, n = weight_t.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.dtype != weight_t.dtype:
        x2 = x2.to(weight_t.dtype)
    y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), packed, None, "none", [], "")
    return y.view(*lead, n)


# The product is in the weight's dtype. The CPU kernel is chosen by kernel().
_LIB = register_linear_op(OP_NAME, None, lambda weight_t: weight_t.dtype)


@functools.cache
def kernel() -> str:
    """Which CPU kernel the op runs: ``native`` (C++) or ``python``; decided once per process.

    Building the C++ kernel happens here, on first use (a model load), not at
    import: the user's process and processes that never load weights skip it.
    """
    reason = native_kernels_unavailable_reason()
    if reason is not None:
        logger.info("cpu target: oneDNN linear op in Python (%s)", reason)
        if not torch._C._dispatch_has_kernel_for_dispatch_key(QUALNAME, "CPU"):
            _LIB.impl(OP_NAME, _onednn_linear_t, "CPU")
        return "python"
    rows = settings.get("SPYRE_CPU_GEMM_HOST_ROWS")
    address = 0
    if rows:
        reason = host_gemm.kernel_unavailable_reason(torch.bfloat16)
        if reason is None:
            address = host_gemm.kernel_address()
        else:
            logger.info("cpu target: SPYRE_CPU_GEMM_HOST_ROWS=%d unused: %s", rows, reason)
    global _host_rows
    _host_rows = rows if address else 0
    torch.ops.spyre_inference_native.set_host_gemm(address, _host_rows)
    logger.info(
        "cpu target: oneDNN linear op in C++%s",
        f", products of <= {rows} rows on the host GEMM kernel ({host_gemm.kernel_isa()} build)"
        if address
        else "",
    )
    return "native"


def onednn_linear_t(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """``x @ weight_t`` in the weight's dtype, through oneDNN on the packed copy."""
    return torch.ops.spyre_inference.onednn_linear_t.default(x, weight_t)


__all__ = [
    "host_gemm_rows",
    "is_packed",
    "kernel",
    "onednn_linear_t",
    "pack",
    "packed_bytes",
    "unavailable_reason",
]
