"""``vllm serve`` on the emulated card answers the official OpenAI client."""

from __future__ import annotations

import openai

from spyre_inference.testing import TEST_PROMPTS, hf_greedy
from tests.serving import serve


def test_serve_answers_openai_client(tiny_llama) -> None:
    args = [
        "--dtype", "float16", "--max-model-len", "512", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "128", "--kv-cache-memory-bytes", str(64 << 20),
    ]  # fmt: skip
    env = {"SPYRE_DEVICE_TARGET": "emulated", "SPYRE_NUM_TOKENS_BUCKETS": "32,128"}
    with serve(tiny_llama, args, env=env) as server:
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="none")
        prompt = TEST_PROMPTS[0]
        out = client.completions.create(
            model=str(tiny_llama), prompt=prompt, max_tokens=8, temperature=0.0
        )
        assert "emulated" in server.log()
    got = out.choices[0].text
    want_ids = hf_greedy(tiny_llama, [prompt], 8, "float16")[0]
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(tiny_llama).decode(want_ids)
    assert got == want
