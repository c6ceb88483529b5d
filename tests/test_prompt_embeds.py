"""``--enable-prompt-embeds`` on the cpu target: prompts given as embeddings.

A batch mixes requests given as embeddings and as token ids; vLLM embeds the
token-id rows (and every decoded token) itself, outside the model call. Each
request must continue as transformers does from the same tokens. The card
path's run of the same is in ``tests/emulated/test_emulated_engine.py``.
"""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from spyre_inference.testing import TEST_PROMPTS, hf_greedy, hf_input_embeddings

MAX_TOKENS = 8


@pytest.fixture
def llm_in_process() -> bool:
    return True


def test_prompt_embeds_and_token_ids_in_one_batch_equal_hf(tiny_llama, make_llm) -> None:
    prompts = list(TEST_PROMPTS[:4])
    embeds = hf_input_embeddings(tiny_llama, prompts[:2], "float32")
    llm = make_llm(tiny_llama, dtype="float32", enable_prompt_embeds=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    inputs = [{"prompt_embeds": e} for e in embeds] + prompts[2:]
    got = [list(o.outputs[0].token_ids) for o in llm.generate(inputs, params)]
    assert got == hf_greedy(tiny_llama, prompts, MAX_TOKENS, "float32")
