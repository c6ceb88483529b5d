"""`vllm serve` under load, bad input and client disconnects: it keeps serving and loses nothing.

One server (a tiny Llama in float32, so a greedy output does not depend on
what else is in the batch) takes, from the official ``openai`` async client:

* 200 greedy requests at concurrency 32: completions and chat, streamed and
  not, prompts of 5..118 tokens and 1..32 output tokens (sequences cross a
  128-token KV page); each output must equal the same request sent alone;
* bad requests mixed into that load, each of which must get a 4xx whose
  message says what is wrong, without disturbing the good ones;
* 50 streams cancelled mid-stream, after which the KV cache (read from
  ``/metrics``) must be empty again and new requests must still be answered;
* finally a SIGTERM to its process group: a clean stop, exit status 0.

Kept cheap for CI: few compiled shapes (two num_tokens buckets, one
batched-decode bucket, two KV-length buckets), short outputs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import pytest
import requests

from tests.load import (
    BAD_REQUESTS,
    CONCURRENCY,
    DISTINCT,
    MAX_TOKENS,
    MODEL,
    PROMPTS,
    SEED,
    SERVER_ARGS,
    SERVER_ENV,
    LoadRequest,
    bounded,
    cancel_stream,
    client,
    metric,
    mixed_requests,
    send,
    send_bad,
    send_malformed_json,
)
from tests.serving import serve

NUM_REQUESTS = 200


@pytest.fixture(scope="module")
def server(tiny_llama):
    with serve(tiny_llama, SERVER_ARGS, env=SERVER_ENV) as srv:
        yield srv


def _client(server) -> openai.AsyncOpenAI:
    return client(server.url("/v1"))


@pytest.fixture(scope="module")
def load(server):
    """Send every distinct request alone, then the 200 with the bad ones mixed in."""
    requests_ = mixed_requests(NUM_REQUESTS, PROMPTS, MAX_TOKENS, seed=SEED, distinct=DISTINCT)

    async def run():
        api = _client(server)
        alone: dict[LoadRequest, str] = {}
        t0 = time.monotonic()
        for req in requests_:
            if req.alone() not in alone:
                alone[req.alone()] = await send(api, MODEL, req.alone())
        t_alone = time.monotonic() - t0

        good = [("good", i, send(api, MODEL, req)) for i, req in enumerate(requests_)]
        bad = [("bad", what, send_bad(api, ep, kw)) for what, (ep, kw, _) in BAD_REQUESTS.items()]
        bad.insert(len(bad) // 2, ("bad", "malformed JSON", send_malformed_json(server.base_url)))
        # Interleaved: a bad request after every ~18 good ones.
        mixed = []
        step = len(good) // len(bad)
        for i, item in enumerate(good):
            mixed.append(item)
            if i % step == step - 1 and bad:
                mixed.append(bad.pop(0))
        mixed.extend(bad)
        t0 = time.monotonic()
        results = await bounded([coro for *_, coro in mixed], CONCURRENCY)
        t_load = time.monotonic() - t0
        await api.close()
        by_tag = {(kind, key): out for (kind, key, _), out in zip(mixed, results, strict=True)}
        return alone, by_tag, t_alone, t_load

    alone, by_tag, t_alone, t_load = asyncio.run(run())
    good = [by_tag["good", i] for i in range(len(requests_))]
    bad = {key: out for (kind, key), out in by_tag.items() if kind == "bad"}
    print(
        f"\n{len(alone)} distinct requests alone in {t_alone:.1f} s; "
        f"{NUM_REQUESTS} + {len(bad)} bad at concurrency {CONCURRENCY} in {t_load:.1f} s"
    )
    return requests_, alone, good, bad


def test_every_request_completes_and_equals_its_output_alone(load) -> None:
    requests_, alone, good, _ = load
    pairs = list(zip(requests_, good, strict=True))
    failed = [(req, out) for req, out in pairs if not isinstance(out, str)]
    assert not failed, f"{len(failed)} of {len(requests_)} requests failed, e.g. {failed[:3]}"
    differ = [(req, out, alone[req.alone()]) for req, out in pairs if out != alone[req.alone()]]
    assert not differ, f"{len(differ)} outputs differ from the request alone, e.g. {differ[:3]}"
    assert {req.stream for req in requests_} == {True, False}
    assert {req.endpoint for req in requests_} == {"completions", "chat"}
    assert len({req.max_tokens for req in requests_}) == len(MAX_TOKENS)
    assert any(good), "every output is empty"


def test_bad_requests_get_a_4xx_with_a_useful_message(load) -> None:
    *_, bad = load
    expected = {what: needle for what, (_, _, needle) in BAD_REQUESTS.items()}
    expected["malformed JSON"] = "JSON decode error"
    assert set(bad) == set(expected)
    for what, needle in expected.items():
        result = bad[what]
        assert isinstance(result, tuple), f"{what}: {result!r}"
        status, message = result
        assert 400 <= status < 500, f"{what}: status {status} ({message})"
        assert needle in message, f"{what}: {message!r} does not say {needle!r}"


def test_cancelled_streams_free_the_kv_cache(server) -> None:
    streams, max_tokens = 50, 200

    def scrape() -> str:
        return requests.get(server.url("/metrics"), timeout=30).text

    def settled_generated() -> float:
        # The counter is updated as the server processes engine outputs; wait
        # until earlier requests' tokens are all in it (two equal readings).
        last = metric(scrape(), "vllm:generation_tokens_total")
        for _ in range(60):
            time.sleep(0.5)
            now = metric(scrape(), "vllm:generation_tokens_total")
            if now == last:
                return now
            last = now
        return last

    generated_before = settled_generated()

    async def run() -> list:
        api = _client(server)
        cancels = [
            cancel_stream(api, MODEL, i, after=3, max_tokens=max_tokens) for i in range(streams)
        ]
        out = await bounded(cancels, CONCURRENCY)
        await api.close()
        return out

    chunks = asyncio.run(run())
    cancelled = sum(1 for c in chunks if c == 3)
    assert cancelled == streams, chunks

    deadline = time.monotonic() + 60
    while True:
        text = scrape()
        usage = metric(text, "vllm:kv_cache_usage_perc")
        running = metric(text, "vllm:num_requests_running")
        waiting = metric(text, "vllm:num_requests_waiting")
        if usage == running == waiting == 0:
            break
        assert time.monotonic() < deadline, (
            f"KV usage {usage}, {running} running, {waiting} waiting"
        )
        time.sleep(0.5)
    # The server stopped generating for the cancelled streams, not ran them out
    # (that would be ~9,000 tokens: 200 per stream, or what max_model_len leaves).
    # How many it makes before it sees a disconnect depends on the step rate and
    # on load: ~150 alone on a 2-core VM, 2,689 and 5,535 inside full CI runs. The
    # bound is 80 % of a run-out: what is asserted is that they stop, not how soon.
    generated = settled_generated() - generated_before
    print(f"\n{streams} streams cancelled; {generated:.0f} tokens generated for them")
    assert generated < 0.8 * streams * max_tokens, generated

    # And it still serves, each answer the same as the request alone.
    async def after() -> tuple[list, list[str]]:
        api = _client(server)
        reqs = [
            LoadRequest("completions", p, 16, stream=bool(i % 2)) for i, p in enumerate(PROMPTS)
        ]
        outs = await bounded([send(api, MODEL, r) for r in reqs], CONCURRENCY)
        refs = [await send(api, MODEL, r.alone()) for r in reqs]
        await api.close()
        return outs, refs

    outs, refs = asyncio.run(after())
    assert outs == refs
    assert all(isinstance(o, str) and o for o in outs)


def test_a_requested_stop_exits_zero(server) -> None:
    """SIGTERM to the whole process group (systemd's default, Ctrl-C) is a clean stop.

    The engine process gets the signal too and may go down before the API
    server cancels its output handler, which makes vLLM log the same failure as
    an engine death; the plugin's exit status must still be 0 here (it is 1
    only for a real death, see ``test_serve_engine_fault.py``). No stream is
    open: vLLM 0.33 can leave in-flight streams waiting after such a stop
    (its shutdown cancels the output handler without failing them), and the
    server then waits for those clients to disconnect. Runs last: it stops the
    module's server.
    """
    api = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)
    assert api.completions.create(model=MODEL, prompt="Hello", max_tokens=4).choices[0].text
    os.killpg(server.proc.pid, signal.SIGTERM)
    status = server.proc.wait(timeout=120)
    assert status == 0, server.log()[-3000:]
    assert "exiting with status 1" not in server.log()
