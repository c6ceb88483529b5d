"""Writing the new tokens' K and V into the paged cache (both layouts).

The source ``[num_tokens, num_kv_heads, 2 * head_size]`` (K then V per head)
is materialised by :func:`kv_source` before the store kernel runs: ``key`` and
``value`` arrive as offset views into the fused QKV output (offset > 0 views
must not cross to the card), and their strides depend on the model (a q/k norm
makes ``key`` contiguous, a plain split does not). A contiguous source keeps
the compiled store's input signature, and so its variant, independent of the
model.
"""

from __future__ import annotations

import torch


def kv_source(key: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``cat(key, value)`` along the head dim, contiguous, in the cache dtype."""
    src = torch.cat((key, value), dim=-1)
    return src if src.dtype == dtype else src.to(dtype)


def store_kv(slots: torch.Tensor, slot_index: torch.Tensor, src: torch.Tensor) -> None:
    """Scatter K|V rows into the token-major slot view, in place.

    Args:
        slots: ``[num_slots, num_kv_heads, 2 * head_size]`` slot-major view of
            the layer cache (see :func:`~.kv_layout.slot_major_view`).
        slot_index: ``[num_tokens]`` int64 slot of every row, built on the host.
            Padding rows point at a slot of the null block (block 0), which
            vLLM never hands to a request, so the shape stays the padded token
            count (one compiled variant per token bucket) and nothing real is
            overwritten.
        src: ``[num_tokens, num_kv_heads, 2 * head_size]`` from :func:`kv_source`.

    With K and V interleaved per slot, one ``index_copy_`` writes both: a
    single store of one contiguous run per token rather than two scatters.
    """
    slots.index_copy_(0, slot_index, src)


def store_kv_head_major(rows: torch.Tensor, head_index: torch.Tensor, src: torch.Tensor) -> None:
    """Scatter K|V into the head-major cache, one ``index_copy_`` per KV head.

    Args:
        rows: ``[num_blocks * num_kv_heads * block_size, 2 * head_size]``, the
            head-major cache with (block, KV head, token) folded (a view).
        head_index: ``[num_kv_heads, num_tokens]`` int64: for KV head ``h`` and
            token ``t``, the row ``(block * num_kv_heads + h) * block_size +
            offset`` of its slot (built on the host once per step; padding
            tokens go to the null block).
        src: ``[num_tokens, num_kv_heads, 2 * head_size]`` from :func:`kv_source`.

    A token's KV heads sit ``block_size`` rows apart in this layout, so the
    write cannot be one contiguous run per token as in the token-major store.
    """
    for h in range(head_index.shape[0]):
        rows.index_copy_(0, head_index[h], src[:, h])
