"""End to end: head_dim 32 and intermediate_size 344 are stick-padded and still exact.

Qwen3 adds per-head q/k norms on the padded heads (``ops.head_norm``).

Tiny Llama (``head_dim=32``: its scale is derived from head_dim, so the
attention backend must keep ``32 ** -0.5``) and Granite (head size
``hidden / heads = 32``, scale from ``attention_multiplier``), both with
``intermediate_size=344``, served in float32 by ``vllm.LLM``: the loaded model
is built at head 64 / intermediate 384 (the platform widened the config) and
its greedy tokens equal Hugging Face's on the unpadded checkpoint.

Needs the platform to call ``spyre_inference.platform.stick_pad.widen_config``
in ``check_and_update_config`` and the attention backend to apply
``stick_pad.attention_scale``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("spyre_inference.testing")

from ops_engine_util import assert_all_swapped, greedy, module_classes

from spyre_inference.platform.stick_pad import PLAN_KEY, DimPad, StickPadPlan
from spyre_inference.testing import TEST_PROMPTS, hf_greedy

MAX_TOKENS = 16
PROMPTS = TEST_PROMPTS[:6]
OVERRIDES = {
    "llama": {"head_dim": 32, "intermediate_size": 344},
    # Granite has no head_dim field: 256 / 8 heads = 32.
    "granite": {"num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 344},
    # Qwen3 normalizes each Q/K head (q_norm/k_norm) before RoPE: the per-head
    # norm must load its 32-wide weight into the padded head and average over 32.
    "qwen3": {"head_dim": 32, "intermediate_size": 344},
}


@pytest.mark.parametrize("kind", ["llama", "granite", "qwen3"])
def test_padded_model_greedy_equals_hf(kind, tiny_model_factory, make_llm):
    model = tiny_model_factory(kind, **OVERRIDES[kind])
    llm = make_llm(model, dtype="float32", enforce_eager=True)
    assert_all_swapped(module_classes(llm))
    (shapes,) = llm.apply_model(
        lambda m: {
            "qkv": tuple(m.model.layers[0].self_attn.qkv_proj.weight.shape),
            "o": tuple(m.model.layers[0].self_attn.o_proj.weight.shape),
            "gate_up": tuple(m.model.layers[0].mlp.gate_up_proj.weight.shape),
            "down": tuple(m.model.layers[0].mlp.down_proj.weight.shape),
            "head_size": m.model.layers[0].self_attn.attn.head_size,
        }
    )
    heads, kv_heads = (8, 2) if kind == "granite" else (4, 2)
    assert shapes == {
        "qkv": (256, (heads + 2 * kv_heads) * 64),
        "o": (heads * 64, 256),
        "gate_up": (256, 2 * 384),
        "down": (384, 256),
        "head_size": 64,
    }, "the platform did not widen the config (stick_pad.widen_config)"
    got = greedy(llm, PROMPTS, MAX_TOKENS)
    want = hf_greedy(model, PROMPTS, MAX_TOKENS, "float32")
    mismatches = {i: (w, g) for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w}
    assert not mismatches


def test_padded_granite_with_explicit_plan(tiny_model_factory, make_llm):
    """The padded engine path with the widened config given explicitly.

    ``hf_overrides`` + ``additional_config`` are exactly what
    ``stick_pad.widen_config`` writes (it leaves an existing plan alone), so
    this runs the padded loaders, RoPE, KV cache and MLP end to end whether or
    not the platform widens by itself. Granite's scale comes from its
    ``attention_multiplier``, so no attention-scale correction is involved.
    """
    model = tiny_model_factory("granite", **OVERRIDES["granite"])
    plan = StickPadPlan(DimPad(32, 64), DimPad(344, 384))
    llm = make_llm(
        model,
        dtype="float32",
        enforce_eager=True,
        hf_overrides={"head_dim": 64, "intermediate_size": 384},
        additional_config={PLAN_KEY: plan.to_dict()},
    )
    (qkv_shape,) = llm.apply_model(
        lambda m: tuple(m.model.layers[0].self_attn.qkv_proj.weight.shape)
    )
    assert qkv_shape == (256, (8 + 2 * 2) * 64)
    got = greedy(llm, PROMPTS, MAX_TOKENS)
    assert got == hf_greedy(model, PROMPTS, MAX_TOKENS, "float32")
