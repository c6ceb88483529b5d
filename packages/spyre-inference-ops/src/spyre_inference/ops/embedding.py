"""The vocabulary embedding, gathered on the device at every TP size.

At TP=1 the gather is a plain ``F.embedding`` on the device (torch-spyre has an
``aten.embedding`` kernel, torch-spyre#420), with no host round-trip.

Under TP each rank owns a slice of the vocabulary, and upstream derives the
local index and the ownership mask per step with int64 comparisons against
Python constants (``get_masked_input_and_mask``), which Spyre cannot lower.
Those answers depend only on the token id, so they are tabulated once at
construction, on the host, for every id: ``spyre_reindex[id]`` is the local row
and ``spyre_keep[id]`` is 1.0 when this rank owns the id. Both are buffers, so
they move to the device with the model; each step is two gathers, a multiply
and the all-reduce, all on the device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from vllm.distributed import tensor_model_parallel_all_reduce
from vllm.model_executor.layers.vocab_parallel_embedding import (
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
    VocabParallelEmbeddingShardIndices,
    get_masked_input_and_mask,
)

from spyre_inference.ops import int8_vocab
from spyre_inference.platform.layer_swaps import spyre_oot


def build_shard_tables(
    shard: VocabParallelEmbeddingShardIndices, num_ids: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-id local row (int64 ``[num_ids]``) and ownership (``dtype`` ``[num_ids, 1]``).

    Computed with upstream's own ``get_masked_input_and_mask`` over every id,
    so the tables agree with upstream's per-step answer by construction.
    """
    ids = torch.arange(num_ids, dtype=torch.int64, device="cpu")
    # Upstream wraps the function in torch.compile; one eager call at load
    # does not need an Inductor compile.
    with torch.compiler.set_stance("force_eager"):
        local, not_owned = get_masked_input_and_mask(
            ids,
            shard.org_vocab_start_index,
            shard.org_vocab_end_index,
            shard.num_org_vocab_padding,
            shard.added_vocab_start_index,
            shard.added_vocab_end_index,
        )
    keep = (~not_owned).to(dtype).unsqueeze(-1)
    return local.to(torch.int64).contiguous(), keep.contiguous()


def sharded_embedding(
    input_ids: torch.Tensor, weight: torch.Tensor, reindex: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    """This rank's partial embedding (zero rows for ids it does not own)."""
    flat = input_ids.reshape(-1)
    local = reindex.index_select(0, flat)
    owned = F.embedding(flat, keep)
    out = F.embedding(local, weight) * owned
    return out.view(*input_ids.shape, weight.shape[-1])


@spyre_oot(VocabParallelEmbedding)
class SpyreVocabParallelEmbedding(VocabParallelEmbedding):
    """``VocabParallelEmbedding`` with an on-device gather and load-time TP tables.

    Weight loading and shard arithmetic are upstream's. Quantized embeddings
    (whose method implements its own ``embedding``) use upstream's forward.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if type(self.quant_method) is UnquantizedEmbeddingMethod and int8_vocab.enabled():
            # cpu target, SPYRE_CPU_INT8_VOCAB=1: INT8 rows (int8_vocab), through
            # upstream's forward, which calls the method's embedding().
            self.quant_method = int8_vocab.SpyreInt8EmbeddingMethod()
        if self.tp_size > 1:
            reindex, keep = build_shard_tables(
                self.shard_indices, self.num_embeddings_padded, self.params_dtype
            )
            self.register_buffer("spyre_reindex", reindex, persistent=False)
            self.register_buffer("spyre_keep", keep, persistent=False)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if type(self.quant_method) is not UnquantizedEmbeddingMethod:
            return super().forward(input_)
        if self.tp_size == 1:
            return F.embedding(input_, self.weight)
        keep = self.spyre_keep
        if keep.dtype != self.weight.dtype:
            keep = keep.to(self.weight.dtype)
        output = sharded_embedding(input_, self.weight, self.spyre_reindex, keep)
        if self.reduce_results:
            if self.parallel_group is not None:
                output = self.parallel_group.all_reduce(output)
            else:
                output = tensor_model_parallel_all_reduce(output)
        return output


__all__ = ["SpyreVocabParallelEmbedding", "build_shard_tables", "sharded_embedding"]
