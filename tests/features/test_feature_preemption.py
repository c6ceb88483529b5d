"""Preemption and recompute when the KV cache runs out of blocks.

``main_llm`` has 8 usable KV blocks of 128 tokens. Four prompts of 245 to 254
tokens fill them all once prefilled (2 blocks each); as they decode past 256
tokens each needs a third block, none is free, and vLLM's scheduler preempts a
running request (frees its blocks) and recomputes it later. Two short requests
wait in the queue meanwhile. Every request's greedy output must equal its
output when it runs alone: Hugging Face transformers decoding each prompt on
its own, float32, token for token.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from spyre_inference.testing import TEST_PROMPTS, hf_greedy
from tests.features.util import MAIN_KV_BLOCKS, greedy_params, preemptions, token_ids

pytestmark = pytest.mark.feature("preemption")

MAX_TOKENS = 16
BLOCK = 128
#: Each fills 2 blocks (256 tokens) and crosses into a third after 3..12 tokens.
LONG_LENGTHS = (245, 248, 251, 254)


@pytest.fixture(scope="module")
def prompts(feature_model: Path) -> list[list[int]]:
    """Four long prompts (distinct token streams, so they share no cached block) and two short."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(feature_model)
    stream = tok(" ".join(TEST_PROMPTS) * 4, add_special_tokens=False).input_ids
    long = [stream[41 * i : 41 * i + n] for i, n in enumerate(LONG_LENGTHS)]
    short = [tok(TEST_PROMPTS[1]).input_ids, tok(TEST_PROMPTS[3]).input_ids]
    usable = MAIN_KV_BLOCKS - 1  # vLLM's null block
    prefilled = sum(-(-n // BLOCK) for n in LONG_LENGTHS)
    finished = sum(-(-(n + MAX_TOKENS) // BLOCK) for n in LONG_LENGTHS)
    assert prefilled <= usable < finished, (prefilled, usable, finished)
    return long + short


def test_preempted_requests_equal_each_request_alone(
    main_llm, feature_model, prompts, record_property
) -> None:
    outputs = main_llm.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy_params(MAX_TOKENS)
    )
    counts = preemptions(outputs)
    record_property("preemptions_per_request", counts)
    assert sum(counts) > 0, f"no request was preempted: {counts}"
    alone = hf_greedy(feature_model, prompts, MAX_TOKENS, "float32")
    got = token_ids(outputs)
    mismatches = [i for i, (g, w) in enumerate(zip(got, alone, strict=True)) if g != w]
    assert not mismatches, {i: (counts[i], alone[i], got[i]) for i in mismatches}
