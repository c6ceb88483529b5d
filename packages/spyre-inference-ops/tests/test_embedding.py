"""The Spyre vocabulary embedding against vLLM's own.

TP=1 is compared layer to layer (an exact gather: equal bit for bit). TP>1
needs several ranks; its per-rank logic (tables built once at load, then
gathers and a keep multiply per step) is checked rank by rank against
upstream's per-step ``get_masked_input_and_mask`` path, and the sum over ranks
(what the all-reduce computes) against the unsharded embedding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ops_testutil import default_dtype, upstream_layers

HIDDEN = 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tp1_embedding_matches_upstream(vllm_env, dtype):
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from spyre_inference import ops

    vocab = 1000
    weight = torch.randn(vocab, HIDDEN, generator=torch.Generator().manual_seed(0)).to(dtype)
    with default_dtype(dtype):
        spyre = VocabParallelEmbedding(vocab, HIDDEN)
        with upstream_layers():
            upstream = VocabParallelEmbedding(vocab, HIDDEN)
    assert type(spyre) is ops.SpyreVocabParallelEmbedding
    for layer in (spyre, upstream):
        layer.weight.weight_loader(layer.weight, weight)
    for ids in (torch.tensor([0, 5, 999]), torch.randint(0, vocab, (4, 9))):
        for index_dtype in (torch.int64, torch.int32):
            out = spyre(ids.to(index_dtype))
            assert out.dtype == dtype
            assert torch.equal(out, upstream(ids))


def _upstream_rank_output(ids, weight_shard, shard):
    """What upstream's TP>1 forward computes on one rank before the all-reduce."""
    from vllm.model_executor.layers.vocab_parallel_embedding import get_masked_input_and_mask

    # Eager: the function is upstream's, its torch.compile wrapper only makes
    # it fast (and would cost an Inductor compile here).
    with torch.compiler.set_stance("force_eager"):
        masked, not_owned = get_masked_input_and_mask(
            ids,
            shard.org_vocab_start_index,
            shard.org_vocab_end_index,
            shard.num_org_vocab_padding,
            shard.added_vocab_start_index,
            shard.added_vocab_end_index,
        )
    out = F.embedding(masked.long(), weight_shard)
    return out.masked_fill(not_owned.unsqueeze(-1), 0)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_tables_match_upstream_masking(vllm_env, tp_size):
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        VocabParallelEmbedding,
        pad_vocab_size,
    )

    from spyre_inference.ops.embedding import build_shard_tables, sharded_embedding

    vocab = 1000
    padded = pad_vocab_size(vocab)
    per_rank = padded // tp_size
    g = torch.Generator().manual_seed(1)
    full = torch.randn(vocab, HIDDEN, generator=g)
    ids = torch.randint(0, vocab, (3, 11), generator=g)
    total = torch.zeros(3, 11, HIDDEN)
    for rank in range(tp_size):
        shard = VocabParallelEmbedding._get_indices(padded, padded, vocab, vocab, rank, tp_size)
        # The rank's parameter as vLLM's weight_loader fills it: its slice of
        # the vocabulary, zero rows after.
        rows = full[shard.org_vocab_start_index : shard.org_vocab_end_index]
        weight_shard = F.pad(rows, (0, 0, 0, per_rank - rows.shape[0]))
        reindex, keep = build_shard_tables(shard, padded, torch.float32)
        assert reindex.dtype == torch.int64 and reindex.shape == (padded,)
        assert keep.shape == (padded, 1)
        out = sharded_embedding(ids, weight_shard, reindex, keep)
        assert torch.equal(out, _upstream_rank_output(ids, weight_shard, shard))
        total += out
    torch.testing.assert_close(total, F.embedding(ids, full), rtol=0, atol=0)
