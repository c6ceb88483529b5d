"""What the Spyre paged decoder backends share, whatever their page layout.

vLLM's own backends keep their shared pieces in ``v1/attention/backends/utils.py``;
here the token-major (default) and head-major backends share one module: the
step's host planning (:class:`PagedAttentionMetadataBuilder`, the bucketer, the
query-row and page tables, mask and ALiBi tiles, :class:`SpyreAttentionMetadata`),
and the base classes of their impl and backend (:class:`PagedAttentionImpl`,
:class:`PagedAttentionBackend`). Each layout module adds only what touches its
pages: the store, the page reads and the cache's allocation.

Integer tensors are only ever built on the host; on the card they serve as
gather/scatter indices and nothing else (Spyre has no integer compute).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
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
from vllm.v1.kv_cache_interface import AttentionSpec

from spyre_inference.attention import ops, policy
from spyre_inference.attention.bucketing import AttnBucketer, cdiv
from spyre_inference.platform import device as placement
from spyre_inference.platform import stick_pad
from spyre_inference.platform.logs import get_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.cache import CacheDType

    from spyre_inference.platform.warmup import AttentionWarmUpPlan

logger = get_logger(__name__)

#: Slot the padding rows of a step are written to: slot 0 of block 0, vLLM's
#: null block, which the block pool never gives to a request. Writing padding
#: there keeps the store's shape at the padded token count.
NULL_SLOT = 0
#: Page the padding entries of a page table point at (the null block; masked).
NULL_BLOCK = 0


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
    vLLM's convention). Everything else gets :func:`~.ops.mask_value`.
    """
    rows = torch.arange(query_bucket).unsqueeze(1)
    keys = torch.arange(kv_tokens).unsqueeze(0)
    q_pos = rows + context_len
    keep = (rows < query_len) & (keys < seq_len) & (keys <= q_pos)
    if sliding_window is not None:
        keep &= (q_pos - keys) < sliding_window
    mask = torch.zeros((query_bucket, kv_tokens), dtype=dtype)
    return mask.masked_fill_(~keep, ops.mask_value(dtype))


def build_row_mask(
    positions: torch.Tensor, kv_tokens: int, sliding_window: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """``[R, kv_tokens]`` additive host mask of query rows at ``positions`` (``[R, 1]``).

    Row r sees keys ``0..positions[r]`` (within the window); a row at position -1
    (a padding entry) sees nothing. One vectorised build for all the rows.
    """
    keys = torch.arange(kv_tokens).unsqueeze(0)
    keep = keys <= positions
    if sliding_window is not None:
        keep &= (positions - keys) < sliding_window
    mask = torch.zeros(keep.shape, dtype=dtype)
    return mask.masked_fill_(~keep, ops.mask_value(dtype))


def build_alibi_bias(
    context_len: int, query_bucket: int, kv_tokens: int, dtype: torch.dtype
) -> torch.Tensor:
    """``[query_bucket, kv_tokens]`` key minus query position (host tensor).

    ALiBi adds ``slope_h * (pos_k - pos_q)`` to head ``h``'s scores (vLLM's and
    the ALiBi paper's convention); the kernel multiplies this tile by each
    head's slope. Masked entries get a finite value too (they are masked).
    """
    q_pos = torch.arange(query_bucket).unsqueeze(1) + context_len
    keys = torch.arange(kv_tokens).unsqueeze(0)
    return (keys - q_pos).to(dtype)


@dataclasses.dataclass
class SequencePlan:
    """One multi-row sequence of the step, padded onto its (query, KV) bucket pair."""

    query_start: int
    query_len: int
    context_len: int
    seq_len: int
    query_bucket: int
    kv_block_bucket: int
    #: ``[query_bucket]`` int64 device tensor: rows of the step's query.
    q_index: torch.Tensor
    #: ``[kv_block_bucket]`` int64 device tensor: page ids, padded with the null block.
    block_ids: torch.Tensor
    #: head-major only: ``[num_kv_heads, kv_block_bucket]`` rows of the folded cache.
    page_index: torch.Tensor | None = None


@dataclasses.dataclass
class DecodeBatch:
    """The step's single-row sequences, padded onto a (num-seqs, KV) bucket pair."""

    #: query rows of the real sequences (host ints), in batch order
    rows: list[int]
    seq_lens: list[int]
    num_seqs_bucket: int
    kv_block_bucket: int
    #: ``[num_seqs_bucket]`` int64 device tensor: query row of every batch entry
    #: (padding entries repeat the first row; they are masked and not written back)
    q_index: torch.Tensor
    #: ``[num_decodes]`` int64 device tensor: output rows of the real entries
    out_index: torch.Tensor
    #: ``[num_seqs_bucket, kv_block_bucket]`` int64 device tensor: page ids
    block_ids: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return len(self.rows)


@dataclasses.dataclass
class HostRows:
    """cpu target: the step's query rows the host kernel attends, one kernel entry per row.

    Every row carries its own page table row and mask row, so decodes and the
    rows of prefills share one call per layer and nothing is padded to a
    query bucket (the host kernel compiles nothing; pages keep their bucket).
    """

    #: ``[R]`` int64: the step's query rows, ascending
    rows: torch.Tensor
    #: the rows are exactly ``0 .. R-1`` (a slice instead of a gather/scatter)
    leading: bool
    #: ``[R]`` int64 host tensor: position of each row's token in its sequence
    positions: torch.Tensor
    #: ``[R, kv_block_bucket]`` int64: page ids of each row's sequence, null-padded
    block_ids: torch.Tensor
    kv_block_bucket: int

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])


