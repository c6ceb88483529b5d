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

import openai
from prometheus_client.parser import text_string_to_metric_families

T = TypeVar("T")

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
    common = dict(model=model, max_tokens=req.max_tokens, temperature=0)
    if req.endpoint == "chat":
        messages = [{"role": "user", "content": req.prompt}]
        if req.stream:
            stream = await client.chat.completions.create(messages=messages, stream=True, **common)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        out = await client.chat.completions.create(messages=messages, **common)
        return out.choices[0].message.content or ""
    if req.stream:
        stream = await client.completions.create(prompt=req.prompt, stream=True, **common)
        return "".join([c.choices[0].text async for c in stream if c.choices])
    out = await client.completions.create(prompt=req.prompt, **common)
    return out.choices[0].text


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
