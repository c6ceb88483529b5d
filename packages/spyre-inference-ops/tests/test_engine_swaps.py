"""End to end: a real model through vLLM with the plugin; every eligible layer is Spyre's.

Tiny Llama, Granite and Qwen3 checkpoints (head_dim 64, no padding needed) are
served by ``vllm.LLM`` on the cpu target; the loaded model is inspected in the
engine process (no upstream class of a swapped layer remains), and greedy
tokens are compared with Hugging Face transformers: exactly in float32 (same
math, same precision), and in bfloat16 (the cpu target's default) with
divergence allowed only at a reference near-tie (logprob gap below 0.2).
"""

from __future__ import annotations

import pytest

pytest.importorskip("spyre_inference.testing")

from ops_engine_util import assert_all_swapped, greedy, module_classes

from spyre_inference.testing import (
    TEST_PROMPTS,
    assert_greedy_close,
    hf_greedy,
    hf_greedy_with_logprobs,
)

MAX_TOKENS = 16
PROMPTS = TEST_PROMPTS[:6]


@pytest.mark.parametrize(
    "kind,eager",
    [("llama", False), ("granite", True), ("qwen3", True)],
    ids=["llama-compiled", "granite-eager", "qwen3-eager"],
)
def test_layers_swapped_and_greedy_equals_hf(kind, eager, tiny_model_factory, make_llm):
    model = tiny_model_factory(kind)
    llm = make_llm(model, dtype="float32", enforce_eager=eager)
    assert_all_swapped(module_classes(llm))
    got = greedy(llm, PROMPTS, MAX_TOKENS)
    want = hf_greedy(model, PROMPTS, MAX_TOKENS, "float32")
    mismatches = {i: (w, g) for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w}
    assert not mismatches


def test_bf16_greedy_close_to_hf(tiny_model_factory, make_llm):
    model = tiny_model_factory("llama")
    llm = make_llm(model, dtype="bfloat16", enforce_eager=True)
    got = greedy(llm, PROMPTS, MAX_TOKENS)
    reference = hf_greedy_with_logprobs(model, PROMPTS, MAX_TOKENS, "float32", num_logprobs=5)
    assert_greedy_close(reference, got, max_logprob_gap=0.2, min_exact=3)