@dataclasses.dataclass
class HostPrefill:
    """cpu target: one multi-row sequence attended eagerly over its real pages.

    No query or page bucket and no host-built mask: the flash kernel of
    :mod:`~spyre_inference.attention.ops.host_prefill` takes the causal and
    window structure from ``context_len`` (see there for why)."""

    query_start: int
    query_len: int
    context_len: int
    #: ``[num_pages]`` int64 host tensor: exactly the sequence's pages, in order.
    block_ids: torch.Tensor


@dataclasses.dataclass
class SpyreAttentionMetadata(AttentionMetadata):
    """Everything a layer needs for one step, built once per KV-cache group."""

    num_actual_tokens: int
    num_reqs: int
    block_size: int
    #: multi-row sequences (and single-row ones when batched decode is off)
    seqs: list[SequencePlan]
    #: single-row sequences, batched (None when there are none or batched decode is off)
    decode: DecodeBatch | None
    #: vLLM's slot mapping, passed through (the runner hands each layer its own
    #: copy through the forward context; tests drive the store with this one).
    slot_mapping: torch.Tensor
    stats_dtype: torch.dtype
    #: cpu target: rows the host kernel attends (None: none, or not this target)
    host: HostRows | None = None
    #: cpu target: prefills attended by the host flash kernel (empty elsewhere)
    host_prefills: list[HostPrefill] = dataclasses.field(default_factory=list)
    _masks: dict[int | None, list[torch.Tensor]] = dataclasses.field(default_factory=dict)
    _host_masks: dict[int | None, torch.Tensor] = dataclasses.field(default_factory=dict)
    _decode_masks: dict[int | None, torch.Tensor] = dataclasses.field(default_factory=dict)
    _alibi: list[torch.Tensor] | None = None
    _decode_alibi: torch.Tensor | None = None
    _step_indices: dict[tuple[Any, ...], torch.Tensor] = dataclasses.field(default_factory=dict)

    def step_index(self, key: tuple[Any, ...], build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A device index derived from this step's slot mapping, built once per ``key``.

        Every layer of the group stores its K/V at the same slots, so the host
        computation and the copy to the device (the spec's step 2: only the
        index is computed on the host) happen once per step, not per layer.
        """
        index = self._step_indices.get(key)
        if index is None:
            index = self._step_indices[key] = build()
        return index

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

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        """``[num_seqs_bucket, kv_tokens]`` device mask of the decode batch."""
        assert self.decode is not None
        mask = self._decode_masks.get(sliding_window)
        if mask is None:
            batch = self.decode
            # Entry i is the single row of a sequence of seq_lens[i] tokens, at
            # position seq_len - 1; padding entries (position -1) see nothing.
            positions = torch.full((batch.num_seqs_bucket, 1), -1, dtype=torch.int64)
            positions[: batch.num_seqs, 0] = torch.tensor(batch.seq_lens, dtype=torch.int64) - 1
            kv_tokens = batch.kv_block_bucket * self.block_size
            host = build_row_mask(positions, kv_tokens, sliding_window, self.stats_dtype)
            mask = placement.to_device(host)
            self._decode_masks[sliding_window] = mask
        return mask

    def host_mask(self, sliding_window: int | None) -> torch.Tensor:
        """``[R, kv_tokens]`` float32 mask of the host rows: causal, within the window."""
        assert self.host is not None
        mask = self._host_masks.get(sliding_window)
        if mask is None:
            host = self.host
            kv_tokens = host.kv_block_bucket * self.block_size
            mask = build_row_mask(
                host.positions.unsqueeze(1), kv_tokens, sliding_window, torch.float32
            )
            self._host_masks[sliding_window] = mask
        return mask

    def alibi_biases(self) -> list[torch.Tensor]:
        """Per-sequence ALiBi position tiles (built on first use by an ALiBi layer)."""
        if self._alibi is None:
            self._alibi = [
                placement.to_device(
                    build_alibi_bias(
                        s.context_len,
                        s.query_bucket,
                        s.kv_block_bucket * self.block_size,
                        self.stats_dtype,
                    )
                )
                for s in self.seqs
            ]
        return self._alibi

    def decode_alibi_bias(self) -> torch.Tensor:
        """``[num_seqs_bucket, kv_tokens]`` ALiBi position tile of the decode batch."""
        assert self.decode is not None
        if self._decode_alibi is None:
            batch = self.decode
            kv_tokens = batch.kv_block_bucket * self.block_size
            q_pos = torch.zeros((batch.num_seqs_bucket, 1), dtype=torch.int64)
            q_pos[: batch.num_seqs, 0] = torch.tensor(batch.seq_lens, dtype=torch.int64) - 1
            keys = torch.arange(kv_tokens).unsqueeze(0)
            self._decode_alibi = placement.to_device((keys - q_pos).to(self.stats_dtype))
        return self._decode_alibi


def _max_model_len(vllm_config: VllmConfig) -> int:
    model_config = vllm_config.model_config
    if model_config is not None:
        return model_config.max_model_len
    return vllm_config.scheduler_config.max_model_len


def make_bucketer(vllm_config: VllmConfig, block_size: int) -> AttnBucketer:
    """The decoder bucketer of a configuration (shared by builders and warm-up)."""
    scheduler = vllm_config.scheduler_config
    return AttnBucketer(
        block_size=block_size,
        max_model_len=_max_model_len(vllm_config),
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        max_num_seqs=scheduler.max_num_seqs,
        configured_num_seqs=policy.num_seqs_buckets_setting(),
    )


class PagedAttentionMetadataBuilder(AttentionMetadataBuilder[SpyreAttentionMetadata]):
    """Host-side planning of one step for every layer of a KV-cache group.

    Layout-independent: a layout's builder says whether it has the batched-decode
    kernel and the host kernel (:attr:`supports_batched_decode`,
    :attr:`supports_host_rows`) and adds what its pages need (:meth:`_page_index`).
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    # Any order of prefills and decodes works: each sequence is dispatched alone
    # and the decodes are gathered by index.
    reorder_batch_threshold: int | None = None
    #: Whether this layout has the batched-decode kernel.
    supports_batched_decode: ClassVar[bool] = False
    #: Whether the cpu target's host kernel reads this layout's pages.
    supports_host_rows: ClassVar[bool] = False
    #: Which synthetic steps warm-up records for this builder's layers
    #: (:mod:`spyre_inference.attention.warmup`): decoder page attention.
    warm_up_form: ClassVar[str] = "decoder"

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.bucketer = make_bucketer(vllm_config, self.block_size)
        self.stats_dtype = policy.softmax_stats_dtype(kv_cache_spec.dtype)
        self.batched_decode = self.supports_batched_decode and policy.batched_decode_requested()
        self._host_capable: bool | None = None
        self._plugin_prefill: bool | None = None

    def _group_impls(self) -> list[Any]:
        context = self.vllm_config.compilation_config.static_forward_context
        impls = []
        for name in self.layer_names:
            impl = getattr(context.get(name), "impl", None)
            if isinstance(impl, PagedAttentionImpl):
                impls.append(impl)
        return impls

    def host_rows_capable(self) -> bool:
        """Whether every layer of the group runs on the cpu target's host kernel.

        Decided on the first step (the layers are registered by then); a group
        without layers of this backend (a bare builder) keeps the graphs.
        """
        if self._host_capable is None:
            impls = self._group_impls()
            self._host_capable = (
                self.supports_host_rows
                and bool(impls)
                and all(
                    policy.use_host_decode(
                        impl.logits_soft_cap,
                        impl.alibi_slopes is not None,
                        self.kv_cache_spec.dtype,
                        impl.head_size,
                        impl.num_heads,
                        impl.num_kv_heads,
                    )
                    for impl in impls
                )
            )
        return self._host_capable

    def plugin_prefill(self) -> bool:
        """Whether the group's host prefills take the plugin's prefill kernel (cpu
        target, bfloat16; see ``ops.host_prefill.kernel_serves``), which moves the
        crossover with the decode kernel's rows (``policy.host_rows_win``)."""
        if self._plugin_prefill is None:
            impls = self._group_impls()
            self._plugin_prefill = bool(impls) and all(
                ops.host_prefill.kernel_serves(
                    self.kv_cache_spec.dtype,
                    placement.host_gemm_dtype(self.kv_cache_spec.dtype),
                    impl.head_size,
                    impl.num_heads,
                    impl.num_kv_heads,
                )
                for impl in impls
            )
        return self._plugin_prefill

    def _group_windows(self) -> set[int | None]:
        """Sliding windows of this group's layers (None: full attention)."""
        return {impl.sliding_window for impl in self._group_impls()}

    def _sequence_plan(
        self, q_start: int, q_len: int, seq_len: int, block_row: torch.Tensor
    ) -> SequencePlan:
        num_blocks = cdiv(seq_len, self.block_size)
        q_bucket = self.bucketer.query_bucket(q_len)
        kv_bucket = self.bucketer.kv_bucket(num_blocks)
        # Padding rows repeat the first real row: a valid gather index whose
        # output is masked and never written back.
        q_index = torch.full((q_bucket,), q_start, dtype=torch.int64)
        q_index[:q_len] = torch.arange(q_start, q_start + q_len, dtype=torch.int64)
        block_ids = torch.full((kv_bucket,), NULL_BLOCK, dtype=torch.int64)
        block_ids[:num_blocks] = block_row[:num_blocks].to(torch.int64)
        return SequencePlan(
            query_start=q_start,
            query_len=q_len,
            context_len=seq_len - q_len,
            seq_len=seq_len,
            query_bucket=q_bucket,
            kv_block_bucket=kv_bucket,
            q_index=placement.to_device(q_index),
            block_ids=placement.to_device(block_ids),
            page_index=self._page_index(block_ids),
        )

    def _page_index(self, block_ids: torch.Tensor) -> torch.Tensor | None:
        """Rows a layout's kernels read every page at, beyond its id (None: the id)."""
        return None

    def _decode_batch(
        self, rows: list[int], seq_lens: list[int], block_table: torch.Tensor, reqs: list[int]
    ) -> DecodeBatch:
        num = len(rows)
        s_bucket = self.bucketer.num_seqs_bucket(num)
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        kv_bucket = self.bucketer.kv_bucket(cdiv(int(lens.max()), self.block_size))
        q_index = torch.full((s_bucket,), rows[0], dtype=torch.int64)
        q_index[:num] = torch.tensor(rows, dtype=torch.int64)
        # Page ids of every decode at once; entries past a sequence's last page
        # (stale ids of earlier requests, or the table's end) become the null
        # block, as do padding sequences.
        width = min(kv_bucket, block_table.shape[1])
        table = block_table[torch.tensor(reqs, dtype=torch.int64), :width].to(torch.int64)
        used = torch.arange(width).unsqueeze(0) < (lens.unsqueeze(1) + self.block_size - 1) // (
            self.block_size
        )
        block_ids = torch.full((s_bucket, kv_bucket), NULL_BLOCK, dtype=torch.int64)
        block_ids[:num, :width] = torch.where(used, table, NULL_BLOCK)
        return DecodeBatch(
            rows=rows,
            seq_lens=seq_lens,
            num_seqs_bucket=s_bucket,
            kv_block_bucket=kv_bucket,
            q_index=placement.to_device(q_index),
            out_index=placement.to_device(q_index[:num].clone()),
            block_ids=placement.to_device(block_ids),
        )

    def _host_rows(
        self,
        entries: list[tuple[int, int, int, int]],
        block_table: torch.Tensor,
    ) -> HostRows:
        """The host kernel's rows from ``(q_start, q_len, seq_len, request)`` entries."""
        entries.sort()
        q_lens = torch.tensor([e[1] for e in entries], dtype=torch.int64)
        seq_lens = torch.tensor([e[2] for e in entries], dtype=torch.int64)
        reqs = torch.tensor([e[3] for e in entries], dtype=torch.int64)
        pages = (seq_lens + self.block_size - 1) // self.block_size
        kv_bucket = self.bucketer.kv_bucket(int(pages.max()))
        width = min(kv_bucket, block_table.shape[1])
        table = block_table[reqs, :width].to(torch.int64)
        used = torch.arange(width).unsqueeze(0) < pages.unsqueeze(1)
        per_seq = torch.full((len(entries), kv_bucket), NULL_BLOCK, dtype=torch.int64)
        per_seq[:, :width] = torch.where(used, table, NULL_BLOCK)
        rows = torch.cat([torch.arange(e[0], e[0] + e[1], dtype=torch.int64) for e in entries])
        # Row i of a sequence's query is the token at context_len + i.
        starts = torch.tensor([e[0] for e in entries], dtype=torch.int64)
        first = torch.repeat_interleave(seq_lens - q_lens - starts, q_lens)
        return HostRows(
            rows=rows,
            leading=int(rows[-1]) == rows.shape[0] - 1,
            positions=rows + first,
            block_ids=torch.repeat_interleave(per_seq, q_lens, dim=0),
            kv_block_bucket=kv_bucket,
        )

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> SpyreAttentionMetadata:
        cm = common_attn_metadata
        if isinstance(cm.causal, torch.Tensor) or not cm.causal:
            raise NotImplementedError(
                "the Spyre decoder backends implement causal attention only "
                "(bidirectional decoder attention is not supported)"
            )
        query_start = cm.query_start_loc_cpu.tolist()
        seq_lens = placement.to_host(cm.seq_lens).tolist()
        block_table = placement.to_host(cm.block_table_tensor)

        on_host = self.host_rows_capable()
        seqs: list[SequencePlan] = []
        host_prefills: list[HostPrefill] = []
        host_entries: list[tuple[int, int, int, int]] = []
        decode_rows: list[int] = []
        decode_lens: list[int] = []
        decode_reqs: list[int] = []
        for i in range(cm.num_reqs):
            q_start, q_end = query_start[i], query_start[i + 1]
            q_len = q_end - q_start
            if q_len <= 0:  # a padding request
                continue
            seq_len = int(seq_lens[i])
            if q_len == 1 and self.batched_decode:
                if on_host:
                    host_entries.append((q_start, 1, seq_len, i))
                    continue
                decode_rows.append(q_start)
                decode_lens.append(seq_len)
                decode_reqs.append(i)
            elif on_host:
                # cpu target: no graph for prefills. Short ones join the decode
                # kernel's rows, longer ones take the flash kernel.
                if policy.host_rows_win(q_len, seq_len - q_len, self.plugin_prefill()):
                    host_entries.append((q_start, q_len, seq_len, i))
                else:
                    pages = block_table[i, : cdiv(seq_len, self.block_size)].to(torch.int64)
                    host_prefills.append(HostPrefill(q_start, q_len, seq_len - q_len, pages))
            else:
                seqs.append(self._sequence_plan(q_start, q_len, seq_len, block_table[i]))

        decode = (
            self._decode_batch(decode_rows, decode_lens, block_table, decode_reqs)
            if decode_rows
            else None
        )
        host = self._host_rows(host_entries, block_table) if host_entries else None
        metadata = SpyreAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            num_reqs=cm.num_reqs,
            block_size=self.block_size,
            seqs=seqs,
            decode=decode,
            slot_mapping=cm.slot_mapping,
            stats_dtype=self.stats_dtype,
            host=host,
            host_prefills=host_prefills,
        )
        impls = self._group_impls()
        for window in {impl.sliding_window for impl in impls}:
            metadata.tile_masks(window)
            if decode is not None:
                metadata.decode_mask(window)
            if host is not None:
                metadata.host_mask(window)
        if any(impl.alibi_slopes is not None for impl in impls):
            metadata.alibi_biases()
            if decode is not None:
                metadata.decode_alibi_bias()
        return metadata


