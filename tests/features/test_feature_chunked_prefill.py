"""Chunked prefill: a prompt longer than the step budget is prefilled across steps.

``main_llm`` has a 64-token step budget and four sequence slots, so the ten
test prompts (5 to 354 tokens) in one batch are split into chunks of at most 64
tokens, and the steps mix those chunks with the decodes of sequences that
have finished their prefill. The references are a single-chunk run (the
reference engine: a budget of ``max_model_len``, no chunking) and Hugging Face
transformers, greedy, float32: all three must be equal token for token.
"""

from __future__ import annotations

import pytest

from spyre_inference.testing import TEST_PROMPTS, hf_greedy
from tests.features.util import STEP_BUDGET, greedy_params, preemptions, token_ids

pytestmark = pytest.mark.feature("chunked_prefill")

MAX_TOKENS = 16


def test_chunked_equals_single_chunk_and_hf(main_llm, reference_llm, feature_model) -> None:
    params = greedy_params(MAX_TOKENS)
    chunked = main_llm.generate(list(TEST_PROMPTS), params)
    lengths = [len(o.prompt_token_ids) for o in chunked]
    assert sum(n > STEP_BUDGET for n in lengths) >= 4, lengths  # several prompts chunked
    assert max(lengths) > 5 * STEP_BUDGET, lengths  # one of them in 6 chunks
    assert preemptions(chunked) == [0] * len(chunked)

    reference_config = reference_llm.llm_engine.vllm_config.scheduler_config
    assert not reference_config.enable_chunked_prefill
    assert reference_config.max_num_batched_tokens >= max(lengths)
    single = reference_llm.generate(list(TEST_PROMPTS), params)

    got = token_ids(chunked)
    assert got == token_ids(single), "chunked and single-chunk prefill differ"
    assert got == hf_greedy(feature_model, TEST_PROMPTS, MAX_TOKENS, "float32")
