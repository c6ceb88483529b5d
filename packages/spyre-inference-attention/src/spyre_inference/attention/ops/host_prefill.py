"""The cpu target's prefill attention: PyTorch's CPU flash kernel over a sequence's pages.

On the card a prefill chunk runs as one compiled graph per (query, pages)
bucket (:func:`~spyre_inference.attention.ops.page_attention.page_attention`):
the rows are padded onto the query bucket, the pages onto the page bucket, and
the online softmax walks every tile of the padded rectangle with a host-built
additive mask. On a CPU that rectangle is the cost: the graph computes the
masked upper triangle of a causal prefill as well, merges one tile's result
per page, and each (query, pages) bucket is a graph to compile at warm-up.
Measured on a 2-core AMD EPYC (Zen 4) with SmolLM2-135M's heads (9 over 3,
head 64, bfloat16), one 8192-token prompt: the compiled graph 1.45 s per layer
after a 100 s compile, this path 0.6 s and no compile.

So the cpu target attends a prefill here instead, eagerly and unpadded: the
sequence's pages are gathered once (``index_select`` through its block table,
as the graph reads them) and PyTorch's flash kernel, which skips the causal
upper triangle and keeps its own tiles, runs over the real rows and keys:

* keys of the chunk itself (positions ``context_len ..``) causally, in one call
  (the kernel's causal mask is top-left aligned, which is right when the keys
  start at the first query row's position);
* keys of the earlier context (a later chunk, or a prefix-cache hit), all
  visible, in a second call; the two merge by their log-sum-exp
  (:func:`~.page_attention.merge_by_lse`, as the graph's flash tiles do);
* a sliding window masks explicitly, a block of query rows at a time, over
  only the keys the block's window can reach;
* attention sinks join the denominator after the merge (as in the graph).

On CPUs with AVX-512 BF16 and no AMX a bfloat16 chunk takes the plugin's own
kernel instead (``csrc/paged_prefill.c``, ``SPYRE_CPU_PREFILL_KERNEL``): the
same causal / context / window / sink semantics in one call that reads the
pages through the block table, with bf16 dot products (VDPBF16PS) where
PyTorch's kernel reaches ~60-130 GFLOP/s on such a CPU, no faster than in
float32. SmolLM2's heads on a 2-core Zen 4, per layer: 500 rows 6.0 -> 1.7 ms,
2000 rows 49 -> 24 ms, 8000 rows 720 -> 314 ms.

The card keeps its graph (this module is never used when
:func:`~spyre_inference.platform.device.is_spyre`); the same gating as the
decode host kernel applies (``SPYRE_CPU_ATTN_KERNEL=auto``, no soft-cap, no
ALiBi), and ``SPYRE_CPU_ATTN_KERNEL=graph`` keeps the cpu target on the graph.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from spyre_inference.attention.ops.page_attention import (
    add_sink_by_lse,
    mask_value,
    merge_by_lse,
)
from spyre_inference.platform import settings
from spyre_inference.platform.logs import get_logger
from spyre_inference.platform.native_build import (
    NativeKernelUnavailable,
    cpu_flags,
    load_kernel,
)

logger = get_logger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_prefill.c"
#: Instruction sets ``csrc/paged_prefill.c`` has builds for: its products are
#: bf16 dot products, which only AVX-512 BF16 has.
ISAS = ("avx512bf16",)
#: CPU flags of a tile unit PyTorch's flash kernel can use through oneDNN's
#: brgemm; ``SPYRE_CPU_PREFILL_KERNEL=auto`` leaves such CPUs on it.
_TILE_UNIT_FLAGS = ("amx_bf16", "amx_tile")

#: Query rows per explicit-mask call of a windowed layer: keeps the additive
#: mask at ``rows x (window + rows)`` whatever the prompt length.
WINDOW_ROWS = 512

_calls = 0
_kernel_calls = 0


def calls() -> int:
    """Host prefill calls in this process (evidence for tests that it, not the graph, ran)."""
    return _calls


def kernel_calls() -> int:
    """Of :func:`calls`, those the plugin's kernel served (the rest: PyTorch's flash kernel)."""
    return _kernel_calls


@functools.cache
def _library_or_error() -> ctypes.CDLL | str:
    """The loaded kernel, or why it cannot be had (tried once per process)."""
    try:
        lib, isa = load_kernel(_SOURCE, ISAS)
    except (NativeKernelUnavailable, OSError) as exc:
        return str(exc)
    fn = lib.spyre_paged_prefill
    fn.restype = ctypes.c_int
    L, P = ctypes.c_long, ctypes.c_void_p
    fn.argtypes = [
        *(P, L, L),  # q, its row and head strides
        *(L, L, L),  # L, H, D
        *(P, L, L, L, L, L),  # pages, page/slot/head strides, KVH, block size
        *(P, L, ctypes.c_float, L, P),  # block_ids, context_len, scale, window, sinks
        *(P, L, L),  # out, its row and head strides
        ctypes.c_int,  # threads
    ]
    logger.info("cpu target: prefill-attention kernel, %s build, loaded from %s", isa, lib._name)
    return lib


def reset_for_tests() -> None:
    """Forget the loaded build and the choice (tests change the settings)."""
    _library_or_error.cache_clear()
    kernel_choice.cache_clear()


def kernel_unavailable_reason() -> str | None:
    """None when the plugin's prefill kernel can run here, else why not."""
    lib = _library_or_error()
    return lib if isinstance(lib, str) else None


