"""The Spyre RoPE (index_select + 2x2 rotation) against vLLM's own.

The rotation cache is built from upstream's own ``cos_sin_cache`` (same
frequencies, same dtype rounding), and the 2x2 form performs the same products
and sums as upstream's ``x1*cos - x2*sin`` / ``x2*cos + x1*sin``; the results
are compared within 1e-6 in float32 and within bf16 tolerance in bfloat16
(rtol = atol = 1.6e-2; in practice they agree bit for bit, which is also
asserted on the default rope).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from ops_testutil import tol, upstream_layers

HEAD = 64
MAX_POS = 256


def _rope(cls_name, dtype, head=HEAD, rotary_dim=HEAD, neox=True, **kwargs):
    import vllm.model_executor.layers.rotary_embedding as rope

    return getattr(rope, cls_name)(head, rotary_dim, MAX_POS, 500000.0, neox, dtype, **kwargs)


LLAMA3 = {
    "scaling_factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "orig_max_position": 64,
}

#: rope_parameters (as in a checkpoint's config.json) -> the class get_rope builds.
#: Scaled tables are longer than MAX_POS where the variant tabulates
#: ``original_max_position * factor`` rows.
VARIANTS = {
    "default": ({"rope_type": "default"}, "RotaryEmbedding"),
    "llama3": (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "Llama3RotaryEmbedding",
    ),
    "yarn": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        "YaRNScalingRotaryEmbedding",
    ),
    "yarn_attention_factor": (
        {
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 16,
            "beta_slow": 2,
            "attention_factor": 1.3,
            "truncate": False,
        },
        "YaRNScalingRotaryEmbedding",
    ),
    "linear": ({"rope_type": "linear", "factor": 8.0}, "LinearScalingRotaryEmbedding"),
    "ntk": ({"rope_type": "ntk", "factor": 2.0, "mixed_b": 0.8}, "NTKScalingRotaryEmbedding"),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, "DynamicNTKScalingRotaryEmbedding"),
    # Gemma 4's global layers: a quarter of the pairs rotate, the rest are identity.
    "proportional": (
        {"rope_type": "proportional", "partial_rotary_factor": 0.25},
        "Gemma4RotaryEmbedding",
    ),
    "dynamic_alpha": (
        {"rope_type": "dynamic", "alpha": 1000.0},
        "DynamicNTKAlphaRotaryEmbedding",
    ),
}


def _get_rope(params, dtype, head=HEAD):
    """vLLM's get_rope on a cleared instance cache (it memoises by arguments)."""
    from vllm.model_executor.layers import rotary_embedding as rope

    rope._ROPE_DICT.clear()
    try:
        return rope.get_rope(head, MAX_POS, True, {"rope_theta": 500000.0, **params}, dtype)
    finally:
        rope._ROPE_DICT.clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_spyre_rope_matches_upstream(vllm_env, variant, dtype):
    from spyre_inference import ops

    params, cls_name = VARIANTS[variant]
    spyre = _get_rope(params, dtype)
    with upstream_layers():
        upstream = _get_rope(params, dtype)
    assert type(spyre) is getattr(ops, f"Spyre{cls_name}")
    assert type(upstream).__name__ == cls_name

    # Stored layout: [positions, 2, 2, rotary_dim // 2] rotation matrices, the
    # upstream table cut to max_model_len rows (positions never reach further).
    rows = upstream.cos_sin_cache.shape[0]
    if vllm_env.model_config is not None:
        rows = min(rows, vllm_env.model_config.max_model_len)
    assert spyre.rotation_cache.shape == (rows, 2, 2, HEAD // 2)
    assert spyre.rotation_cache.dtype == dtype
    assert torch.equal(spyre.cos_sin_cache, upstream.cos_sin_cache[:rows])
    cos, sin = upstream.cos_sin_cache[:rows].chunk(2, dim=-1)
    assert torch.equal(spyre.rotation_cache[:, 0, 0], cos)
    assert torch.equal(spyre.rotation_cache[:, 0, 1], -sin)
    assert torch.equal(spyre.rotation_cache[:, 1, 0], sin)
    assert torch.equal(spyre.rotation_cache[:, 1, 1], cos)

    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, rows, (9,), generator=g)
    q = torch.randn(9, 4 * HEAD, generator=g).to(dtype)
    k = torch.randn(9, 2 * HEAD, generator=g).to(dtype)
    out_q, out_k = spyre(positions, q.clone(), k.clone())
    ref_q, ref_k = upstream.forward_native(positions, q.clone(), k.clone())
    assert out_q.shape == q.shape and out_k.shape == k.shape
    torch.testing.assert_close(out_q, ref_q, **tol(dtype))
    torch.testing.assert_close(out_k, ref_k, **tol(dtype))
    if variant == "default":
        assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)

    # Head-shaped query, no key (cross-layer KV sharing).
    q3 = q.view(9, 4, HEAD)
    out3, none = spyre(positions, q3)
    assert none is None and out3.shape == q3.shape
    torch.testing.assert_close(out3.reshape(9, -1), out_q, rtol=0, atol=0)


