"""Head-major paged attention (spec, "Head-major KV cache" and "LX-resident pages").

Selected by ``SPYRE_ATTN_KV_LAYOUT=head_major``. A page is stored
``[num_kv_heads, block_size, K|V]`` (vLLM's ``LBHNC`` layout), so a page of one
KV head arrives in the shape the matmuls want and the per-page permute of the
token-major kernel disappears. The transpose moves to the write: a token's KV
heads are ``block_size`` rows apart, so the store is one ``index_copy_`` per
KV head over a source materialised contiguously first.

Everything above the cache's memory (the bucketer, the mask tiles, the query
row tables, warm-up recording and dispatch) is shared with the token-major
backend in :mod:`spyre_inference.attention.backends.paged`; what differs is the
declared layout, the allocation and the kernels that touch a page:

* pages are gathered with a 2-D ``[num_kv_heads, pages]`` index into the
  cache folded to ``[num_blocks * num_kv_heads, block_size, K|V]`` (the folded
  axis is device dim 0, where an indexed axis costs one page);
* that gather lowers to ``aten.index``, which fails eagerly on the card, so
  these kernels always compile, even under ``--enforce-eager``; their compile
  is capped at ``SPYRE_ATTN_MAX_CORES`` cores on the card;
* no ALiBi (it would need a bias tile per query group) and no batched decode
  (its kernel gathers whole token-major pages): asking for either is a
  start-up error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from spyre_inference.attention import ops, policy
from spyre_inference.attention.backends.paged import (
    NULL_BLOCK,
    PagedAttentionBackend,
    PagedAttentionImpl,
    PagedAttentionMetadataBuilder,
    SpyreAttentionMetadata,
)
from spyre_inference.attention.config_checks import HeadMajorConfigError, check_batched_decode
from spyre_inference.platform import device as placement

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def validate_head_major_config(vllm_config: VllmConfig | None = None) -> None:
    """Refuse an explicit batched-decode request (also checked at start-up, see
    :mod:`spyre_inference.attention.config_checks`; this is the layer-build backstop)."""
    check_batched_decode()


class SpyreHeadMajorMetadataBuilder(PagedAttentionMetadataBuilder):
    """The paged planning plus the folded-cache rows of every page (no batched decode,
    no host kernel: both read token-major pages)."""

    def _page_index(self, block_ids: torch.Tensor) -> torch.Tensor:
        # Row of (block, kv_head) in the folded cache: block * KVH + kv_head,
        # built on the host (the card has no integer compute). Padding pages
        # are the null block's rows.
        heads = torch.arange(self.num_kv_heads, dtype=torch.int64).unsqueeze(1)
        return placement.to_device(block_ids.unsqueeze(0) * self.num_kv_heads + heads)


def head_store_index(slots: torch.Tensor, num_kv_heads: int, block_size: int) -> torch.Tensor:
    """``[num_kv_heads, num_tokens]`` rows of the folded head-major cache for each slot."""
    block = torch.div(slots, block_size, rounding_mode="floor")
    offset = slots - block * block_size
    heads = torch.arange(num_kv_heads, dtype=torch.int64).unsqueeze(1)
    return (block.unsqueeze(0) * num_kv_heads + heads) * block_size + offset.unsqueeze(0)


class SpyreHeadMajorAttentionImpl(PagedAttentionImpl):
    """Per-layer attention on the head-major cache."""

    layout_name: ClassVar[str] = "head-major"

    def _init_alibi(self, alibi_slopes: list[float]) -> None:
        raise NotImplementedError(
            "ALiBi is not available on the head-major KV-cache layout (it needs a bias tile "
            "per query group); set SPYRE_ATTN_KV_LAYOUT=token_major, which supports it."
        )

    def _configure(self, vllm_config: VllmConfig) -> None:
        validate_head_major_config(vllm_config)
        # Always compiled (the 2-D page gather has no eager path on the card);
        # the store compiles only when num_tokens is bucketed.
        self.compile_kernels = True
        self.compile_store = policy.model_compiles(vllm_config)

    def _store_index(self, slots: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """``[num_kv_heads, num_tokens]`` rows of the folded cache for the slots."""
        num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[2]
        return placement.to_device(head_store_index(slots, num_kv_heads, block_size))

    def _store_at(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, index: torch.Tensor
    ) -> None:
        """One ``index_copy_`` per KV head of the materialised ``cat(K, V)``."""
        rows = ops.head_major_rows(kv_cache)
        src = ops.kv_source(key, value, rows.dtype)
        ops.STORE_KV_HEAD_MAJOR(self.compile_store, rows, index, src)

    def _attend_sequences(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: SpyreAttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        if not md.seqs:
            return
        pages = ops.head_major_pages(kv_cache)
        masks = md.tile_masks(self.sliding_window)
        sinks = self._sinks_on_device(md.stats_dtype)
        for seq, mask in zip(md.seqs, masks, strict=True):
            assert seq.page_index is not None
            tile = self._tile(kv_cache, md.block_size, 1, seq.query_bucket)
            q = query.index_select(0, seq.q_index)
            result = ops.HEAD_MAJOR_ATTENTION(
                self.compile_kernels,
                q,
                pages,
                seq.page_index,
                mask,
                self.scale,
                self.logits_soft_cap,
                tile,
                policy.use_flash(self.logits_soft_cap, query.dtype),
                sinks,
            )
            output[seq.query_start : seq.query_start + seq.query_len].copy_(result[: seq.query_len])


class SpyreHeadMajorAttentionBackend(PagedAttentionBackend):
    """Head-major paged attention for Spyre (``SPYRE_ATTN_KV_LAYOUT=head_major``)."""

    @staticmethod
    def get_impl_cls() -> type[SpyreHeadMajorAttentionImpl]:
        return SpyreHeadMajorAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[SpyreHeadMajorMetadataBuilder]:
        return SpyreHeadMajorMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # [L, B, H, N, C]: a page of one KV head is one contiguous run, and
        # (block, kv_head) folds into the leading axis of a view.
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def validate_config(cls, vllm_config: VllmConfig) -> None:
        """Start-up check: batched decode is not on this layout (ALiBi is checked per layer)."""
        validate_head_major_config(vllm_config)

    @staticmethod
    def allocate_pages(
        kv_cache_spec: AttentionSpec, num_blocks: int, device: torch.device | str
    ) -> torch.Tensor:
        """A layer cache on ``device`` with the strides the impl expects (LBHNC)."""
        return ops.allocate_head_major_pages(
            num_blocks,
            kv_cache_spec.block_size,
            kv_cache_spec.num_kv_heads,
            kv_cache_spec.head_size,
            kv_cache_spec.dtype,
            device,
        )


__all__ = [
    "NULL_BLOCK",
    "HeadMajorConfigError",
    "SpyreHeadMajorAttentionBackend",
    "SpyreHeadMajorAttentionImpl",
    "SpyreHeadMajorMetadataBuilder",
    "head_store_index",
    "validate_head_major_config",
]
