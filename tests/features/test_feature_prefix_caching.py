"""Automatic prefix caching: cache hits change nothing but the work done.

Requests share a 2-block prefix (128-token pages). The first request fills the
cache alone; the next four run together and find the prefix there, so their
steps have ``query_len < seq_len`` over cached pages: tails of 100 to 175
tokens (chunked further by the 64-token step budget), the same prompt again,
and a 257-token prompt with 256 tokens cached, which reaches attention as a
one-row prefill. References: the same requests with prefix caching off (and no
chunking), and Hugging Face transformers; float32 makes all of them exactly
equal. Both decoder backends are checked: token-major (the default, compiled,
``LLM``) and head-major (``vllm serve``, completions with token-id prompts).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from spyre_inference.testing import TEST_PROMPTS, hf_greedy
from tests.features.util import (
    MAIN_NAME,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    SERVED_NAME,
    greedy_params,
    preemptions,
    prometheus_counter,
    token_ids,
)

pytestmark = pytest.mark.feature("prefix_caching")

MAX_TOKENS = 16
BLOCK = 128  # the platform's default KV block size
SHARED = 2 * BLOCK


@pytest.fixture(scope="module")
def prompts(feature_model: Path) -> list[list[int]]:
    """Token ids: A (cold, fills the cache), then B..E sharing A's first 2 blocks."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(feature_model)
    prefix = tok(TEST_PROMPTS[9]).input_ids
    assert SHARED < len(prefix) < SHARED + BLOCK, len(prefix)

    def tail(text: str) -> list[int]:
        return tok(text, add_special_tokens=False).input_ids

    a = prefix + tail(" Answer:")
    b = prefix + tail(" " + TEST_PROMPTS[8])  # a long tail, chunked after the hit
    c = prefix + tail(" " + TEST_PROMPTS[1])
    d = list(a)  # the same prompt again
    e = a[: SHARED + 1]  # all but its last token cached: a one-row prefill
    batch = [a, b, c, d, e]
    assert max(len(p) for p in batch) + MAX_TOKENS <= MAX_MODEL_LEN
    assert len(batch) - 1 <= MAX_NUM_SEQS  # B..E run in one batch
    return batch


@pytest.fixture(scope="module")
def caching_off(reference_llm, prompts: list[list[int]]) -> list[list[int]]:
    outputs = reference_llm.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy_params(MAX_TOKENS)
    )
    assert all(o.num_cached_tokens == 0 for o in outputs)
    return token_ids(outputs)


@pytest.fixture(scope="module")
def hf_reference(feature_model: Path, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(feature_model, prompts, MAX_TOKENS, "float32")


def _check_hits(cached: list[int]) -> None:
    # A ran on an empty cache; B, C and D find the 2 prefix blocks, E all of
    # its 2 full blocks (vLLM always computes a prompt's last token).
    assert cached[0] == 0, cached
    assert all(c >= SHARED for c in cached[1:]), cached


def test_token_major_hits_equal_caching_off_and_hf(
    main_llm, prompts, caching_off, hf_reference, record_property
) -> None:
    main_llm.reset_prefix_cache()
    hits_before = prometheus_counter("vllm:prefix_cache_hits", MAIN_NAME)
    params = greedy_params(MAX_TOKENS)
    first = main_llm.generate([{"prompt_token_ids": prompts[0]}], params)
    rest = main_llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)
    outputs = first + rest
    assert preemptions(outputs) == [0] * len(outputs)  # hits only, no recompute

    cached = [o.num_cached_tokens for o in outputs]
    _check_hits(cached)
    hits = prometheus_counter("vllm:prefix_cache_hits", MAIN_NAME) - hits_before
    record_property("cached_tokens", cached)
    record_property("prefix_cache_hits", hits)
    assert hits >= sum(cached) > 0, (hits, cached)

    got = token_ids(outputs)
    assert got == caching_off, "prefix caching on and off differ"
    assert got == hf_reference, "prefix-cached run differs from Hugging Face"


def test_head_major_hits_equal_caching_off_and_hf(
    head_major_server, head_major_client, prompts, caching_off, hf_reference, record_property
) -> None:
    assert "attention backend: head_major" in head_major_server.log()

    def complete(prompt: list[int]) -> Any:
        return head_major_client.completions.create(
            model=SERVED_NAME,
            prompt=[prompt],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )

    first = complete(prompts[0])
    # B..E as concurrent requests (one usage record each), batched by the server.
    with ThreadPoolExecutor(len(prompts) - 1) as pool:
        rest = list(pool.map(complete, prompts[1:]))
    responses = [first, *rest]

    cached = [r.usage.prompt_tokens_details.cached_tokens for r in responses]
    record_property("cached_tokens", cached)
    _check_hits(cached)
    got = [list(r.choices[0].token_ids) for r in responses]
    assert got == caching_off, "prefix caching on (head-major) and off differ"
    assert got == hf_reference, "head-major prefix-cached run differs from Hugging Face"
