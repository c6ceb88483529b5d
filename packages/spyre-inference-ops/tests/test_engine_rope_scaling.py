"""End to end: scaled RoPE through the Spyre rotary swaps, greedy equal to transformers.

YaRN: a tiny Qwen2 with ``rope_type: yarn`` (the Qwen2.5 long-context recipe: factor 4
over an original 128 positions) is served by ``vllm.LLM`` on the cpu target in
float32. The loaded model must hold the Spyre YaRN class (vLLM's own
``YaRNScalingRotaryEmbedding`` must not survive), its rotation cache cut to
``max_model_len`` rows, and greedy tokens must equal transformers' on the same
weights, for prompts from 5 to 354 tokens: the long one reaches past the
original 128 positions and, at 128 batched tokens, is prefilled in chunks.

Longrope: a tiny Phi-3 (head_dim 32, so stick-padded to 64) with short and long
factors over an original 64 positions. vLLM fixes the choice per engine (long
when ``max_model_len`` exceeds 64); transformers chooses per forward (long when
the sequence exceeds 64). Each regime is served with prompts for which both
choose the same: ``max_model_len`` 64 with short prompts, 384 with prompts of
73-354 tokens.
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
LONGROPE_ORIGINAL = 64
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    # One factor per frequency of the 32-wide head; long ones stretch far more.
    "short_factor": [1.0 + 0.05 * i for i in range(16)],
    "long_factor": [1.0 + 1.5 * i for i in range(16)],
    "original_max_position_embeddings": LONGROPE_ORIGINAL,
}
#: regime -> (max_model_len, prompts): prompts for which vLLM's per-engine and
#: transformers' per-sequence choice of factors agree.
LONGROPE_REGIMES = {
    "short_factors": (LONGROPE_ORIGINAL, TEST_PROMPTS[:4]),
    "long_factors": (MAX_MODEL_LEN, TEST_PROMPTS[6:10]),
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


@pytest.mark.parametrize("regime", sorted(LONGROPE_REGIMES))
def test_phi3_longrope_greedy_equals_hf(tiny_model_factory, make_llm, regime):
    max_model_len, prompts = LONGROPE_REGIMES[regime]
    model = tiny_model_factory(
        "phi3",
        rope_parameters=LONGROPE,
        original_max_position_embeddings=LONGROPE_ORIGINAL,
        max_position_embeddings=512,
    )
    llm = make_llm(model, dtype="float32", enforce_eager=True, max_model_len=max_model_len)
    classes = module_classes(llm)
    assert_all_swapped(classes)
    ropes = {name: cls for name, cls in classes.items() if cls.endswith("RotaryEmbedding")}
    assert ropes and set(ropes.values()) == {"SpyrePhi3LongRoPEScaledRotaryEmbedding"}, ropes
    (state,) = llm.apply_model(
        lambda m: [
            [list(mod.rotation_cache.shape), mod.use_long_rope]
            for mod in m.modules()
            if type(mod).__name__ == "SpyrePhi3LongRoPEScaledRotaryEmbedding"
        ]
    )
    # head_dim 32 padded to 64: 32 rotation pairs, the 16 padded ones the identity.
    long = regime == "long_factors"
    assert state and all(s == [[max_model_len, 2, 2, 32], long] for s in state), state

    got = greedy(llm, prompts, MAX_TOKENS)
    want = hf_greedy(model, prompts, MAX_TOKENS, "float32")
    mismatches = {i: (w, g) for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w}
    assert not mismatches
