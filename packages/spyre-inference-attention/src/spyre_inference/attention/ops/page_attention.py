"""Paged attention kernels with an online (FlashAttention-style) softmax.

Three kernels share one softmax loop (:func:`online_softmax`):

* :func:`page_attention`: one sequence of a step over its token-major pages
  (prefills, and decodes when the batched-decode kernel is off);
* :func:`batched_decode_attention`: every single-row (decode) sequence of a
  step in one call, the sequences padded onto a num-seqs bucket;
* :func:`head_major_page_attention`: one sequence over head-major pages.

Every call is already padded onto its buckets (query rows, pages, sequences),
so every shape inside is fixed by the bucket: that is what lets
:class:`~spyre_inference.attention.ops.compiled.KernelFamily` compile each
kernel once per bucket with ``dynamic=False``. The Python loops over page
tiles unroll into the graph.

Why this shape of algorithm (spec, "Attention Backend"):

* pages are visited a tile at a time and each tile is read by indexing the
  dense cache with an index tensor (an indirect access, so a compiled graph
  carries a real index rather than a constant slice). ``pages_per_tile=1`` is
  the spec's one-page-at-a-time walk, used on the card; the cpu target reads
  several pages per tile (the host has the cache memory to spare, and fewer,
  larger matmuls are both faster and quicker to compile);
* token-major pages ``[block_size, kv_heads, K|V]`` are permuted to
  head-major ``[kv_heads, tokens, head]`` on the device before the matmuls;
  head-major pages arrive in that shape already;
* masking is an additive tile built on the host (the card cannot build bool
  masks or broadcast a ``where``); ALiBi is a per-head slope times a host-built
  tile of key-minus-query positions;
* the query groups of GQA/MQA fold into the row axis (heads are KV-major, so
  it is a reshape), keeping every matmul a single-batch-dim bmm;
* attention sinks (gpt-oss: one learned logit per head that joins every row's
  softmax denominator and contributes no value) are one more rescale after the
  last tile (:func:`sink_rows`, :func:`online_softmax`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

#: (K tile ``[B, KVH, tokens, D]``, V tile, additive bias broadcastable to
#: ``[B, KVH, G, Q, tokens]``: the mask, plus ALiBi where used)
Tile = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def mask_value(dtype: torch.dtype) -> float:
    """The additive "masked" value for softmax statistics in ``dtype``.

    Finite rather than ``-inf``: a tile whose entries are all masked for a row
    (padding pages, pages before a sliding window, padding sequences) must not
    turn the running maximum into ``-inf`` and the rescale into
    ``exp(-inf + inf) = NaN``. Half of the most negative value leaves headroom
    so ``score + mask`` cannot overflow to ``-inf`` for any realistic score,
    while ``exp(mask - m)`` still underflows to exactly 0 once a real score has
    been seen.
    """
    return torch.finfo(dtype).min / 2


def sink_rows(sinks: torch.Tensor, b: int, kvh: int, groups: int, q_len: int) -> torch.Tensor:
    """Per-head sink logits ``[H]`` (head ``kvh * G + g``) laid out on the folded rows:
    ``[b, KVH, G * Q, 1]``, group major like the query rows."""
    rows = sinks.view(1, kvh, groups, 1, 1).expand(b, kvh, groups, q_len, 1)
    return rows.reshape(b, kvh, groups * q_len, 1)


def merge_by_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attention results over disjoint keys as one, with the joint log-sum-exp.

    Each result is normalised by its own ``exp(lse)``; over the union of keys the
    normaliser is ``exp(logaddexp(lse_a, lse_b))``, so each is reweighted by its
    share of it. ``out_*`` ``[..., rows, D]``, ``lse_*`` ``[..., rows]``.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse).unsqueeze(-1)
    out = out + out_b * torch.exp(lse_b - lse).unsqueeze(-1)
    return out, lse


def add_sink_by_lse(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """``out`` (normalised by ``exp(lse)``) with a sink logit joining the denominator:
    the normaliser becomes ``exp(lse) + exp(sink)``. ``sink`` broadcasts to ``lse``."""
    return out * torch.exp(lse - torch.logaddexp(lse, sink)).unsqueeze(-1)


def online_softmax(
    q: torch.Tensor,
    tiles: Iterable[Tile],
    scale: float,
    logits_soft_cap: float | None,
    stats: torch.dtype,
    groups: int,
    flash: bool | torch.dtype = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``softmax(q k^T * scale + bias) v`` over KV tiles, one tile at a time.

    ``q`` is ``[B, KVH, G * Q, D]`` (query groups folded into the rows, group
    major); each tile's K and V are ``[B, KVH, tokens, D]`` and its bias
    broadcasts to ``[B, KVH, G, Q, tokens]``. Returns ``[B, KVH, G * Q, D]``
    in ``stats``.

    Two ways to run one tile, same result:

    * ``flash=False`` (the spec's kernel, used on the card): ``Q @ K^T`` and
      ``P @ V`` matmuls in the cache dtype with the running maximum, sum and
      accumulator in ``stats``, rescaled tile by tile;
    * ``flash=True`` (cpu target, no soft-cap): PyTorch's CPU flash-attention
      kernel per tile, which returns each tile's log-sum-exp, and the tiles
      merged by their log-sum-exp. The CPU's batched matmuls are slow for the
      few rows a decode has (``G`` per KV head); the fused kernel reads K and V
      once. It has no soft-cap, so soft-capped layers use the matmul form.

    ``sinks`` (``[H]`` in ``stats``, or None): a logit per query head that
    joins the softmax's denominator with no value of its own, as gpt-oss
    defines it (``softmax([scores, sink])`` with the sink column dropped). It is
    folded in after the last tile: one more rescale by the running maximum (or,
    in the flash form, by the log-sum-exp), so no tile changes shape.
    """
    b, kvh, rows, _ = q.shape
    q_len = rows // groups
    if flash:
        assert logits_soft_cap is None, "the flash form has no soft-cap"
        # ``flash`` may name the dtype the kernel computes in (float32 on a CPU
        # without a fast bfloat16 GEMM: the kernel's tile products are GEMMs).
        compute = flash if isinstance(flash, torch.dtype) else q.dtype
        qc = q.to(compute)
        out = lse = None
        for k, v, bias in tiles:
            tokens = k.shape[2]
            mask = bias.expand(b, bias.shape[1], groups, q_len, tokens)
            mask = mask.reshape(b, bias.shape[1], rows, tokens)
            # In the kernel's dtype, as it wants; clamped so float16's range
            # keeps the "masked" value finite (see mask_value).
            mask = mask.clamp_min(mask_value(compute)).to(compute)
            tile_out, tile_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qc, k.to(compute), v.to(compute), 0.0, False, attn_mask=mask, scale=scale
            )
            tile_out = tile_out.to(stats)
            if out is None:
                out, lse = tile_out, tile_lse
            else:
                out, lse = merge_by_lse(out, lse, tile_out, tile_lse)
        assert out is not None, "attention over zero pages"
        if sinks is not None:
            sink = sink_rows(sinks, b, kvh, groups, q_len).squeeze(-1)
            out = add_sink_by_lse(out, lse.to(stats), sink)
        return out

    m = denom = acc = None
    for k, v, bias in tiles:
        tokens = k.shape[2]
        s = torch.matmul(q, k.transpose(-1, -2)).to(stats) * scale
        if logits_soft_cap is not None:
            s = torch.tanh(s / logits_soft_cap) * logits_soft_cap
        s = (s.view(b, kvh, groups, q_len, tokens) + bias).view(b, kvh, rows, tokens)
        s_max = s.amax(dim=-1, keepdim=True)
        if m is None:
            m = s_max
            p = torch.exp(s - m)
            denom = p.sum(dim=-1, keepdim=True)
            acc = torch.matmul(p.to(v.dtype), v).to(stats)
        else:
            m_new = torch.maximum(m, s_max)
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new)
            denom = denom * alpha + p.sum(dim=-1, keepdim=True)
            acc = acc * alpha + torch.matmul(p.to(v.dtype), v).to(stats)
            m = m_new
    assert acc is not None and denom is not None and m is not None, "attention over zero pages"
    if sinks is not None:
        sink = sink_rows(sinks, b, kvh, groups, q_len)
        m_new = torch.maximum(m, sink)
        alpha = torch.exp(m - m_new)
        denom = denom * alpha + torch.exp(sink - m_new)
        acc = acc * alpha
    return acc / denom


