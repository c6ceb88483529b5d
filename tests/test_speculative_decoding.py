"""Speculative decoding with vLLM's ngram proposer on the cpu target.

The engine drafts up to three tokens per step from n-grams of the request's
own tokens (numba, on the host), verifies them in one target-model step
(query length 4 per sequence, through the compiled block graphs and the
attention backend's sequence path) and accepts or rejects them with vLLM's
rejection sampler, whose Triton kernels the platform replaces with PyTorch
(``spyre_inference.platform.rejection_kernels``).

Greedy speculation must not change a single token: the outputs equal the same
engine without speculation and Hugging Face transformers (float32), and vLLM's
own counters show drafts were made and some were accepted (the prompts repeat
themselves, and a random-weight model loops, so n-grams match).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from spyre_inference.testing import hf_greedy

pytestmark = pytest.mark.feature("speculative_decoding")

MAX_TOKENS = 40
PROMPTS = (
    "one two three four one two three four one two three",
    "the cat sat on the mat and the cat sat on the",
    "a b c d e f a b c d e f a b c",
    "Spyre Spyre Spyre Spyre",
)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "max_num_seqs": 4,
    "max_num_batched_tokens": 64,
    "seed": 0,
}
#: One num_tokens bucket (the step budget) keeps warm-up short.
ENV = {"SPYRE_NUM_TOKENS_BUCKETS": "64"}


def _counter(llm: Any, name: str) -> float:
    return sum(float(m.value) for m in llm.get_metrics() if m.name == name)


@pytest.fixture(scope="module")
def spec_model(tiny_model_factory) -> Path:
    return tiny_model_factory("llama", max_position_embeddings=512)


def test_ngram_greedy_equals_plain_decoding_and_hf(spec_model: Path, make_llm, monkeypatch) -> None:
    from vllm import SamplingParams

    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    spec_llm = make_llm(spec_model, speculative_config=NGRAM, disable_log_stats=False, **ENGINE)
    speculated = [list(o.outputs[0].token_ids) for o in spec_llm.generate(list(PROMPTS), params)]
    drafts = _counter(spec_llm, "vllm:spec_decode_num_draft_tokens")
    accepted = _counter(spec_llm, "vllm:spec_decode_num_accepted_tokens")
    spec_llm.llm_engine.engine_core.shutdown()

    plain_llm = make_llm(spec_model, **ENGINE)
    plain = [list(o.outputs[0].token_ids) for o in plain_llm.generate(list(PROMPTS), params)]

    assert speculated == plain, "ngram speculation changed greedy tokens"
    assert speculated == hf_greedy(spec_model, PROMPTS, MAX_TOKENS, "float32")
    assert drafts > 0, "the ngram proposer drafted nothing"
    assert accepted > 0, f"no draft token accepted ({drafts:g} drafted)"
