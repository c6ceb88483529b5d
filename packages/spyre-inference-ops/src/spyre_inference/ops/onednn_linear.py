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
"""

from __future__ import annotations

import weakref

import torch

from spyre_inference.ops.linear_op import OP_NAMESPACE, register_linear_op
from spyre_inference.platform import settings
from spyre_inference.platform.device import is_spyre
from spyre_inference.platform.logs import get_logger

logger = get_logger(__name__)

OP_NAME = "onednn_linear_t"
QUALNAME = f"{OP_NAMESPACE}::{OP_NAME}"

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
    key = weight_t.data_ptr()
    fresh = key not in _packed
    # oneDNN takes the linear convention, [out, in]. The batch-size hint (1)
    # only picks among blocked formats; measured 1 vs 32 vs 128: no difference.
    _packed[key] = torch.ops.mkldnn._reorder_linear_weight(weight_t.t().contiguous(), 1)
    if fresh:
        weakref.finalize(weight_t, _packed.pop, key, None)


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


# The product is in the weight's dtype.
_LIB = register_linear_op(OP_NAME, _onednn_linear_t, lambda weight_t: weight_t.dtype)


def onednn_linear_t(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """``x @ weight_t`` in the weight's dtype, through oneDNN on the packed copy."""
    return torch.ops.spyre_inference.onednn_linear_t.default(x, weight_t)


__all__ = [
    "is_packed",
    "onednn_linear_t",
    "pack",
    "packed_bytes",
    "unavailable_reason",
]
