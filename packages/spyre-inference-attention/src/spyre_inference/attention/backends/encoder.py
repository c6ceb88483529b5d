"""Encoder attention: bidirectional, no KV cache (spec, "Encoder-only attention").

Used for ``ENCODER_ONLY`` layers (BERT/RoBERTa-style embedding models) and
``ENCODER`` self-attention. Every sequence attends to all of its own tokens,
so there are no pages: a step's ragged Q/K/V are packed into a dense batch,
attended, and unpacked.

1. **Plan (host).** :class:`SpyreEncoderMetadataBuilder` pads the number of
   sequences and the longest sequence onto the
   :class:`~spyre_inference.attention.bucketing.EncoderBucketer` buckets (the
   length on 64-element sticks), builds the pack index (token ``i`` of
   sequence ``s`` goes to row ``s * L + i``) and the additive key mask, and
   copies them to the device.
2. **Pack (device).** Q, K and V are scattered into zeroed
   ``[num_seqs * L, heads, Dp]`` workspaces with ``index_copy_``; the head dim
   is zero-padded to the stick when it is not a multiple of 64 (MiniLM's 32),
   which changes neither scores nor values.
3. **Attend (device).** One sequence that fills its bucket exactly has no
   padding: fused ``scaled_dot_product_attention``. Otherwise a compiled
   ``Q @ K^T``, the mask added eagerly, and a compiled softmax and ``P @ V``
   (kept apart so Inductor cannot fuse them into an SDPA that drops the mask
   on Spyre).
4. **Unpack (device).** The real rows are gathered back and the head padding
   sliced off into the layer's output.

The pack and unpack shapes follow the step's token count, which is why they
stay eager; the attention kernels are fixed by the (sequences, length)
bucket and compile once per bucket (when the model compiles; warm-up records
them).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from vllm.config import get_current_vllm_config
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

from spyre_inference.attention import ops, policy
from spyre_inference.attention.bucketing import EncoderBucketer
from spyre_inference.platform import device as placement
from spyre_inference.platform.logs import get_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.cache import CacheDType

    from spyre_inference.platform.warmup import AttentionWarmUpPlan

logger = get_logger(__name__)

ENCODER_ATTN_TYPES = (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)


def build_encoder_mask(
    seq_lens: list[int],
    num_seqs_bucket: int,
    seq_len_bucket: int,
    sliding_window: int | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Additive mask ``[S, 1, 1, Lq, L]`` (host): padding keys, optional window.

    Without a window every query row of a sequence sees the same keys, so
    ``Lq`` is 1 (broadcast); with one, key ``j`` is visible from row ``i`` only
    when ``|i - j| < W`` (bidirectional), and ``Lq = L``. Padding sequences see
    no key at all (their rows are discarded).
    """
    lens = torch.zeros((num_seqs_bucket, 1, 1), dtype=torch.int64)
    lens[: len(seq_lens), 0, 0] = torch.tensor(seq_lens, dtype=torch.int64)
    keys = torch.arange(seq_len_bucket).view(1, 1, -1)
    if sliding_window is None:
        keep = keys < lens  # [S, 1, L]
    else:
        rows = torch.arange(seq_len_bucket).view(1, -1, 1)
        keep = (keys < lens) & ((rows - keys).abs() < sliding_window)  # [S, L, L]
    mask = torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, ops.mask_value(dtype))
    return mask.unsqueeze(1).unsqueeze(1)


@dataclasses.dataclass
class SpyreEncoderMetadata(AttentionMetadata):
    num_actual_tokens: int
    seq_lens: list[int]
    num_seqs_bucket: int
    seq_len_bucket: int
    #: one sequence that fills its bucket exactly: the fused SDPA path
    unpadded: bool
    #: ``[num_actual_tokens]`` int64 device tensor: workspace row of every token
    pack_index: torch.Tensor
    stats_dtype: torch.dtype
    _masks: dict[int | None, torch.Tensor] = dataclasses.field(default_factory=dict)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        mask = self._masks.get(sliding_window)
        if mask is None:
            mask = placement.to_device(
                build_encoder_mask(
                    self.seq_lens,
                    self.num_seqs_bucket,
                    self.seq_len_bucket,
                    sliding_window,
                    self.stats_dtype,
                )
            )
            self._masks[sliding_window] = mask
        return mask


