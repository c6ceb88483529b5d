"""Per-sequence paged attention with an online (FlashAttention-style) softmax.

One call handles one sequence of one step, already padded onto its buckets:
``q_index`` holds ``query_bucket`` rows and ``block_ids`` holds
``kv_block_bucket`` pages, so every shape inside is fixed by the bucket pair.
That is what lets a later stage wrap this function in
``torch.compile(dynamic=False)`` once per (query bucket, KV bucket); the
Python loop over pages then unrolls into the graph.

Why this shape of algorithm (spec, "Attention Backend"):

* pages are visited one at a time, each read by indexing the dense cache with
  a one-element index tensor (an indirect access, so a compiled graph carries
  a real index rather than a constant slice); there is no compact gather of
  the whole context;
* the token-major page ``[block_size, kv_heads, K|V]`` is permuted to
  head-major ``[kv_heads, block_size, head]`` on the device before the
  matmuls;
* masking is one additive tile per page, built on the host (the card cannot
  build bool masks or broadcast a ``where``);
* the query groups of GQA/MQA fold into the row axis (heads are KV-major, so
  it is a reshape), keeping every matmul a single-batch-dim bmm.
"""

from __future__ import annotations

import torch


def mask_value(dtype: torch.dtype) -> float:
    """The additive "masked" value for softmax statistics in ``dtype``.

    Finite rather than ``-inf``: a page whose entries are all masked for a row
    (padding pages, pages before a sliding window) must not turn the running
    maximum into ``-inf`` and the rescale into ``exp(-inf + inf) = NaN``. Half
    of the most negative value leaves headroom so ``score + mask`` cannot
    overflow to ``-inf`` for any realistic score, while ``exp(mask - m)`` still
    underflows to exactly 0 once a real score has been seen.
    """
    return torch.finfo(dtype).min / 2


def page_attention(
    query: torch.Tensor,
    q_index: torch.Tensor,
    pages: torch.Tensor,
    block_ids: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of one sequence's query rows over its pages.

    Args:
        query: ``[num_tokens, num_heads, head_size]``, every token of the step.
        q_index: ``[query_bucket]`` int64 rows of ``query`` that belong to this
            sequence, padded by repeating a real row (padding rows are fully
            masked and their output discarded). The gather runs on the device.
        pages: ``[num_blocks, block_size, num_kv_heads, 2 * head_size]``
            token-major cache view, K then V in the last axis.
        block_ids: ``[kv_block_bucket, 1]`` int64 page ids, padded with the
            null block (masked).
        mask: ``[query_bucket, kv_block_bucket * block_size]`` additive mask
            (0 or :func:`mask_value`) in the dtype of the softmax statistics:
            causal, padding and sliding window in one tile per page.
        scale: softmax scale applied to ``q @ k^T``.
        logits_soft_cap: if set, scores become ``cap * tanh(scores / cap)``
            before masking.

    Returns:
        ``[query_bucket, num_heads, head_size]`` in ``query.dtype``.

    """
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = pages.shape[2]
    groups = num_heads // num_kv_heads
    q_len = q_index.shape[0]
    block_size = pages.shape[1]
    stats = mask.dtype

    # [Q, H, D] -> [KVH, G * Q, D]: head h = kvh * G + g reads KV head kvh.
    q = query.index_select(0, q_index)
    q = q.reshape(q_len, num_kv_heads, groups, head_size).permute(1, 2, 0, 3)
    q = q.reshape(num_kv_heads, groups * q_len, head_size)

    rows = groups * q_len
    m = torch.full((num_kv_heads, rows, 1), mask_value(stats), dtype=stats, device=query.device)
    denom = torch.zeros((num_kv_heads, rows, 1), dtype=stats, device=query.device)
    acc = torch.zeros((num_kv_heads, rows, head_size), dtype=stats, device=query.device)

    for j in range(block_ids.shape[0]):
        page = pages[block_ids[j]][0]  # [block_size, KVH, 2D], one indirect page read
        page = page.permute(1, 0, 2)  # token-major -> head-major [KVH, block_size, 2D]
        k = page[..., :head_size]
        v = page[..., head_size:]

        s = torch.bmm(q, k.transpose(1, 2)).to(stats) * scale  # [KVH, G*Q, block_size]
        if logits_soft_cap is not None:
            s = torch.tanh(s / logits_soft_cap) * logits_soft_cap
        tile = mask[:, j * block_size : (j + 1) * block_size]  # [Q, block_size]
        s = (s.view(num_kv_heads, groups, q_len, block_size) + tile).view(
            num_kv_heads, rows, block_size
        )

        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        p = torch.exp(s - m_new)
        alpha = torch.exp(m - m_new)
        denom = denom * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + torch.bmm(p.to(v.dtype), v).to(stats)
        m = m_new

    out = acc / denom  # [KVH, G*Q, D]
    out = out.view(num_kv_heads, groups, q_len, head_size).permute(2, 0, 1, 3)
    return out.reshape(q_len, num_heads, head_size).to(query.dtype)