def test_yarn_table_carries_the_magnitude_factor(vllm_env):
    """YaRN scales cos and sin by mscale (0.1 ln(factor) + 1); the rotation keeps it."""
    import math

    params, _ = VARIANTS["yarn"]
    spyre = _get_rope(params, torch.float32)
    mscale = 0.1 * math.log(params["factor"]) + 1.0
    row = spyre.rotation_cache[0]  # position 0: cos = mscale, sin = 0
    torch.testing.assert_close(row[0, 0], torch.full((HEAD // 2,), mscale))
    torch.testing.assert_close(row[1, 0], torch.zeros(HEAD // 2))


def test_rope_forward_is_spyre_body_under_custom_ops_none(vllm_env):
    """vLLM's default custom_ops under Inductor is 'none'; the Spyre body still runs."""
    assert "none" in vllm_env.compilation_config.custom_ops
    spyre = _rope("RotaryEmbedding", torch.float32)
    assert spyre._forward_method == spyre.forward_oot


@pytest.mark.parametrize(
    ("rotary_dim", "neox"), [(HEAD, True), (HEAD // 2, False)], ids=["2x2", "pair_form"]
)
def test_rope_traces_into_one_graph(vllm_env, rotary_dim, neox):
    """No graph break: the gather and rotation are traced, not opaque (both forms)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    spyre = _rope("RotaryEmbedding", torch.float32, rotary_dim=rotary_dim, neox=neox)
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(spyre, backend=counter, fullgraph=True, dynamic=False)
    positions = torch.arange(4)
    q, k = torch.randn(4, 2 * HEAD), torch.randn(4, HEAD)
    out_q, out_k = compiled(positions, q, k)
    ref_q, ref_k = spyre(positions, q, k)
    assert counter.frame_count == 1
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    ops = {str(node.target) for gm in counter.graphs for node in gm.graph.nodes}
    assert any("index_select" in op for op in ops)


#: (rotary_dim, is_neox_style) of the pair form: partial neox (StableLM, Phi-4-mini),
#: full interleaved (Command-R, GLM-4), partial interleaved (GPT-J).
PAIR_FORMS = {
    "partial_neox": (HEAD // 4, True),
    "interleaved": (HEAD, False),
    "partial_interleaved": (HEAD // 2, False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("form", sorted(PAIR_FORMS))
@pytest.mark.parametrize("cls_name", ["RotaryEmbedding", "Llama3RotaryEmbedding"])
def test_pair_form_matches_upstream(vllm_env, cls_name, form, dtype):
    """Partial and interleaved RoPE: bit for bit upstream's forward_native."""
    rotary_dim, neox = PAIR_FORMS[form]
    kwargs = LLAMA3 if cls_name == "Llama3RotaryEmbedding" else {}
    spyre = _rope(cls_name, dtype, rotary_dim=rotary_dim, neox=neox, **kwargs)
    with upstream_layers():
        upstream = _rope(cls_name, dtype, rotary_dim=rotary_dim, neox=neox, **kwargs)
    assert type(spyre).__name__ == f"Spyre{cls_name}"
    assert type(upstream).__name__ == cls_name
    # Whole-head tables and a [head, head] permutation: nothing at the rotary width.
    assert spyre.rotation_cache.shape == (spyre.cos_sin_cache.shape[0], 2, HEAD)
    assert spyre.partner.shape == (HEAD, HEAD)
    assert torch.equal(spyre.partner.sum(0), torch.ones(HEAD, dtype=dtype))

    g = torch.Generator().manual_seed(1)
    positions = torch.randint(0, MAX_POS, (7,), generator=g)
    q = torch.randn(7, 4 * HEAD, generator=g).to(dtype)
    k = torch.randn(7, 2 * HEAD, generator=g).to(dtype)
    out_q, out_k = spyre(positions, q.clone(), k.clone())
    ref_q, ref_k = upstream.forward_native(positions, q.clone(), k.clone())
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    # The entries past the rotary width pass through unchanged.
    heads = out_q.view(7, 4, HEAD)[..., rotary_dim:]
    assert torch.equal(heads, q.view(7, 4, HEAD)[..., rotary_dim:])


def test_style_set_after_construction_rebuilds_the_cache(vllm_env):
    """vLLM's Ernie 4.5 flips a built Llama RoPE to ``is_neox_style = False``."""
    spyre = _rope("RotaryEmbedding", torch.float32)
    assert spyre.partner is None
    spyre.is_neox_style = False
    with upstream_layers():
        upstream = _rope("RotaryEmbedding", torch.float32, neox=False)
    assert spyre.partner is not None and spyre.rotation_cache.shape[-1] == HEAD
    positions = torch.arange(5) * 7
    q, k = torch.randn(5, 2 * HEAD), torch.randn(5, HEAD)
    out_q, out_k = spyre(positions, q.clone(), k.clone())
    ref_q, ref_k = upstream.forward_native(positions, q.clone(), k.clone())
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)


def test_linear_scaling_with_several_factors_is_refused(vllm_env):
    import vllm.model_executor.layers.rotary_embedding as rope

    with pytest.raises(NotImplementedError, match="several scaling factors"):
        rope.LinearScalingRotaryEmbedding(HEAD, HEAD, 64, 1e4, True, [2.0, 4.0], torch.float32)


def test_get_rope_builds_spyre_class(vllm_env):
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from spyre_inference import ops

    rope = get_rope(HEAD, MAX_POS, True, {"rope_type": "default", "rope_theta": 1234.0})
    assert type(rope) is ops.SpyreRotaryEmbedding
    scaled = get_rope(
        HEAD,
        MAX_POS,
        True,
        {
            "rope_type": "llama3",
            "rope_theta": 1234.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    assert type(scaled) is ops.SpyreLlama3RotaryEmbedding


#: Longrope (Phi-3): one short and one long factor per frequency of the 64-wide head.
LONGROPE_ORIGINAL = 64
LONGROPE_ARGS = {
    "short_factor": [1.0 + 0.03 * i for i in range(HEAD // 2)],
    "long_factor": [1.0 + 0.9 * i for i in range(HEAD // 2)],
}


@contextlib.contextmanager
def _engine_config(model, max_model_len):
    """A VllmConfig for ``model`` made current (longrope reads max_model_len from it)."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config

    config = VllmConfig(model_config=ModelConfig(str(model), max_model_len=max_model_len))
    with set_current_vllm_config(config):
        yield config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("max_model_len", [48, MAX_POS], ids=["short_factors", "long_factors"])
def test_longrope_matches_upstream(vllm_env, tiny_model_factory, max_model_len, dtype):
    """The built-module swap and a directly built Spyre longrope both equal vLLM's layer."""
    from vllm.model_executor.layers.rotary_embedding.phi3_long_rope_scaled_rope import (
        Phi3LongRoPEScaledRotaryEmbedding,
    )

    from spyre_inference.ops import SpyrePhi3LongRoPEScaledRotaryEmbedding as Spyre

    args = (HEAD, HEAD, 2 * MAX_POS, LONGROPE_ORIGINAL, 10000.0, True, dtype)
    with _engine_config(tiny_model_factory("llama"), max_model_len):
        upstream = Phi3LongRoPEScaledRotaryEmbedding(*args, **LONGROPE_ARGS)
        direct = Spyre(*args, **LONGROPE_ARGS)
        swapped = Spyre.from_upstream(upstream)
    assert upstream.use_long_rope is (max_model_len > LONGROPE_ORIGINAL)
    for spyre in (direct, swapped):
        assert spyre.use_long_rope is upstream.use_long_rope
        assert spyre.rotation_cache.shape == (max_model_len, 2, 2, HEAD // 2)
        assert "long_short_cos_sin_cache" not in dict(spyre.named_buffers())
    assert torch.equal(direct.rotation_cache, swapped.rotation_cache)

    g = torch.Generator().manual_seed(1)
    positions = torch.randint(0, max_model_len, (11,), generator=g)
    q = torch.randn(11, 4 * HEAD, generator=g).to(dtype)
    k = torch.randn(11, 2 * HEAD, generator=g).to(dtype)
    ref_q, ref_k = upstream(positions, q.clone(), k.clone())
    out_q, out_k = swapped(positions, q.clone(), k.clone())
    torch.testing.assert_close(out_q, ref_q, **tol(dtype))
    torch.testing.assert_close(out_k, ref_k, **tol(dtype))


def test_built_module_swap_keeps_shared_instances_shared(vllm_env, tiny_model_factory):
    """get_rope shares one RoPE module between layers; the swap keeps one replacement."""
    from torch import nn
    from vllm.model_executor.layers.rotary_embedding.phi3_long_rope_scaled_rope import (
        Phi3LongRoPEScaledRotaryEmbedding,
    )

    from spyre_inference.ops import SpyrePhi3LongRoPEScaledRotaryEmbedding as Spyre
    from spyre_inference.platform.layer_swaps import swap_built_modules

    args = (HEAD, HEAD, 2 * MAX_POS, LONGROPE_ORIGINAL, 10000.0, True, torch.float32)
    with _engine_config(tiny_model_factory("llama"), MAX_POS):
        shared = Phi3LongRoPEScaledRotaryEmbedding(*args, **LONGROPE_ARGS)
        layers = nn.ModuleList(nn.Module() for _ in range(3))
        for layer in layers:
            layer.rotary_emb = shared
        model = nn.Sequential(layers)
        replaced = swap_built_modules(model)
        assert swap_built_modules(model) == {}  # idempotent
    assert sorted(replaced) == [f"0.{i}.rotary_emb" for i in range(3)]
    swapped = {id(layer.rotary_emb) for layer in layers}
    assert len(swapped) == 1 and type(layers[0].rotary_emb) is Spyre
