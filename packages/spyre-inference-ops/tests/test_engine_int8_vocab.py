"""``SPYRE_CPU_INT8_VOCAB=1`` end to end: a tiny Llama with its vocabulary matrix in INT8.

A tied embedding and head (one shared table), compiled as served, bfloat16. The reference is
transformers on the same checkpoint with the embedding and head replaced by
their INT8 round trip (``spyre_inference.testing.quantize.int8_vocab_reference``,
written from the definition), so that the comparison measures the plugin's
kernels and the per-token activation rounding of the head, not the weights'
rounding: greedy tokens identical up to a first divergence where each side's
token is among the other's top 5. In the engine the vocabulary is held once, in
INT8 (a tied model's 16-bit matrix is released).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from spyre_inference.testing import (
    TEST_PROMPTS,
    assert_greedy_top_k_close,
    hf_greedy_with_logprobs,
    vllm_greedy_with_top_logprobs,
)
from spyre_inference.testing.quantize import int8_vocab_reference

MAX_TOKENS = 12
PROMPTS = TEST_PROMPTS[:6]


def _vocab_storage(model: torch.nn.Module) -> dict[str, Any]:
    """Where the engine keeps the vocabulary: methods and bytes by dtype."""
    from spyre_inference.ops import int8_vocab

    embed = model.model.embed_tokens
    head = model.lm_head
    params = dict(model.named_parameters())  # shared tensors once
    return {
        "embed_method": type(embed.quant_method).__name__,
        "head_method": type(head.quant_method).__name__,
        "shared_table": getattr(embed, int8_vocab.WEIGHT_T_PARAM)
        is getattr(head, int8_vocab.WEIGHT_T_PARAM),
        "int8_bytes": sum(p.numel() for p in params.values() if p.dtype == torch.int8),
        "embed_16bit_numel": embed.weight.numel(),
        "vocab_hidden": [head.org_vocab_size, embed.embedding_dim],
    }


# Untied (a table each) passed the same way (6/6 identical) when measured; the
# suite runs the tied case, whose shared table is the harder one. The head alone
# (an untied head's path) is test_int8_vocab.py's.
@pytest.mark.parametrize("tied", [True], ids=["tied"])
def test_int8_vocab_greedy_close_to_transformers(
    tied, tiny_model_factory, make_llm, monkeypatch, tmp_path
) -> None:
    from spyre_inference.platform import settings

    monkeypatch.setenv("SPYRE_CPU_INT8_VOCAB", "1")
    monkeypatch.setenv("SPYRE_NUM_TOKENS_BUCKETS", "16,128")
    settings.reset_cache()
    src = tiny_model_factory("llama", tie_word_embeddings=tied)
    reference = int8_vocab_reference(src, tmp_path / "reference", torch.bfloat16)
    llm = make_llm(src, dtype="bfloat16")

    (storage,) = llm.apply_model(_vocab_storage)
    print(f"\nINT8 vocabulary ({'tied' if tied else 'untied'}): {storage}")
    assert storage["embed_method"] == "SpyreInt8EmbeddingMethod", storage
    assert storage["head_method"] == "SpyreInt8LMHeadMethod", storage
    assert storage["shared_table"] is tied, storage
    vocab, hidden = storage["vocab_hidden"]
    tables = 1 if tied else 2
    # Each table: hidden x (vocab padded to 2048) codes.
    assert storage["int8_bytes"] == tables * hidden * -(-vocab // 2048) * 2048, storage
    if tied:
        assert storage["embed_16bit_numel"] == 0, storage

    got, got_lp = vllm_greedy_with_top_logprobs(llm, PROMPTS, MAX_TOKENS, k=5)
    want = hf_greedy_with_logprobs(reference, PROMPTS, MAX_TOKENS, "bfloat16", num_logprobs=5)
    exact = assert_greedy_top_k_close(want, got, got_lp, k=5)
    print(f"INT8 vocabulary: {exact}/{len(PROMPTS)} prompts identical to transformers bf16")
    settings.reset_cache()
