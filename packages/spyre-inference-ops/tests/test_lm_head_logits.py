"""The Spyre LM head and logits processor against vLLM's own.

The head's per-rank rows are padded to a multiple of 64x32 = 2048 and stored
transposed; the logits it produces (after the un-pad slice) must equal
upstream's ``F.linear`` logits: float32 within 1e-5, bfloat16 within
rtol = atol = 1.6e-2 (hidden states and weights of unit scale, logits of
order 1). The logits reach the host in the model dtype (the sampler's float32
cast happens there, never on the device), or in float32 where the cpu target
computes the head on a float32 weight copy (``SPYRE_CPU_GEMM_DTYPE``).
"""

from __future__ import annotations

import pytest
import torch
from ops_testutil import default_dtype, process_after_loading, tol, upstream_layers

from spyre_inference.platform.device import host_gemm_dtype

HIDDEN = 64
VOCAB = 1000  # vLLM pads to 1024 (a multiple of 64); the Spyre head to 2048


def _head_and_processor(dtype, weight, bias=None, *, soft_cap=None, scale=1.0):
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    with default_dtype(dtype):
        head = ParallelLMHead(VOCAB, HIDDEN, bias=bias is not None)
        processor = LogitsProcessor(VOCAB, soft_cap=soft_cap, scale=scale)
    head.weight.weight_loader(head.weight, weight.to(dtype))
    if bias is not None:
        head.bias.weight_loader(head.bias, bias.to(dtype))
    process_after_loading(head)
    return head, processor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "soft_cap,scale", [(None, 1.0), (10.0, 0.5)], ids=["plain", "softcap_scale"]
)
def test_spyre_logits_match_upstream(vllm_env, dtype, soft_cap, scale):
    from spyre_inference import ops

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5
    head, processor = _head_and_processor(dtype, weight, soft_cap=soft_cap, scale=scale)
    with upstream_layers():
        ref_head, ref_processor = _head_and_processor(dtype, weight, soft_cap=soft_cap, scale=scale)
    assert type(head) is ops.SpyreParallelLMHead
    assert type(head.quant_method) is ops.SpyreUnquantizedLMHeadMethod
    assert type(processor) is ops.SpyreLogitsProcessor
    assert type(ref_processor).__name__ == "LogitsProcessor"

    # Stored layout: [hidden, rows padded to 2048], zero pad columns, no
    # [vocab, hidden] weight left on the head.
    assert head.num_embeddings_per_partition == 1024
    wt = head.padded_weight_t
    assert wt.shape == (HIDDEN, 2048) and wt.is_contiguous()
    assert torch.equal(wt[:, :1024], ref_head.weight.t())
    assert not wt[:, 1024:].any()
    assert "weight" not in dict(head.named_parameters())

    for tokens in (1, 5):
        hidden = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
        logits = processor(head, hidden)
        ref = ref_processor(ref_head, hidden)
        assert logits.shape == ref.shape == (tokens, VOCAB)
        assert logits.device.type == "cpu"
        # The sampler's float32 cast has not happened yet (it must run on the
        # host); a head computed on a float32 weight copy keeps its float32.
        assert logits.dtype == (host_gemm_dtype(dtype) or dtype)
        torch.testing.assert_close(logits.to(dtype), ref, **tol(dtype))


@pytest.mark.parametrize("mode", ["float32", "model"])
def test_cpu_gemm_head_keeps_float32_logits(vllm_env, monkeypatch, mode):
    """SPYRE_CPU_GEMM_DTYPE=float32: a bfloat16 head returns the float32 product
    unrounded (bfloat16 logits near 20 are 0.125 apart: near-ties between top
    tokens would become exact ties); =model returns bfloat16 logits."""
    from spyre_inference.platform import device as dev

    monkeypatch.setenv("SPYRE_CPU_GEMM_DTYPE", mode)
    dev.reset_for_tests()
    try:
        g = torch.Generator().manual_seed(6)
        weight = torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5
        head, processor = _head_and_processor(torch.bfloat16, weight)
        hidden = torch.randn(3, HIDDEN, generator=g).to(torch.bfloat16)
        logits = processor(head, hidden)
        exact = hidden.float() @ weight.to(torch.bfloat16).float().t()
        if mode == "model":
            assert logits.dtype == torch.bfloat16
            torch.testing.assert_close(logits, exact.bfloat16(), **tol(torch.bfloat16))
        else:
            assert logits.dtype == torch.float32
            torch.testing.assert_close(logits, exact, rtol=1e-5, atol=1e-5)
    finally:
        monkeypatch.delenv("SPYRE_CPU_GEMM_DTYPE")
        dev.reset_for_tests()


def test_lm_head_bias_after_unpad(vllm_env):
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5
    bias = torch.randn(VOCAB, generator=g)
    head, processor = _head_and_processor(torch.float32, weight, bias)
    hidden = torch.randn(3, HIDDEN, generator=g)
    logits = processor(head, hidden, embedding_bias=head.bias)
    torch.testing.assert_close(logits, hidden @ weight.t() + bias, rtol=1e-5, atol=1e-5)


def test_tied_lm_head_keeps_embedding(vllm_env):
    """With tied embeddings the head transposes a copy; the embedding still works."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    g = torch.Generator().manual_seed(3)
    weight = torch.randn(VOCAB, HIDDEN, generator=g)
    embed = VocabParallelEmbedding(VOCAB, HIDDEN)
    embed.weight.weight_loader(embed.weight, weight)
    head = ParallelLMHead(VOCAB, HIDDEN).tie_weights(embed)
    assert head.weight is embed.weight
    process_after_loading(embed)
    process_after_loading(head)
    assert embed.weight.shape == (1024, HIDDEN)
    ids = torch.tensor([0, 17, 999])
    torch.testing.assert_close(embed(ids), weight[ids])
    hidden = torch.randn(2, HIDDEN, generator=g)
    logits = LogitsProcessor(VOCAB)(head, hidden)
    torch.testing.assert_close(logits, hidden @ weight.t(), rtol=1e-5, atol=1e-4)


def test_head_dtype_float32_on_transposed_head(vllm_env):
    """An explicit float32 head dtype still works without the head's [V, H] weight."""
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5
    head, processor = _head_and_processor(torch.bfloat16, weight)
    processor.head_dtype = torch.float32
    hidden = torch.randn(4, HIDDEN, generator=g).to(torch.bfloat16)
    logits = processor(head, hidden)
    assert logits.dtype == torch.float32
    ref = hidden.float() @ weight.to(torch.bfloat16).float().t()
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)


def test_get_top_tokens_matches_argmax(vllm_env):
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5
    head, processor = _head_and_processor(torch.float32, weight)
    hidden = torch.randn(6, HIDDEN, generator=g)
    top = processor.get_top_tokens(head, hidden)
    assert torch.equal(top, (hidden @ weight.t()).argmax(-1))