def host_slots(slot_mapping: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[num_tokens]`` int64 host slots; vLLM's padding (-1) and missing rows -> null slot."""
    host = placement.to_host(slot_mapping).to(torch.int64)[:num_tokens]
    index = host.clamp_min(NULL_SLOT)
    if index.shape[0] < num_tokens:
        index = torch.cat(
            (index, torch.full((num_tokens - index.shape[0],), NULL_SLOT, dtype=torch.int64))
        )
    return index


class PagedAttentionImpl(AttentionImpl[SpyreAttentionMetadata]):
    """Per-layer decoder attention on a paged cache, whatever the page layout.

    What every layout shares: construction and its checks, ALiBi and sink
    parameters on the device, the step's KV write through a store index built
    once per step, and the order of a step (store, then the multi-row sequences,
    the decode batch, the host rows, then zeroed padding rows). A layout
    supplies the store (:meth:`_store_index`, :meth:`_store_at`) and the page
    reads (:meth:`_attend_sequences`, and where its builder allows them
    :meth:`_attend_decodes`, :meth:`_attend_host_rows`,
    :meth:`_store_and_attend_on_host`).
    """

    #: Name in error messages.
    layout_name: ClassVar[str] = "paged"

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
                f"the Spyre {self.layout_name} backend implements decoder attention, not "
                f"{attn_type} (encoder layers use the encoder backend)"
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
        # Models derive the scale from the (possibly stick-padded) head_dim;
        # zero padding leaves q.k unchanged, so the original head's scale holds.
        self.scale = stick_pad.attention_scale(head_size, float(scale))
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = float(logits_soft_cap) if logits_soft_cap else None
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.alibi_slopes: torch.Tensor | None = None
        if alibi_slopes is not None:
            self._init_alibi(alibi_slopes)
        #: Attention-sink logits ``[num_heads]`` (gpt-oss): the model's own
        #: parameter, filled by the weight loader after this constructor runs
        #: and moved with the model, so it is read where it lives at each step.
        self.sinks = sinks
        if sinks is not None and sinks.numel() != num_heads:
            raise ValueError(f"expected {num_heads} attention sinks, got {sinks.numel()}")
        self._sinks_cache: tuple[tuple[Any, ...], torch.Tensor] | None = None

        #: (cache, its page view, its slot view): the layer's cache tensor is the
        #: same object every step, so its views are made once, not per step (each
        #: view is a dispatched op; on the card, an eager one).
        self._views: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        vllm_config = get_current_vllm_config()
        self._configure(vllm_config)
        if self.num_queries_per_kv == 1 and placement.is_spyre():
            # Spec, key constraints: MHA currently fails in the Spyre compiler's
            # layout-propagation pass. A compiler bug, not a property of the
            # kernels: the cpu target runs MHA.
            logger.warning(
                "Multi-head attention (num_heads == num_kv_heads == %d) is known to fail in "
                "the Spyre compiler's layout propagation; GQA/MQA models are the tested path.",
                num_heads,
            )

    def _init_alibi(self, alibi_slopes: list[float]) -> None:
        slopes = torch.as_tensor(alibi_slopes, dtype=torch.float32).reshape(-1)
        if slopes.numel() != self.num_heads:
            raise ValueError(f"expected {self.num_heads} ALiBi slopes, got {slopes.numel()}")
        # Kept in the statistics dtype of the cpu target (float32); the card
        # has float16 only. Moved to the device once, at construction.
        self.alibi_slopes = slopes

    def _configure(self, vllm_config: VllmConfig) -> None:
        """Compile policy of this layer (from the config current at model construction)."""
        compiled = policy.model_compiles(vllm_config)
        self.compile_kernels = compiled
        self.compile_store = compiled

    def _alibi_on_device(self, stats: torch.dtype) -> torch.Tensor | None:
        if self.alibi_slopes is None:
            return None
        if self.alibi_slopes.dtype != stats or self.alibi_slopes.device != placement.device():
            self.alibi_slopes = placement.to_device(self.alibi_slopes, dtype=stats)
        return self.alibi_slopes

    def _sinks_on_device(self, stats: torch.dtype) -> torch.Tensor | None:
        """The sink logits on the device in the statistics dtype (converted once per
        version of the parameter: weights load, and may reload, after construction)."""
        sinks = self.sinks
        if sinks is None:
            return None
        key = (sinks.data_ptr(), sinks._version, sinks.device, stats)
        cached = self._sinks_cache
        if cached is None or cached[0] != key:
            cached = (key, placement.to_device(sinks.detach().reshape(-1), dtype=stats))
            self._sinks_cache = cached
        return cached[1]

    def _check_content(self, kv_cache: torch.Tensor) -> None:
        if kv_cache.shape[-1] != 2 * self.head_size:
            raise ValueError(
                f"expected K|V content of {2 * self.head_size} elements per slot, the cache "
                f"has {kv_cache.shape[-1]} (head_size_v != head_size is not supported)"
            )

    def do_kv_cache_update(
        self,
        layer: AttentionLayer | torch.nn.Module | None,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write K/V (``[num_tokens, kv_heads, head]``) at ``slot_mapping``'s slots.

        For callers outside a step (warm-up, tests); ``forward`` writes through
        :meth:`_write_step_kv`, which shares the index across the step's layers.
        """
        if kv_cache.numel() == 0:  # placeholder cache before allocation
            return
        self._check_content(kv_cache)
        index = self._store_index(host_slots(slot_mapping, key.shape[0]), kv_cache)
        self._store_at(key, value, kv_cache, index)

    def _write_step_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        md: SpyreAttentionMetadata,
    ) -> None:
        """The KV write of ``forward``: the store index built once per step (on ``md``)."""
        if kv_cache.numel() == 0:
            return
        self._store_at(key, value, kv_cache, self._step_store_index(key.shape[0], kv_cache, md))

    def _step_store_index(
        self, num_tokens: int, kv_cache: torch.Tensor, md: SpyreAttentionMetadata
    ) -> torch.Tensor:
        """The store index of this step's ``num_tokens`` K/V rows, built once per step
        for every layer of the group (see ``SpyreAttentionMetadata.step_index``)."""
        self._check_content(kv_cache)
        return md.step_index(
            (self.layout_name, num_tokens, *kv_cache.shape[1:3]),
            lambda: self._store_index(host_slots(md.slot_mapping, num_tokens), kv_cache),
        )

    def _tile(self, kv_cache: torch.Tensor, block_size: int, num_seqs: int, rows: int) -> int:
        return policy.pages_per_tile(
            block_size,
            num_seqs=num_seqs,
            query_rows=rows,
            num_heads=self.num_heads,
            token_bytes=self.num_kv_heads * kv_cache.shape[-1] * kv_cache.element_size(),
        )

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
        """Store the step's K/V, then attention of ``query`` ``[num_tokens, heads, head]``.

        The backend sets ``forward_includes_kv_cache_update = True``: vLLM calls
        no separate KV-update op, the write is :meth:`do_kv_cache_update` here.
        """
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported")
        if attn_metadata is None:  # profiling / dummy run without metadata
            return output.zero_()
        if self._store_and_attend_on_host(query, key, value, kv_cache, attn_metadata, output):
            return output

        # Step 2, the KV write, before any attention reads the pages. A layer
        # that shares an earlier layer's cache writes nothing (vLLM's rule for
        # its own KV-update op).
        if key is not None and value is not None and self.kv_sharing_target_layer_name is None:
            self._write_step_kv(key, value, kv_cache, attn_metadata)
        self._attend_sequences(query, kv_cache, attn_metadata, output)
        if attn_metadata.decode is not None:
            self._attend_decodes(query, kv_cache, attn_metadata, output)
        if attn_metadata.host is not None:
            self._attend_host_rows(query, kv_cache, attn_metadata, output)
        if attn_metadata.host_prefills:
            self._attend_host_prefills(query, kv_cache, attn_metadata, output)
        # Padding rows of the step are zeroed, not left uninitialised: they flow
        # through the next layers into K/V written to the null block, and a NaN
        # there would survive an additive mask.
        if attn_metadata.num_actual_tokens < output.shape[0]:
            output[attn_metadata.num_actual_tokens :].zero_()
        return output

    def _store_index(self, slots: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """The device index the store scatters through, from ``[num_tokens]`` host slots."""
        raise NotImplementedError

    def _store_at(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, index: torch.Tensor
    ) -> None:
        """Write ``key``/``value`` into ``kv_cache`` through ``index``."""
        raise NotImplementedError

    def _store_and_attend_on_host(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        md: SpyreAttentionMetadata,
        output: torch.Tensor,
    ) -> bool:
        """The whole layer step in one host call, where a layout has one (None here)."""
        return False

    def _attend_sequences(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: SpyreAttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        raise NotImplementedError

    def _attend_decodes(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: SpyreAttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        raise AssertionError(f"the {self.layout_name} builder never batches decodes")

    def _attend_host_rows(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: SpyreAttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        raise AssertionError(f"the {self.layout_name} builder never plans host rows")

    def _attend_host_prefills(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: SpyreAttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        raise AssertionError(f"the {self.layout_name} builder never plans host prefills")


class PagedAttentionBackend(AttentionBackend):
    """What the paged decoder backends declare alike; a layout adds its impl, builder,
    cache layout and allocation."""

    # The KV write (the spec's step 2, do_kv_cache_update) runs inside forward:
    # one opaque op per layer for vLLM to enter, not two.
    forward_includes_kv_cache_update: bool = True

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
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sink(cls) -> bool:
        # Per-head sink logits join the online softmax's denominator after the
        # last tile (graphs) and inside the cpu target's host kernel.
        return True

    @classmethod
    def validate_config(cls, vllm_config: VllmConfig) -> None:
        """Start-up checks of the plugin settings against this backend (none here)."""
        return None

    @classmethod
    def warm_up(cls, plan: AttentionWarmUpPlan) -> None:
        """Record every kernel variant serving can reach (the core's
        :class:`~spyre_inference.platform.warmup.WarmsUpAttention` contract).

        See :func:`spyre_inference.attention.warmup.record_backend`.
        """
        from spyre_inference.attention.warmup import record_backend

        record_backend(cls, plan)
