"""When the attention kernels compile, and how they tile (one place for the rules).

* Decoder and encoder kernels compile (``dynamic=False``, one graph per
  bucket) whenever the model itself compiles, i.e. unless ``--enforce-eager``;
  under ``--enforce-eager`` they run the same functions eagerly.
* The head-major kernels always compile (spec, "LX-resident pages": their 2-D
  page gather lowers to ``aten.index``, which fails eagerly on the card by
  upcasting its int32 index). Attention compiles in its own domain, so the
  rest of the model still runs eagerly.
* The KV store compiles only when the model does: only then is the step's
  token count padded onto the runner's buckets, which bounds its variants.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from spyre_inference.platform import device as placement
from spyre_inference.platform import settings

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: On the cpu target a tile of the online softmax is as many pages as keep
#: the tile's gathered K|V and its float32 scores each under this many bytes
#: (summed over a batched-decode batch). Typical decode contexts then take a
#: single tile: fewer, larger matmuls, and fewer graph nodes to compile.
CPU_TILE_BYTES = 64 << 20


#: Whether the cpu target runs a tile through PyTorch's CPU flash-attention
#: kernel (read K and V once, merge tiles by log-sum-exp) rather than the
#: card's matmul form. The batched matmuls of the card's form are slow on a
#: CPU for the few rows of a decode (``G`` per KV head); results agree within
#: float rounding. Soft-capped layers always use the matmul form (the flash
#: kernel has no soft-cap). Tests turn this off to check the card's form.
CPU_FLASH_ATTENTION = True


def use_flash(
    logits_soft_cap: float | None, dtype: torch.dtype | None = None
) -> bool | torch.dtype:
    """The flash form for a layer: cpu target, no soft-cap (see :data:`CPU_FLASH_ATTENTION`).

    Returns False (the card's matmul form), True (flash in the query's dtype) or
    the dtype the flash kernel computes in: float32 when this CPU has no fast
    GEMM for ``dtype`` (:func:`~spyre_inference.platform.device.host_gemm_dtype`),
    since the CPU flash kernel's tile products are GEMMs too.
    """
    if not (CPU_FLASH_ATTENTION and logits_soft_cap is None and not placement.is_spyre()):
        return False
    gemm = placement.host_gemm_dtype(dtype) if dtype is not None else None
    return gemm if gemm is not None else True


def model_compiles(vllm_config: VllmConfig) -> bool:
    """Whether the runner compiles the model (and pads num_tokens onto buckets)."""
    from vllm.config import CompilationMode

    return vllm_config.compilation_config.mode != CompilationMode.NONE


def pages_per_tile(
    block_size: int,
    *,
    num_seqs: int = 1,
    query_rows: int = 1,
    num_heads: int = 1,
    token_bytes: int = 0,
) -> int:
    """Pages read per step of the online softmax.

    One on the card (the spec's page-at-a-time walk). On the cpu target, as
    many as keep both the gathered K|V (``num_seqs * tokens * token_bytes``)
    and the float32 scores (``num_seqs * num_heads * query_rows * tokens * 4``)
    of a tile within :data:`CPU_TILE_BYTES`; at least one page.
    """
    if placement.is_spyre():
        return 1
    kv_per_token = max(1, num_seqs * token_bytes)
    scores_per_token = max(1, num_seqs * num_heads * query_rows * 4)
    tokens = CPU_TILE_BYTES // max(kv_per_token, scores_per_token)
    return max(1, tokens // block_size)


def batched_decode_requested() -> bool:
    return bool(settings.get("SPYRE_BATCHED_DECODE"))


def explicitly_set(name: str) -> bool:
    """Whether the user set a plugin setting, as opposed to leaving its default.

    The batched-decode kernel is on by default, but only on the token-major
    layout: the head-major backend ignores the default and refuses an explicit
    request. Reading the raw variable only answers "was it given"; its value
    still comes from :mod:`spyre_inference.platform.settings`.
    """
    settings.get(name)  # a known setting, with a valid value
    return name in os.environ


def num_seqs_buckets_setting() -> tuple[int, ...]:
    return tuple(settings.get("SPYRE_ATTN_NUM_SEQS_BUCKETS"))


def record_at_warm_up() -> bool:
    return bool(settings.get("SPYRE_ATTN_RECORD"))
