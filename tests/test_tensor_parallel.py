"""Tensor parallelism on the cpu target: two worker processes under vLLM's mp executor.

With ``tensor_parallel_size=2`` vLLM's multiprocessing executor starts two
``TorchSpyreWorker`` processes; each holds half of every sharded layer (the
tiny Llama has 4 query / 2 KV heads, so one KV head per rank), and the layers
exchange partial results through ``SpyreCommunicator`` over gloo: the
vocab-parallel embedding and the row-parallel o_proj/down_proj all-reduce, the
vocab-sharded LM head all-gathers its logits. Compiled runs trace those
collectives into each block's graph (functional collectives); eager runs call
them directly.

float32 makes the comparison exact: TP=2 must produce the same greedy tokens as
Hugging Face transformers (which TP=1 equals, in other tests; summing two
float32 partial products instead of one full one moves logits by ~1e-6, far
below the top-1 margins of these models). bfloat16, the cpu target's default,
runs as the TP example does in ``tests/test_examples.py`` (near-tie tolerance).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

import openai
import pytest
from vllm import SamplingParams

from spyre_inference.testing import TEST_PROMPTS, hf_greedy
from tests.serving import serve

MAX_TOKENS = 16
TP = 2


@pytest.fixture(autouse=True)
def _allow_rpc_functions(monkeypatch: pytest.MonkeyPatch) -> None:
    # collective_rpc with a function (not a method name) pickles it to the
    # workers, which vLLM only allows when told to.
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def _greedy(llm: Any, prompts: list[str] | tuple[str, ...]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(list(prompts), params)]


def _describe_workers(llm: Any) -> list[dict[str, Any]]:
    """What each worker process runs: its rank, pid, TP communicator and thread count."""

    def describe(worker: Any) -> dict[str, Any]:
        import os

        import torch
        from vllm.distributed import get_tp_group

        tp = get_tp_group()
        comm = tp.device_communicator
        return {
            "pid": os.getpid(),
            "rank": tp.rank_in_group,
            "world": tp.world_size,
            "communicator": None if comm is None else type(comm).__qualname__,
            "threads": torch.get_num_threads(),
        }

    return llm.collective_rpc(describe)


def _check_two_workers(llm: Any) -> None:
    from spyre_inference.platform.worker import host_threads

    workers = _describe_workers(llm)
    assert [w["rank"] for w in workers] == [0, 1]
    assert len({w["pid"] for w in workers}) == TP, "TP ranks must be separate processes"
    assert all(w["world"] == TP and w["communicator"] == "SpyreCommunicator" for w in workers)
    # The cores are shared between the ranks, not oversubscribed.
    assert all(w["threads"] == host_threads(TP) for w in workers), workers


# Qwen3-MoE at TP=2 is test_moe_tp_stick_widening.py (with a mid-stick expert width).
@pytest.mark.parametrize("kind", ["mixtral"])
def test_tp2_moe_equals_hf(kind, tiny_model_factory, make_llm) -> None:
    """MoE: each rank holds every expert's half intermediate; MoERunner all-reduces.

    TP=1 on these models equals transformers in the models package's
    ``test_moe.py``.
    """
    model = tiny_model_factory(kind)
    prompts = TEST_PROMPTS[:6]
    want = hf_greedy(model, prompts, MAX_TOKENS, "float32")
    tp2 = make_llm(model, dtype="float32", tensor_parallel_size=TP)
    _check_two_workers(tp2)
    assert _greedy(tp2, prompts) == want


# ---- vllm serve --tensor-parallel-size 2 -----------------------------------

SERVED = "tiny-llama-tp2"


@pytest.fixture(scope="module")
def tp2_client(tiny_llama):
    args = [
        "--tensor-parallel-size", str(TP),
        "--served-model-name", SERVED,
        "--dtype", "float32",
        "--max-model-len", "512",
        "--max-num-seqs", "8",
        "--max-num-batched-tokens", "128",
    ]  # fmt: skip
    with serve(tiny_llama, args) as srv:
        yield openai.OpenAI(base_url=srv.url("/v1"), api_key="unused")


def _chat(client: openai.OpenAI, messages: list[dict[str, str]], **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=SERVED,
        messages=messages,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
        **kwargs,
    )


def test_serve_tp2_chat_equals_hf(tp2_client, tiny_llama) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = _chat(tp2_client, messages)
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 12
    assert choice.message.content
    # The server's own prompt ids (chat template applied), continued by HF.
    want = hf_greedy(tiny_llama, [out.prompt_token_ids], 12, "float32")[0]
    assert choice.token_ids == want


def test_serve_tp2_concurrent_and_streamed_chats(tp2_client) -> None:
    conversations = [
        [{"role": "user", "content": "Say hello."}],
        [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "And another one?"},
        ],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to 3."}],
    ]
    alone = [_chat(tp2_client, m).choices[0].message.content for m in conversations]
    together: list[str | None] = [None] * len(conversations)

    def ask(i: int) -> None:
        together[i] = _chat(tp2_client, conversations[i]).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(conversations))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    # Batched with each other, the answers are those each got alone.
    assert together == alone
    stream = tp2_client.chat.completions.create(
        model=SERVED,
        messages=conversations[0],
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == alone[0]


# ---- what is not supported fails clearly -------------------------------------


def test_serve_rejects_data_parallel(tiny_llama) -> None:
    """The user's view of the platform's data-parallel rule: the command exits and says why."""
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(tiny_llama),
        "--data-parallel-size", "2", "--max-model-len", "256",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode != 0
    log = proc.stdout + proc.stderr
    assert "data_parallel_size=2 is not supported by spyre-inference" in log, log[-3000:]
    assert "--tensor-parallel-size" in log