@functools.cache
def kernel_choice() -> str:
    """``"plugin"`` or ``"torch"``: what bfloat16 prefill chunks attend through here.

    ``SPYRE_CPU_PREFILL_KERNEL`` names one; ``auto`` takes the plugin's kernel
    where it builds and the CPU has no tile unit. A forced ``plugin`` that
    cannot run raises (the platform's start-up check refuses it first).
    """
    wanted = settings.get("SPYRE_CPU_PREFILL_KERNEL")
    if wanted == "torch":
        return "torch"
    reason = kernel_unavailable_reason()
    if wanted == "plugin":
        if reason is not None:
            raise NativeKernelUnavailable(f"SPYRE_CPU_PREFILL_KERNEL=plugin: {reason}")
        return "plugin"
    tile_unit = [f for f in _TILE_UNIT_FLAGS if f in cpu_flags()]
    choice = "plugin" if reason is None and not tile_unit else "torch"
    why = reason or (f"the CPU has {', '.join(tile_unit)}" if tile_unit else "AVX-512 BF16")
    logger.info("cpu target: bfloat16 prefill attention on the %s kernel (%s)", choice, why)
    return choice


def kernel_serves(
    cache_dtype: torch.dtype,
    compute_dtype: torch.dtype | None,
    head_size: int,
    num_heads: int,
    num_kv_heads: int,
) -> bool:
    """Whether :func:`paged_prefill` takes the plugin's kernel for such a layer.

    ``compute_dtype`` is what the flash path would compute in (None: the
    cache's, see ``policy.use_flash``); the kernel's products are bf16, so
    only bfloat16 caches computed in bfloat16, with whole 16-lane head chunks.
    """
    return (
        cache_dtype == torch.bfloat16
        and (compute_dtype or cache_dtype) == torch.bfloat16
        and head_size % 16 == 0
        and num_heads % num_kv_heads == 0
        and kernel_choice() == "plugin"
    )


def _kernel_prefill(
    q: torch.Tensor,
    pages: torch.Tensor,
    block_ids: torch.Tensor,
    context_len: int,
    scale: float,
    out: torch.Tensor,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
) -> None:
    """:func:`paged_prefill` through ``csrc/paged_prefill.c`` (bfloat16 in and out)."""
    global _kernel_calls
    lib = _library_or_error()
    assert not isinstance(lib, str)  # kernel_choice() said "plugin"
    q_len, num_heads, head_size = q.shape
    _, block_size, num_kv_heads, _ = pages.shape
    if q.dtype != torch.bfloat16 or q.stride(2) != 1:
        q = q.to(torch.bfloat16).contiguous()
    ids = block_ids.to(torch.int64).contiguous()
    if ids.numel() * block_size < context_len + q_len:
        raise ValueError(
            f"prefill kernel: {ids.numel()} pages of {block_size} do not hold "
            f"{context_len + q_len} tokens"
        )
    sk = None if sinks is None else sinks.to(torch.float32).contiguous()
    dst = out if out.dtype == torch.bfloat16 and out.stride(2) == 1 else None
    if dst is None:
        dst = torch.empty(q.shape, dtype=torch.bfloat16)
    failed = lib.spyre_paged_prefill(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        q_len,
        num_heads,
        head_size,
        pages.data_ptr(),
        pages.stride(0),
        pages.stride(1),
        pages.stride(2),
        num_kv_heads,
        block_size,
        ids.data_ptr(),
        context_len,
        scale,
        sliding_window or 0,
        None if sk is None else sk.data_ptr(),
        dst.data_ptr(),
        dst.stride(0),
        dst.stride(1),
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError(f"prefill kernel: no memory for {context_len + q_len} packed keys")
    if dst is not out:
        out.copy_(dst)
    _kernel_calls += 1


def _flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [1, H, L, D], lse [1, H, L] float32)``; heads ``h`` read KV head ``h // G``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )


def _windowed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_len: int,
    window: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention within the last ``window`` positions, a block of rows at a time."""
    q_len = q.shape[2]
    outs, lses = [], []
    neg = mask_value(q.dtype)
    for r0 in range(0, q_len, WINDOW_ROWS):
        r1 = min(q_len, r0 + WINDOW_ROWS)
        # Rows r0..r1-1 sit at positions context_len + r; row p sees keys p-W < key <= p.
        lo = max(0, context_len + r0 - window + 1)
        hi = context_len + r1
        pos_q = torch.arange(context_len + r0, hi).unsqueeze(1)
        keys = torch.arange(lo, hi).unsqueeze(0)
        keep = (keys <= pos_q) & (pos_q - keys < window)
        mask = torch.zeros(keep.shape, dtype=q.dtype).masked_fill_(~keep, neg)
        out, lse = _flash(q[:, :, r0:r1], k[:, :, lo:hi], v[:, :, lo:hi], scale, False, mask)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def paged_prefill(
    q: torch.Tensor,
    pages: torch.Tensor,
    block_ids: torch.Tensor,
    context_len: int,
    scale: float,
    out: torch.Tensor,
    *,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> None:
    """Attention of one sequence's query rows over its token-major pages, into ``out``.

    Args:
        q: ``[query_len, num_heads, head_size]``, the chunk's rows (positions
            ``context_len ..``).
        pages: ``[num_blocks, block_size, num_kv_heads, 2 * head_size]``
            token-major cache (K then V in the last axis), the chunk's K/V
            already stored.
        block_ids: ``[num_pages]`` int64 host tensor, the sequence's pages in
            order, exactly those holding its ``context_len + query_len`` tokens.
        context_len: tokens of the sequence before this chunk.
        scale: softmax scale.
        out: ``[query_len, num_heads, head_size]`` destination (any dtype).
        sliding_window: vLLM's window (a row at ``p`` sees keys ``> p - W``).
        sinks: ``[num_heads]`` float32 attention-sink logits, or None.
        compute_dtype: the dtype the kernel computes in (float32 on CPUs without a
            fast 16-bit GEMM, see ``policy.use_flash``); None: the cache's.
    """
    global _calls
    _calls += 1
    q_len, num_heads, head_size = q.shape
    num_kv_heads = pages.shape[2]
    seq_len = context_len + q_len
    compute = compute_dtype or pages.dtype
    if pages.stride(3) == 1 and kernel_serves(
        pages.dtype, compute, head_size, num_heads, num_kv_heads
    ):
        _kernel_prefill(q, pages, block_ids, context_len, scale, out, sliding_window, sinks)
        return
    # One gather of the sequence's pages, then [1, KVH, tokens, K|V] views.
    kv = pages.index_select(0, block_ids).view(-1, num_kv_heads, 2 * head_size)[:seq_len]
    kv = kv.to(compute).permute(1, 0, 2).unsqueeze(0)
    k, v = kv[..., :head_size], kv[..., head_size:]
    qh = q.to(compute).permute(1, 0, 2).unsqueeze(0)

    if sliding_window is not None and sliding_window < seq_len:
        result = _windowed(qh, k, v, context_len, sliding_window, scale)
    else:
        result = _flash(qh, k[:, :, context_len:], v[:, :, context_len:], scale, True)
        if context_len:
            o, lse = result
            o_ctx, lse_ctx = _flash(qh, k[:, :, :context_len], v[:, :, :context_len], scale, False)
            result = merge_by_lse(o.float(), lse, o_ctx.float(), lse_ctx)
    o, lse = result
    if sinks is not None:
        o = add_sink_by_lse(o.float(), lse, sinks.to(torch.float32).view(1, num_heads, 1))
    out.copy_(o.squeeze(0).transpose(0, 1))
