"""Every script in ``examples/`` runs on the cpu target and produces the right output.

Each example is run as a user would run it (``python examples/<name>.py ...``,
a separate process), on a tiny random model instead of the default SmolLM2 so
the whole module stays cheap, with ``--enforce-eager`` (no block compilation)
and float32 so the output can be compared exactly with Hugging Face
transformers on the same weights (the tensor-parallel example excepted: it runs
compiled in bfloat16, the TP setting no other e2e test covers).
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps vLLM's engine core in the example's
own process: it saves one ~20 s import of vLLM per example and changes nothing
the example does (the multiprocess engine is what every other e2e test runs).
The ``vllm serve`` + ``openai`` client example runs against the server of
``test_serve.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from spyre_inference.testing import assert_greedy_close, hf_greedy, hf_greedy_with_logprobs

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MAX_TOKENS = 8
#: Small engine limits for tiny models (the examples' own defaults are sized for SmolLM2).
SMALL = ["--max-model-len", "512", "--max-num-batched-tokens", "128", "--max-num-seqs", "8"]
EXACT = ["--enforce-eager", "--dtype", "float32"]


def run_example(
    name: str, args: list[str], tmp_path: Path, timeout: float = 600
) -> tuple[str, Any]:
    """Run ``examples/<name>`` with ``--json-out``; return its stdout and the JSON it wrote."""
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args, "--json-out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if done.returncode != 0:
        pytest.fail(f"{name} exited with {done.returncode}:\n{done.stderr[-6000:]}")
    return done.stdout, json.loads(out.read_text())


def test_offline_generate_equals_hf(tiny_llama: Path, tmp_path: Path) -> None:
    stdout, results = run_example(
        "offline_generate.py",
        ["--model", str(tiny_llama), *EXACT, *SMALL, "--max-tokens", str(MAX_TOKENS)],
        tmp_path,
    )
    prompts = [r["prompt"] for r in results]
    assert len(prompts) == 4
    expected = hf_greedy(tiny_llama, prompts, MAX_TOKENS, ignore_eos=False)
    assert [r["token_ids"] for r in results] == expected
    for r in results:
        assert f"Prompt:    {r['prompt']!r}\nGenerated: {r['text']!r}" in stdout


def test_chat_applies_the_template_and_equals_hf(tiny_llama: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    stdout, turns = run_example(
        "chat.py",
        ["--model", str(tiny_llama), *EXACT, *SMALL, "--max-tokens", str(MAX_TOKENS)],
        tmp_path,
    )
    assert len(turns) == 2
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    for turn in turns:
        templated = tokenizer.apply_chat_template(
            turn["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert turn["prompt_token_ids"] == list(templated)
        assert f"user:      {turn['messages'][-1]['content']}" in stdout
    # The second question is asked after the first answer, as a chat client does.
    assert turns[1]["messages"][-2] == {"role": "assistant", "content": turns[0]["answer"]}
    expected = hf_greedy(
        tiny_llama, [t["prompt_token_ids"] for t in turns], MAX_TOKENS, ignore_eos=False
    )
    assert [t["token_ids"] for t in turns] == expected


def _hf_cls_embeddings(path: Path, texts: list[str]) -> torch.Tensor:
    """BertModel's CLS vector, normalised: what vLLM's embed pooler returns for it."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    with torch.inference_mode():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt").input_ids
            rows.append(model(input_ids=ids).last_hidden_state[0, 0])
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1)


def test_embeddings_equal_hf_and_rank_by_cosine(tiny_bert: Path, tmp_path: Path) -> None:
    stdout, result = run_example("embeddings.py", ["--model", str(tiny_bert), *EXACT], tmp_path)
    vectors = torch.tensor(result["embeddings"])
    assert vectors.shape == (5, 256)
    assert "5 embeddings of size 256" in stdout
    reference = _hf_cls_embeddings(tiny_bert, result["texts"])
    cosines = torch.nn.functional.cosine_similarity(vectors, reference, dim=-1)
    assert cosines.min().item() > 0.9999, cosines
    # The printed ranking is the documents sorted by their dot product with the query.
    scores = (vectors[1:] @ vectors[0]).tolist()
    assert result["scores"] == pytest.approx(scores, abs=1e-5)
    printed = [line.split(maxsplit=1)[1] for line in stdout.splitlines() if line.startswith("  ")]
    ranked = [doc for _, doc in sorted(zip(scores, result["texts"][1:], strict=True), reverse=True)]
    assert printed == ranked


def test_tensor_parallel_close_to_hf(tiny_llama: Path, tmp_path: Path) -> None:
    """The TP example as users run it: compiled blocks in the default dtype (bfloat16).

    This is the e2e suite's one compiled bfloat16 TP=2 engine (the collectives
    inside the block graphs); exact float32 TP=2 runs in ``test_tensor_parallel.py``
    (compiled) and ``test_moe_tp_stick_widening.py`` (eager). bfloat16 all-reduces
    may flip near-ties only.
    """
    args = ["--model", str(tiny_llama), "--tensor-parallel-size", "2", *SMALL]
    stdout, results = run_example(
        "tensor_parallel.py", [*args, "--max-tokens", str(MAX_TOKENS)], tmp_path
    )
    assert "tensor_parallel_size=2\n" in stdout
    reference = hf_greedy_with_logprobs(
        tiny_llama, [r["prompt"] for r in results], MAX_TOKENS, "float32", ignore_eos=False
    )
    exact = assert_greedy_close(reference, [r["token_ids"] for r in results], max_logprob_gap=0.1)
    assert exact >= len(results) // 2
