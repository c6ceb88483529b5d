"""End to end: scaled RoPE through the Spyre rotary swaps, greedy equal to transformers.

A tiny Qwen2 with ``rope_type: yarn`` (the Qwen2.5 long-context recipe: factor 4
over an original 128 positions) is served by ``vllm.LLM`` on the cpu target in
float32. The loaded model must hold the Spyre YaRN class (vLLM's own
``YaRNScalingRotaryEmbedding`` must not survive), its rotation cache cut to
``max_model_len`` rows, and greedy tokens must equal transformers' on the same
weights, for prompts from 5 to 354 tokens: the long one reaches past the
original 128 positions and, at 128 batched tokens, is prefilled in chunks.
"""

from __future__ import annotations

import pytest

pytest.importorskip("spyre_inference.testing")

from ops_engine_util import assert_all_swapped, greedy, module_classes

from spyre_inference.testing import TEST_PROMPTS, hf_greedy

MAX_TOKENS = 12
MAX_MODEL_LEN = 384
PROMPTS = (*TEST_PROMPTS[:3], TEST_PROMPTS[7], TEST_PROMPTS[9])
YARN = {
    "rope_type": "yarn",
    "rope_theta": 1000000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
}


def test_qwen2_yarn_greedy_equals_hf(tiny_model_factory, make_llm):
    model = tiny_model_factory("qwen2", rope_parameters=YARN, max_position_embeddings=512)
    llm = make_llm(model, dtype="float32", enforce_eager=True, max_model_len=MAX_MODEL_LEN)
    classes = module_classes(llm)
    assert_all_swapped(classes)
    ropes = {name: cls for name, cls in classes.items() if cls.endswith("RotaryEmbedding")}
    assert ropes and set(ropes.values()) == {"SpyreYaRNScalingRotaryEmbedding"}, ropes
    # (A list: the engine's reply to apply_model cannot carry a set.)
    (shapes,) = llm.apply_model(
        lambda m: [
            list(mod.rotation_cache.shape)
            for mod in m.modules()
            if type(mod).__name__ == "SpyreYaRNScalingRotaryEmbedding"
        ]
    )
    # Upstream tabulates 128 * 4 = 512 positions; only max_model_len can occur.
    assert shapes and all(s == [MAX_MODEL_LEN, 2, 2, 32] for s in shapes), shapes

    got = greedy(llm, PROMPTS, MAX_TOKENS)
    want = hf_greedy(model, PROMPTS, MAX_TOKENS, "float32")
    mismatches = {i: (w, g) for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w}
    assert not mismatches
