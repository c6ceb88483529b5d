"""``model_impl="transformers"``: Spyre rotation cache and matmul apply vs Hugging Face.

Layer level: the cache built from an HF rotary module, gathered and applied with
:func:`spyre_apply_rotary_pos_emb`, rotates q and k as HF's own
``rotary_emb`` + ``apply_rotary_pos_emb`` do (float32; the only difference a
2-term matmul may make is one rounding). Engine level: a tiny Llama served with
``model_impl="transformers"`` is built as ``SpyreTransformersForCausalLM``, its
rotary module is the Spyre one, every attention module rotates with the Spyre
apply, and greedy tokens equal Hugging Face's exactly in float32.
"""

from __future__ import annotations

import pytest
import torch

from spyre_inference.models.transformers_backend import (
    SpyreHFRotaryEmbedding,
    build_rotation_cache,
    spyre_apply_rotary_pos_emb,
)
from spyre_inference.platform.stick_pad import DimPad
from spyre_inference.testing import TEST_PROMPTS, hf_greedy, tiny_config

MAX_POS = 256


@pytest.fixture
def llm_in_process() -> bool:
    """Engines in their own process here: vLLM's Transformers backend decorates the
    transformers model classes it serves (``support_torch_compile``) for the whole
    process, after which the tests' transformers references of those classes no
    longer build outside a vLLM config."""
    return False


def _hf_rotary(**overrides):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(tiny_config("llama", **overrides))


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ],
    ids=["default", "llama3"],
)
def test_cache_and_apply_match_hf(overrides) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hf = _hf_rotary(**overrides)
    cache, partner = build_rotation_cache(hf, MAX_POS, torch.float32, None, 64)
    assert partner is None  # full head: the 2x2 form
    spyre = SpyreHFRotaryEmbedding(cache, "x")
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, tokens, head_dim = 4, 2, 37, 64
    q = torch.randn(1, heads, tokens, head_dim, generator=gen)
    k = torch.randn(1, kv_heads, tokens, head_dim, generator=gen)
    positions = torch.randint(0, MAX_POS, (1, tokens), generator=gen)
    x = torch.zeros(1, tokens, 256)

    want_q, want_k = apply_rotary_pos_emb(q, k, *hf(x, positions))
    got_q, got_k = spyre_apply_rotary_pos_emb(q, k, *spyre(x, positions))
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=2e-6)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=2e-6)


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_per_layer_type_cache_and_apply_match_hf(layer_type) -> None:
    """OLMo 3's rotary holds one frequency set per layer type; each type's cache
    rotates as HF's ``forward(x, position_ids, layer_type)`` does."""
    from transformers import AutoConfig
    from transformers.models.olmo3.modeling_olmo3 import (
        Olmo3RotaryEmbedding,
        apply_rotary_pos_emb,
    )

    from spyre_inference.models.transformers_backend import SpyreHFLayerTypeRotaryEmbedding

    config = AutoConfig.for_model(
        "olmo3",
        hidden_size=256,
        num_attention_heads=4,
        num_hidden_layers=4,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
        },
    )
    hf = Olmo3RotaryEmbedding(config)
    per_type = {}
    for t in ("sliding_attention", "full_attention"):
        cache, partner = build_rotation_cache(hf, MAX_POS, torch.float32, None, 64, t)
        per_type[t] = SpyreHFRotaryEmbedding(cache, t, partner)
    spyre = SpyreHFLayerTypeRotaryEmbedding(per_type)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 37, 64, generator=gen)
    k = torch.randn(1, 4, 37, 64, generator=gen)
    positions = torch.randint(0, MAX_POS, (1, 37), generator=gen)
    x = torch.zeros(1, 37, 256)

    want_q, want_k = apply_rotary_pos_emb(q, k, *hf(x, positions, layer_type))
    got_q, got_k = spyre_apply_rotary_pos_emb(q, k, *spyre(x, positions, layer_type))
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=2e-6)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=2e-6)


