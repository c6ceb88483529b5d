"""Gemma 3 and Granite: greedy output equals Hugging Face (float32, exact).

Gemma 3 is vLLM's own class with the ops package's swaps; the tiny model here
is built both with plain RoPE (the fixture) and with the 4B/12B/27B models'
``linear`` x8 scaling on the full-attention layers, which the ops package's
``SpyreLinearScalingRotaryEmbedding`` computes. Granite needs no model-level adaptation: its four
multipliers are Python floats in vLLM's model (embedding, residual), the
attention scale, and the logits processor's scale; the test proves all four
reach the output (the fixture sets each away from 1).
"""

from __future__ import annotations

import pytest

from spyre_inference.testing import TEST_PROMPTS, hf_greedy

MAX_TOKENS = 16
PROMPTS = TEST_PROMPTS[:6]
GEMMA3_LINEAR_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
}


def _classes(model):
    return sorted({type(m).__name__ for m in model.modules()})


def _greedy(llm, prompts, max_tokens):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(list(prompts), params)]


def _assert_equal(got, want):
    mismatches = {i: (w, g) for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w}
    assert not mismatches


@pytest.mark.parametrize("linear_rope", [False, True], ids=["default-rope", "linear-rope"])
def test_gemma3_greedy_equals_hf(tiny_model_factory, make_llm, linear_rope) -> None:
    overrides = {"rope_parameters": GEMMA3_LINEAR_ROPE} if linear_rope else {}
    model = tiny_model_factory("gemma3", **overrides)
    want = hf_greedy(model, PROMPTS, MAX_TOKENS, "float32")
    llm = make_llm(model, dtype="float32", enforce_eager=True)
    (classes,) = llm.apply_model(_classes)
    assert "Gemma3ForCausalLM" in classes  # upstream's own class
    assert "LinearScalingRotaryEmbedding" not in classes
    assert ("SpyreLinearScalingRotaryEmbedding" in classes) == linear_rope
    assert "SpyreRotaryEmbedding" in classes  # the sliding layers' plain RoPE (ops swap)
    _assert_equal(_greedy(llm, PROMPTS, MAX_TOKENS), want)


def test_granite_greedy_equals_hf(tiny_granite, make_llm) -> None:
    want = hf_greedy(tiny_granite, PROMPTS, MAX_TOKENS, "float32")
    llm = make_llm(tiny_granite, dtype="float32", enforce_eager=True)
    (classes,) = llm.apply_model(_classes)
    assert "GraniteForCausalLM" in classes  # upstream's own class: nothing to adapt
    _assert_equal(_greedy(llm, PROMPTS, MAX_TOKENS), want)