def _fold_groups(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[Q, H, D]`` -> ``[KVH, G * Q, D]``: head ``h = kvh * G + g`` reads KV head ``kvh``."""
    q_len, num_heads, head_size = q.shape
    groups = num_heads // num_kv_heads
    q = q.reshape(q_len, num_kv_heads, groups, head_size).permute(1, 2, 0, 3)
    return q.reshape(num_kv_heads, groups * q_len, head_size)


def _unfold_groups(out: torch.Tensor, q_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`_fold_groups`: ``[KVH, G * Q, D]`` -> ``[Q, H, D]``."""
    num_kv_heads, rows, head_size = out.shape
    groups = rows // q_len
    out = out.view(num_kv_heads, groups, q_len, head_size).permute(2, 0, 1, 3)
    return out.reshape(q_len, num_kv_heads * groups, head_size).to(dtype)


def _tile_bounds(num_pages: int, pages_per_tile: int) -> list[tuple[int, int]]:
    step = max(1, pages_per_tile)
    return [(start, min(start + step, num_pages)) for start in range(0, num_pages, step)]


def page_attention(
    q: torch.Tensor,
    pages: torch.Tensor,
    block_ids: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    logits_soft_cap: float | None,
    pages_per_tile: int,
    alibi_slopes: torch.Tensor | None = None,
    alibi_bias: torch.Tensor | None = None,
    flash: bool | torch.dtype = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one sequence's query rows over its token-major pages.

    Args:
        q: ``[query_bucket, num_heads, head_size]``, the sequence's rows
            (gathered from the step's query by the caller, padded by repeating
            a real row; padding rows are fully masked and discarded).
        pages: ``[num_blocks, block_size, num_kv_heads, 2 * head_size]``
            token-major cache view, K then V in the last axis.
        block_ids: ``[kv_block_bucket]`` int64 page ids, padded with the null
            block (masked).
        mask: ``[query_bucket, kv_block_bucket * block_size]`` additive mask
            (0 or :func:`mask_value`) in the dtype of the softmax statistics:
            causal, padding and sliding window.
        scale: softmax scale applied to ``q @ k^T``.
        logits_soft_cap: if set, scores become ``cap * tanh(scores / cap)``
            before masking.
        pages_per_tile: pages read per step of the online softmax.
        alibi_slopes: ``[num_heads]`` ALiBi slopes (stats dtype), or None.
        alibi_bias: ``[query_bucket, kv_block_bucket * block_size]`` key minus
            query position (stats dtype), with ``alibi_slopes``.
        flash: run each tile through the CPU flash-attention kernel (see
            :func:`online_softmax`).
        sinks: ``[num_heads]`` attention-sink logits (stats dtype), or None.

    Returns:
        ``[query_bucket, num_heads, head_size]`` in ``q.dtype``.
    """
    q_len, num_heads, head_size = q.shape
    block_size, num_kv_heads = pages.shape[1], pages.shape[2]
    groups = num_heads // num_kv_heads

    def tiles() -> Iterable[Tile]:
        for start, stop in _tile_bounds(block_ids.shape[0], pages_per_tile):
            tokens = (stop - start) * block_size
            # One indirect read of the tile's pages, then token-major ->
            # head-major [KVH, tokens, K|V] on the device.
            kv = pages.index_select(0, block_ids[start:stop])
            kv = kv.reshape(tokens, num_kv_heads, 2 * head_size).permute(1, 0, 2).unsqueeze(0)
            cols = slice(start * block_size, stop * block_size)
            bias = mask[:, cols].view(1, 1, 1, q_len, tokens)
            if alibi_slopes is not None and alibi_bias is not None:
                slopes = alibi_slopes.view(1, num_kv_heads, groups, 1, 1)
                bias = bias + slopes * alibi_bias[:, cols].view(1, 1, 1, q_len, tokens)
            yield kv[..., :head_size], kv[..., head_size:], bias

    qf = _fold_groups(q, num_kv_heads).unsqueeze(0)
    out = online_softmax(qf, tiles(), scale, logits_soft_cap, mask.dtype, groups, flash, sinks)
    return _unfold_groups(out.squeeze(0), q_len, q.dtype)


def batched_decode_attention(
    q: torch.Tensor,
    pages: torch.Tensor,
    block_ids: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    logits_soft_cap: float | None,
    pages_per_tile: int,
    alibi_slopes: torch.Tensor | None = None,
    alibi_bias: torch.Tensor | None = None,
    flash: bool | torch.dtype = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query row per sequence, many sequences in one call (token-major pages).

    Args:
        q: ``[num_seqs_bucket, num_heads, head_size]``, one row per sequence;
            padding sequences repeat a real row and are fully masked.
        pages: ``[num_blocks, block_size, num_kv_heads, 2 * head_size]``.
        block_ids: ``[num_seqs_bucket, kv_block_bucket]`` int64 page ids per
            sequence, padded with the null block.
        mask: ``[num_seqs_bucket, kv_block_bucket * block_size]`` additive
            mask per sequence (padding keys, sliding window).
        alibi_slopes, alibi_bias: as for :func:`page_attention`, the bias
            ``[num_seqs_bucket, kv_block_bucket * block_size]``.
        sinks: as for :func:`page_attention`.

    Whole pages are gathered from the token-major cache for every sequence of a
    tile; the query groups stay a row axis of ``G`` rows per (sequence, KV
    head), so each matmul's batch is ``num_seqs * num_kv_heads``.

    Returns:
        ``[num_seqs_bucket, num_heads, head_size]`` in ``q.dtype``.
    """
    num_seqs, num_heads, head_size = q.shape
    block_size, num_kv_heads = pages.shape[1], pages.shape[2]
    groups = num_heads // num_kv_heads

    def tiles() -> Iterable[Tile]:
        for start, stop in _tile_bounds(block_ids.shape[1], pages_per_tile):
            tokens = (stop - start) * block_size
            kv = pages.index_select(0, block_ids[:, start:stop].reshape(-1))
            kv = kv.view(num_seqs, tokens, num_kv_heads, 2 * head_size).permute(0, 2, 1, 3)
            cols = slice(start * block_size, stop * block_size)
            bias = mask[:, cols].view(num_seqs, 1, 1, 1, tokens)
            if alibi_slopes is not None and alibi_bias is not None:
                slopes = alibi_slopes.view(1, num_kv_heads, groups, 1, 1)
                bias = bias + slopes * alibi_bias[:, cols].view(num_seqs, 1, 1, 1, tokens)
            yield kv[..., :head_size], kv[..., head_size:], bias

    qf = q.view(num_seqs, num_kv_heads, groups, head_size)
    out = online_softmax(qf, tiles(), scale, logits_soft_cap, mask.dtype, groups, flash, sinks)
    return out.reshape(num_seqs, num_heads, head_size).to(q.dtype)


def head_major_page_attention(
    q: torch.Tensor,
    pages: torch.Tensor,
    page_index: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    logits_soft_cap: float | None,
    pages_per_tile: int,
    flash: bool | torch.dtype = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one sequence over head-major pages (spec, "LX-resident pages").

    Args:
        q: ``[query_bucket, num_heads, head_size]``.
        pages: ``[num_blocks * num_kv_heads, block_size, 2 * head_size]``, the
            head-major cache with (block, KV head) folded into dim 0 (a view).
        page_index: ``[num_kv_heads, kv_block_bucket]`` int64 rows of
            ``pages``: ``block * num_kv_heads + kv_head``, padded with the null
            block's rows.
        mask: ``[query_bucket, kv_block_bucket * block_size]`` additive mask.
        sinks: as for :func:`page_attention`.

    A tile is gathered with a 2-D subscript on (KV head, page): the result is
    ``[KVH, pages, block_size, K|V]``, already head-major, so it reshapes to
    the matmul operand without the permute the token-major kernel needs. The
    query groups fold into the row axis so every matmul has one batch dim.
    """
    q_len, num_heads, head_size = q.shape
    num_kv_heads = page_index.shape[0]
    block_size = pages.shape[1]
    groups = num_heads // num_kv_heads

    def tiles() -> Iterable[Tile]:
        for start, stop in _tile_bounds(page_index.shape[1], pages_per_tile):
            tokens = (stop - start) * block_size
            kv = pages[page_index[:, start:stop]]  # [KVH, n, block_size, 2D]
            kv = kv.reshape(1, num_kv_heads, tokens, 2 * head_size)
            cols = slice(start * block_size, stop * block_size)
            bias = mask[:, cols].view(1, 1, 1, q_len, tokens)
            yield kv[..., :head_size], kv[..., head_size:], bias

    qf = _fold_groups(q, num_kv_heads).unsqueeze(0)
    out = online_softmax(qf, tiles(), scale, logits_soft_cap, mask.dtype, groups, flash, sinks)
    return _unfold_groups(out.squeeze(0), q_len, q.dtype)