@pytest.mark.parametrize("gemma", [False, True], ids=["rms", "gemma"])
def test_backend_norm_over_padded_heads_equals_the_unpadded_norm(vllm_env, gemma) -> None:
    """The backend's TP-aware norms take the Spyre bodies: a K norm over a whole
    projection (OLMo 2, FlexOlmo) of two 32-wide heads, built at the padded 2 x 64,
    loads the checkpoint's 64 weights and normalises over the 64 real lanes."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from vllm.model_executor.models.transformers.fusers.rms_norm import (
        TPAwareGemmaRMSNorm,
        TPAwareRMSNorm,
    )

    from spyre_inference.models import backend_norms
    from spyre_inference.ops.stick_pad_load import pad_heads
    from spyre_inference.platform.stick_pad import PLAN_KEY, StickPadPlan

    pad = DimPad(32, 64)
    upstream, spyre = (
        (TPAwareGemmaRMSNorm, backend_norms.SpyreTPAwareGemmaRMSNorm)
        if gemma
        else (TPAwareRMSNorm, backend_norms.SpyreTPAwareRMSNorm)
    )
    g = torch.Generator().manual_seed(0)
    weight = torch.rand(2 * pad.original, generator=g) - 0.5
    x = torch.randn(5, 2 * pad.original, generator=g)
    vllm_env.additional_config[PLAN_KEY] = StickPadPlan(pad).to_dict()
    try:
        norm = upstream(hidden_size=2 * pad.padded, eps=1e-6)
    finally:
        del vllm_env.additional_config[PLAN_KEY]
    assert type(norm) is spyre
    norm.weight.weight_loader(norm.weight, weight)
    # Hugging Face's norms on the unpadded projection are the reference.
    reference = (GemmaRMSNorm if gemma else Olmo2RMSNorm)(2 * pad.original, eps=1e-6)
    with torch.no_grad():
        reference.weight.copy_(weight)
        want = reference(x)
    torch.testing.assert_close(norm(pad_heads(x, 1, pad)), pad_heads(want, 1, pad))


def test_padded_head_keeps_original_frequencies() -> None:
    """With head_dim 32 widened to 64 the rotation of the real entries is HF's at 32."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hf_small = _hf_rotary(head_dim=32)
    hf_padded = _hf_rotary(head_dim=64)  # what the widened config builds
    pad = DimPad(32, 64)
    cache, _ = build_rotation_cache(hf_padded, MAX_POS, torch.float32, pad)
    spyre = SpyreHFRotaryEmbedding(cache, "x")
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 9, 32, generator=gen)
    positions = torch.arange(100, 109)[None]
    want, _ = apply_rotary_pos_emb(q, q, *hf_small(torch.zeros(1, 9, 8), positions))

    def widen(t):  # [x1, x2] -> [x1, 0, x2, 0], as the QKV loader pads
        x1, x2 = t.chunk(2, -1)
        z = torch.zeros_like(x1)
        return torch.cat((x1, z, x2, z), -1)

    got, _ = spyre_apply_rotary_pos_emb(widen(q), widen(q), *spyre(torch.zeros(1, 9, 8), positions))
    torch.testing.assert_close(got, widen(want), rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_partial_rope_matches_hf_gpt_neox(dtype) -> None:
    """GPT-NeoX (Pythia) rotates its leading rotary_pct of each head: the pair form,
    against transformers' own GPT-NeoX rotary and apply."""
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import (
        GPTNeoXRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    config = GPTNeoXConfig(hidden_size=256, num_attention_heads=4, rotary_pct=0.25)
    hf = GPTNeoXRotaryEmbedding(config)
    cache, partner = build_rotation_cache(hf, MAX_POS, dtype, None, 64)
    assert partner is not None and cache.shape == (MAX_POS, 2, 64)
    spyre = SpyreHFRotaryEmbedding(cache, "x", partner)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 21, 64, generator=gen).to(dtype)
    positions = torch.randint(0, MAX_POS, (1, 21), generator=gen)
    x = torch.zeros(1, 21, 256, dtype=dtype)
    want, _ = apply_rotary_pos_emb(q, q, *hf(x, positions))
    got, _ = spyre_apply_rotary_pos_emb(q, q, *spyre(x, positions))
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(got[..., 16:], q[..., 16:])


def test_dynamic_rope_is_refused() -> None:
    hf = _hf_rotary(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(NotImplementedError, match="dynamic"):
        build_rotation_cache(hf, MAX_POS, torch.float32, None)


def _inspect(model):
    attn_applies = sorted(
        {
            module.forward.__func__.__globals__["apply_rotary_pos_emb"].__name__
            for module in model.modules()
            if hasattr(module, "attn") and hasattr(module.forward, "__func__")
        }
    )
    return {
        "model": type(model).__name__,
        "classes": sorted({type(m).__name__ for m in model.modules()}),
        "applies": attn_applies,
        "num_attn": sum(1 for m in model.modules() if type(m).__name__ == "LlamaAttention"),
    }


MAX_TOKENS = 16
PROMPTS = TEST_PROMPTS[:6]


def test_tiny_llama_transformers_backend_equals_hf(tiny_llama, make_llm) -> None:
    """Eager; the backend's compiled blocks are the Arcee and GPT-NeoX cases below."""
    want = hf_greedy(tiny_llama, PROMPTS, MAX_TOKENS, "float32")
    llm = make_llm(tiny_llama, dtype="float32", model_impl="transformers", enforce_eager=True)
    (info,) = llm.apply_model(_inspect)
    assert info["model"] == "SpyreTransformersForCausalLM"
    assert "SpyreHFRotaryEmbedding" in info["classes"]
    assert "LlamaRotaryEmbedding" not in info["classes"]
    assert info["num_attn"] == 2 and info["applies"] == ["spyre_apply_rotary_pos_emb"]
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(list(PROMPTS), params)]
    mismatches = {i: (w, g) for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w}
    assert not mismatches


# ---- architectures vLLM lists under their own names ----------------------------


def _tiny_checkpoint(out_dir, model_type: str, **fields):
    """A tiny random checkpoint of ``model_type`` with head_dim 32 (the platform pads it to 64),
    unless ``fields`` say otherwise (a field given as None is left out)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from spyre_inference.testing import (
        BOS_TOKEN_ID,
        EOS_TOKEN_ID,
        PAD_TOKEN_ID,
        VOCAB_SIZE,
        save_tokenizer,
    )

    fields = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": MAX_POS,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        **fields,
    }
    # None drops a field the model type does not have (GPT-NeoX has no GQA field,
    # and vLLM would read a stray num_key_value_heads as one).
    config = AutoConfig.for_model(
        model_type, **{name: value for name, value in fields.items() if value is not None}
    )
    gen = torch.Generator().manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    model.save_pretrained(out_dir)
    save_tokenizer(out_dir, "decoder", model_max_length=MAX_POS)
    return out_dir


def _classes(model) -> dict:
    return {
        "model": type(model).__name__,
        "classes": sorted({type(m).__name__ for m in model.modules()}),
    }


@pytest.mark.parametrize(
    ("model_type", "fields", "spyre_class", "eager"),
    # One compiled, one eager: the class resolution and the rotary are the same in both.
    [
        ("arcee", {}, "SpyreTransformersForCausalLM", False),
        # FlexOlmo: vLLM's MoE backend class, and Q/K norms over the whole projection
        # (the backend's TP-aware norm, swapped by name) on the padded heads.
        (
            "flex_olmo",
            {"num_experts": 4, "num_experts_per_tok": 2},
            "SpyreTransformersMoEForCausalLM",
            True,
        ),
        # HunYuan MoE: vLLM routes with the HF gate itself (external routing), which
        # the Spyre MoE method calls on the cpu target.
        (
            "hunyuan_v1_moe",
            {"num_experts": 4, "moe_topk": 2, "head_dim": 32},
            "SpyreTransformersMoEForCausalLM",
            True,
        ),
        # GPT-BigCode (StarCoder 1): learned absolute positions, no RoPE to replace;
        # its attention sizes heads from n_embd, so a 64-wide head (no padding).
        (
            "gpt_bigcode",
            {
                "n_embd": 256,
                "n_head": 4,
                "n_layer": 2,
                "n_positions": MAX_POS,
                "hidden_size": None,
                "num_attention_heads": None,
                "num_hidden_layers": None,
                "num_key_value_heads": None,
                "max_position_embeddings": None,
                "intermediate_size": None,
            },
            "SpyreTransformersForCausalLM",
            True,
        ),
        # OLMo 3: one rotary frequency set per layer type (forward(x, position_ids,
        # layer_type)), here with different thetas, on sliding and full layers.
        (
            "olmo3",
            {
                "num_hidden_layers": 4,
                "sliding_window": 16,
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                },
            },
            "SpyreTransformersForCausalLM",
            True,
        ),
    ],
    ids=["arcee", "flex_olmo", "hunyuan_moe", "gpt_bigcode", "olmo3"],
)
def test_backend_architecture_listed_by_name_with_a_padded_head_equals_hf(
    tmp_path, make_llm, model_type, fields, spyre_class, eager
) -> None:
    """vLLM 0.33 maps Arcee, OLMo, OLMo 2, SmolLM3, FlexOlmo, ... to its Transformers
    classes under their own names. Built as vLLM's class they kept HF's rotary at the
    padded width and decoded wrong tokens (Arcee 0 of 4 prompts equal, OLMo 1 of 4);
    each must be a Spyre class. FlexOlmo was refused at start-up before (vLLM's MoE
    backend class was not adapted), and its Q/K norms failed to load on a padded head."""
    model = _tiny_checkpoint(tmp_path / model_type, model_type, **fields)
    want = hf_greedy(model, PROMPTS, MAX_TOKENS, "float32")
    llm = make_llm(model, dtype="float32", max_model_len=MAX_POS, enforce_eager=eager)
    (info,) = llm.apply_model(_classes)
    assert info["model"] == spyre_class
    assert ("SpyreHFRotaryEmbedding" in info["classes"]) == (model_type != "gpt_bigcode")
    if model_type == "olmo3":
        assert "SpyreHFLayerTypeRotaryEmbedding" in info["classes"]
    assert not [c for c in info["classes"] if c.endswith("RotaryEmbedding") and "Spyre" not in c]
    assert "TPAwareRMSNorm" not in info["classes"]
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(list(PROMPTS), params)]
    mismatches = {i: (w, g) for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w}
    assert not mismatches


@pytest.mark.parametrize(
    ("model_type", "fields", "eager"),
    [
        # Pythia: GPT-NeoX rotates a quarter of each 64-wide head (rotary_pct).
        ("gpt_neox", {"hidden_size": 256, "rotary_pct": 0.25, "num_key_value_heads": None}, False),
        # Phi-2's shape: 32 of each 80-wide head rotate; the platform widens the head
        # to 128 and pins the share, and Phi's attention slices it off itself.
        (
            "phi",
            {"hidden_size": 320, "partial_rotary_factor": 0.4, "num_key_value_heads": None},
            True,
        ),
    ],
    ids=["gpt_neox", "phi"],
)
def test_partial_rope_model_through_the_backend_equals_hf(
    tmp_path, make_llm, model_type, fields, eager
) -> None:
    """vLLM 0.33 has no native GPT-NeoX or Phi: its Transformers backend builds them,
    and the Spyre class rotates their partial RoPE in the pair form (Phi's on a
    stick-padded head; refused at start-up before)."""
    model = _tiny_checkpoint(tmp_path / model_type, model_type, **fields)
    want = hf_greedy(model, PROMPTS, MAX_TOKENS, "float32")
    llm = make_llm(model, dtype="float32", max_model_len=MAX_POS, enforce_eager=eager)
    (info,) = llm.apply_model(_classes)
    assert info["model"] == "SpyreTransformersForCausalLM"
    assert "SpyreHFRotaryEmbedding" in info["classes"]
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(list(PROMPTS), params)]
    assert got == want


#: Text generators vLLM would build through its Transformers backend that the Spyre
#: class cannot serve: (model type, config fields, what the start-up error says).
_REFUSED_BACKEND_MODELS = {
    # GPT-BigCode sizes heads from n_embd / n_head: a 32-wide head cannot be widened.
    "no-rope-head-sized-by-the-model": (
        "gpt_bigcode",
        dict(
            n_embd=128,
            n_head=4,
            n_layer=2,
            n_positions=512,
            architectures=["GPTBigCodeForCausalLM"],
        ),
        r"gpt_bigcode attention sizes its heads itself \(32\)",
    ),
    # Bamba (Mamba2 + attention) resolves to the Transformers backend in vLLM 0.33,
    # whose model build fails on a layer outside its attention interface.
    "non-attention-layers": (
        "bamba",
        dict(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_layer_indices=[1],
            mamba_n_heads=8,
            mamba_d_head=64,
            architectures=["BambaForCausalLM"],
        ),
        r"BambaForCausalLM .*has linear_attention layers \(layer_types",
    ),
    # GPT-NeoX sizes heads from hidden_size / heads, not config.head_dim: an 80-wide
    # head (Pythia-2.8B) cannot be widened; it died tracing the model before.
    "head-sized-by-the-model": (
        "gpt_neox",
        dict(
            hidden_size=320,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            rotary_pct=1.0,
            architectures=["GPTNeoXForCausalLM"],
        ),
        r"gpt_neox attention sizes its heads itself \(80\).*multiple of 64",
    ),
    # Phi slices the rotary share off the head itself: past the first half of the
    # original head, the padded layout would hand it zeros.
    "partial-share-past-half-a-padded-head": (
        "phi",
        dict(
            hidden_size=320,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            partial_rotary_factor=0.75,
            architectures=["PhiForCausalLM"],
        ),
        r"rotates 60 of each 80-wide head, more than half",
    ),
}


@pytest.mark.parametrize(
    ("model_type", "fields", "expected"),
    list(_REFUSED_BACKEND_MODELS.values()),
    ids=list(_REFUSED_BACKEND_MODELS),
)
def test_backend_model_the_spyre_class_cannot_serve_is_refused_at_start_up(
    tmp_path, model_type, fields, expected
) -> None:
    from transformers import AutoConfig
    from vllm.engine.arg_utils import EngineArgs

    from spyre_inference.testing.models import save_config_only

    model = save_config_only(AutoConfig.for_model(model_type, vocab_size=1024, **fields), tmp_path)
    # vLLM re-raises the check's error as its config's ValidationError (a ValueError).
    with pytest.raises(ValueError, match=expected):
        EngineArgs(model=str(model), max_model_len=256).create_engine_config()
