"""Token-major paged attention for vLLM 0.33's v1 attention API.

The KV cache of a layer is one dense tensor whose pages are token-major,
``[num_blocks, block_size, num_kv_heads, K|V]`` (vLLM's ``LBNHC`` layout, see
:mod:`spyre_inference.attention.ops.kv_layout`). A step runs in four stages
(spec, "Attention Backend"):

1. **Metadata (host).** :class:`SpyreAttentionMetadataBuilder` reads
   ``query_start_loc``/``seq_lens``/``block_table``, pads every sequence's
   query length and page count onto their buckets
   (:class:`~spyre_inference.attention.bucketing.AttnBucketer`), builds the
   per-sequence query-row and page index tables and the additive mask tiles
   on the host, and copies them to the device once per step.
2. **KV write (device).** :meth:`SpyreAttentionImpl.do_kv_cache_update`
   scatters the new tokens' K|V through the slot-major view with one
   ``index_copy_``; only the slot-index vector is computed on the host.
3. **Page attention (device).** A host loop dispatches
   :func:`~spyre_inference.attention.ops.page_attention` once per sequence:
   query rows are gathered on the device, pages are visited with an online
   softmax.
4. **Write-back (device).** Each sequence's rows are copied device-to-device
   into the layer's output buffer.

Integer tensors are only ever built on the host; on the card they serve as
gather/scatter indices and nothing else (Spyre has no integer compute).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from spyre_inference.attention.bucketing import AttnBucketer, cdiv
from spyre_inference.attention.ops import (
    allocate_pages,
    mask_value,
    page_attention,
    slot_major_view,
    store_kv,
    token_major_pages,
)
from spyre_inference.platform import device as placement

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.cache import CacheDType

logger = logging.getLogger(__name__)

#: Slot the padding rows of a step are written to: slot 0 of block 0, vLLM's
#: null block, which the block pool never gives to a request. Writing padding
#: there keeps the store's shape at the padded token count.
NULL_SLOT = 0
#: Page the padding entries of a page table point at (the null block; masked).
NULL_BLOCK = 0


def softmax_stats_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """Dtype of the scores, running max/sum and accumulator.

    float32 on the cpu target (the host has it for free, and it keeps long
    contexts accurate); the card computes in float16 only, so there the
    statistics stay in the compute dtype.
    """
    return compute_dtype if placement.is_spyre() else torch.float32


def build_tile_mask(
    query_len: int,
    context_len: int,
    seq_len: int,
    query_bucket: int,
    kv_tokens: int,
    sliding_window: int | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Additive ``[query_bucket, kv_tokens]`` mask of one sequence (host tensor).

    Query row ``i`` sits at absolute position ``context_len + i``; key column
    ``j`` is absolute position ``j`` of the sequence (pages in block-table
    order). A key is visible when the row is real (``i < query_len``), the key
    exists (``j < seq_len``), it is not in the future (causal) and, with a
    window ``W``, it is among the last ``W`` positions (``pos_q - pos_k < W``,
    vLLM's convention). Everything else gets :func:`mask_value`.
    """
    rows = torch.arange(query_bucket).unsqueeze(1)
    keys = torch.arange(kv_tokens).unsqueeze(0)
    q_pos = rows + context_len
    keep = (rows < query_len) & (keys < seq_len) & (keys <= q_pos)
    if sliding_window is not None:
        keep &= (q_pos - keys) < sliding_window
    mask = torch.zeros((query_bucket, kv_tokens), dtype=dtype)
    return mask.masked_fill_(~keep, mask_value(dtype))


@dataclasses.dataclass
class SequencePlan:
    """One sequence of the step, padded onto its (query, KV) bucket pair."""

    query_start: int
    query_len: int
    context_len: int
    seq_len: int
    query_bucket: int
    kv_block_bucket: int
    #: ``[query_bucket]`` int64 device tensor: rows of the step's query.
    q_index: torch.Tensor
    #: ``[kv_block_bucket, 1]`` int64 device tensor: page ids, padded with the null block.
    block_ids: torch.Tensor


@dataclasses.dataclass
class SpyreAttentionMetadata(AttentionMetadata):
    """Everything a layer needs for one step, built once per KV-cache group."""

    num_actual_tokens: int
    num_reqs: int
    block_size: int
    seqs: list[SequencePlan]
    #: vLLM's slot mapping, passed through (the runner hands each layer its own
    #: copy through the forward context; tests drive the store with this one).
    slot_mapping: torch.Tensor
    stats_dtype: torch.dtype
    _masks: dict[int | None, list[torch.Tensor]] = dataclasses.field(default_factory=dict)

    def tile_masks(self, sliding_window: int | None) -> list[torch.Tensor]:
        """Per-sequence device masks for layers with this window (None: full).

        Windows are per layer (a hybrid stack mixes windowed and full layers in
        one group), so masks are kept per window value; the builder makes the
        ones its layers use up front, any other is built here on first use.
        """
        masks = self._masks.get(sliding_window)
        if masks is None:
            masks = [
                placement.to_device(
                    build_tile_mask(
                        s.query_len,
                        s.context_len,
                        s.seq_len,
                        s.query_bucket,
                        s.kv_block_bucket * self.block_size,
                        sliding_window,
                        self.stats_dtype,
                    )
                )
                for s in self.seqs
            ]
            self._masks[sliding_window] = masks
        return masks


