"""The INT8 vocabulary matrix (``SPYRE_CPU_INT8_VOCAB=1``, cpu target) against references.

The reference quantization is written here from its definition (symmetric, a
float32 scale per row = the row's largest magnitude / 127, round to nearest,
in vLLM's kernels' order), not taken from the plugin. Integer products are
exact, so the head's logits must equal the float64 product of the dequantized
activations and weights to float32 rounding; the embedding must return the dequantized rows. A tied
embedding and head share one INT8 table and release the 16-bit matrix.
"""

from __future__ import annotations

import pytest
import torch
from ops_testutil import default_dtype, process_after_loading

HIDDEN = 64
VOCAB = 1000  # vLLM pads to 1024 rows; the INT8 table to 2048 (64x32)


def _reference_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes, scale per row) by definition, in float64 for the products.

    In float32 and as ``round(w * (1 / scale))``: the order of vLLM's INT8
    quantization kernels, so that ties round as the plugin's do.
    """
    w = w.float()
    amax = w.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    codes = (w * (1.0 / scale)).round().clamp(-128, 127)
    return codes.double(), scale.double()


@pytest.fixture
def int8_vocab_on(monkeypatch):
    from spyre_inference.platform import settings

    monkeypatch.setenv("SPYRE_CPU_INT8_VOCAB", "1")
    settings.reset_cache()
    yield
    monkeypatch.delenv("SPYRE_CPU_INT8_VOCAB")
    settings.reset_cache()


def _weight(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5


def test_head_logits_equal_the_dequantized_product(vllm_env, int8_vocab_on):
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from spyre_inference.ops import int8_vocab

    weight = _weight().bfloat16()
    with default_dtype(torch.bfloat16):
        head = ParallelLMHead(VOCAB, HIDDEN)
    assert type(head.quant_method) is int8_vocab.SpyreInt8LMHeadMethod
    head.weight.weight_loader(head.weight, weight)
    loaded = head.weight.data.clone()  # [1024, HIDDEN], vLLM's pad rows zero
    process_after_loading(head)

    # The spec's [in, out] layout, rows padded to 2048; no 16-bit weight left.
    names = dict(head.named_parameters())
    assert "weight" not in names
    codes, scale = names[int8_vocab.WEIGHT_T_PARAM], names[int8_vocab.SCALE_PARAM]
    assert codes.dtype == torch.int8 and codes.shape == (HIDDEN, 2048)
    want_codes, want_scale = _reference_rows(loaded)
    assert torch.equal(codes[:, :1024].t().double(), want_codes)
    torch.testing.assert_close(scale[:1024].double(), want_scale.squeeze(-1), rtol=1e-6, atol=0)
    assert not codes[:, 1024:].any()

    g = torch.Generator().manual_seed(1)
    for tokens in (1, 7):
        x = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
        logits = head.quant_method.apply(head, x)
        assert logits.shape == (tokens, 1024) and logits.dtype == torch.float32
        xq, xs = _reference_rows(x)
        ref = (xq * xs) @ (want_codes * want_scale).t()
        torch.testing.assert_close(logits.double(), ref, rtol=1e-5, atol=1e-5)
        # And close to the unquantized head: 8-bit error, not a wrong layout.
        exact = x.double() @ loaded.double().t()
        assert (logits.double() - exact).abs().max() < 0.05 * exact.abs().max()


def test_tied_embedding_and_head_share_one_table(vllm_env, int8_vocab_on):
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    from spyre_inference.ops import int8_vocab

    weight = _weight(2).bfloat16()
    with default_dtype(torch.bfloat16):
        embed = VocabParallelEmbedding(VOCAB, HIDDEN)
        head = ParallelLMHead(VOCAB, HIDDEN).tie_weights(embed)
    assert type(embed.quant_method) is int8_vocab.SpyreInt8EmbeddingMethod
    embed.weight.weight_loader(embed.weight, weight)
    loaded = embed.weight.data.clone()
    shared = embed.weight
    # vLLM's loader visits the embedding first, then the head.
    process_after_loading(embed)
    process_after_loading(head)

    assert shared.numel() == 0  # the 16-bit matrix is released
    assert getattr(embed, int8_vocab.WEIGHT_T_PARAM) is getattr(head, int8_vocab.WEIGHT_T_PARAM)
    model = torch.nn.ModuleDict({"embed": embed, "head": head})
    int8_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert int8_bytes == HIDDEN * 2048 + 2048 * 4  # one table: codes + scales

    codes, scale = _reference_rows(loaded)
    ids = torch.tensor([[0, 5, 999], [17, 17, 3]])
    out = embed(ids)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, HIDDEN)
    ref = (codes * scale)[ids].bfloat16()
    assert torch.equal(out, ref)


def test_lora_is_refused_with_it(int8_vocab_on, tiny_llama, monkeypatch):
    from vllm import LLM

    # Buckets LoRA accepts (the test plugin's set holds 1), so this refusal is the one.
    monkeypatch.setenv("SPYRE_NUM_TOKENS_BUCKETS", "2,8")

    with pytest.raises(ValueError, match="SPYRE_CPU_INT8_VOCAB=1 with LoRA"):
        LLM(str(tiny_llama), enable_lora=True, max_model_len=256, max_num_seqs=2)