def make_encoder_bucketer(vllm_config: VllmConfig) -> EncoderBucketer:
    scheduler = vllm_config.scheduler_config
    model_config = vllm_config.model_config
    max_model_len = (
        model_config.max_model_len if model_config is not None else scheduler.max_model_len
    )
    return EncoderBucketer(
        max_model_len=max_model_len,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        max_num_seqs=scheduler.max_num_seqs,
    )


class SpyreEncoderMetadataBuilder(AttentionMetadataBuilder[SpyreEncoderMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    #: Which synthetic steps warm-up records (:mod:`spyre_inference.attention.warmup`):
    #: padded and fused encoder attention, no KV cache.
    warm_up_form: ClassVar[str] = "encoder"
    reorder_batch_threshold: int | None = None

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.bucketer = make_encoder_bucketer(vllm_config)
        self.stats_dtype = policy.softmax_stats_dtype(kv_cache_spec.dtype)

    def _group_windows(self) -> set[int | None]:
        context = self.vllm_config.compilation_config.static_forward_context
        windows: set[int | None] = set()
        for name in self.layer_names:
            impl = getattr(context.get(name), "impl", None)
            if isinstance(impl, SpyreEncoderAttentionImpl):
                windows.add(impl.sliding_window)
        return windows

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> SpyreEncoderMetadata:
        cm = common_attn_metadata
        starts = cm.query_start_loc_cpu.tolist()
        seq_lens: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(cm.num_reqs):
            q_len = starts[i + 1] - starts[i]
            if q_len <= 0:  # a padding request
                continue
            seq_lens.append(q_len)
        if not seq_lens:
            seq_lens = [1]
        s_bucket = self.bucketer.num_seqs_bucket(len(seq_lens))
        l_bucket = self.bucketer.seq_len_bucket(max(seq_lens))
        s = 0
        for i in range(cm.num_reqs):
            q_len = starts[i + 1] - starts[i]
            if q_len <= 0:
                continue
            rows.append(torch.arange(q_len, dtype=torch.int64) + s * l_bucket)
            s += 1
        pack_index = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
        metadata = SpyreEncoderMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            seq_lens=seq_lens,
            num_seqs_bucket=s_bucket,
            seq_len_bucket=l_bucket,
            unpadded=len(seq_lens) == 1 and seq_lens[0] == l_bucket,
            pack_index=placement.to_device(pack_index),
            stats_dtype=self.stats_dtype,
        )
        for window in self._group_windows():
            metadata.mask(window)
        return metadata


class SpyreEncoderAttentionImpl(AttentionImpl[SpyreEncoderMetadata]):
    """Bidirectional attention over a packed dense batch; no KV cache."""

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
        attn_type: str = AttentionType.ENCODER_ONLY,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        if attn_type not in ENCODER_ATTN_TYPES:
            raise NotImplementedError(
                f"the Spyre encoder backend implements encoder attention, not {attn_type}"
            )
        if alibi_slopes is not None:
            raise NotImplementedError("ALiBi is not supported by the Spyre encoder backend")
        if sinks is not None:
            raise NotImplementedError("attention sinks are not supported by the encoder backend")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of {num_kv_heads=}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.padded_head_size = placement.round_up(head_size)
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = float(logits_soft_cap) if logits_soft_cap else None
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.compile_kernels = policy.model_compiles(get_current_vllm_config())

    def _pad_head(self, t: torch.Tensor) -> torch.Tensor:
        """Zero-pad the head dim to the stick (a host round trip on the card)."""
        pad = self.padded_head_size - self.head_size
        if pad == 0:
            return t
        if placement.is_spyre():
            return placement.to_device(F.pad(placement.to_host(t), (0, pad)))
        return F.pad(t, (0, pad))

    def _pack(self, t: torch.Tensor, md: SpyreEncoderMetadata) -> torch.Tensor:
        rows = md.num_seqs_bucket * md.seq_len_bucket
        workspace = t.new_zeros((rows, t.shape[1], t.shape[2]))
        workspace.index_copy_(0, md.pack_index, t)
        return workspace.view(md.num_seqs_bucket, md.seq_len_bucket, t.shape[1], t.shape[2])

    def forward(
        self,
        layer: AttentionLayer | torch.nn.Module | None,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: SpyreEncoderMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported")
        if attn_metadata is None:  # profiling / dummy run without metadata
            return output.zero_()
        md = attn_metadata
        n = md.pack_index.shape[0]
        q = self._pad_head(query[:n])
        k = self._pad_head(key[:n])
        v = self._pad_head(value[:n])
        fused = md.unpadded and self.sliding_window is None and self.logits_soft_cap is None
        if fused:
            # Contiguous inputs: q/k/v are views into the fused QKV output whose
            # strides depend on the model; the compiled graph should not.
            out = ops.ENCODER_FUSED(
                self.compile_kernels, q.contiguous(), k.contiguous(), v.contiguous(), self.scale
            )
        else:
            scores = ops.ENCODER_SCORES(
                self.compile_kernels,
                self._pack(q, md),
                self._pack(k, md),
                self.scale,
                md.stats_dtype,
            )
            # Eager, between the two compiled matmuls (see the module docstring).
            s_b, kvh, rows, length = scores.shape
            if self.logits_soft_cap is not None:
                scores = torch.tanh(scores / self.logits_soft_cap) * self.logits_soft_cap
            scores = scores.view(s_b, kvh, rows // length, length, length)
            scores = (scores + md.mask(self.sliding_window)).view(s_b, kvh, rows, length)
            out = ops.ENCODER_PROBS_V(self.compile_kernels, scores, self._pack(v, md))
            out = out.index_select(0, md.pack_index)
        if self.padded_head_size != self.head_size:
            out = out[..., : self.head_size]
            if placement.is_spyre():
                # The slice of a padded head dim is an offset view the card
                # cannot transfer; finish it on the host (spec: MiniLM's D=32).
                out = placement.to_device(placement.to_host(out).contiguous())
        output[:n].copy_(out)
        if n < output.shape[0]:
            output[n:].zero_()
        return output


class SpyreEncoderAttentionBackend(AttentionBackend):
    """Encoder / encoder-only attention for Spyre (no KV cache)."""

    # Nothing to write: encoder layers keep no KV cache.
    forward_includes_kv_cache_update: bool = True

    supported_dtypes: ClassVar[list[torch.dtype]] = [
        torch.float16,
        torch.bfloat16,
        torch.float32,
    ]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[SpyreEncoderAttentionImpl]:
        return SpyreEncoderAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[SpyreEncoderMetadataBuilder]:
        return SpyreEncoderMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(placement.STICK_ELEMS)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        # Any: heads that are not whole sticks are zero-padded (MiniLM's 32).
        return []

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...] | None:
        # No pages: any layout the decoder layers of a model want.
        return None

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type in ENCODER_ATTN_TYPES

    @classmethod
    def validate_config(cls, vllm_config: VllmConfig) -> None:
        return None

    @classmethod
    def warm_up(cls, plan: AttentionWarmUpPlan) -> None:
        """Record every encoder kernel variant serving can reach (the core's
        :class:`~spyre_inference.platform.warmup.WarmsUpAttention` contract)."""
        from spyre_inference.attention.warmup import record_backend

        record_backend(cls, plan)
