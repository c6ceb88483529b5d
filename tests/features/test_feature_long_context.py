"""Long context: ``max_model_len`` up to the model's limit, and clear errors past it.

The feature model has 512 positions; ``main_llm`` serves all of them
(``max_model_len=512``: KV-length buckets up to 4 pages of 128 tokens, within
the bucket rules). A 504-token prompt generating 8 tokens fills the context
exactly and must equal Hugging Face greedy decoding (float32). A prompt of
513 tokens is refused before it reaches the engine, with vLLM's message
naming the limit, and the engine keeps serving; asking for a ``max_model_len``
above the model's limit fails at start-up.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.exceptions import VLLMValidationError

from spyre_inference.testing import TEST_PROMPTS, hf_greedy
from tests.features.util import MAX_MODEL_LEN, greedy_params, token_ids

MAX_TOKENS = 8


def _long_ids(model: Path, n: int) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids = tok(" ".join(TEST_PROMPTS) * 4).input_ids
    assert len(ids) >= n
    return ids[:n]


@pytest.mark.feature("long_context")
def test_context_at_the_model_limit_equals_hf(main_llm, feature_model) -> None:
    assert main_llm.llm_engine.vllm_config.model_config.max_model_len == MAX_MODEL_LEN
    prompt = _long_ids(feature_model, MAX_MODEL_LEN - MAX_TOKENS)
    (out,) = main_llm.generate([{"prompt_token_ids": prompt}], greedy_params(MAX_TOKENS))
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == MAX_MODEL_LEN
    assert token_ids([out]) == hf_greedy(feature_model, [prompt], MAX_TOKENS, "float32")


@pytest.mark.feature("prompt_over_max_model_len")
def test_prompt_over_max_model_len_is_rejected_clearly(main_llm, feature_model) -> None:
    prompt = _long_ids(feature_model, MAX_MODEL_LEN + 1)
    with pytest.raises(
        VLLMValidationError, match=rf"maximum context length is {MAX_MODEL_LEN} tokens"
    ) as info:
        main_llm.generate([{"prompt_token_ids": prompt}], greedy_params(4))
    assert str(MAX_MODEL_LEN + 1) in str(info.value)
    # The engine is unaffected.
    (out,) = main_llm.generate(["Hello"], greedy_params(4))
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.feature("prompt_over_max_model_len")
def test_max_model_len_above_the_model_limit_fails_at_start(feature_model) -> None:
    from vllm import LLM

    too_long = 2 * MAX_MODEL_LEN
    with pytest.raises(ValueError, match=rf"max_model_len \({too_long}\) is greater than") as info:
        LLM(model=str(feature_model), max_model_len=too_long)
    assert f"max_position_embeddings={MAX_MODEL_LEN}" in str(info.value)