class SpyreAttentionMetadataBuilder(AttentionMetadataBuilder[SpyreAttentionMetadata]):
    """Host-side planning of one step for every layer of a KV-cache group."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    # Any order of prefills and decodes works: each sequence is dispatched alone.
    reorder_batch_threshold: int | None = None

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        model_config = vllm_config.model_config
        max_model_len = (
            model_config.max_model_len
            if model_config is not None
            else vllm_config.scheduler_config.max_model_len
        )
        self.bucketer = AttnBucketer(
            block_size=self.block_size,
            max_model_len=max_model_len,
            max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        )
        self.stats_dtype = softmax_stats_dtype(kv_cache_spec.dtype)

    def _group_windows(self) -> set[int | None]:
        """Sliding windows of this group's layers (None: full attention)."""
        context = self.vllm_config.compilation_config.static_forward_context
        windows: set[int | None] = set()
        for name in self.layer_names:
            impl = getattr(context.get(name), "impl", None)
            if isinstance(impl, SpyreAttentionImpl):
                windows.add(impl.sliding_window)
        return windows

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> SpyreAttentionMetadata:
        cm = common_attn_metadata
        if isinstance(cm.causal, torch.Tensor) or not cm.causal:
            raise NotImplementedError(
                "the Spyre token-major backend implements causal decoder attention only"
            )
        query_start = cm.query_start_loc_cpu.tolist()
        seq_lens = placement.to_host(cm.seq_lens).tolist()
        block_table = placement.to_host(cm.block_table_tensor)

        seqs: list[SequencePlan] = []
        for i in range(cm.num_reqs):
            q_start, q_end = query_start[i], query_start[i + 1]
            q_len = q_end - q_start
            if q_len <= 0:  # a padding request
                continue
            seq_len = int(seq_lens[i])
            num_blocks = cdiv(seq_len, self.block_size)
            q_bucket = self.bucketer.query_bucket(q_len)
            kv_bucket = self.bucketer.kv_bucket(num_blocks)

            # Padding rows repeat the first real row: a valid gather index whose
            # output is masked and never written back.
            q_index = torch.full((q_bucket,), q_start, dtype=torch.int64)
            q_index[:q_len] = torch.arange(q_start, q_end, dtype=torch.int64)
            block_ids = torch.full((kv_bucket, 1), NULL_BLOCK, dtype=torch.int64)
            block_ids[:num_blocks, 0] = block_table[i, :num_blocks].to(torch.int64)

            seqs.append(
                SequencePlan(
                    query_start=q_start,
                    query_len=q_len,
                    context_len=seq_len - q_len,
                    seq_len=seq_len,
                    query_bucket=q_bucket,
                    kv_block_bucket=kv_bucket,
                    q_index=placement.to_device(q_index),
                    block_ids=placement.to_device(block_ids),
                )
            )

        metadata = SpyreAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            num_reqs=cm.num_reqs,
            block_size=self.block_size,
            seqs=seqs,
            slot_mapping=cm.slot_mapping,
            stats_dtype=self.stats_dtype,
        )
        for window in self._group_windows():
            metadata.tile_masks(window)
        return metadata


class _SlotIndexCache:
    """The device slot index of the current step, shared by all layers.

    Every layer of a KV-cache group gets the same slot-mapping tensor in a
    step, so the host computation and the host-to-device copy happen once per
    step rather than once per layer. The entry keeps a reference to the tensor
    (so its identity cannot be reused) and its version counter (bumped when the
    runner rewrites the buffer in place). Inference-mode tensors have no
    version counter; for those the index is rebuilt on every call (correct,
    just not shared).
    """

    def __init__(self) -> None:
        self._key: tuple[Any, int, int] | None = None
        self._index: torch.Tensor | None = None

    def get(self, slot_mapping: torch.Tensor, num_tokens: int) -> torch.Tensor:
        cacheable = not slot_mapping.is_inference()
        key = (slot_mapping, slot_mapping._version if cacheable else -1, num_tokens)
        if (
            cacheable
            and self._key is not None
            and self._key[0] is slot_mapping
            and self._key[1:] == key[1:]
            and self._index is not None
        ):
            return self._index
        host = placement.to_host(slot_mapping).to(torch.int64)[:num_tokens]
        # vLLM marks padding tokens with slot -1; send them to the null block.
        index = host.clamp_min(NULL_SLOT)
        if index.shape[0] < num_tokens:
            index = torch.cat(
                (index, torch.full((num_tokens - index.shape[0],), NULL_SLOT, dtype=torch.int64))
            )
        self._index = placement.to_device(index)
        self._key = key
        return self._index


