"""Client-side load for a `vllm serve` under test: mixed OpenAI requests, sent concurrently.

Shared by the reliability tests (``tests/test_serve_load.py``) and the soak
benchmark (``benchmarks/soak.py``), so the benchmark measures the same load the
tests check. Requests go through the official ``openai`` async client; every
request is greedy (``temperature=0``), so a request's text is a function of the
request alone and can be compared with the same request sent on its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Awaitable, Iterable, Sequence
from typing import Literal, TypeVar

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from spyre_inference.testing.prompts import TEST_PROMPTS

T = TypeVar("T")

# ---- the server and the load (tests/test_serve_load.py, benchmarks/soak.py) ----

MODEL = "tiny-llama"
MAX_MODEL_LEN = 256
CONCURRENCY = 32
#: Prompts of 5..118 tokens (the longest test prompt, 354 tokens, would not fit).
PROMPTS = TEST_PROMPTS[:9]
MAX_TOKENS = (1, 5, 16, 32)
#: Distinct requests the load draws from (each is also sent alone, as the reference),
#: and the seed of the draw: with it, the 12 cover all 4 output lengths, both
#: endpoints and 8 prompt lengths.
DISTINCT = 12
SEED = 1

#: ``vllm serve`` arguments: float32, so a greedy output does not depend on the
#: batch it ran in; one sequence slot per concurrent request.
SERVER_ARGS = (
    "--served-model-name", MODEL,
    "--dtype", "float32",
    "--max-model-len", str(MAX_MODEL_LEN),
    "--max-num-seqs", str(CONCURRENCY),
    "--max-num-batched-tokens", "128",
)  # fmt: skip
#: Few compiled shapes: num_tokens buckets 32 and 128, one batched-decode bucket.
SERVER_ENV = {"SPYRE_NUM_TOKENS_BUCKETS": "32", "SPYRE_ATTN_NUM_SEQS_BUCKETS": str(CONCURRENCY)}


def client(base_url: str) -> openai.AsyncOpenAI:
    """The official async client, without retries (a failure must be seen, not hidden)."""
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)


Endpoint = Literal["completions", "chat"]


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    """One greedy request: which endpoint, what prompt, how many tokens, streamed or not."""

    endpoint: Endpoint
    prompt: str
    max_tokens: int
    stream: bool = False

    def alone(self) -> LoadRequest:
        """The reference form: the same request, not streamed (streaming must not change it)."""
        return dataclasses.replace(self, stream=False)


async def send(client: openai.AsyncOpenAI, model: str, req: LoadRequest) -> str:
    """Send ``req`` and return the generated text (streamed chunks joined)."""
    return (await send_counted(client, model, req))[0]


async def send_counted(client: openai.AsyncOpenAI, model: str, req: LoadRequest) -> tuple[str, int]:
    """Send ``req``; the generated text and its number of tokens (the server's usage)."""
    common = dict(model=model, max_tokens=req.max_tokens, temperature=0)
    stream_usage = {"stream": True, "stream_options": {"include_usage": True}}
    if req.endpoint == "chat":
        messages = [{"role": "user", "content": req.prompt}]
        if not req.stream:
            out = await client.chat.completions.create(messages=messages, **common)
            return out.choices[0].message.content or "", out.usage.completion_tokens
        stream = await client.chat.completions.create(messages=messages, **stream_usage, **common)
        text, tokens = [], 0
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return "".join(text), tokens
    if not req.stream:
        out = await client.completions.create(prompt=req.prompt, **common)
        return out.choices[0].text, out.usage.completion_tokens
    stream = await client.completions.create(prompt=req.prompt, **stream_usage, **common)
    text, tokens = [], 0
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].text)
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return "".join(text), tokens


async def cancel_stream(
    client: openai.AsyncOpenAI, model: str, i: int, *, after: int, max_tokens: int = 200
) -> int:
    """Stream a greedy completion of prompt ``i`` (numbered, so each is a distinct
    request) and disconnect after ``after`` chunks; returns the chunks read."""
    stream = await client.completions.create(
        model=model, prompt=f"{i}: {PROMPTS[i % len(PROMPTS)]}", max_tokens=max_tokens,
        temperature=0, stream=True,
    )  # fmt: skip
    chunks = 0
    async for _ in stream:
        chunks += 1
        if chunks == after:
            break
    await stream.close()  # the client disconnects
    return chunks


