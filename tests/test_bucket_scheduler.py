"""Bucket-aligned step budgets (``platform.bucket_scheduler``) in a real engine.

In-process engines (``inproc_llm``) on a tiny Llama with buckets 64, 128 and
256 (the 256-token budget). Every step the scheduler builds is recorded as
vLLM's ``SchedulerOutput``: a cut step ends exactly at a bucket edge, every
decode that was running is in it, and the requests get the same tokens as
under vLLM's own scheduling.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.v1.core.sched.scheduler import Scheduler

from spyre_inference.testing import scheduler_of

BUCKETS = "64,128"
BUDGET = 256


class _StepLog:
    """Every step of one engine: (decoding request ids before it, its SchedulerOutput,
    whether the bucket scheduler cut its budget)."""

    def __init__(self, scheduler: Any) -> None:
        self.steps: list[tuple[set[str], Any, bool]] = []
        schedule = scheduler.schedule
        stats = getattr(scheduler, "alignment", None)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            decoding = {
                r.request_id
                for r in scheduler.running
                if r.num_tokens_with_spec - r.num_computed_tokens == 1
            }
            cuts = stats.cut_steps if stats else 0
            out = schedule(*args, **kwargs)
            self.steps.append((decoding, out, bool(stats and stats.cut_steps > cuts)))
            return out

        scheduler.schedule = recorded


def _tokens(out: Any, request_id: str) -> int:
    """Tokens scheduled for ``request_id`` (vLLM suffixes its internal ids)."""
    return sum(
        n for rid, n in out.num_scheduled_tokens.items() if rid.rsplit("-", 1)[0] == request_id
    )


def _engine(inproc_llm, model, aligned: str, monkeypatch) -> LLM:
    monkeypatch.setenv("SPYRE_BUCKET_ALIGNED_PREFILL", aligned)
    return inproc_llm(model, buckets=BUCKETS, max_num_batched_tokens=BUDGET, max_num_seqs=8)


def _join_decodes(llm: LLM) -> dict[str, list[int]]:
    """Three requests decode; a 66-token prompt joins them (3 + 66 = 69 -> 128)."""
    engine = llm.llm_engine
    rng = random.Random(7)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i in range(3):
        prompt = [rng.randrange(3, 500) for _ in range(10)]
        engine.add_request(f"decode-{i}", TokensPrompt(prompt_token_ids=prompt), greedy)
    for _ in range(3):
        engine.step()
    joining = [rng.randrange(3, 500) for _ in range(66)]
    engine.add_request("join", TokensPrompt(prompt_token_ids=joining), greedy)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return tokens


def _random_workload(llm: LLM) -> list[tuple[list[int], float]]:
    """40 greedy requests of 1-300 prompt tokens, arriving while others decode."""
    rng = random.Random(99)
    engine = llm.llm_engine
    results: dict[str, tuple[list[int], float]] = {}
    pending = list(range(40))
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.choice([0, 0, 1, 2])):
            if pending:
                i = pending.pop(0)
                length = rng.choice(
                    [rng.randint(1, 20), rng.randint(50, 140), rng.randint(150, 300)]
                )
                prompt = [rng.randrange(3, 500) for _ in range(length)]
                params = SamplingParams(
                    temperature=0.0, max_tokens=rng.randint(1, 16), ignore_eos=True, logprobs=0
                )
                engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=prompt), params)
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                results[out.request_id] = (list(c.token_ids), c.cumulative_logprob)
    return [results[f"r{i}"] for i in range(40)]


def test_a_prompt_joining_decodes_is_cut_at_the_bucket_edge(
    tiny_model_factory, inproc_llm, monkeypatch
) -> None:
    model = tiny_model_factory("llama", num_hidden_layers=2)
    runs = {}
    for aligned in ("0", "1"):
        llm = _engine(inproc_llm, model, aligned, monkeypatch)
        scheduler = scheduler_of(llm)
        log = _StepLog(scheduler)
        runs[aligned] = _join_decodes(llm)
        joined = [out for _, out, _ in log.steps if _tokens(out, "join")]
        if aligned == "0":
            assert type(scheduler) is Scheduler
            # vLLM's scheduler: one step of 69 tokens, padded to the 128 bucket.
            assert [o.total_num_scheduled_tokens for o in joined[:1]] == [69]
        else:
            assert scheduler.alignment.cut_steps >= 1
            # Cut at 64: the three decodes and 61 prompt tokens; the last 5 next.
            first, second = joined[0], joined[1]
            assert first.total_num_scheduled_tokens == 64
            assert _tokens(first, "join") == 61
            assert _tokens(second, "join") == 5
            assert all(_tokens(first, f"decode-{i}") == 1 for i in range(3))
    assert runs["0"] == runs["1"]


def test_random_arrivals_keep_decodes_and_results(
    tiny_model_factory, inproc_llm, monkeypatch
) -> None:
    """Every cut step ends on a bucket and holds every decode; tokens are vLLM's."""
    model = tiny_model_factory("llama", num_hidden_layers=2)
    buckets = [int(b) for b in BUCKETS.split(",")] + [BUDGET]
    results = {}
    for aligned in ("0", "1"):
        llm = _engine(inproc_llm, model, aligned, monkeypatch)
        scheduler = scheduler_of(llm)
        log = _StepLog(scheduler)
        results[aligned] = _random_workload(llm)
        for decoding, out, _ in log.steps:
            assert decoding <= set(out.num_scheduled_tokens), "a running decode was left out"
        cut = [out.total_num_scheduled_tokens for _, out, was_cut in log.steps if was_cut]
        if aligned == "1":
            assert scheduler.alignment.steps == len(log.steps)
            assert len(cut) == scheduler.alignment.cut_steps > 0
            # No prompt here hits the prefix cache, so a cut step is exactly a
            # bucket: nothing padded.
            assert all(t in buckets for t in cut), cut
        else:
            assert not cut
    tokens = {k: [t for t, _ in v] for k, v in results.items()}
    assert tokens["0"] == tokens["1"]
    # Prefill split differently: the same math in another summation order.
    for (_, a), (_, b) in zip(results["0"], results["1"], strict=True):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4)


@pytest.mark.parametrize("why", ["enforce_eager", "user scheduler"])
def test_vllm_scheduler_when_steps_are_not_padded_or_the_user_named_one(
    tiny_model_factory, inproc_llm, monkeypatch, why
) -> None:
    """Eager steps are not padded; a --scheduler-cls of the user's is kept."""
    model = tiny_model_factory("llama", num_hidden_layers=2)
    monkeypatch.setenv("SPYRE_BUCKET_ALIGNED_PREFILL", "1")
    if why == "enforce_eager":
        llm = inproc_llm(model, enforce_eager=True)
        named = None
    else:
        named = "vllm.v1.core.sched.scheduler.Scheduler"
        llm = inproc_llm(model, buckets=BUCKETS, max_num_batched_tokens=BUDGET, scheduler_cls=named)
    assert type(scheduler_of(llm)) is Scheduler
    assert llm.llm_engine.vllm_config.scheduler_config.scheduler_cls == named