_slot_index_cache = _SlotIndexCache()


class SpyreAttentionImpl(AttentionImpl[SpyreAttentionMetadata]):
    """Per-layer attention: KV store and per-sequence page attention."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                f"the Spyre token-major backend implements decoder attention, not {attn_type}"
            )
        if alibi_slopes is not None:
            raise NotImplementedError("ALiBi is not supported by the Spyre attention backend")
        if sinks is not None:
            raise NotImplementedError(
                "attention sinks are not supported by the Spyre attention backend"
            )
        if kv_cache_dtype not in ("auto", "float16", "bfloat16"):
            raise NotImplementedError(
                f"kv_cache_dtype={kv_cache_dtype!r} is not supported: the Spyre KV cache is "
                "kept in the model dtype"
            )
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of {num_kv_heads=}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap if logits_soft_cap else None
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def do_kv_cache_update(
        self,
        layer: AttentionLayer | torch.nn.Module | None,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write the step's new K/V (``[num_tokens, kv_heads, head]``) at their slots."""
        if kv_cache.numel() == 0:  # placeholder cache before allocation
            return
        if kv_cache.shape[-1] != 2 * self.head_size:
            raise ValueError(
                f"expected K|V content of {2 * self.head_size} elements per slot, the cache "
                f"has {kv_cache.shape[-1]} (head_size_v != head_size is not supported)"
            )
        index = _slot_index_cache.get(slot_mapping, key.shape[0])
        store_kv(slot_major_view(kv_cache), index, key, value)

    def forward(
        self,
        layer: AttentionLayer | torch.nn.Module | None,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: SpyreAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``query`` ``[num_tokens, heads, head]`` over the paged cache.

        The KV write already happened in :meth:`do_kv_cache_update` (the backend
        sets ``forward_includes_kv_cache_update = False``).
        """
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported")
        if attn_metadata is None:  # profiling / dummy run without metadata
            return output.zero_()

        pages = token_major_pages(kv_cache)
        masks = attn_metadata.tile_masks(self.sliding_window)
        for seq, mask in zip(attn_metadata.seqs, masks, strict=True):
            result = page_attention(
                query,
                seq.q_index,
                pages,
                seq.block_ids,
                mask,
                self.scale,
                self.logits_soft_cap,
            )
            output[seq.query_start : seq.query_start + seq.query_len].copy_(result[: seq.query_len])
        # Padding rows of the step are zeroed, not left uninitialised: they flow
        # through the next layers into K/V written to the null block, and a NaN
        # there would survive an additive mask.
        if attn_metadata.num_actual_tokens < output.shape[0]:
            output[attn_metadata.num_actual_tokens :].zero_()
        return output


class SpyreAttentionBackend(AttentionBackend):
    """Token-major paged attention for Spyre (and its cpu target)."""

    # The KV write is a separate op (do_kv_cache_update), as the spec's step 2.
    forward_includes_kv_cache_update: bool = False

    supported_dtypes: ClassVar[list[torch.dtype]] = [
        torch.float16,
        torch.bfloat16,
        torch.float32,
    ]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        # Must name an AttentionBackendEnum member (the Attention layer looks it
        # up); CUSTOM is vLLM's slot for out-of-tree backends.
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[SpyreAttentionImpl]:
        return SpyreAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[SpyreAttentionMetadataBuilder]:
        return SpyreAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # A page row is a 128-byte stick multiple: 64 two-byte elements.
        return [MultipleOf(placement.STICK_ELEMS)]

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        # Spec: "The default is 128" (two sticks of tokens per page).
        from spyre_inference.platform.platform import DEFAULT_BLOCK_SIZE

        return DEFAULT_BLOCK_SIZE

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        # Multiples of the 64-element stick; the ops package pads narrower heads.
        return list(range(placement.STICK_ELEMS, 1024 + 1, placement.STICK_ELEMS))

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Token-major pages in one dense region per layer: the only layout in
        # which the layer view folds to a slot axis (the KV store) and a page is
        # one index on dim 0 (the page read).
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def allocate_pages(
        kv_cache_spec: AttentionSpec, num_blocks: int, device: torch.device | str
    ) -> torch.Tensor:
        """A layer cache on ``device`` with the strides the impl expects (LBNHC).

        For a runner that allocates per layer on the device rather than through
        vLLM's flat int8 buffer.
        """
        return allocate_pages(
            num_blocks,
            kv_cache_spec.block_size,
            kv_cache_spec.num_kv_heads,
            kv_cache_spec.head_size,
            kv_cache_spec.dtype,
            device,
        )
