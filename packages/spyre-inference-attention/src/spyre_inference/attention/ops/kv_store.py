"""Writing the new tokens' K and V into the paged cache."""

from __future__ import annotations

import torch


def store_kv(
    slots: torch.Tensor,
    slot_index: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` rows into the slot-major cache view, in place.

    Args:
        slots: ``[num_slots, num_kv_heads, 2 * head_size]`` slot-major view of
            the layer cache (see :func:`~.kv_layout.slot_major_view`).
        slot_index: ``[num_tokens]`` int64 slot of every row, built on the host.
            Padding rows point at a slot of the null block (block 0), which
            vLLM never hands to a request, so the shape stays the padded token
            count (one compiled variant per token bucket) and nothing real is
            overwritten.
        key, value: ``[num_tokens, num_kv_heads, head_size]``.

    With K and V interleaved per slot, one ``index_copy_`` writes both: a
    single store of one contiguous run per token rather than two scatters.
    ``cat`` also materialises ``key``/``value``, which arrive as offset views
    into the fused QKV output (offset > 0 views must not cross to the card).
    """
    src = torch.cat((key, value), dim=-1)
    if src.dtype != slots.dtype:
        src = src.to(slots.dtype)
    slots.index_copy_(0, slot_index, src)
