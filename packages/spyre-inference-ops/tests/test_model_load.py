"""A real vLLM model loaded from a checkpoint with head-dim and MLP stick padding.

A tiny random Llama (head_dim 32, intermediate_size 344: neither a whole
number of 64-element sticks) is saved with transformers, loaded by vLLM's own
model loader after ``stick_pad.widen_config`` (the platform's step), and its
layers are compared with the Hugging Face modules on the same weights: the
embedding, Q/K/V projections, RoPE (HF's rotary embedding is the reference),
O projection, MLP and logits. Everything is float32: results agree within
1e-5 (only summation order differs). Attention itself is the attention
package's business; what it must do with the padded head (keep the original
scale) is checked through ``stick_pad.attention_scale``.
"""

from __future__ import annotations

import pytest
import torch

from spyre_inference.platform.stick_pad import PLAN_KEY, attention_scale, widen_config

HIDDEN, HEADS, KV_HEADS, HEAD, INTER, VOCAB = 128, 4, 2, 32, 344, 1000
FP32 = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD,
        intermediate_size=INTER,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny-llama-h32")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def loaded(module_vllm_env, hf_checkpoint):
    """vLLM's LlamaForCausalLM built and loaded the way the model runner does."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    path, hf_model = hf_checkpoint
    model_config = ModelConfig(
        model=str(path), dtype="float32", max_model_len=256, skip_tokenizer_init=True
    )
    vllm_config = VllmConfig(model_config=model_config)
    plan = widen_config(vllm_config)  # idempotent if the platform already did it
    assert widen_config(vllm_config) == plan
    with set_current_vllm_config(vllm_config):
        loader = get_model_loader(vllm_config.load_config)
        with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
            model = loader.create_model(vllm_config=vllm_config, model_config=model_config)
        loader.load_weights(model, model_config)
        process_weights_after_loading(model, model_config, torch.device("cpu"))
    return vllm_config, model, hf_model


def test_config_widened(loaded):
    vllm_config, _, _ = loaded
    text = vllm_config.model_config.hf_text_config
    assert (text.head_dim, text.intermediate_size) == (64, 384)
    assert vllm_config.model_config.get_head_size() == 64
    assert vllm_config.additional_config[PLAN_KEY] == {
        "head_dim": [32, 64],
        "intermediate_size": [344, 384],
    }


def test_every_eligible_layer_is_spyre(loaded):
    from spyre_inference import ops

    _, model, _ = loaded
    layer = model.model.layers[0]
    assert type(model.model.embed_tokens) is ops.SpyreVocabParallelEmbedding
    assert type(model.lm_head) is ops.SpyreParallelLMHead
    assert type(model.logits_processor) is ops.SpyreLogitsProcessor
    assert type(layer.self_attn.qkv_proj) is ops.SpyreQKVParallelLinear
    assert type(layer.self_attn.o_proj) is ops.SpyreRowParallelLinear
    assert type(layer.self_attn.rotary_emb) is ops.SpyreRotaryEmbedding
    assert type(layer.mlp.gate_up_proj) is ops.SpyreMergedColumnParallelLinear
    assert type(layer.mlp.down_proj) is ops.SpyreRowParallelLinear
    for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert type(module.quant_method) is ops.SpyreUnquantizedLinearMethod


def _unpad_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[T, heads*64] in the [x1, 0, x2, 0] layout -> [T, heads*32]."""
    halves = t.view(t.shape[0], heads, 2, 32)
    assert not halves[..., HEAD // 2 :].any()
    return halves[..., : HEAD // 2].reshape(t.shape[0], heads * HEAD)


def test_attention_projections_and_rope_match_hf(loaded):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    vllm_config, model, hf_model = loaded
    attn, hf_attn = model.model.layers[0].self_attn, hf_model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, HIDDEN, generator=g)
    positions = torch.tensor([0, 1, 2, 7, 100, 255])

    qkv, _ = attn.qkv_proj(x)
    assert qkv.shape == (6, (HEADS + 2 * KV_HEADS) * 64)
    q, k, v = qkv.split([HEADS * 64, KV_HEADS * 64, KV_HEADS * 64], dim=-1)
    with torch.no_grad():
        hq, hk, hv = hf_attn.q_proj(x), hf_attn.k_proj(x), hf_attn.v_proj(x)
    torch.testing.assert_close(_unpad_heads(q, HEADS), hq, **FP32)
    torch.testing.assert_close(_unpad_heads(k, KV_HEADS), hk, **FP32)
    torch.testing.assert_close(_unpad_heads(v, KV_HEADS), hv, **FP32)

    rq, rk = attn.rotary_emb(positions, q, k)
    with torch.no_grad():
        cos, sin = hf_model.model.rotary_emb(x[None], positions[None])
        ref_q, ref_k = apply_rotary_pos_emb(
            hq.view(1, 6, HEADS, HEAD).transpose(1, 2),
            hk.view(1, 6, KV_HEADS, HEAD).transpose(1, 2),
            cos,
            sin,
        )
    torch.testing.assert_close(
        _unpad_heads(rq, HEADS), ref_q.transpose(1, 2).reshape(6, -1), **FP32
    )
    torch.testing.assert_close(
        _unpad_heads(rk, KV_HEADS), ref_k.transpose(1, 2).reshape(6, -1), **FP32
    )

    # The attention layer is built at the padded head size with the scale the
    # model derived from it; the backend must turn that back into 32 ** -0.5.
    layer = attn.attn
    assert layer.head_size == 64
    plan_scale = attention_scale(layer.head_size, layer.impl.scale, _plan(vllm_config))
    assert plan_scale == pytest.approx(HEAD**-0.5)

    # O projection: padded per-head input (zero pads) -> HF's output.
    attn_out = torch.randn(6, HEADS * HEAD, generator=g)
    halves = attn_out.view(6, HEADS, 2, HEAD // 2)
    padded = torch.cat([halves, torch.zeros(6, HEADS, 2, 16)], dim=-1).reshape(6, -1)
    out, _ = attn.o_proj(padded)
    with torch.no_grad():
        torch.testing.assert_close(out, hf_attn.o_proj(attn_out), **FP32)


def _plan(vllm_config):
    from spyre_inference.platform.stick_pad import plan_from_config

    return plan_from_config(vllm_config)


def test_mlp_embedding_and_logits_match_hf(loaded):
    _, model, hf_model = loaded
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, HIDDEN, generator=g)
    ids = torch.tensor([0, 3, 999, 500])
    with torch.no_grad():
        for i in range(2):
            torch.testing.assert_close(
                model.model.layers[i].mlp(x), hf_model.model.layers[i].mlp(x), **FP32
            )
        assert torch.equal(model.model.embed_tokens(ids), hf_model.model.embed_tokens(ids))
        logits = model.compute_logits(x)
        torch.testing.assert_close(logits, hf_model.lm_head(x), **FP32)
    assert model.lm_head.padded_weight_t.shape == (HIDDEN, 2048)
