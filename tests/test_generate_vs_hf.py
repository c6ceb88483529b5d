"""Greedy generation through the plugin equals Hugging Face transformers, token for token.

float32 on the cpu target makes exact comparison meaningful: both sides do the
same math in the same precision, so any difference is a bug (wrong mask, wrong
page, wrong slot), not rounding. The ten prompts (5 to 354 tokens) go in one
batch; with 128-token KV blocks and a 128-token step budget the batch mixes
prefill chunks with decodes and sequences cross block boundaries while generating.
"""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from spyre_inference.testing import TEST_PROMPTS, hf_greedy

MAX_TOKENS = 24


@pytest.fixture
def llm_in_process() -> bool:
    """The engines in this process: these tests are about what each architecture
    computes (the engine process as served is the rest of ``tests/``'s subject)."""
    return True


#: Test id -> tiny model kind and config overrides.
CASES = {
    "llama": ("llama", {}),
    "granite": ("granite", {}),
    "mistral": ("mistral", {}),
    "granitemoe": ("granitemoe", {}),
    "falcon": ("falcon", {}),
    # The RoPE pair form: partial (StableLM's quarter of the head, Phi-4-mini's
    # three quarters) and interleaved over half the head (GLM-4). StableLM in
    # StableLM-3B's shape: 80-wide heads (stick-padded to 128), 20 of them rotate.
    "stablelm": ("stablelm", {"hidden_size": 320}),
    "glm4": ("glm4", {}),
    "phi3_partial_rope": (
        "phi3",
        {
            "num_attention_heads": 4,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
            },
        },
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_hf(case: str, tiny_model_factory, make_llm) -> None:
    kind, overrides = CASES[case]
    model = tiny_model_factory(kind, **overrides)
    llm = make_llm(model, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(list(TEST_PROMPTS), params)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    want = hf_greedy(model, TEST_PROMPTS, MAX_TOKENS, "float32")
    mismatches = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    assert not mismatches, {i: (want[i], got[i]) for i in mismatches}


def test_greedy_equals_hf_eager(tiny_llama, make_llm) -> None:
    """The same with --enforce-eager (no compiled blocks, no num_tokens padding)."""
    llm = make_llm(tiny_llama, dtype="float32", enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(list(TEST_PROMPTS), params)]
    assert got == hf_greedy(tiny_llama, TEST_PROMPTS, MAX_TOKENS, "float32")
