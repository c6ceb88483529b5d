"""`vllm serve` on the plugin answers the OpenAI API, checked with the official client."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import requests

from tests.serving import serve

MODEL_NAME = "tiny-llama"


@pytest.fixture(scope="module")
def server(tiny_llama):
    args = [
        "--served-model-name", MODEL_NAME,
        "--max-model-len", "512",
        "--max-num-seqs", "8",
        "--max-num-batched-tokens", "128",
    ]  # fmt: skip
    with serve(tiny_llama, args) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused")


def test_health_and_models(server, client) -> None:
    assert requests.get(server.url("/health"), timeout=10).status_code == 200
    models = [m.id for m in client.models.list().data]
    assert models == [MODEL_NAME]


def test_completion(client) -> None:
    out = client.completions.create(
        model=MODEL_NAME, prompt="The capital of France is", max_tokens=12, temperature=0
    )
    choice = out.choices[0]
    assert out.usage.completion_tokens == 12
    assert choice.finish_reason == "length"
    assert choice.text


def test_completion_is_deterministic_and_streams_the_same_text(client) -> None:
    kwargs = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=16, temperature=0)
    first = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(
        chunk.choices[0].text for chunk in client.completions.create(stream=True, **kwargs)
    )
    assert streamed == first


def test_chat_completion(client) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0
    )
    text = out.choices[0].message.content
    assert out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens <= 10
    streamed = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(pieces) == text


def test_bad_request_gets_4xx_and_server_keeps_serving(client) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="hi " * 1000, max_tokens=4)
    out = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4)
    assert out.usage.completion_tokens == 4


def test_openai_client_example(server, client, tmp_path) -> None:
    """examples/openai_client.py on this server: models, chat (streamed or not), completion."""
    out = tmp_path / "client.json"
    script = Path(__file__).resolve().parent.parent / "examples" / "openai_client.py"
    done = subprocess.run(
        [sys.executable, str(script), "--base-url", server.url("/v1"), "--max-tokens", "8",
         "--json-out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["models"] == [MODEL_NAME]
    assert result["chat"] and result["streamed"] == result["chat"]
    assert result["chat_tokens"] <= 8
    expected = client.completions.create(
        model=MODEL_NAME, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert result["completion"] == expected.choices[0].text
    assert f"completion: {result['completion']!r}" in done.stdout


def _progress(pattern: str, log: str) -> list[int]:
    """The ``i`` of every ``i/n`` progress line matching ``pattern``; checks they count 1..n."""
    found = re.findall(pattern, log)
    assert found, f"no progress line matches {pattern!r}"
    total = int(found[0][1])
    assert [int(i) for i, _ in found] == list(range(1, total + 1))
    return [int(i) for i, _ in found]


def test_warm_up_logs_progress(server) -> None:
    """Start-up shows warm-up progress: counts and elapsed time per bucket and kernel variant."""
    log = server.log()
    elapsed = r"\d+\.\d s \(\d+\.\d s total"
    _progress(rf"Warm-up (\d+)/(\d+): num_tokens=\d+: .* {elapsed}", log)
    # The cpu target's host kernels leave no attention graph to record; the card's
    # backends (and soft-capped or ALiBi layers) record theirs with progress lines.
    if "Attention warm-up (SpyreAttentionBackend): nothing to record" not in log:
        _progress(rf"Attention warm-up (\d+)/(\d+): .* in {elapsed}\)", log)
