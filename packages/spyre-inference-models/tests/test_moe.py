"""The Spyre MoE backend against Hugging Face's expert code, layer by layer and end to end.

Layer level (float32): the host routing equals HF's Mixtral/Qwen3-MoE top-k
routers, and both expert forms over the re-laid-out (and stick-widened)
weights equal HF's ``MixtralExperts`` on the same weights and routing.

Engine level: tiny Mixtral and Qwen3-MoE greedy output equals HF exactly in
float32; with one sequence, every decode step runs the gathered form and every
prefill chunk the all-expert form (read from the layers' form counters), also
compiled, where the decode step is padded to a token bucket and only the real
row is gathered; and a Qwen3-MoE whose expert width (96) is not a whole
number of sticks (as a tensor-parallel shard can be) equals HF too.
"""

from __future__ import annotations

import math

import pytest
import torch

from spyre_inference.models.moe import (
    ALL_EXPERT,
    GATHERED,
    MoeRecipe,
    all_expert_experts,
    gathered_experts,
    relayout_expert_weights,
    route,
    swiglu_oai,
)
from spyre_inference.testing import TEST_PROMPTS, hf_greedy, tiny_config

E, K, H = 4, 2, 128


def _hf_moe(kind: str, intermediate: int, seed: int = 0):
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    overrides = dict(hidden_size=H, num_attention_heads=2, num_key_value_heads=1)
    if kind == "mixtral":
        config = tiny_config("mixtral", intermediate_size=intermediate, **overrides)
        router = MixtralTopKRouter(config)
    else:
        config = tiny_config("qwen3_moe", moe_intermediate_size=intermediate, **overrides)
        router = Qwen3MoeTopKRouter(config)
    config.intermediate_size = intermediate  # MixtralExperts reads this name
    experts = MixtralExperts(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (router.weight, experts.gate_up_proj, experts.down_proj):
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return router, experts


class _Stacks(torch.nn.Module):
    """Holds vLLM-layout stacks (w13 [E, 2M, H], w2 [E, H, M], optional biases
    w13_bias [E, 2M], w2_bias [E, H]) like a RoutedExperts."""

    def __init__(self, w13, w2, b13=None, b2=None) -> None:
        super().__init__()
        self.w13_weight = torch.nn.Parameter(w13.clone(), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(w2.clone(), requires_grad=False)
        if b13 is not None:
            self.w13_bias = torch.nn.Parameter(b13.clone(), requires_grad=False)
            self.w2_bias = torch.nn.Parameter(b2.clone(), requires_grad=False)


def _silu_glu(gate, up):
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_route_equals_hf_router(kind) -> None:
    router, _ = _hf_moe(kind, 64)
    x = torch.randn(11, H, generator=torch.Generator().manual_seed(1))
    logits, want_w, want_ids = router(x)
    got_w, got_ids = route(logits, K, MoeRecipe())
    torch.testing.assert_close(got_ids, want_ids.to(torch.int64), rtol=0, atol=0)
    torch.testing.assert_close(got_w, want_w.float(), rtol=0, atol=1e-7)


@pytest.mark.parametrize("intermediate", [64, 96], ids=["whole-sticks", "mid-stick"])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_both_forms_equal_hf_experts(intermediate, tokens) -> None:
    router, experts = _hf_moe("mixtral", intermediate)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, hf_w, hf_ids = router(x)
        want = experts(x, hf_ids, hf_w)
    # vLLM's stacks: w13 = [gate; up] rows per expert, w2 = down.
    layer = _Stacks(experts.gate_up_proj.data, experts.down_proj.data)
    width = relayout_expert_weights(layer, intermediate)
    assert width == 64 * math.ceil(intermediate / 64)
    assert layer.w13_weight.shape == (E, H, 2 * width)
    assert layer.w2_weight.shape == (E, width, H)
    # The widened columns/rows are zero.
    assert not layer.w13_weight[:, :, intermediate:width].any()
    assert not layer.w2_weight[:, intermediate:, :].any()

    weights, ids = route(logits, K, MoeRecipe())
    got_g = gathered_experts(x, weights, ids, layer.w13_weight, layer.w2_weight, _silu_glu)
    combine = torch.zeros(tokens, E).scatter_(1, ids, weights)
    got_a = all_expert_experts(x, combine, layer.w13_weight, layer.w2_weight, _silu_glu)
    torch.testing.assert_close(got_g, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_a, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("intermediate", [64, 96], ids=["whole-sticks", "mid-stick"])
@pytest.mark.parametrize("tokens", [1, 17])
def test_gpt_oss_experts_equal_hf(intermediate, tokens) -> None:
    """gpt-oss: interleaved gate/up rows, expert biases and the clamped SwiGLU, in both
    forms, against transformers' GptOssExperts and router on the same weights."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

    config = tiny_config(
        "gpt_oss", hidden_size=H, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=intermediate, num_local_experts=E, num_experts_per_tok=K,
    )  # fmt: skip
    router, experts = GptOssTopKRouter(config), GptOssExperts(config)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in (router.weight, experts.gate_up_proj, experts.down_proj):
            p.copy_(
                torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-2 if p.ndim == 3 else -1])
            )
        # Gains that push some gate/up values past the clamp limit (7).
        experts.gate_up_proj.mul_(6.0)
        for p in (router.bias, experts.gate_up_proj_bias, experts.down_proj_bias):
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits, hf_w, hf_ids = router(x)
        want = experts(x, hf_ids, hf_w)
        gate_up = x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    assert gate_up.abs().max() > 7.0  # the clamp is exercised
    # vLLM's loader gives w13 [E, 2M, H] with HF's interleaved rows, w2 [E, H, M].
    layer = _Stacks(
        experts.gate_up_proj.data.transpose(1, 2),
        experts.down_proj.data.transpose(1, 2),
        experts.gate_up_proj_bias.data,
        experts.down_proj_bias.data,
    )
    width = relayout_expert_weights(layer, intermediate, interleaved=True)
    assert layer.w13_bias.shape == (E, 2 * width)
    assert not layer.w13_bias[:, intermediate:width].any()
    weights, ids = route(logits, K, MoeRecipe())
    b13, b2 = layer.w13_bias, layer.w2_bias
    got_g = gathered_experts(
        x, weights, ids, layer.w13_weight, layer.w2_weight, swiglu_oai, b13, b2
    )
    combine = torch.zeros(tokens, E).scatter_(1, ids, weights)
    got_a = all_expert_experts(x, combine, layer.w13_weight, layer.w2_weight, swiglu_oai, b13, b2)
    torch.testing.assert_close(got_g, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got_a, want, rtol=1e-5, atol=1e-4)


def test_recipe_expert_scale_and_sigmoid() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5], [3.0, 0.0, 0.2, 0.1]])
    scale = torch.tensor([1.0, 2.0, 3.0, 4.0])
    w, _ = route(logits, 2, MoeRecipe(expert_scale=lambda: scale))
    probs = torch.softmax(logits, -1)
    top, top_ids = probs.topk(2, -1)
    torch.testing.assert_close(w, top / top.sum(-1, keepdim=True) * scale[top_ids])
    w, _ = route(logits, 2, MoeRecipe(scoring="sigmoid", renormalize=False))
    torch.testing.assert_close(w, torch.sigmoid(logits).topk(2, -1).values)


# ---- engine ---------------------------------------------------------------


def _greedy(llm, prompts, max_tokens):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(list(prompts), params)]


def _moe_methods(model):
    from spyre_inference.models.moe import SpyreUnquantizedFusedMoEMethod

    return [m for m in model.modules() if isinstance(m, SpyreUnquantizedFusedMoEMethod)]


def _reset_counts(model):
    methods = _moe_methods(model)
    for method in methods:
        method.form_counts.clear()
    return len(methods)


def _read_counts(model):
    return [dict(method.form_counts) for method in _moe_methods(model)]


def _layer_shapes(model):
    return sorted(
        {
            (tuple(m.w13_weight.shape), tuple(m.w2_weight.shape))
            for m in model.modules()
            if hasattr(m, "w13_weight")
        }
    )


MAX_TOKENS = 16
PROMPTS = TEST_PROMPTS[:6]


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_moe_greedy_equals_hf(kind, tiny_model_factory, make_llm) -> None:
    model = tiny_model_factory(kind)
    want = hf_greedy(model, PROMPTS, MAX_TOKENS, "float32")
    llm = make_llm(model, dtype="float32", enforce_eager=True)
    got = _greedy(llm, PROMPTS, MAX_TOKENS)
    mismatches = {i: (w, g) for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w}
    assert not mismatches


@pytest.mark.parametrize(
    "kind,eager",
    [("mixtral", True), ("qwen3_moe", True), ("mixtral", False)],
    ids=["mixtral-eager", "qwen3_moe-eager", "mixtral-compiled"],
)
def test_decode_gathered_prefill_all_expert(kind, eager, tiny_model_factory, make_llm) -> None:
    model = tiny_model_factory(kind)
    prompt = TEST_PROMPTS[-1]  # the longest prompt: several 128-token prefill chunks
    (want,) = hf_greedy(model, [prompt], MAX_TOKENS, "float32")
    llm = make_llm(model, dtype="float32", enforce_eager=eager, max_num_seqs=1)
    (num_layers,) = llm.apply_model(_reset_counts)
    assert num_layers == 2
    (got,) = _greedy(llm, [prompt], MAX_TOKENS)
    assert got == want
    prompt_len = len(llm.get_tokenizer()(prompt).input_ids)
    chunks = -(-prompt_len // 128)
    assert chunks >= 2, prompt_len
    (counts,) = llm.apply_model(_read_counts)
    # Each prefill chunk is one all-expert pass; each of the MAX_TOKENS - 1
    # decode steps (the last token needs no forward) one gathered pass.
    assert counts == [{ALL_EXPERT: chunks, GATHERED: MAX_TOKENS - 1}] * num_layers


def test_mid_stick_expert_width_equals_hf(tiny_model_factory, make_llm) -> None:
    model = tiny_model_factory("qwen3_moe", moe_intermediate_size=96)
    want = hf_greedy(model, PROMPTS, MAX_TOKENS, "float32")
    llm = make_llm(model, dtype="float32", enforce_eager=True)
    (shapes,) = llm.apply_model(_layer_shapes)
    # M = 96 widened to 128 (the engine returns the tuples as lists).
    assert [tuple(map(tuple, pair)) for pair in shapes] == [((4, 256, 256), (4, 128, 256))]
    got = _greedy(llm, PROMPTS, MAX_TOKENS)
    mismatches = {i: (w, g) for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w}
    assert not mismatches


# ---- Gemma 4: a model-owned routing recipe -------------------------------------


def test_model_routing_function_is_the_recipe_on_the_cpu_target() -> None:
    """vLLM's Transformers MoE backend routes some models with the HF gate (a
    ``custom_routing_function``); on the cpu target the recipe calls it as is."""
    from types import SimpleNamespace

    from spyre_inference.models.moe import default_recipe

    def gate(hidden_states, gating_output, topk, renormalize):
        return gating_output.topk(topk, dim=-1)

    layer = SimpleNamespace(layer_name="experts", custom_routing_function=gate)
    assert default_recipe(layer) == MoeRecipe(external=gate)


def test_gemma4_recipe_routes_like_vllms_gemma4_function() -> None:
    from vllm.model_executor.models.gemma4 import gemma4_routing_function_torch

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 8, generator=gen)
    per_expert_scale = torch.linspace(0.5, 2.0, 8)
    want_w, want_ids = gemma4_routing_function_torch(logits, 2, per_expert_scale)
    recipe = MoeRecipe(scoring="softmax", renormalize=True, expert_scale=lambda: per_expert_scale)
    got_w, got_ids = route(logits, 2, recipe)
    torch.testing.assert_close(got_ids, want_ids.to(torch.int64), rtol=0, atol=0)
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=1e-6)


def _build_tiny_gemma4_moe(out_dir):
    """A 2-layer Gemma 4 text model with 4 experts (top-2) and a non-uniform per_expert_scale.

    Built like the core's tiny models (same seeded initialisation and test
    tokenizer); Gemma 4's per-layer-input embeddings are switched off; the
    global layers use Gemma 4's proportional RoPE (a quarter of the pairs
    rotate), through the ops package's Spyre swap.
    """
    import transformers
    from transformers import AutoConfig

    from spyre_inference.testing.models import TinyModelKind, init_weights_
    from spyre_inference.testing.tokenizer import (
        BOS_TOKEN_ID,
        EOS_TOKEN_ID,
        PAD_TOKEN_ID,
        VOCAB_SIZE,
        save_tokenizer,
    )

    config = AutoConfig.for_model(
        "gemma4_text",
        vocab_size=VOCAB_SIZE,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        global_head_dim=64,
        max_position_embeddings=1024,
        sliding_window=48,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            # Gemma 4's own global RoPE: a quarter of the pairs rotate.
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
            },
        },
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=VOCAB_SIZE,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=256,
        tie_word_embeddings=False,
        final_logit_softcapping=None,
    )
    config.architectures = ["Gemma4ForCausalLM"]
    spec = TinyModelKind("gemma4_text", "Gemma4ForCausalLM", "decoder", {})
    model = transformers.Gemma4ForCausalLM._from_config(config, dtype=torch.float32)
    init_weights_(model, config, spec, 0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("router.per_expert_scale"):
                param.copy_(torch.linspace(0.5, 2.0, param.numel()))
            elif name.endswith("router.scale"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
    model.to(torch.bfloat16).save_pretrained(out_dir)
    save_tokenizer(out_dir, "decoder", model_max_length=1024)
    return out_dir


def _gemma4_recipes(model):
    from spyre_inference.models.moe import RECIPE_ATTR

    recipes = [getattr(m, RECIPE_ATTR) for m in model.modules() if hasattr(m, RECIPE_ATTR)]
    return {
        "model": type(model).__name__,
        "recipes": len(recipes),
        "scales": [r.expert_scale().tolist() for r in recipes if r.expert_scale is not None],
        "ropes": sorted(
            {n for m in model.modules() if (n := type(m).__name__).endswith("RotaryEmbedding")}
        ),
    }


def test_gemma4_moe_greedy_equals_hf(tmp_path_factory, make_llm) -> None:
    model = _build_tiny_gemma4_moe(tmp_path_factory.mktemp("gemma4-moe"))
    want = hf_greedy(model, PROMPTS, MAX_TOKENS, "float32")
    llm = make_llm(model, dtype="float32", enforce_eager=True)
    (info,) = llm.apply_model(_gemma4_recipes)
    assert info["model"] == "SpyreGemma4ForCausalLM" and info["recipes"] == 2
    assert info["ropes"] == ["SpyreGemma4RotaryEmbedding", "SpyreRotaryEmbedding"]
    for scale in info["scales"]:
        assert scale == pytest.approx(torch.linspace(0.5, 2.0, 4).tolist(), abs=1e-6)
    got = _greedy(llm, PROMPTS, MAX_TOKENS)
    mismatches = {i: (w, g) for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w}
    assert not mismatches