def mixed_requests(
    count: int,
    prompts: Sequence[str],
    max_tokens: Sequence[int],
    *,
    seed: int = 0,
    distinct: int | None = None,
) -> list[LoadRequest]:
    """``count`` requests mixing endpoints, prompt lengths, output lengths and streaming.

    With ``distinct``, requests are drawn from that many distinct (endpoint,
    prompt, max_tokens) combinations, so each one's alone-reference is sent
    only once; streaming is drawn per request.
    """
    rng = random.Random(seed)

    def draw() -> tuple[Endpoint, str, int]:
        return rng.choice(("completions", "chat")), rng.choice(prompts), rng.choice(max_tokens)

    pool = [draw() for _ in range(distinct)] if distinct else None
    requests = []
    for _ in range(count):
        endpoint, prompt, tokens = rng.choice(pool) if pool else draw()
        requests.append(LoadRequest(endpoint, prompt, tokens, stream=rng.random() < 0.5))
    return requests


async def bounded(coros: Iterable[Awaitable[T]], concurrency: int) -> list[T | BaseException]:
    """Await ``coros`` with at most ``concurrency`` in flight; exceptions are returned."""
    gate = asyncio.Semaphore(concurrency)

    async def one(coro: Awaitable[T]) -> T:
        async with gate:
            return await coro

    return await asyncio.gather(*(one(c) for c in coros), return_exceptions=True)


def metric(text: str, name: str) -> float:
    """The value of one Prometheus sample of ``/metrics`` (summed over its label sets)."""
    total, found = 0.0, False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
                found = True
    if not found:
        raise KeyError(f"{name} is not in /metrics")
    return total


# ---- bad requests: (endpoint, arguments, what the 4xx message must say) ----

#: Every kind of bad input the issue names; each must get a 4xx naming the problem.
BAD_REQUESTS: dict[str, tuple[str, dict, str]] = {
    "prompt over max_model_len": (
        "completions",
        {"prompt": "word " * 400, "max_tokens": 4},
        f"maximum context length is {MAX_MODEL_LEN}",
    ),
    "chat over max_model_len": (
        "chat",
        {"messages": [{"role": "user", "content": "word " * 400}], "max_tokens": 4},
        f"maximum context length is {MAX_MODEL_LEN}",
    ),
    "negative max_tokens": (
        "completions",
        {"prompt": "Hello", "max_tokens": -5},
        "max_tokens must be at least 1",
    ),
    "huge max_tokens": (
        "completions",
        {"prompt": "Hello", "max_tokens": 10**9},
        f"cannot be greater than max_model_len={MAX_MODEL_LEN}",
    ),
    "negative temperature": (
        "completions",
        {"prompt": "Hello", "max_tokens": 4, "temperature": -1.0},
        "temperature must be non-negative",
    ),
    "top_p above 1": (
        "chat",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "top_p": 1.5},
        "top_p must be in (0, 1]",
    ),
    "negative top_k": (
        "completions",
        {"prompt": "Hello", "max_tokens": 4, "extra_body": {"top_k": -3}},
        "top_k must be 0 (disable), or at least 1",
    ),
    "unknown model": (
        "completions",
        {"prompt": "Hello", "max_tokens": 4, "model": "no-such-model"},
        "The model `no-such-model` does not exist",
    ),
    "empty prompt": (
        "completions",
        {"prompt": "", "max_tokens": 4},
        "prompt or prompt_embeds must be provided and non-empty",
    ),
    "empty conversation": (
        "chat",
        {"messages": [], "max_tokens": 4},
        "Cannot apply chat template to an empty conversation",
    ),
}
MALFORMED_JSON = b'{"model": "tiny-llama", "prompt": "Hello", "max_tokens": '


async def send_bad(client: openai.AsyncOpenAI, endpoint: str, kwargs: dict) -> tuple[int, str]:
    """Send a bad request; its (status, message), or (200, text) if it was served."""
    kwargs = {"model": MODEL, **kwargs}
    try:
        if endpoint == "chat":
            await client.chat.completions.create(**kwargs)
        else:
            await client.completions.create(**kwargs)
    except openai.APIStatusError as exc:
        return exc.status_code, exc.message
    return 200, "served"


async def send_malformed_json(base_url: str) -> tuple[int, str]:
    """POST a body that is not JSON to ``/v1/completions``; (status, body)."""
    async with httpx.AsyncClient(timeout=60) as http:
        resp = await http.post(
            base_url + "/v1/completions",
            content=MALFORMED_JSON,
            headers={"Content-Type": "application/json"},
        )
    return resp.status_code, resp.text
