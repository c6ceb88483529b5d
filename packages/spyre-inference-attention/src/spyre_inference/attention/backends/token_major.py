"""Token-major paged attention for vLLM 0.33's v1 attention API.

The KV cache of a layer is one dense tensor whose pages are token-major,
``[num_blocks, block_size, num_kv_heads, K|V]`` (vLLM's ``LBNHC`` layout, see
:mod:`spyre_inference.attention.ops.kv_layout`). A step runs in four stages
(spec, "Attention Backend"):

1. **Metadata (host).** :class:`SpyreAttentionMetadataBuilder` reads
   ``query_start_loc``/``seq_lens``/``block_table``, pads every sequence's
   query length and page count onto their buckets
   (:class:`~spyre_inference.attention.bucketing.AttnBucketer`), builds the
   query-row and page index tables and the additive mask tiles on the host,
   and copies them to the device once per step. Single-row (decode) sequences
   are gathered into one batch padded onto a num-seqs bucket when the
   batched-decode kernel is on (``SPYRE_BATCHED_DECODE``, the default).
2. **KV write (device).** :meth:`SpyreAttentionImpl.do_kv_cache_update`
   scatters the new tokens' K|V through the slot-major view with one
   ``index_copy_``; only the slot-index vector is computed on the host. It
   runs at the start of ``forward`` (``forward_includes_kv_cache_update``):
   vLLM then enters one opaque op per layer instead of two, which saves the
   second op's dispatch and Python on every layer of every step.
3. **Page attention (device).** A host loop dispatches the compiled
   per-sequence kernel for every multi-row sequence, and the batched-decode
   kernel once for all decodes; query rows are gathered on the device. The
   cpu target enters no attention graph: the decodes and the short prefill
   chunks (:func:`~spyre_inference.attention.policy.host_rows_win`) run as one
   call of the host kernel per layer, one entry per query row
   (:class:`HostRows`), and longer chunks through PyTorch's CPU flash kernel
   over their unpadded pages (:class:`HostPrefill`,
   :mod:`~spyre_inference.attention.ops.host_prefill`).
4. **Write-back (device).** Each result is copied device-to-device into the
   layer's output buffer.

Kernels compile once per bucket (:mod:`spyre_inference.attention.ops.compiled`,
rules in :mod:`spyre_inference.attention.policy`); warm-up records them all
(:mod:`spyre_inference.attention.warmup`).

What does not depend on the page layout (planning, metadata, the step's order,
the backend's declarations) is in :mod:`spyre_inference.attention.backends.paged`,
shared with the head-major backend; this module holds the token-major pages'
store and reads.

Integer tensors are only ever built on the host; on the card they serve as
gather/scatter indices and nothing else (Spyre has no integer compute).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from spyre_inference.attention import ops, policy
from spyre_inference.attention.backends.paged import (
    PagedAttentionBackend,
    PagedAttentionImpl,
    PagedAttentionMetadataBuilder,
    SpyreAttentionMetadata,
)
from spyre_inference.platform import device as placement


class SpyreAttentionMetadataBuilder(PagedAttentionMetadataBuilder):
    """The paged planning; this layout has the batched-decode and host kernels."""

    supports_batched_decode: ClassVar[bool] = True
    supports_host_rows: ClassVar[bool] = True


class SpyreAttentionImpl(PagedAttentionImpl):
    """Per-layer attention: KV store and page attention on the token-major cache."""

    layout_name: ClassVar[str] = "token-major"

    def _cache_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(token-major pages, slot-major view)`` of ``kv_cache``, made once per cache."""
        views = self._views
        if views is None or views[0] is not kv_cache:
            views = (kv_cache, ops.token_major_pages(kv_cache), ops.slot_major_view(kv_cache))
            self._views = views
        return views[1], views[2]

    def _store_index(self, slots: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """The device index the store scatters through, from ``[num_tokens]`` host slots."""
        return placement.to_device(slots)

    def _store_at(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, index: torch.Tensor
    ) -> None:
        """One ``index_copy_`` of ``cat(K, V)`` through the slot-major view."""
        _, slots = self._cache_views(kv_cache)
        src = ops.kv_source(key, value, slots.dtype)
        if self.compile_store and policy.host_kv_store():
            # cpu target: the store's compiled graph costs ~300 us per layer to
            # enter for a few microseconds of copying; the same op runs eagerly,
            # marked as the one graph call the card makes here.
            with ops.host_decode.as_graph_call("KV store"):
                ops.store_kv(slots, index, src)
            return
        ops.STORE_KV(self.compile_store, slots, index, src)

    def _store_and_attend_on_host(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        md: SpyreAttentionMetadata,
        output: torch.Tensor,
    ) -> bool:
        """cpu target: the whole layer step as one host-kernel call, when it can be.

        When every real row of the step is a host row (decode steps, and the
        prefills the policy sends to the kernel) the KV store, the attention,
        the write into ``output`` and the zeroing of its padding rows are one
        call of ``ops.host_decode.store_and_decode``: no Python between them,
        no ``cat`` of K|V, no float32 copies of the query and result. The card
        runs the same work as its store graph then its attention graph; a step
        with rows on the graphs takes the general path below. Returns whether
        it ran.
        """
        host = md.host
        if (
            host is None
            or md.seqs
            or md.host_prefills
            or md.decode is not None
            or not host.leading
            or host.num_rows != md.num_actual_tokens
            or kv_cache.numel() == 0
        ):
            return False
        writes = key is not None and value is not None and self.kv_sharing_target_layer_name is None
        if writes and (key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype):
            return False
        n = host.num_rows
        pages, _ = self._cache_views(kv_cache)
        slots = self._step_store_index(key.shape[0], kv_cache, md) if writes else None
        ops.host_decode.store_and_decode(
            query if n == query.shape[0] else query[:n],
            key if writes else None,
            value if writes else None,
            slots,
            pages,
            host.block_ids,
            md.host_mask(self.sliding_window),
            self.scale,
            output,
            sinks=self._sinks_on_device(torch.float32),
        )
        return True

    def _attend_sequences(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: SpyreAttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        if not md.seqs:
            return
        pages, _ = self._cache_views(kv_cache)
        masks = md.tile_masks(self.sliding_window)
        slopes = self._alibi_on_device(md.stats_dtype)
        sinks = self._sinks_on_device(md.stats_dtype)
        biases = md.alibi_biases() if slopes is not None else [None] * len(md.seqs)
        for seq, mask, bias in zip(md.seqs, masks, biases, strict=True):
            q = query.index_select(0, seq.q_index)
            tile = self._tile(kv_cache, md.block_size, 1, seq.query_bucket)
            result = ops.PAGE_ATTENTION(
                self.compile_kernels,
                q,
                pages,
                seq.block_ids,
                mask,
                self.scale,
                self.logits_soft_cap,
                tile,
                slopes,
                bias,
                policy.use_flash(self.logits_soft_cap, query.dtype),
                sinks,
            )
            output[seq.query_start : seq.query_start + seq.query_len].copy_(result[: seq.query_len])

    def _attend_decodes(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: SpyreAttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        batch = md.decode
        assert batch is not None
        slopes = self._alibi_on_device(md.stats_dtype)
        q = query.index_select(0, batch.q_index)
        result = ops.BATCHED_DECODE(
            self.compile_kernels,
            q,
            self._cache_views(kv_cache)[0],
            batch.block_ids,
            md.decode_mask(self.sliding_window),
            self.scale,
            self.logits_soft_cap,
            self._tile(kv_cache, md.block_size, batch.num_seqs_bucket, 1),
            slopes,
            md.decode_alibi_bias() if slopes is not None else None,
            policy.use_flash(self.logits_soft_cap, query.dtype),
            self._sinks_on_device(md.stats_dtype),
        )
        output.index_copy_(0, batch.out_index, result[: batch.num_seqs])

    def _attend_host_rows(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: SpyreAttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        """cpu target: the host kernel over the step's host rows, in place of the
        card's compiled graphs (same pages; see ops.host_decode)."""
        host = md.host
        assert host is not None
        n = host.num_rows
        q = query[:n] if host.leading else query.index_select(0, host.rows)
        result = ops.host_decode.paged_decode(
            q,
            self._cache_views(kv_cache)[0],
            host.block_ids,
            md.host_mask(self.sliding_window),
            self.scale,
            out_dtype=query.dtype,
            sinks=self._sinks_on_device(torch.float32),
        )
        if host.leading:
            output[:n].copy_(result)
        else:
            output.index_copy_(0, host.rows, result)

    def _attend_host_prefills(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: SpyreAttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        """cpu target: each planned prefill through the host flash kernel, in place
        of the card's page-attention graph (same pages; see ops.host_prefill)."""
        pages, _ = self._cache_views(kv_cache)
        flash = policy.use_flash(self.logits_soft_cap, query.dtype)
        sinks = self._sinks_on_device(torch.float32)
        for seq in md.host_prefills:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            with ops.host_decode.as_graph_call("prefill attention"):
                ops.host_prefill.paged_prefill(
                    query[rows],
                    pages,
                    seq.block_ids,
                    seq.context_len,
                    self.scale,
                    output[rows],
                    sliding_window=self.sliding_window,
                    sinks=sinks,
                    compute_dtype=flash if isinstance(flash, torch.dtype) else None,
                )


class SpyreAttentionBackend(PagedAttentionBackend):
    """Token-major paged attention for Spyre (and its cpu target)."""

    @staticmethod
    def get_impl_cls() -> type[SpyreAttentionImpl]:
        return SpyreAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[SpyreAttentionMetadataBuilder]:
        return SpyreAttentionMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Token-major pages in one dense region per layer: the only layout in
        # which the layer view folds to a slot axis (the KV store) and a page is
        # one index on dim 0 (the page read).
        return (KVCacheLayout.LBNHC,)

    @staticmethod
    def allocate_pages(
        kv_cache_spec: AttentionSpec, num_blocks: int, device: torch.device | str
    ) -> torch.Tensor:
        """A layer cache on ``device`` with the strides the impl expects (LBNHC).

        For a runner that allocates per layer on the device rather than through
        vLLM's flat int8 buffer.
        """
        return ops.allocate_pages(
            num_blocks,
            kv_cache_spec.block_size,
            kv_cache_spec.num_kv_heads,
            kv_cache_spec.head_size,
            kv_cache_spec.dtype,
            device,
        )
