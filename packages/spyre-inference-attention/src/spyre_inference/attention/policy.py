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


#: Whether the cpu target may run decode batches through the host kernel
#: (:mod:`~spyre_inference.attention.ops.host_decode`) instead of the compiled
#: batched-decode graph. Tests turn this off to check the graph.
CPU_DECODE_KERNEL = True


def use_host_decode(
    logits_soft_cap: float | None,
    alibi: bool,
    cache_dtype: torch.dtype,
    head_size: int,
    num_heads: int,
    num_kv_heads: int,
) -> bool:
    """Whether a layer's decode batches run through the cpu target's host kernel.

    Only on the cpu target (the card runs the compiled graph), only when
    ``SPYRE_CPU_ATTN_KERNEL`` is ``auto``, and only for layers without a
    soft-cap or ALiBi (the kernel has neither) whose shape the kernel serves.
    """
    if not CPU_DECODE_KERNEL or placement.is_spyre() or logits_soft_cap is not None or alibi:
        return False
    if settings.get("SPYRE_CPU_ATTN_KERNEL") != "auto":
        return False
    from spyre_inference.attention.ops import host_decode

    return host_decode.unavailable_reason(cache_dtype, head_size, num_heads, num_kv_heads) is None


#: cpu target: prefill chunks of fewer query rows than this join the decode
#: kernel's rows (:mod:`~spyre_inference.attention.ops.host_decode`); longer ones
#: take the flash kernel (:mod:`~spyre_inference.attention.ops.host_prefill`).
#: Both cost about the same per (query row, key) pair once past their fixed
#: costs; the kernel has almost none (it joins the step's one call), the flash
#: kernel a page gather and one or two calls. Measured on a 2-core AMD EPYC
#: (Zen 4), SmolLM2-135M's heads (9 over 3, head 64), bfloat16, median of 7:
#: at 128 rows the kernel 0.35 ms vs 0.49 ms (no context) and 11.5 vs 11.4 ms
#: (4000 tokens of context); at 256 rows 1.4 vs 1.6 ms and 23.5 vs 18.9 ms; at
#: 1024 rows 21.5 vs 15.9 ms and 114 vs 94 ms. Those isolated figures flatter
#: the flash kernel: in the engine (where the rows share the layer's one fused
#: store-and-attend call) on the same CPU, bfloat16, the rows took 25.4 ms per
#: 256-token prompt over 30 layers against the flash kernel's 55.0, and 132 vs
#: 174 ms at 512 tokens; 892 vs 884 ms for 1536 tokens in 512-token chunks.
#: That class now takes the plugin's prefill kernel for bfloat16 (below); the
#: crossover for the flash kernel is left at 256 until it is measured in the
#: engine on the classes that use it (float32 compute on AVX2, AMX tiles).
HOST_ROWS_MAX_QUERY = 256

#: cpu target, where bfloat16 prefills take the plugin's prefill kernel
#: (:func:`~spyre_inference.attention.ops.host_prefill.kernel_serves`): a chunk
#: takes it from this many rows, once its (query row, visible key) pairs,
#: ``q_len * (context_len + q_len / 2)``, reach :data:`PLUGIN_PREFILL_MIN_PAIRS`
#: (those of a 192-row first chunk). Measured in the engine (SmolLM2-135M,
#: bfloat16, 512-token steps, 2-core AMD EPYC Zen 4), attention per prompt over
#: its 30 layers, decode-kernel rows (fused with the KV store) vs the prefill
#: kernel, ms: 128 tokens 7.9 vs 10.3, 192 17.7 vs 17.3, 256 25.4 vs 23.2, 384
#: 65.8 vs 39.5, 512 132 vs 56, 1536 (three 512-token chunks) 892 vs 392.
#: Shorter chunks after a long context gain sooner: the decode kernel's cost per
#: (row, key) pair is about twice the prefill kernel's, which first packs the
#: sequence's keys.
PLUGIN_PREFILL_MIN_ROWS = 16
PLUGIN_PREFILL_MIN_PAIRS = 192 * 96


def host_rows_win(q_len: int, context_len: int = 0, plugin_kernel: bool = False) -> bool:
    """Whether a prefill chunk of ``q_len`` rows after ``context_len`` tokens runs on
    the decode kernel's rows rather than the host prefill path (cpu target).

    Against PyTorch's flash kernel the crossover is :data:`HOST_ROWS_MAX_QUERY`
    rows whatever the context; against the plugin's prefill kernel
    (``plugin_kernel``) it is lower and falls with the context
    (:data:`PLUGIN_PREFILL_MIN_ROWS`, :data:`PLUGIN_PREFILL_MIN_PAIRS`).
    """
    if plugin_kernel:
        pairs = q_len * (context_len + q_len / 2)
        return q_len < PLUGIN_PREFILL_MIN_ROWS or pairs < PLUGIN_PREFILL_MIN_PAIRS
    return q_len < HOST_ROWS_MAX_QUERY


def host_kv_store() -> bool:
    """Whether the cpu target runs the KV store eagerly although the model compiles.

    The card compiles the store (a device op); on a CPU entering its compiled
    graph costs far more than the copy. Same setting as the decode kernel.
    """
    if not CPU_DECODE_KERNEL or placement.is_spyre():
        return False
    return settings.get("SPYRE_CPU_ATTN_KERNEL") == "auto"


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


def softmax_stats_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """Dtype of the scores, running max/sum and accumulator (every backend).

    float32 on the cpu target (the host has it for free, and it keeps long
    contexts accurate); the card computes in float16 only, so there the
    statistics stay in the compute dtype.
    """
    return compute_dtype if placement.is_spyre() else torch.float32


def explicitly_set(name: str) -> bool:
    """Whether the user set a plugin setting, as opposed to leaving its default.

    The batched-decode kernel is on by default, but only on the token-major
    layout: the head-major backend ignores the default and refuses an explicit
    request. Reading the raw variable only answers "was it given"; its value
    still comes from :mod:`spyre_inference.platform.settings`.
    """
    return settings.is_set(name)


def num_seqs_buckets_setting() -> tuple[int, ...]:
    return tuple(settings.get("SPYRE_ATTN_NUM_SEQS_BUCKETS"))


def record_at_warm_up() -> bool:
    return bool(settings.get("SPYRE_ATTN_RECORD"))
